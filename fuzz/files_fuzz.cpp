// Fuzz target: the two file formats attnkit reads, on arbitrary bytes.
//
// The first input byte chooses what the rest is:
//   0  a DocumentMemory file, as is (DocumentMemory::load)
//   1  a DocumentMemory file whose FNV-1a checksum the target recomputes first,
//      so mutations reach the checks behind the checksum
//   2  a checkpoint file, as is (train::read_checkpoint_file)
//   3  the JSON header of a checkpoint, whose "tensors" list
//      train::load_training_state checks against the small model and AdamW
//      optimiser below before it reads the (valid) payload those wrote
//   4  only with ATTNKIT_FUZZ_TORCH_ARCHIVE=1 in the environment: a checkpoint
//      file whose CRC-32 the target recomputes first, loaded into that model;
//      mutations then reach libtorch's archive reader (zip, pickle,
//      TorchScript), which is not hardened against crafted input: see
//      docs/RELIABILITY.md (a pickled length makes it allocate and fill
//      gigabytes). Off by default so that scripts/fuzz tests attnkit's code.
// Invariants: every refusal is an exception whose message names the file; a
// memory that loads saves back to the same bytes; nothing crashes, hangs,
// leaks or trips a sanitizer.
//
// ATTNKIT_FUZZ_WRITE_SEEDS=DIR files_fuzz writes the seed corpus (one valid
// file of each kind, per mode) into DIR and exits: fuzz/corpus/files_fuzz.
#include <attnkit/document_memory.h>
#include <attnkit/train/checkpoint.h>

#include "fuzz_util.h"

#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <unistd.h>

using namespace attnkit;
using namespace attnkit::fuzz;

namespace {

std::string scratch_path(const char* name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr && *dir ? dir : "/tmp") + "/attnkit-files-fuzz-" +
         std::to_string(::getpid()) + "-" + name;
}

void write_bytes(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) violation("cannot write the scratch file " + path);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

/// The files the target writes each input to; removed at exit.
std::string scratch[3];

uint64_t fnv1a64(const uint8_t* data, size_t size) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 1099511628211ull;
  return h;
}

void put_le(uint8_t* out, uint64_t value, int bytes) {
  for (int b = 0; b < bytes; ++b) out[b] = static_cast<uint8_t>(value >> (8 * b));
}

/// The model and optimiser whose state the checkpoint mode loads: two layers
/// and a buffer, AdamW after one step (so the optimiser has state to restore).
struct Model : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor count;
  Model() {
    a = register_module("a", torch::nn::Linear(3, 4));
    b = register_module("b", torch::nn::Linear(4, 2));
    count = register_buffer("count", torch::zeros({1}, torch::kLong));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b->forward(torch::relu(a->forward(x))); }
};

struct Training {
  std::shared_ptr<Model> model = std::make_shared<Model>();
  torch::optim::AdamW optimizer{model->parameters(), torch::optim::AdamWOptions(1e-2)};
  Training() {
    torch::manual_seed(1);
    for (auto& p : model->parameters()) {
      torch::NoGradGuard g;
      p.uniform_(-1, 1);
    }
    model->forward(torch::ones({2, 3})).sum().backward();
    optimizer.step();
  }
};

void memory_case(const uint8_t* data, size_t size, bool fix_checksum) {
  std::vector<uint8_t> bytes(data, data + size);
  if (fix_checksum && size >= 8) put_le(&bytes[size - 8], fnv1a64(bytes.data(), size - 8), 8);
  const std::string &path = scratch[0], &again = scratch[1];
  write_bytes(path, bytes.data(), bytes.size());
  try {
    auto memory = DocumentMemory::load(path);
    memory.save(again);
    if (read_bytes(again) != std::string(bytes.begin(), bytes.end()))
      violation("DocumentMemory: a loaded file does not save back to the same bytes");
    auto out = memory.lookup(torch::ones({1, memory.dim()}));
    if (out.sizes() != torch::IntArrayRef({1, memory.dim()})) violation("DocumentMemory::lookup: wrong shape");
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find(path) == std::string::npos) violation("DocumentMemory::load: an error that does not name the file: " + msg);
  }
}

