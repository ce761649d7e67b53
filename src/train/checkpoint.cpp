// The checkpoint container, atomic file writes and the training state's
// (de)serialization. Format: include/attnkit/train/checkpoint.h.
#include <attnkit/train/checkpoint.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <stdexcept>

#include "base/durable_file.h"
#include "train/optimizer_compat.h"
#include "train/refusal.h"

namespace attnkit::train {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------
// CRC-32
// ---------------------------------------------------------------------------

namespace {

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (0xEDB88320u ^ (c >> 1)) : (c >> 1);
    table[n] = c;
  }
  return table;
}

}  // namespace

uint32_t crc32(const void* data, std::size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = crc ^ 0xFFFFFFFFu;
  for (std::size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// ---------------------------------------------------------------------------
// Container
// ---------------------------------------------------------------------------

namespace {

void put_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFFu));
}

uint64_t get_le(const std::string& in, std::size_t offset, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i)
    value |= static_cast<uint64_t>(static_cast<unsigned char>(in[offset + i])) << (8 * i);
  return value;
}

}  // namespace

void refuse_checkpoint(const std::string& what, const std::string& problem) {
  throw std::runtime_error("checkpoint '" + what + "' refused: " + problem);
}

std::string encode_checkpoint(const CheckpointFile& file) {
  std::string out;
  out.reserve(kCheckpointPrefixBytes + file.header.size() + file.payload.size() + 4);
  out.append(kCheckpointMagic, sizeof(kCheckpointMagic));
  put_le(out, kCheckpointVersion, 4);
  put_le(out, file.header.size(), 8);
  put_le(out, file.payload.size(), 8);
  out += file.header;
  out += file.payload;
  put_le(out, crc32(out.data(), out.size()), 4);
  return out;
}

CheckpointFile decode_checkpoint(const std::string& bytes, const std::string& what) {
  const std::size_t n = bytes.size();
  if (n < sizeof(kCheckpointMagic) || std::memcmp(bytes.data(), kCheckpointMagic, sizeof(kCheckpointMagic)) != 0)
    refuse_checkpoint(what, "not an attnkit checkpoint (the file does not start with the magic \"ATNKCKPT\")");
  if (n < kCheckpointPrefixBytes + 4)
    refuse_checkpoint(what, "truncated: " + std::to_string(n) + " bytes, shorter than the container's fixed " +
                     std::to_string(kCheckpointPrefixBytes + 4) + " bytes");
  const uint64_t header_bytes = get_le(bytes, 12, 8), payload_bytes = get_le(bytes, 20, 8);
  const uint64_t limit = uint64_t{1} << 56;  // guards the sum below against overflow
  const bool sizes_sane = header_bytes <= limit && payload_bytes <= limit;
  const uint64_t expected = sizes_sane ? kCheckpointPrefixBytes + header_bytes + payload_bytes + 4 : 0;
  const std::string sizes = "the container's sizes (header " + std::to_string(header_bytes) +
                            " B, payload " + std::to_string(payload_bytes) + " B)";
  // The checksum covers every byte but its own, whatever the sizes say, so a
  // flipped bit anywhere (sizes and version included) is caught here; the
  // sizes then tell a truncated file from a corrupted one.
  const uint32_t stored = static_cast<uint32_t>(get_le(bytes, n - 4, 4));
  const uint32_t actual = crc32(bytes.data(), n - 4);
  if (stored != actual) {
    if (sizes_sane && expected > n)
      refuse_checkpoint(what, "truncated: " + sizes + " need " + std::to_string(expected) +
                       " bytes, the file has " + std::to_string(n));
    std::ostringstream s;
    s << "corrupt: CRC-32 mismatch (stored 0x" << std::hex << stored << ", computed 0x" << actual
      << " over " << std::dec << (n - 4) << " bytes)";
    refuse_checkpoint(what, s.str());
  }
  const uint32_t version = static_cast<uint32_t>(get_le(bytes, 8, 4));
  if (version != kCheckpointVersion)
    refuse_checkpoint(what, "format version " + std::to_string(version) + ", this attnkit reads version " +
                     std::to_string(kCheckpointVersion));
  if (!sizes_sane || expected != n)
    refuse_checkpoint(what, "inconsistent: " + sizes + " do not add up to the file's " + std::to_string(n) +
                     " bytes");
  CheckpointFile file;
  file.header = bytes.substr(kCheckpointPrefixBytes, header_bytes);
  file.payload = bytes.substr(kCheckpointPrefixBytes + header_bytes, payload_bytes);
  return file;
}

