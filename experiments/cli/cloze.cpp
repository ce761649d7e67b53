// `attnkit-experiments cloze`: trains the recurrent cloze reader (models/reader.h) with one
// of the cheap-linear-attention paper's read-outs on the cloze task built from
// a char-lm corpus (tasks/cloze.h), into a run directory:
//   OUT/checkpoint-<step>.ckpt  the newest two (train/checkpoint.h's container;
//                               the header holds the run's settings)
//   OUT/metrics.jsonl           one record per --eval-every steps: training loss
//                               and accuracy since the last record, validation
//                               loss and accuracy, elapsed training seconds
//   OUT/result.json             at the end: test accuracy, the baselines, the
//                               settings, wall time, load averages
// --resume continues from the newest checkpoint: flags not given are taken from
// it, flags given must match it (except --steps, --threads, --eval-every).
// Batches are pure functions of (seed, step), so a resumed run sees the data the
// uninterrupted one would have seen.
#include <attnkit/runtime.h>
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/clock.h>
#include <attnkit/train/loop.h>
#include <attnkit/train/progress.h>
#include <attnkit/train/run_directory.h>
#include <attnkit/train/signals.h>

#include <ATen/Parallel.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "models/reader.h"
#include "run_util.h"
#include "tasks/cloze.h"

namespace attnkit::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

/// What the checkpoints' header says wrote them, so that --resume refuses
/// another program's run.
constexpr const char* kClozeKind = "attnkit-cloze";
constexpr int64_t kEvalBatch = 256;

struct ClozeFlags {
  std::string data, readout = "softmax", out;
  int64_t steps = 2000, batch = 32, embedding = 64, hidden = 64, paragraph = 80, query = 16;
  int64_t min_count = 5, stop_words = 100, eval_every = 100, valid_examples = 1000, test_examples = 4000;
  double lr = 2e-3, weight_decay = 0.01, clip = 5.0;
  std::optional<double> gate_bias;
  uint64_t seed = 1;
  int threads = 0;
  bool unidirectional = false, shared_encoder = false, resume = false;
};

// The settings that define a run, stored in its checkpoints. Keys are the flag
// names without "--" and with '_' for '-'.
json settings(const ClozeFlags& f) {
  return json{{"data", f.data},           {"readout", f.readout},
              {"batch", f.batch},         {"embedding", f.embedding},
              {"hidden", f.hidden},       {"unidirectional", f.unidirectional},
              {"shared_encoder", f.shared_encoder},
              {"paragraph", f.paragraph}, {"query", f.query},
              {"min_count", f.min_count}, {"stop_words", f.stop_words},
              {"lr", f.lr},               {"weight_decay", f.weight_decay},
              {"clip", f.clip},           {"seed", f.seed},
              {"valid_examples", f.valid_examples}, {"test_examples", f.test_examples},
              {"gate_bias", f.gate_bias ? json(*f.gate_bias) : json(nullptr)}};
}

void apply_settings(const json& s, ClozeFlags& f) {
  s.at("data").get_to(f.data);
  s.at("readout").get_to(f.readout);
  // (Checkpoints from before --gate-bias have no such key: the default.)
  if (s.contains("gate_bias") && !s.at("gate_bias").is_null()) f.gate_bias = s.at("gate_bias").get<double>();
  s.at("batch").get_to(f.batch);
  s.at("embedding").get_to(f.embedding);
  s.at("hidden").get_to(f.hidden);
  s.at("unidirectional").get_to(f.unidirectional);
  s.at("shared_encoder").get_to(f.shared_encoder);
  s.at("paragraph").get_to(f.paragraph);
  s.at("query").get_to(f.query);
  s.at("min_count").get_to(f.min_count);
  s.at("stop_words").get_to(f.stop_words);
  s.at("lr").get_to(f.lr);
  s.at("weight_decay").get_to(f.weight_decay);
  s.at("clip").get_to(f.clip);
  s.at("seed").get_to(f.seed);
  s.at("valid_examples").get_to(f.valid_examples);
  s.at("test_examples").get_to(f.test_examples);
}

struct EvalResult {
  double loss = 0, accuracy = 0;
  int64_t examples = 0;
};

