// `attnkit-experiments translate`: trains the recurrent encoder-decoder
// (models/seq2seq.h) with one score function of the classic zoo, or none, on
// the translation pairs of a dictd dictionary (tasks/dictionary.h), into a run
// directory:
//   OUT/checkpoint-<step>.ckpt  the newest two (train/checkpoint.h's container;
//                               the header holds the run's settings)
//   OUT/metrics.jsonl           one record per --eval-every steps: training loss
//                               since the last record, validation loss and the
//                               greedy outputs' exact match and character error
//                               rate, elapsed training seconds
//   OUT/result.json             at the end: the same on the test split, by
//                               source length too, and the attention weights of
//                               a few test examples
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

#include <array>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "models/seq2seq.h"
#include "run_util.h"
#include "tasks/dictionary.h"

namespace attnkit::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using experiments::CharVocabulary;

/// What the checkpoints' header says wrote them, so that --resume refuses
/// another program's run.
constexpr const char* kTranslateKind = "attnkit-translate";
constexpr int64_t kTranslateEvalBatch = 256;

struct TranslateFlags {
  std::string data, score = "additive", out;
  int64_t steps = 6000, batch = 64, embedding = 64, hidden = 128, max_source = 32, max_target = 32;
  int64_t eval_every = 500, valid_examples = 1000, test_examples = 1000000, attention_examples = 4;
  double lr = 2e-3, weight_decay = 0.0, clip = 5.0;
  uint64_t seed = 1;
  int threads = 0;
  bool resume = false;
};

// The settings that define a run, stored in its checkpoints. Keys are the flag
// names without "--" and with '_' for '-'.
json settings(const TranslateFlags& f) {
  return json{{"data", f.data},
              {"score", f.score},
              {"batch", f.batch},
              {"embedding", f.embedding},
              {"hidden", f.hidden},
              {"max_source", f.max_source},
              {"max_target", f.max_target},
              {"lr", f.lr},
              {"weight_decay", f.weight_decay},
              {"clip", f.clip},
              {"seed", f.seed},
              {"valid_examples", f.valid_examples},
              {"test_examples", f.test_examples},
              {"attention_examples", f.attention_examples}};
}

void apply_settings(const json& s, TranslateFlags& f) {
  s.at("data").get_to(f.data);
  s.at("score").get_to(f.score);
  s.at("batch").get_to(f.batch);
  s.at("embedding").get_to(f.embedding);
  s.at("hidden").get_to(f.hidden);
  s.at("max_source").get_to(f.max_source);
  s.at("max_target").get_to(f.max_target);
  s.at("lr").get_to(f.lr);
  s.at("weight_decay").get_to(f.weight_decay);
  s.at("clip").get_to(f.clip);
  s.at("seed").get_to(f.seed);
  s.at("valid_examples").get_to(f.valid_examples);
  s.at("test_examples").get_to(f.test_examples);
  s.at("attention_examples").get_to(f.attention_examples);
}

/// Cross-entropy per target character (kEos included, padding not).
torch::Tensor target_loss(const torch::Tensor& logits, const torch::Tensor& target,
                          torch::nn::functional::CrossEntropyFuncOptions::reduction_t reduction = torch::kMean) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(2)}), target.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(CharVocabulary::kPad).reduction(reduction));
}

/// One example's greedy output and how it scores.
struct Translation {
  std::u32string output;
  experiments::TranslationScore score;
};

struct TranslationEval {
  double loss = 0, exact = 0, cer = 0;
  int64_t examples = 0;
  std::vector<Translation> translations;  // per example, in order
  std::vector<torch::Tensor> weights;     // of the first batches (N, T', S); undefined for none
};