// ---------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------

void write_file_atomically(const std::string& path, const std::string& bytes) {
  base::write_file_durably(path, bytes);
}

void write_checkpoint_file(const std::string& path, const CheckpointFile& file) {
  write_file_atomically(path, encode_checkpoint(file));
}

CheckpointFile read_checkpoint_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) refuse_checkpoint(path, std::string("cannot open it: ") + std::strerror(errno));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) refuse_checkpoint(path, "read error");
  return decode_checkpoint(buffer.str(), path);
}

// ---------------------------------------------------------------------------
// Training state
// ---------------------------------------------------------------------------

namespace {

struct NamedTensor {
  std::string name, kind;
  torch::Tensor tensor;
};

std::vector<NamedTensor> model_tensors(torch::nn::Module& model) {
  std::vector<NamedTensor> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    out.push_back({item.key(), "parameter", item.value()});
  for (const auto& item : model.named_buffers(/*recurse=*/true))
    out.push_back({item.key(), "buffer", item.value()});
  return out;
}

nlohmann::json describe(const NamedTensor& t) {
  return {{"name", t.name},
          {"kind", t.kind},
          {"shape", t.tensor.sizes().vec()},
          {"dtype", std::string(c10::toString(t.tensor.scalar_type()))}};
}

}  // namespace

std::string save_training_state(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                 std::string* tensors_json) {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model_archive;
  nlohmann::json described = nlohmann::json::array();
  const auto tensors = model_tensors(model);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    model_archive.write("t" + std::to_string(i), tensors[i].tensor.detach(),
                        tensors[i].kind == "buffer");
    described.push_back(describe(tensors[i]));
  }
  archive.write("model", model_archive);
  if (optimizer != nullptr) {
    torch::serialize::OutputArchive optimizer_archive;
    optimizer->save(optimizer_archive);
    archive.write("optimizer", optimizer_archive);
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("cpu_generator", gen.get_state());
  }
  std::string bytes;
  archive.save_to([&bytes](const void* data, size_t size) -> size_t {
    bytes.append(static_cast<const char*>(data), size);
    return size;
  });
  if (tensors_json != nullptr) *tensors_json = described.dump();
  return bytes;
}