EvalResult evaluate(experiments::Reader& model, const std::vector<experiments::ClozeBatch>& batches) {
  torch::NoGradGuard no_grad;
  model->eval();
  double loss = 0, correct = 0;
  int64_t n = 0;
  for (const auto& b : batches) {
    const auto logits = model->forward(b.document, b.query, b.candidate);
    loss += torch::nn::functional::cross_entropy(
                logits, b.answer, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                .item<double>();
    correct += logits.argmax(1).eq(b.answer).sum().item<double>();
    n += b.answer.size(0);
  }
  model->train();
  return {n ? loss / n : 0, n ? correct / n : 0, n};
}

json baselines_json(const experiments::ClozeBaselines& b) {
  return json{{"examples", b.examples},
              {"mean_candidates", b.mean_candidates},
              {"random", b.random},
              {"frequency", b.frequency}};
}

void run(ClozeFlags f, CLI::App* cmd) {
  const OpenedRun opened("cloze", kClozeKind, f.out, f.resume);
  const std::string resumed_from = opened.resumed_from();
  if (opened.resumed()) {
    // Flags given must match the run's settings; the others are taken from it.
    check_resume_flags("cloze", opened.settings(), settings(f), *cmd, "--steps, --threads and --eval-every");
    apply_settings(opened.settings(), f);
  }
  TORCH_CHECK(!f.data.empty(), "cloze: --data (the directory `attnkit data char-lm` wrote) is required");
  set_threads(f.threads);
  const std::string load_start = train::loadavg_line();
  const double wall_start = train::steady_seconds();

  experiments::ClozeTask task(f.data, experiments::ClozeOptions()
                                    .paragraph(f.paragraph)
                                    .query(f.query)
                                    .min_count(f.min_count)
                                    .stop_words(f.stop_words));
  const auto models_readout = experiments::readout_from_string(f.readout);
  torch::manual_seed(f.seed);
  experiments::Reader model(experiments::ReaderOptions(task.vocabulary().size())
                           .embedding(f.embedding)
                           .hidden(f.hidden)
                           .bidirectional(!f.unidirectional)
                           .readout(models_readout)
                           .placeholder(experiments::WordVocabulary::kBlank)
                           .shared_encoder(f.shared_encoder)
                           .gate_bias(f.gate_bias ? c10::optional<double>(*f.gate_bias) : c10::nullopt));
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(f.lr).weight_decay(f.weight_decay));
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();

  const int64_t start_step = opened.restore(*model, &optimizer);
  const double elapsed_before = opened.elapsed_before();
  train::RunDirectory dir(f.out, resumed_from, start_step);
  const auto metrics = dir.open_log("metrics.jsonl");

  std::printf("cloze: readout %s, seed %llu, vocabulary %lld words, %lld parameters, paragraph %lld "
              "query %lld, batch %lld, steps %lld, threads %d%s\n",
              f.readout.c_str(), static_cast<unsigned long long>(f.seed),
              static_cast<long long>(task.vocabulary().size()), static_cast<long long>(parameters),
              static_cast<long long>(f.paragraph), static_cast<long long>(f.query),
              static_cast<long long>(f.batch), static_cast<long long>(f.steps), attnkit::num_threads(),
              resumed_from.empty() ? "" : (", resuming " + resumed_from + " at step " +
                                            std::to_string(start_step)).c_str());
  std::fflush(stdout);

  const auto valid_examples = task.eval_examples(tasks::Split::valid, f.valid_examples);
  const auto valid_batches = task.eval_batches(tasks::Split::valid, f.valid_examples, kEvalBatch);

  auto save = [&](int64_t step, double elapsed) {
    const json stored{{"kind", kClozeKind}, {"elapsed", elapsed}, {"settings", settings(f)}};
    return dir.write_checkpoint(step, stored.dump(), *model, &optimizer);
  };

  const double session_start = train::steady_seconds();
  double interval_loss = 0, interval_correct = 0;
  int64_t interval_examples = 0;
  EvalResult last_valid;
  std::string last_checkpoint;
  train::LoopHooks hooks;
  hooks.step = [&](int64_t step) {
    const auto b = task.train_batch(f.seed, step, f.batch);
    const auto logits = model->forward(b.document, b.query, b.candidate);
    const auto loss = torch::nn::functional::cross_entropy(logits, b.answer);
    optimizer.zero_grad();
    loss.backward();
    if (f.clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), f.clip);
    optimizer.step();
    interval_loss += loss.item<double>() * static_cast<double>(f.batch);
    interval_correct += logits.detach().argmax(1).eq(b.answer).sum().item<double>();
    interval_examples += f.batch;
    return train::stop_requested();
  };
  // Validation, a metrics record and a checkpoint every eval_every steps, at
  // the end and on a stop.
  hooks.after_step = [&](const train::StepDone& d) {
    if (d.done % f.eval_every != 0 && !d.last && !d.stopping) return;
    const double elapsed = elapsed_before + d.session_seconds;
    last_valid = evaluate(model, valid_batches);
    json rec{{"step", d.done},
             {"loss", interval_loss / static_cast<double>(interval_examples)},
             {"accuracy", interval_correct / static_cast<double>(interval_examples)},
             {"valid_loss", last_valid.loss},
             {"valid_accuracy", last_valid.accuracy},
             {"elapsed", elapsed}};
    metrics->append(rec.dump());
    last_checkpoint = save(d.done, elapsed);
    std::printf("step %lld/%lld  loss %.4f  accuracy %.4f  valid loss %.4f  valid accuracy %.4f  %s  ETA %s\n",
                static_cast<long long>(d.done), static_cast<long long>(f.steps),
                interval_loss / static_cast<double>(interval_examples),
                interval_correct / static_cast<double>(interval_examples), last_valid.loss,
                last_valid.accuracy, train::format_duration(elapsed).c_str(),
                train::format_duration(d.eta_seconds).c_str());
    std::fflush(stdout);
    interval_loss = interval_correct = 0;
    interval_examples = 0;
  };
  const auto end = train::run_loop(start_step, f.steps, hooks);
  const int64_t step = end.done;
  if (end.interrupted) {
    std::printf("cloze: stopped by signal %d at step %lld; checkpoint %s; the same command with "
                "--resume continues\n",
                end.signal, static_cast<long long>(step), last_checkpoint.c_str());
    return;
  }
  const double elapsed = elapsed_before + (train::steady_seconds() - session_start);

  // The end: test accuracy and the baselines on the same examples.
  const auto test_examples = task.eval_examples(tasks::Split::test, f.test_examples);
  const auto test = evaluate(model, task.eval_batches(tasks::Split::test, f.test_examples, kEvalBatch));
  if (last_valid.examples == 0) last_valid = evaluate(model, valid_batches);
  json result{{"readout", f.readout},
              {"step", step},
              {"settings", settings(f)},
              {"parameters", parameters},
              {"vocabulary", task.vocabulary().size()},
              {"test_accuracy", test.accuracy},
              {"test_loss", test.loss},
              {"test_examples", test.examples},
              {"valid_accuracy", last_valid.accuracy},
              {"valid_loss", last_valid.loss},
              {"baselines", {{"valid", baselines_json(experiments::ClozeTask::baselines(valid_examples))},
                             {"test", baselines_json(experiments::ClozeTask::baselines(test_examples))}}},
              {"train_seconds", elapsed},
              {"session", session_record(resumed_from, "start_step", start_step, wall_start, load_start)}};
  const auto result_path = (fs::path(f.out) / "result.json").string();
  train::write_file_atomically(result_path, result.dump(2) + "\n");
  std::printf("trained to step %lld of %lld; test accuracy %.4f (%lld examples; frequency baseline "
              "%.4f); %s\n",
              static_cast<long long>(step), static_cast<long long>(f.steps), test.accuracy,
              static_cast<long long>(test.examples),
              experiments::ClozeTask::baselines(test_examples).frequency, result_path.c_str());
}

}  // namespace