/// Teacher-forced loss per character on the first sense, and the greedy
/// outputs scored against every sense; the attention weights of the batches
/// that hold the first `keep_weights` examples.
TranslationEval evaluate(experiments::Seq2Seq& model, const experiments::TranslationTask& task,
                         tasks::Split split, int64_t count, int64_t keep_weights = 0) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto examples = task.eval_examples(split, count);
  TranslationEval r;
  double loss_sum = 0, characters = 0;
  size_t next = 0;
  for (const auto& b : task.eval_batches(split, count, kTranslateEvalBatch)) {
    const auto teacher = model->forward(b.source, b.source_lengths, b.decoder_input);
    loss_sum += target_loss(teacher.logits, b.target, torch::kSum).item<double>();
    characters += b.target.ne(CharVocabulary::kPad).sum().item<double>();
    const auto decoded = model->greedy(b.source, b.source_lengths, task.options().max_target() + 1);
    if (static_cast<int64_t>(next) < keep_weights) r.weights.push_back(decoded.weights);
    const auto ids = decoded.ids.contiguous();
    for (int64_t n = 0; n < ids.size(0); ++n, ++next) {
      const auto* row = ids[n].data_ptr<int64_t>();
      const auto output = task.vocabulary().text(std::vector<int64_t>(row, row + ids.size(1)));
      const auto score = experiments::score_translation(output, examples[next].senses);
      r.exact += score.exact;
      r.cer += score.cer;
      r.translations.push_back({output, score});
    }
  }
  model->train();
  r.examples = static_cast<int64_t>(examples.size());
  if (r.examples) {
    r.loss = loss_sum / characters;
    r.exact /= static_cast<double>(r.examples);
    r.cer /= static_cast<double>(r.examples);
  }
  return r;
}

json summary(const TranslationEval& r) {
  return json{{"examples", r.examples}, {"loss", r.loss}, {"exact", r.exact}, {"cer", r.cer}};
}

/// Exact match and character error rate per source length (characters).
json by_source_length(const std::vector<experiments::TranslationExample>& examples, const TranslationEval& r) {
  std::map<size_t, std::array<double, 3>> sums;  // length -> examples, exact, cer
  for (size_t i = 0; i < examples.size(); ++i) {
    auto& s = sums[examples[i].source.size()];
    s[0] += 1;
    s[1] += r.translations[i].score.exact;
    s[2] += r.translations[i].score.cer;
  }
  json rows = json::array();
  for (const auto& [length, s] : sums)
    rows.push_back({{"length", length}, {"examples", static_cast<int64_t>(s[0])}, {"exact", s[1] / s[0]},
                    {"cer", s[2] / s[0]}});
  return rows;
}

/// The first `count` test examples with their output and, with attention, the
/// weights of every output step (rows) over the source (columns).
json attention_examples(const std::vector<experiments::TranslationExample>& examples, const TranslationEval& r,
                        int64_t count) {
  json out = json::array();
  for (int64_t i = 0; i < std::min<int64_t>(count, static_cast<int64_t>(examples.size())); ++i) {
    const auto& e = examples[static_cast<size_t>(i)];
    json senses = json::array();
    for (const auto& sense : e.senses) senses.push_back(experiments::encode_utf8(sense));
    json item{{"source", experiments::encode_utf8(e.source)},
              {"output", experiments::encode_utf8(r.translations[static_cast<size_t>(i)].output)},
              {"senses", senses}};
    const auto& w = r.weights[static_cast<size_t>(i / kTranslateEvalBatch)];
    if (w.defined()) {
      // The steps up to and including the one that produced kEos, over the source's own positions.
      const auto steps =
          std::min<int64_t>(w.size(1), static_cast<int64_t>(r.translations[static_cast<size_t>(i)].output.size()) + 1);
      const auto a = w[i % kTranslateEvalBatch].narrow(0, 0, steps).narrow(1, 0, static_cast<int64_t>(e.source.size()))
                         .to(torch::kDouble).contiguous();
      json matrix = json::array();
      for (int64_t t = 0; t < a.size(0); ++t) {
        const auto* row = a[t].data_ptr<double>();
        matrix.push_back(std::vector<double>(row, row + a.size(1)));
      }
      item["weights"] = matrix;
    }
    out.push_back(item);
  }
  return out;
}