void load_training_state(const std::string& payload, const std::string& tensors_json,
                         torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                         bool restore_generator, const std::string& what) {
  nlohmann::json stored;
  try {
    stored = nlohmann::json::parse(tensors_json);
  } catch (const std::exception& e) {
    refuse_checkpoint(what, std::string("the header's tensor list is not JSON: ") + e.what());
  }
  const auto tensors = model_tensors(model);
  if (!stored.is_array()) refuse_checkpoint(what, "the header's tensor list is not an array");
  // Compare names, kinds, shapes and dtypes before touching the model.
  for (std::size_t i = 0; i < std::max(tensors.size(), stored.size()); ++i) {
    if (i >= stored.size())
      refuse_checkpoint(what, "the model has " + tensors[i].kind + " '" + tensors[i].name +
                       "' which the checkpoint lacks (it stores " + std::to_string(stored.size()) +
                       " tensors, the model has " + std::to_string(tensors.size()) + ")");
    if (i >= tensors.size())
      refuse_checkpoint(what, "the checkpoint stores " + stored[i].value("kind", std::string("?")) + " '" +
                       stored[i].value("name", std::string("?")) + "' which the model lacks");
    const auto expected = describe(tensors[i]);
    if (stored[i] != expected)
      refuse_checkpoint(what, "tensor " + std::to_string(i) + " differs: the checkpoint stores " +
                       stored[i].dump() + ", the model has " + expected.dump());
  }
  // libtorch reads the payload with its TorchScript loader, which throws
  // c10::Error or, for a malformed code section of the archive,
  // torch::jit::ErrorReport (not a c10::Error); neither names the file.
  // Every libtorch call on the payload goes through `reading`, so that each
  // failure is a refusal naming it (found by fuzz/files_fuzz.cpp).
  auto reading = [&what](const char* problem, const auto& call) {
    try {
      return call();
    } catch (const c10::Error& e) {
      refuse_checkpoint(what, std::string(problem) + ": " + e.what_without_backtrace());
    } catch (const std::exception& e) {  // `call` makes libtorch calls only, no refusals of ours
      refuse_checkpoint(what, std::string(problem) + ": " + e.what());
    }
  };
  const char* unreadable = "the payload is not a readable torch archive";
  torch::serialize::InputArchive archive;
  reading(unreadable, [&] {
    archive.load_from(payload.data(), payload.size());
    return true;
  });
  torch::serialize::InputArchive model_archive;
  if (!reading(unreadable, [&] { return archive.try_read("model", model_archive); }))
    refuse_checkpoint(what, "the payload lacks the model");
  std::vector<torch::Tensor> values(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!reading(unreadable, [&] {
          return model_archive.try_read("t" + std::to_string(i), values[i], tensors[i].kind == "buffer");
        }))
      refuse_checkpoint(what, "the payload lacks " + tensors[i].kind + " '" + tensors[i].name + "'");
    if (values[i].sizes() != tensors[i].tensor.sizes() ||
        values[i].scalar_type() != tensors[i].tensor.scalar_type())
      refuse_checkpoint(what, "the payload's " + tensors[i].kind + " '" + tensors[i].name +
                       "' does not match its description in the header");
  }
  torch::serialize::InputArchive optimizer_archive;
  if (optimizer != nullptr &&
      !reading(unreadable, [&] { return archive.try_read("optimizer", optimizer_archive); }))
    refuse_checkpoint(what, "the payload lacks the optimiser state");
  torch::Tensor generator_state;
  if (restore_generator &&
      !reading(unreadable, [&] { return archive.try_read("cpu_generator", generator_state); }))
    refuse_checkpoint(what, "the payload lacks the random generator state");
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].tensor.copy_(values[i]);
  }
  if (optimizer != nullptr)
    reading("the optimiser state does not fit", [&] {
      // Through the loader that reads either torch's files
      // (train/optimizer_compat.h says why torch's own cannot).
      optimizer_compat::load_optimizer(optimizer_archive, *optimizer);
      return true;
    });
  if (restore_generator)
    reading("the random generator state does not fit", [&] {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(generator_state);
      return true;
    });
}

// ---------------------------------------------------------------------------
// Run directories
// ---------------------------------------------------------------------------

std::string checkpoint_name(int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "checkpoint-%08lld.ckpt", static_cast<long long>(step));
  return name;
}

std::vector<CheckpointEntry> list_checkpoints(const std::string& run_dir) {
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return out;
  static const std::regex pattern("checkpoint-([0-9]{1,18})\\.ckpt");
  for (const auto& entry : fs::directory_iterator(run_dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && std::regex_match(name, m, pattern))
      out.push_back({std::stoll(m[1].str()), entry.path().string()});
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step > b.step; });
  return out;
}

std::vector<std::string> prune_checkpoints(const std::string& run_dir, std::size_t keep) {
  std::vector<std::string> deleted;
  const auto entries = list_checkpoints(run_dir);
  for (std::size_t i = keep; i < entries.size(); ++i) {
    std::error_code ec;
    if (fs::remove(entries[i].path, ec)) deleted.push_back(entries[i].path);
  }
  if (!deleted.empty()) base::fsync_directory(run_dir);
  return deleted;
}

}  // namespace attnkit::train