Training& training() {
  static Training t;
  return t;
}

/// The valid payload of training() and its tensor list, as the trainer writes them.
const std::pair<std::string, std::string>& valid_state() {
  static const auto state = [] {
    std::string tensors;
    std::string payload = train::save_training_state(*training().model, &training().optimizer, &tensors);
    return std::make_pair(payload, tensors);
  }();
  return state;
}

/// load_training_state, whose every refusal must name `path`.
void load_state(const std::string& payload, const std::string& header, const std::string& path) {
  // As the CLI does: the header is JSON with a "tensors" list (a header that is
  // not is refused by the caller before load_training_state).
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header);
  } catch (const std::exception&) {
    return;
  }
  if (!json.is_object() || !json.contains("tensors")) return;
  try {
    train::load_training_state(payload, json["tensors"].dump(), *training().model, &training().optimizer,
                               /*restore_generator=*/true, path);
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    if (msg.find(path) == std::string::npos) violation("load_training_state: an error that does not name the file: " + msg);
  }
}

void checkpoint_case(const uint8_t* data, size_t size, bool fix_checksum) {
  std::vector<uint8_t> bytes(data, data + size);
  if (fix_checksum && size >= 4) put_le(&bytes[size - 4], train::crc32(bytes.data(), size - 4), 4);
  const std::string& path = scratch[2];
  write_bytes(path, bytes.data(), bytes.size());
  train::CheckpointFile file;
  try {
    file = train::read_checkpoint_file(path);
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    if (msg.find(path) == std::string::npos) violation("read_checkpoint_file: an error that does not name the file: " + msg);
    return;
  }
  if (fix_checksum) load_state(file.payload, file.header, path);
}

void write_seeds(const std::string& dir) {
  auto save = [&](const std::string& name, uint8_t mode, const std::string& bytes) {
    std::ofstream out(dir + "/" + name, std::ios::binary);
    out.put(static_cast<char>(mode));
    out << bytes;
  };
  DocumentMemory memory(3);
  memory.append(torch::arange(6, torch::kFloat).view({2, 3}) / 4);
  const std::string mem_path = scratch_path("seed-memory");
  memory.save(mem_path);
  const std::string mem = read_bytes(mem_path);
  std::remove(mem_path.c_str());
  save("memory-3x3", 0, mem);
  save("memory-3x3-fixed", 1, mem);
  DocumentMemory empty(1);
  empty.save(mem_path);
  save("memory-1x1-fixed", 1, read_bytes(mem_path));
  std::remove(mem_path.c_str());

  const auto& [payload, tensors] = valid_state();
  train::CheckpointFile file;
  file.payload = payload;
  file.header = nlohmann::json{{"step", 1}, {"tensors", nlohmann::json::parse(tensors)}}.dump();
  const std::string ckpt = train::encode_checkpoint(file);
  save("checkpoint", 2, ckpt);
  save("header", 3, file.header);
  save("checkpoint-fixed", 4, ckpt);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("ATTNKIT_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  scratch[0] = scratch_path("memory");
  scratch[1] = scratch_path("memory-again");
  scratch[2] = scratch_path("checkpoint");
  std::atexit([] {
    for (const auto& path : scratch) std::remove(path.c_str());
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const bool torch_archive = std::getenv("ATTNKIT_FUZZ_TORCH_ARCHIVE") != nullptr;
  const uint8_t mode = data[0] % 5;
  if (mode <= 1)
    memory_case(data + 1, size - 1, mode == 1);
  else if (mode == 2)
    checkpoint_case(data + 1, size - 1, false);
  else if (mode == 3)
    load_state(valid_state().first, std::string(data + 1, data + size), scratch[2]);
  else if (torch_archive)
    checkpoint_case(data + 1, size - 1, true);
  return 0;
}
