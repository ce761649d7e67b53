// Checkpoint files of a training run: our own container around libtorch's
// serialized tensors, written atomically and verified before anything is
// loaded from it.
//
// Container (all integers little-endian):
//
//   offset  size  field
//   0       8     magic "ATNKCKPT"
//   8       4     format version (kCheckpointVersion)
//   12      8     H: bytes of the JSON header
//   20      8     P: bytes of the payload
//   28      H     header: UTF-8 JSON (step, options that built the model, the
//                 names, kinds, shapes and dtypes of the stored tensors, ...)
//   28+H    P     payload: a torch::serialize::OutputArchive (model tensors,
//                 optimiser state, torch's default CPU generator state)
//   28+H+P  4     CRC-32 (IEEE 802.3, the zlib polynomial) of bytes [0, 28+H+P)
//
// write_checkpoint_file() writes a temporary file in the target's directory,
// fsyncs it, renames it over the target and fsyncs the directory: a crash
// leaves either the old state or the complete new file, never a torn one.
// read_checkpoint_file() refuses a file whose magic, version, sizes or
// checksum are wrong with an error naming the file and the problem.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace attnkit::train {

inline constexpr char kCheckpointMagic[8] = {'A', 'T', 'N', 'K', 'C', 'K', 'P', 'T'};
inline constexpr uint32_t kCheckpointVersion = 1;
/// Bytes before the header: magic, version, H, P.
inline constexpr std::size_t kCheckpointPrefixBytes = 28;

/// CRC-32 (reflected polynomial 0xEDB88320, initial value and final xor
/// 0xFFFFFFFF: zlib's crc32) of `size` bytes, continuing from `crc` (0 to start).
uint32_t crc32(const void* data, std::size_t size, uint32_t crc = 0);

/// A checkpoint's two parts as stored: the JSON header text and the payload bytes.
struct CheckpointFile {
  std::string header;
  std::string payload;
};

/// The container's bytes for `file` (magic, version, sizes, header, payload, CRC).
std::string encode_checkpoint(const CheckpointFile& file);

/// Parses and verifies container bytes; `what` names the source in errors
/// (usually the path). Throws std::runtime_error on a wrong magic, an
/// unsupported version, sizes that disagree with the length of `bytes`
/// (truncated or trailing data) or a checksum mismatch.
CheckpointFile decode_checkpoint(const std::string& bytes, const std::string& what);

/// Writes `bytes` to `path` atomically and durably: a temporary file in the
/// same directory, write, fsync, rename onto `path`, fsync of the directory
/// (the library's one way of replacing a file: src/base/durable_file.h). On
/// failure the temporary file is removed, `path` keeps its old content unless
/// the rename happened, and the error (a std::system_error) names the step,
/// the path and the system's reason.
void write_file_atomically(const std::string& path, const std::string& bytes);

/// encode_checkpoint + write_file_atomically.
void write_checkpoint_file(const std::string& path, const CheckpointFile& file);

/// Reads and verifies the checkpoint at `path` (decode_checkpoint's errors,
/// prefixed with the path; a missing or unreadable file is refused too).
CheckpointFile read_checkpoint_file(const std::string& path);

// ---------------------------------------------------------------------------
// The training state in a payload.
// ---------------------------------------------------------------------------

/// Serializes the model's parameters and buffers (in named_parameters() then
/// named_buffers() order), the optimiser's state and param groups, and torch's
/// default CPU generator state into payload bytes. `tensors_json` receives a
/// JSON array describing the model tensors ({"name", "kind", "shape",
/// "dtype"}), which the header stores so that load_training_state can name
/// what does not match.
std::string save_training_state(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                 std::string* tensors_json);

/// Restores what save_training_state stored into a model of the same
/// structure (and, when `optimizer` is not null, its optimiser, and when
/// `restore_generator` is set, torch's default CPU generator). `tensors_json`
/// is the header's description; a tensor whose name, kind, shape or dtype
/// differs from the model's is refused with an error naming it, before the
/// model is changed. `what` names the source in errors.
void load_training_state(const std::string& payload, const std::string& tensors_json,
                         torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                         bool restore_generator, const std::string& what);

// ---------------------------------------------------------------------------
// Checkpoints in a run directory: RUN/checkpoint-<step, 8 digits>.ckpt.
// ---------------------------------------------------------------------------

/// "checkpoint-00000200.ckpt" for step 200.
std::string checkpoint_name(int64_t step);

struct CheckpointEntry {
  int64_t step;
  std::string path;
};

/// The checkpoint files of `run_dir` (names of the form checkpoint_name
/// produces), newest (highest step) first. Does not open them. An absent
/// directory has none.
std::vector<CheckpointEntry> list_checkpoints(const std::string& run_dir);

/// Deletes all but the `keep` newest checkpoints of `run_dir`; returns the
/// deleted paths.
std::vector<std::string> prune_checkpoints(const std::string& run_dir, std::size_t keep);

}  // namespace attnkit::train