void run(TranslateFlags f, CLI::App* cmd) {
  const OpenedRun opened("translate", kTranslateKind, f.out, f.resume);
  const std::string resumed_from = opened.resumed_from();
  if (opened.resumed()) {
    check_resume_flags("translate", opened.settings(), settings(f), *cmd, "--steps, --threads and --eval-every");
    apply_settings(opened.settings(), f);
  }
  TORCH_CHECK(!f.data.empty(), "translate: --data (a directory with a dictd database, "
              "scripts/fetch-corpus freedict-deu-eng) is required");
  set_threads(f.threads);
  const std::string load_start = train::loadavg_line();
  const double wall_start = train::steady_seconds();

  const experiments::TranslationTask task(
      f.data, experiments::TranslationOptions().max_source(f.max_source).max_target(f.max_target));
  torch::manual_seed(f.seed);
  experiments::Seq2Seq model(experiments::Seq2SeqOptions(task.vocabulary().size(), f.max_source)
                                 .embedding(f.embedding)
                                 .hidden(f.hidden)
                                 .score(experiments::score_from_string(f.score)));
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(f.lr).weight_decay(f.weight_decay));
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();

  const int64_t start_step = opened.restore(*model, &optimizer);
  const double elapsed_before = opened.elapsed_before();
  train::RunDirectory dir(f.out, resumed_from, start_step);
  const auto metrics = dir.open_log("metrics.jsonl");

  const auto count = [&](tasks::Split s) { return static_cast<long long>(task.examples(s).size()); };
  std::printf("translate: score %s, seed %llu, %lld/%lld/%lld train/valid/test sources, vocabulary %lld, "
              "%lld parameters, batch %lld, steps %lld, threads %d%s\n",
              f.score.c_str(), static_cast<unsigned long long>(f.seed), count(tasks::Split::train),
              count(tasks::Split::valid), count(tasks::Split::test),
              static_cast<long long>(task.vocabulary().size()), static_cast<long long>(parameters),
              static_cast<long long>(f.batch), static_cast<long long>(f.steps), attnkit::num_threads(),
              resumed_from.empty() ? "" : (", resuming " + resumed_from + " at step " +
                                            std::to_string(start_step)).c_str());
  std::fflush(stdout);

  auto save = [&](int64_t step, double elapsed) {
    const json stored{{"kind", kTranslateKind}, {"elapsed", elapsed}, {"settings", settings(f)}};
    return dir.write_checkpoint(step, stored.dump(), *model, &optimizer);
  };

  const double session_start = train::steady_seconds();
  double interval_loss = 0;
  int64_t interval_steps = 0;
  TranslationEval last_valid;
  std::string last_checkpoint;
  train::LoopHooks hooks;
  hooks.step = [&](int64_t step) {
    const auto b = task.train_batch(f.seed, step, f.batch);
    const auto loss = target_loss(model->forward(b.source, b.source_lengths, b.decoder_input).logits, b.target);
    optimizer.zero_grad();
    loss.backward();
    if (f.clip > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), f.clip);
    optimizer.step();
    interval_loss += loss.item<double>();
    ++interval_steps;
    return train::stop_requested();
  };
  // Validation, a metrics record and a checkpoint every eval_every steps, at
  // the end and on a stop.
  hooks.after_step = [&](const train::StepDone& d) {
    if (d.done % f.eval_every != 0 && !d.last && !d.stopping) return;
    const double elapsed = elapsed_before + d.session_seconds;
    last_valid = evaluate(model, task, tasks::Split::valid, f.valid_examples);
    const double train_loss = interval_loss / static_cast<double>(std::max<int64_t>(interval_steps, 1));
    json rec{{"step", d.done},          {"loss", train_loss},          {"valid_loss", last_valid.loss},
             {"valid_exact", last_valid.exact}, {"valid_cer", last_valid.cer}, {"elapsed", elapsed}};
    metrics->append(rec.dump());
    last_checkpoint = save(d.done, elapsed);
    std::printf("step %lld/%lld  loss %.4f  valid loss %.4f  valid exact %.4f  valid cer %.4f  %s  ETA %s\n",
                static_cast<long long>(d.done), static_cast<long long>(f.steps), train_loss, last_valid.loss,
                last_valid.exact, last_valid.cer, train::format_duration(elapsed).c_str(),
                train::format_duration(d.eta_seconds).c_str());
    std::fflush(stdout);
    interval_loss = 0;
    interval_steps = 0;
  };
  const auto end = train::run_loop(start_step, f.steps, hooks);
  const int64_t step = end.done;
  if (end.interrupted) {
    std::printf("translate: stopped by signal %d at step %lld; checkpoint %s; the same command with "
                "--resume continues\n",
                end.signal, static_cast<long long>(step), last_checkpoint.c_str());
    return;
  }
  const double elapsed = elapsed_before + (train::steady_seconds() - session_start);

  const auto test = evaluate(model, task, tasks::Split::test, f.test_examples, f.attention_examples);
  if (last_valid.examples == 0) last_valid = evaluate(model, task, tasks::Split::valid, f.valid_examples);
  const auto test_examples = task.eval_examples(tasks::Split::test, f.test_examples);
  json result{{"score", f.score},
              {"step", step},
              {"settings", settings(f)},
              {"parameters", parameters},
              {"vocabulary", task.vocabulary().size()},
              {"sources", {{"train", count(tasks::Split::train)},
                           {"valid", count(tasks::Split::valid)},
                           {"test", count(tasks::Split::test)}}},
              {"test", summary(test)},
              {"valid", summary(last_valid)},
              {"test_by_source_length", by_source_length(test_examples, test)},
              {"attention_examples", attention_examples(test_examples, test, f.attention_examples)},
              {"train_seconds", elapsed},
              {"session", session_record(resumed_from, "start_step", start_step, wall_start, load_start)}};
  const auto result_path = (fs::path(f.out) / "result.json").string();
  train::write_file_atomically(result_path, result.dump(2) + "\n");
  std::printf("trained to step %lld of %lld; test exact match %.4f, character error rate %.4f (%lld sources); %s\n",
              static_cast<long long>(step), static_cast<long long>(f.steps), test.exact, test.cer,
              static_cast<long long>(test.examples), result_path.c_str());
}

}  // namespace