void add_cloze_command(CLI::App& app) {
  auto f = std::make_shared<ClozeFlags>();
  auto* cmd = app.add_subcommand(
      "cloze",
      "Train a recurrent reader on cloze questions from a char-lm corpus with one read-out of the "
      "document (none, linear, gated, softmax: the cheap-linear-attention paper), into a run "
      "directory (checkpoints, metrics.jsonl, result.json). With --resume, flags not given are "
      "taken from the newest checkpoint and flags given must match it (except --steps, --threads "
      "and --eval-every)");
  cmd->add_option("--data", f->data, "The directory `attnkit data char-lm` wrote (train/valid/test.txt)");
  cmd->add_option("--readout", f->readout, "none (final state), linear (C q, C = H^T H), gated "
                  "(C = sum f f^T, f = sigmoid(W h + b) * h) or softmax (H^T softmax(H q))")
      ->check(CLI::IsMember({"none", "linear", "gated", "softmax"}))->capture_default_str();
  cmd->add_option("--gate-bias", f->gate_bias, "gated only: the gate's bias starts at this value (4: sigmoid = "
                  "0.98, C starts near linear's); default: the layer's own initialisation");
  cmd->add_option("--steps", f->steps, "Optimiser steps of the whole run")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--batch", f->batch, "Examples per step")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of the initial weights and of the training examples")->capture_default_str();
  cmd->add_option("--threads", f->threads, "Threads (default: all cores)")->check(CLI::PositiveNumber);
  cmd->add_option("--out", f->out, "Run directory")->required();
  cmd->add_flag("--resume", f->resume, "Continue the newest checkpoint of --out");
  cmd->add_option("--embedding", f->embedding, "Word embedding size")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--hidden", f->hidden, "GRU hidden size per direction (k = 2 hidden when bidirectional)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_flag("--unidirectional", f->unidirectional, "Forward GRUs only (k = hidden)");
  cmd->add_flag("--shared-encoder", f->shared_encoder,
                "One GRU encodes the document and the query (default: two, as in the paper)");
  cmd->add_option("--paragraph", f->paragraph, "Words per paragraph")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--query", f->query, "Words per query (a span of the paragraph)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--min-count", f->min_count, "Train occurrences for a word to enter the vocabulary")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--stop-words", f->stop_words, "The most frequent words, never answers")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  add_training_options(cmd, f->lr, f->weight_decay, f->clip, f->eval_every);
  cmd->add_option("--valid-examples", f->valid_examples, "Validation examples (fixed)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--test-examples", f->test_examples, "Test examples (fixed), evaluated at the end")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->callback([f, cmd] { run(*f, cmd); });
}

}  // namespace attnkit::cli
