// `attnkit train`'s checkpoint header; runs for eval, generate and the Python
// package (save_model_run, read_stored_options, load_run).
#include "train/stored_run.h"

#include <attnkit/runtime.h>

#include <filesystem>
#include <stdexcept>
#include <unordered_set>

namespace attnkit::train {

namespace fs = std::filesystem;
using nlohmann::json;

RunHeader parse_run_header(const StoredCheckpoint& checkpoint) {
  auto refuse = [&](const std::string& problem) -> RunHeader {
    throw std::runtime_error("checkpoint '" + checkpoint.path() + "' refused: " + problem);
  };
  const json j = json::parse(checkpoint.header());  // read_newest_checkpoint checked that it parses
  for (const char* key : {"elapsed_seconds", "trainer", "model", "task", "tensors"})
    if (!j.contains(key)) return refuse(std::string("its header lacks '") + key + "'");
  RunHeader h;
  h.step = checkpoint.step();
  try {
    h.elapsed = j.at("elapsed_seconds").get<double>();
    h.trainer = TrainerOptions::from_json(j.at("trainer").dump());
    h.model = models::TransformerOptions::from_json(j.at("model").dump());
    h.task = task_options_from_json(j.at("task").dump());
  } catch (const c10::Error& e) {
    return refuse(std::string("its header does not describe a run: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return refuse(std::string("its header does not describe a run: ") + e.what());
  }
  return h;
}

json run_header(models::TransformerImpl& model, const TrainerOptions& trainer,
                const models::TransformerOptions& model_options, const tasks::TaskOptions& task, double elapsed) {
  return {{"format", "attnkit-checkpoint"},
          {"attnkit_version", attnkit::version()},
          {"elapsed_seconds", elapsed},
          {"trainer", json::parse(trainer.to_json())},
          {"model", json::parse(model_options.to_json())},
          {"task", json::parse(task_options_to_json(task))},
          {"parameters", model.parameter_count()}};
}

std::vector<std::string> resume_mismatches(const RunHeader& stored, const TrainerOptions& t,
                                           const models::TransformerOptions& m, const tasks::TaskOptions& task) {
  std::vector<std::string> out;
  const json stored_model = json::parse(stored.model.to_json()), model = json::parse(m.to_json());
  for (const auto& item : stored_model.items())
    if (!model.contains(item.key()) || model[item.key()] != item.value())
      out.push_back("model " + item.key() + ": checkpoint " + item.value().dump() + ", now " +
                    (model.contains(item.key()) ? model[item.key()].dump() : "absent (the default)"));
  // Options written only when set (kv_heads) are absent from older checkpoints.
  for (const auto& item : model.items())
    if (!stored_model.contains(item.key()))
      out.push_back("model " + item.key() + ": checkpoint absent (the default), now " + item.value().dump());
  const json stored_trainer = json::parse(stored.trainer.to_json()), trainer = json::parse(t.to_json());
  // What may change between sessions of a run: its length, threads, logging,
  // evaluation and checkpoint cadence, the display. Everything else shapes
  // the trajectory.
  static const std::unordered_set<std::string> free_keys = {
      "steps", "threads", "log_every", "eval_every", "eval_batches", "checkpoint_every", "out", "resume", "display"};
  for (const auto& item : stored_trainer.items())
    if (!free_keys.count(item.key()) && trainer[item.key()] != item.value())
      out.push_back("trainer " + item.key() + ": checkpoint " + item.value().dump() + ", now " +
                    trainer[item.key()].dump());
  if (stored.task.name != task.name)
    out.push_back("task: checkpoint '" + stored.task.name + "', now '" + task.name + "'");
  if (stored.task.data_dir != task.data_dir)
    out.push_back("data: checkpoint '" + stored.task.data_dir + "', now '" + task.data_dir + "'");
  if (stored.task.copy_length != task.copy_length)
    out.push_back("copy_length: checkpoint " + std::to_string(stored.task.copy_length) + ", now " +
                  std::to_string(task.copy_length));
  return out;
}

json metrics_json(const std::string& prefix, const tasks::Metrics& m) {
  return {{prefix + "loss", m.loss()}, {prefix + "bpc", m.bits()}, {prefix + "accuracy", m.accuracy()}};
}

void check_architecture(const models::TransformerOptions& model, const tasks::Task& task) {
  using models::Architecture;
  if (model.architecture() == Architecture::encoder_decoder)
    throw std::invalid_argument("train: architecture 'encoder-decoder' needs source sequences; the " +
                                task.name() + " task gives one sequence per example (use decoder or encoder)");
  if (task.causal() && model.architecture() != Architecture::decoder)
    throw std::invalid_argument("train: task '" + task.name() +
                                "' predicts the next token and needs architecture 'decoder', got '" +
                                models::to_string(model.architecture()) + "'");
  if (model.vocab_size() != task.vocab_size())
    throw std::invalid_argument("train: the model's vocab_size " + std::to_string(model.vocab_size()) +
                                " differs from task '" + task.name() + "''s " +
                                std::to_string(task.vocab_size()));
}

tasks::TaskOptions normalised(tasks::TaskOptions t) {
  if (!t.data_dir.empty()) t.data_dir = fs::weakly_canonical(fs::absolute(t.data_dir)).string();
  return t;
}

std::string save_model_run(const std::string& run_dir, models::TransformerImpl& model,
                           const tasks::TaskOptions& task, TrainerOptions trainer, int64_t step) {
  TORCH_CHECK(!run_dir.empty(), "save_model_run: the run directory is empty");
  TORCH_CHECK(step >= 0, "save_model_run: step must be >= 0, got ", step);
  for (const auto& t : model.parameters())
    TORCH_CHECK(t.scalar_type() == torch::kFloat32, "save_model_run: the model's parameters are ",
                c10::toString(t.scalar_type()), "; runs store float32 (convert the model with .float())");
  const auto stored_task = normalised(task);
  check_architecture(model.options(), *tasks::make_task(stored_task));  // also refuses missing data
  std::error_code error;
  fs::create_directories(run_dir, error);
  TORCH_CHECK(!error, "save_model_run: cannot create '", run_dir, "': ", error.message());
  trainer.out(run_dir).resume(false);
  const auto path = (fs::path(run_dir) / checkpoint_name(step)).string();
  const auto header = run_header(model, trainer, model.options(), stored_task, 0.0);
  write_checkpoint_file(path, make_checkpoint(step, header.dump(), model, nullptr));
  return path;
}

namespace {

StoredOptions stored_options(const StoredCheckpoint& checkpoint) {
  const auto header = parse_run_header(checkpoint);
  return {checkpoint.path(), header.step, header.trainer, header.model, header.task};
}

}  // namespace

StoredOptions read_stored_options(const std::string& run_dir) {
  return stored_options(read_newest_checkpoint(run_dir));
}

LoadedRun load_run(const std::string& run_dir) {
  const auto checkpoint = read_newest_checkpoint(run_dir);
  auto stored = stored_options(checkpoint);
  LoadedRun run;
  run.checkpoint = std::move(stored.checkpoint);
  run.step = stored.step;
  run.trainer = std::move(stored.trainer);
  run.model_options = std::move(stored.model);
  run.task_options = std::move(stored.task);
  run.task = tasks::make_task(run.task_options);
  run.model = models::Transformer(run.model_options);
  checkpoint.restore(*run.model, nullptr, /*restore_generator=*/false);
  run.model->eval();
  return run;
}

}  // namespace attnkit::train