void add_translate_command(CLI::App& app) {
  auto f = std::make_shared<TranslateFlags>();
  auto* cmd = app.add_subcommand(
      "translate",
      "Train a recurrent encoder-decoder with one score function of the classic attention zoo (or "
      "none) on a dictd dictionary's translation pairs, character by character, into a run directory "
      "(checkpoints, metrics.jsonl, result.json). With --resume, flags not given are taken from the "
      "newest checkpoint and flags given must match it (except --steps, --threads and --eval-every)");
  cmd->add_option("--data", f->data, "A directory with one dictd database, NAME.index and NAME.dict "
                  "(scripts/fetch-corpus freedict-deu-eng)");
  cmd->add_option("--score", f->score, "The attention's score function: additive (v^T tanh(W s + U h)), "
                  "general (s^T W h), dot (s^T h), scaled-dot (s^T h / sqrt(k)), location (softmax(W s) over "
                  "positions) or none (no attention: the decoder sees the source through its first state)")
      ->check(CLI::IsMember({"none", "additive", "general", "dot", "scaled-dot", "location"}))->capture_default_str();
  cmd->add_option("--steps", f->steps, "Optimiser steps of the whole run")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--batch", f->batch, "Sources per step")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of the initial weights and of the training examples")->capture_default_str();
  cmd->add_option("--threads", f->threads, "Threads (default: all cores)")->check(CLI::PositiveNumber);
  cmd->add_option("--out", f->out, "Run directory")->required();
  cmd->add_flag("--resume", f->resume, "Continue the newest checkpoint of --out");
  cmd->add_option("--embedding", f->embedding, "Character embedding size")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--hidden", f->hidden, "GRU hidden size per encoder direction (the decoder's is twice it)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--max-source", f->max_source, "The longest source kept, in characters")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--max-target", f->max_target, "The longest translation kept, in characters")
      ->check(CLI::PositiveNumber)->capture_default_str();
  add_training_options(cmd, f->lr, f->weight_decay, f->clip, f->eval_every);
  cmd->add_option("--valid-examples", f->valid_examples, "Validation sources (the first of the split's fixed order)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--test-examples", f->test_examples, "Test sources, evaluated at the end (default: all)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--attention-examples", f->attention_examples,
                  "Test sources whose attention weights result.json keeps")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->callback([f, cmd] { run(*f, cmd); });
}

}  // namespace attnkit::cli
