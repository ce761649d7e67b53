// A run's directory: open-or-resume, the lock, cleanup, checkpoints, logs.
#include <attnkit/train/run_directory.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <stdexcept>

#include "train/refusal.h"

namespace attnkit::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

/// The header's "step", which must be the step in the file's name.
int64_t header_step(const std::string& header, const CheckpointEntry& entry) {
  json j;
  try {
    j = json::parse(header);
  } catch (const json::exception& e) {
    refuse_checkpoint(entry.path, std::string("its header is not JSON: ") + e.what());
  }
  if (!j.contains("step")) refuse_checkpoint(entry.path, "its header lacks 'step'");
  int64_t step = 0;
  try {
    step = j.at("step").get<int64_t>();
  } catch (const json::exception& e) {
    refuse_checkpoint(entry.path, std::string("its header does not describe a run: ") + e.what());
  }
  if (step != entry.step)
    refuse_checkpoint(entry.path, "its header says step " + std::to_string(step) + ", its name step " +
                           std::to_string(entry.step));
  return step;
}

}  // namespace

// ---------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------

std::string StoredCheckpoint::kind() const { return json::parse(file_.header).value("kind", ""); }

void StoredCheckpoint::restore(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                               bool restore_generator) const {
  const auto header = json::parse(file_.header);
  if (!header.contains("tensors")) refuse_checkpoint(path_, "its header lacks 'tensors'");
  load_training_state(file_.payload, header.at("tensors").dump(), model, optimizer, restore_generator, path_);
}

StoredCheckpoint read_newest_checkpoint(const std::string& run_dir) {
  const auto entries = list_checkpoints(run_dir);
  if (entries.empty())
    throw std::runtime_error("no checkpoint in '" + run_dir + "' (expected checkpoint-<step>.ckpt files)");
  CheckpointFile file;
  try {
    file = read_checkpoint_file(entries[0].path);
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    if (entries.size() > 1)
      msg += ". The newest checkpoint is not skipped silently; to continue from the older '" + entries[1].path +
             "' (step " + std::to_string(entries[1].step) + "), move the refused file out of the run directory";
    throw std::runtime_error(msg);
  }
  const int64_t step = header_step(file.header, entries[0]);
  return StoredCheckpoint(entries[0].path, std::move(file), step);
}

std::optional<StoredCheckpoint> open_or_resume(const std::string& run_dir, bool resume) {
  const auto existing = list_checkpoints(run_dir);
  if (!resume && !existing.empty())
    throw std::runtime_error("run directory '" + run_dir + "' already holds checkpoints (newest: '" +
                             existing[0].path + "'); pass --resume to continue it or choose another --out");
  if (existing.empty()) return std::nullopt;
  return read_newest_checkpoint(run_dir);
}

// ---------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------

CheckpointFile make_checkpoint(int64_t step, const std::string& header_json, torch::nn::Module& model,
                               torch::optim::Optimizer* optimizer) {
  std::string tensors;
  CheckpointFile file;
  file.payload = save_training_state(model, optimizer, &tensors);
  json header = json::parse(header_json);
  header["step"] = step;
  header["tensors"] = json::parse(tensors);
  file.header = header.dump();
  return file;
}

// ---------------------------------------------------------------------------
// RunDirectory
// ---------------------------------------------------------------------------

RunDirectory::RunDirectory(std::string path, std::string resumed_from, int64_t start_step, std::size_t keep)
    : path_(std::move(path)), resumed_from_(std::move(resumed_from)), start_step_(start_step), keep_(keep) {
  fs::create_directories(path_);
  // One process per run directory: an advisory lock, held until destruction.
  const std::string lock_path = (fs::path(path_) / ".lock").string();
  lock_.fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_.fd < 0) throw std::runtime_error("cannot open '" + lock_path + "': " + std::strerror(errno));
  if (::flock(lock_.fd, LOCK_EX | LOCK_NB) != 0)
    throw std::runtime_error("another process is training in '" + path_ + "' (it holds " + lock_path + ")");
  // Under the lock, the directory must still be as open_or_resume found it.
  const auto checkpoints = list_checkpoints(path_);
  const std::string newest = checkpoints.empty() ? "" : checkpoints[0].path;
  if (newest != resumed_from_)
    throw std::runtime_error("the checkpoints of '" + path_ + "' changed since the run was opened (newest now: '" +
                             newest + "'); open it again (a Trainer: build it again)");
  // write_file_atomically's temporary files of checkpoint writes a crash
  // interrupted (".<name>.tmp-<pid>", or "-<n>" after it: base/durable_file.cpp).
  static const std::regex stale(R"(\.checkpoint-[0-9]+\.ckpt\.tmp-[0-9]+(-[0-9]+)?)");
  for (const auto& entry : fs::directory_iterator(path_))
    if (std::regex_match(entry.path().filename().string(), stale)) fs::remove(entry.path());
}

RunDirectory::Lock::~Lock() {
  if (fd >= 0) ::close(fd);
}

std::unique_ptr<MetricsLog> RunDirectory::open_log(const std::string& name) const {
  const std::string path = (fs::path(path_) / name).string();
  if (!resumed_from_.empty())
    trim_metrics(path, start_step_);
  else
    fs::remove(path);  // a fresh run (no checkpoint): its own log
  return std::make_unique<MetricsLog>(path);
}

std::string RunDirectory::write_checkpoint(int64_t step, const std::string& header_json, torch::nn::Module& model,
                                           torch::optim::Optimizer* optimizer) {
  const auto path = (fs::path(path_) / checkpoint_name(step)).string();
  write_checkpoint_file(path, make_checkpoint(step, header_json, model, optimizer));
  prune_checkpoints(path_, keep_);  // only after the new one is durable
  return path;
}

}  // namespace attnkit::train
