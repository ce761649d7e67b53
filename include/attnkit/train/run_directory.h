// A training run's directory, owned in one place: the rule that opens a fresh
// run or resumes the newest checkpoint, the exclusive lock of the process that
// writes it, the cleanup of interrupted writes, the checkpoints (written
// atomically, the newest few kept) and the logs trimmed back to the resumed
// step. It is the one C++ reader of the checkpoint files a run writes
// (train/checkpoint.h's container, a JSON header with at least "step" and
// "tensors"); what else a header holds belongs to the program that wrote it
// (`attnkit train`'s: src/train/stored_run.h; the "kind"-tagged ones of
// `attnkit-experiments cloze` and `node-classify`: theirs).
//
//   auto resumed = open_or_resume(out, resume);  // reads, writes nothing
//   if (resumed) resumed->restore(*model, &optimizer, /*restore_generator=*/true);
//   RunDirectory dir(out, resumed ? resumed->path() : "", resumed ? resumed->step() : 0);
//   auto metrics = dir.open_log("metrics.jsonl");
//   for (...) { ...; dir.write_checkpoint(step, header_json, *model, &optimizer); }
//
// docs/TRAINING.md, "The run directory", is the user's view.
#pragma once

#include <attnkit/train/checkpoint.h>
#include <attnkit/train/progress.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace attnkit::train {

/// Checkpoints a run keeps: the newest and the one before, so that a newest
/// one damaged on disk leaves a way back.
inline constexpr std::size_t kKeepCheckpoints = 2;

/// A run's checkpoint, read and verified: the container's checksum and sizes,
/// a JSON header, and a "step" that agrees with the file's name.
class StoredCheckpoint {
 public:
  const std::string& path() const { return path_; }
  int64_t step() const { return step_; }
  /// The header's JSON text, for the fields of the program that wrote it.
  const std::string& header() const { return file_.header; }
  /// The header's "kind" (what wrote it, e.g. "attnkit-cloze"); "" when it
  /// has none (`attnkit train` writes "format": "attnkit-checkpoint" instead).
  std::string kind() const;
  /// The payload's tensors into `model`, and when given, the optimiser's
  /// state and torch's default generator (load_training_state: a tensor that
  /// does not match the model is refused before anything changes).
  void restore(torch::nn::Module& model, torch::optim::Optimizer* optimizer, bool restore_generator) const;

 private:
  friend StoredCheckpoint read_newest_checkpoint(const std::string& run_dir);
  StoredCheckpoint(std::string path, CheckpointFile file, int64_t step)
      : path_(std::move(path)), step_(step), file_(std::move(file)) {}

  std::string path_;
  int64_t step_ = 0;
  CheckpointFile file_;
};

/// The newest checkpoint of `run_dir`, read and verified. A damaged newest
/// checkpoint is refused, not skipped: silently resuming from an older one
/// would repeat steps without saying so; the error names the older file and
/// how to fall back to it deliberately. Throws when there is none.
StoredCheckpoint read_newest_checkpoint(const std::string& run_dir);

/// The checkpoint of `model` at `step`: the header is `header_json` (a JSON
/// object's text: what the writing program records) with "step" and
/// "tensors" (save_training_state's description) added; the payload holds the
/// model's tensors, the optimiser's state (when not null) and torch's default
/// generator.
CheckpointFile make_checkpoint(int64_t step, const std::string& header_json, torch::nn::Module& model,
                               torch::optim::Optimizer* optimizer);

/// The open-or-resume rule of a run directory, before anything is written.
/// Without `resume`, a directory that holds checkpoints is refused (naming
/// the newest); with it, the newest checkpoint is read and verified
/// (read_newest_checkpoint) and returned. A directory without checkpoints (or
/// none at all) starts fresh either way: nullopt.
std::optional<StoredCheckpoint> open_or_resume(const std::string& run_dir, bool resume);

/// A run directory claimed by the process that writes it, for the object's
/// lifetime.
class RunDirectory {
 public:
  /// Claims `path` for a run that continues `resumed_from` at `start_step`
  /// (open_or_resume's outcome; "" and 0 for a fresh run): creates the
  /// directory, takes an advisory lock on PATH/.lock (held by another
  /// process: refused), checks that the newest checkpoint is still
  /// `resumed_from` (another run may have written since) and removes the
  /// temporary files of checkpoint writes a crash interrupted.
  RunDirectory(std::string path, std::string resumed_from, int64_t start_step, std::size_t keep = kKeepCheckpoints);
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::string& path() const { return path_; }

  /// A JSON-lines log of the run (PATH/`name`): a resumed run's records
  /// after its start step are dropped (an interrupted session may have
  /// logged steps it then repeats); a fresh run's log starts empty.
  std::unique_ptr<MetricsLog> open_log(const std::string& name) const;

  /// Writes make_checkpoint(...) atomically as PATH/checkpoint-<step>.ckpt;
  /// then, once it is durable, deletes all but the newest `keep`. Returns
  /// its path.
  std::string write_checkpoint(int64_t step, const std::string& header_json, torch::nn::Module& model,
                               torch::optim::Optimizer* optimizer);

 private:
  std::string path_, resumed_from_;
  int64_t start_step_;
  std::size_t keep_;
  /// The descriptor that holds the flock; closing it (also when the
  /// constructor fails after taking it) releases the lock.
  struct Lock {
    int fd = -1;
    Lock() = default;
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
    ~Lock();
  } lock_;
};

}  // namespace attnkit::train
