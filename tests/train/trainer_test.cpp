// The Trainer end to end on tiny models: bitwise resume, refusals that leave
// the run directory untouched, the last two checkpoints kept, metrics.jsonl,
// and swap-in evaluation of every mechanism of the registry.
#include <attnkit/nn/registry.h>
#include <attnkit/runtime.h>
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/signals.h>
#include <attnkit/train/trainer.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "train/train_test_util.h"

namespace trainer_test {

namespace fs = std::filesystem;
using namespace attnkit;
using namespace attnkit::train;
using attnkit::testing::char_lm_data;
using attnkit::testing::fresh_dir;

namespace {

models::TransformerOptions tiny_decoder() {
  return models::TransformerOptions().layers(2).width(32).heads(2).ffn(64).dropout(0.1);
}

TrainerOptions tiny_run(const std::string& out) {
  return TrainerOptions().steps(20).batch(4).context(32).lr(3e-3).warmup(4).min_lr(3e-4).seed(3)
      .threads(1).log_every(5).checkpoint_every(100).eval_batches(2).display(Display::quiet).out(out);
}

tasks::TaskOptions char_lm() { return {"char-lm", char_lm_data(), 0}; }

/// Every parameter and buffer of two models, bitwise.
void expect_same_weights(models::Transformer& a, models::Transformer& b) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
  auto ba = a->named_buffers(), bb = b->named_buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (const auto& item : ba) EXPECT_TRUE(torch::equal(item.value(), bb[item.key()])) << item.key();
}

std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    files[entry.path().filename().string()] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return files;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

using attnkit::testing::ThreadsGuard;

/// Trains 20 steps straight and 10 + 10 with a stop and a resume in between;
/// the two end with bitwise the same weights and buffers.
void check_resume_is_bitwise(const std::string& name, const models::TransformerOptions& model,
                             const tasks::TaskOptions& task, DType dtype = DType::float32) {
  const auto straight_dir = fresh_dir(name + "_straight"), resumed_dir = fresh_dir(name + "_resumed");
  auto tiny_run = [dtype](const std::string& out) { return trainer_test::tiny_run(out).dtype(dtype); };
  Trainer straight(tiny_run(straight_dir), model, task);
  const auto full = straight.run();
  EXPECT_EQ(full.step, 20);
  EXPECT_FALSE(full.interrupted);

  {
    Trainer first(tiny_run(resumed_dir), model, task);
    first.on_step([](int64_t step) {
      if (step == 10) request_stop();
    });
    const auto half = first.run();
    EXPECT_TRUE(half.interrupted);
    EXPECT_EQ(half.step, 10);
    EXPECT_EQ(fs::path(half.checkpoint).filename(), checkpoint_name(10));
    EXPECT_FALSE(stop_requested());  // run() clears its request
    EXPECT_THROW(first.run(), std::logic_error);  // once per Trainer
  }
  Trainer second(tiny_run(resumed_dir).resume(true), model, task);
  EXPECT_EQ(second.start_step(), 10);
  EXPECT_EQ(fs::path(second.resumed_from()).filename(), checkpoint_name(10));
  const auto rest = second.run();
  EXPECT_EQ(rest.step, 20);
  expect_same_weights(straight.model(), second.model());

  // The checkpoints on disk agree too, and what eval loads is those weights.
  auto a = load_run(straight_dir), b = load_run(resumed_dir);
  EXPECT_EQ(a.step, 20);
  expect_same_weights(a.model, b.model);
  expect_same_weights(a.model, straight.model());
  for (const auto& p : a.model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
  EXPECT_EQ(read_stored_options(resumed_dir).trainer.dtype(), dtype);
  // One record per step in metrics.jsonl: 5, 10 (the stop), 15, 20.
  std::ifstream in(fs::path(resumed_dir) / "metrics.jsonl");
  std::vector<int64_t> steps;
  for (std::string line; std::getline(in, line);) steps.push_back(nlohmann::json::parse(line)["step"]);
  EXPECT_EQ(steps, (std::vector<int64_t>{5, 10, 15, 20}));
}

/// The predictor's weights move, the baseline follows the rewards,
/// metrics.jsonl logs both, and the validation (beam search) is finite.
void check_sac_training(const std::string& reward) {
  ThreadsGuard threads;
  const auto dir = fresh_dir("sac_train_" + reward);
  const auto encoder = tiny_decoder()
                           .architecture(models::Architecture::encoder)
                           .attention({"sac:alpha=1,variant=all-connected,hidden=8,max_distance=9,reward=" + reward});
  Trainer trainer(tiny_run(dir), encoder, {"copy", "", 8});
  std::map<std::string, torch::Tensor> initial;
  for (const auto& p : trainer.model()->named_parameters())
    if (p.key().rfind("edge_predictor.", 0) == 0) initial[p.key()] = p.value().detach().clone();
  ASSERT_FALSE(initial.empty());
  const auto result = trainer.run();
  auto trained = trainer.model()->named_parameters();
  for (const auto& [key, value] : initial) EXPECT_FALSE(torch::equal(value, trained[key])) << key;
  const double baseline = trainer.model()->edge_predictor()->baseline();
  EXPECT_LT(baseline, 0.0);  // a mean log-probability
  std::ifstream in(fs::path(dir) / "metrics.jsonl");
  int records = 0;
  for (std::string line; std::getline(in, line);) {
    const auto r = nlohmann::json::parse(line);
    ASSERT_TRUE(r.contains("sac_reward") && r.contains("sac_baseline")) << line;
    EXPECT_LT(r["sac_reward"].get<double>(), 0.0);
    ++records;
  }
  EXPECT_EQ(records, 4);
  EXPECT_TRUE(result.validated);
  EXPECT_TRUE(std::isfinite(result.valid.loss()));
  // Partner hits count the scored (masked) positions only, every one of them.
  StructureStats stats;
  const auto m = evaluate(trainer.model(), trainer.task(), tasks::Split::valid, 4, 18, 0, &stats);
  EXPECT_EQ(stats.partner_rows, m.scored);
  EXPECT_GE(stats.partner_found, 0);
  EXPECT_LE(stats.partner_found, stats.partner_rows);
  EXPECT_NEAR(stats.edges_per_node(), 2.0, 0.2);  // one predicted edge and the self-edge, some merged
}

}  // namespace

// A char-lm decoder with dropout (the generator state matters) and a copy-task
// encoder with improved-clustered attention (its call counter is a buffer).
TEST(TrainTrainer, ResumeEqualsUninterruptedBitwise) {
  ThreadsGuard threads;
  {
    SCOPED_TRACE("char-lm decoder, full attention, dropout 0.1");
    check_resume_is_bitwise("lm", tiny_decoder(), char_lm());
  }
  {
    SCOPED_TRACE("copy encoder, improved-clustered attention");
    const auto encoder = tiny_decoder()
                             .architecture(models::Architecture::encoder)
                             .attention({"improved-clustered:clusters=4,topk=4"});
    check_resume_is_bitwise("copy", encoder, {"copy", "", 8});
  }
  {
    // The edge predictor samples from torch's generator and keeps its
    // REINFORCE baseline in a buffer: both must survive the stop.
    SCOPED_TRACE("copy encoder, SAC");
    const auto encoder = tiny_decoder()
                             .architecture(models::Architecture::encoder)
                             .attention({"sac:alpha=1,variant=all-connected,hidden=8,max_distance=9"});
    check_resume_is_bitwise("sac", encoder, {"copy", "", 8});
  }
}

// The same in mixed precision: the bf16 working copy is a function of the
// float32 weights, and its buffers (clustered attention's call counter, SAC's
// baseline) are handed back to them, so a checkpoint holds everything.
TEST(TrainTrainer, Bf16ResumeEqualsUninterruptedBitwise) {
  ThreadsGuard threads;
  {
    SCOPED_TRACE("bf16 char-lm decoder, full attention, dropout 0.1");
    check_resume_is_bitwise("bf16_lm", tiny_decoder(), char_lm(), DType::bf16);
  }
  {
    SCOPED_TRACE("bf16 copy encoder, improved-clustered attention");
    const auto encoder = tiny_decoder()
                             .architecture(models::Architecture::encoder)
                             .attention({"improved-clustered:clusters=4,topk=4"});
    check_resume_is_bitwise("bf16_copy", encoder, {"copy", "", 8}, DType::bf16);
  }
  {
    SCOPED_TRACE("bf16 copy encoder, SAC");
    const auto encoder = tiny_decoder()
                             .architecture(models::Architecture::encoder)
                             .attention({"sac:alpha=1,variant=all-connected,hidden=8,max_distance=9"});
    check_resume_is_bitwise("bf16_sac", encoder, {"copy", "", 8}, DType::bf16);
  }
}

// A run's dtype shapes its trajectory: resuming it in another is refused.
TEST(TrainTrainer, ResumeInAnotherDtypeIsRefused) {
  ThreadsGuard threads;
  const auto dir = fresh_dir("dtype_refuse");
  Trainer(tiny_run(dir).steps(2).dtype(DType::bf16), tiny_decoder(), char_lm()).run();
  const auto msg = error_of([&] { Trainer(tiny_run(dir).steps(4).resume(true), tiny_decoder(), char_lm()); });
  EXPECT_NE(msg.find("trainer dtype: checkpoint \"bf16\", now \"float32\""), std::string::npos) << msg;
}

// The REINFORCE term on a hand-made batch: its gradient with respect to each
// step's log-probability is -(R - b) / N where the step is credited, 0
// elsewhere; the baseline is the first batch's mean reward.
TEST(TrainTrainer, SacReinforceCreditsTheRightSteps) {
  torch::manual_seed(1);
  nn::EdgePredictor predictor(nn::EdgePredictorOptions(4, 4).variant(nn::EdgePredictorVariant::all_connected));
  const int64_t N = 2, L = 3, V = 4;
  tasks::Batch batch{torch::zeros({N, L}, torch::kLong), torch::tensor({{1, 2, 3}, {0, 1, 2}}),
                     torch::tensor({{1.f, 0.f, 1.f}, {0.f, 0.f, 0.f}})};
  const auto logits = torch::randn({N, L, V});
  const auto lp = tasks::target_log_probs(logits, batch);  // (N, L)
  // all-connected, alpha 1: origins 0, 1, 2 fed at steps 0, 2, 4.
  models::SacStructures sac;
  sac.tokens = torch::tensor({{{0, 2, 1, 0, 2, 2}}, {{0, 1, 1, 1, 2, 0}}});
  sac.step_log_prob = torch::randn({N, 1, 6}).requires_grad_(true);
  sac.log_prob = sac.step_log_prob.sum({1, 2});
  sac.entropy = torch::rand({N}).requires_grad_(true);
  nn::SacOptions edge;
  edge.reward = "edge";
  {
    SCOPED_TRACE("edge credit");
    auto r = train::sac_reinforce(*predictor, sac, logits, batch, edge);
    // Credited: sequence 0, destinations of origins 0 and 2 (scored); nothing in sequence 1.
    const double r0 = lp[0][0].item<double>(), r2 = lp[0][2].item<double>();
    EXPECT_NEAR(r.mean_reward, (r0 + r2) / 2, 1e-12);
    EXPECT_NEAR(r.baseline, (r0 + r2) / 2, 1e-12);
    const auto g = torch::autograd::grad({r.surrogate}, {sac.step_log_prob})[0];
    auto expected = torch::zeros({N, 1, 6});
    expected[0][0][1] = -(r0 - r.baseline) / N;
    expected[0][0][5] = -(r2 - r.baseline) / N;
    EXPECT_LT((g - expected).abs().max().item<double>(), 1e-6);
  }
  {
    SCOPED_TRACE("sequence credit");
    const double before = predictor->baseline();
    auto r = train::sac_reinforce(*predictor, sac, logits, batch, nn::SacOptions{});
    const double R0 = (lp[0][0].item<double>() + lp[0][2].item<double>()) / 2;  // sequence 1 unscored
    EXPECT_NEAR(r.mean_reward, R0, 1e-12);
    EXPECT_NEAR(r.baseline, before, 1e-12);  // compared with the average before this batch
    const auto g = torch::autograd::grad({r.surrogate}, {sac.step_log_prob})[0];
    auto expected = torch::zeros({N, 1, 6});
    expected[0] = -(R0 - before) / N;
    EXPECT_LT((g - expected).abs().max().item<double>(), 1e-6);
  }
  {
    SCOPED_TRACE("entropy bonus");
    nn::SacOptions bonus;
    bonus.entropy = 0.25;
    auto r = train::sac_reinforce(*predictor, sac, logits, batch, bonus);
    const auto g = torch::autograd::grad({r.surrogate}, {sac.entropy})[0];
    EXPECT_LT((g + 0.25 / N).abs().max().item<double>(), 1e-7);  // -entropy x mean(H)
  }
  // Nothing scored: no term.
  batch.weight.zero_();
  EXPECT_FALSE(train::sac_reinforce(*predictor, sac, logits, batch, edge).surrogate.defined());
}

// SAC trains its predictor by REINFORCE in the same loop, with either credit
// (nn::SacOptions::reward).
TEST(TrainTrainer, SacTrainsItsEdgePredictor) {
  for (const std::string reward : {"sequence", "edge"}) {
    SCOPED_TRACE(reward);
    check_sac_training(reward);
  }
}

TEST(TrainTrainer, KeepsTheLastTwoCheckpointsAndLogsMetrics) {
  ThreadsGuard threads;
  const auto dir = fresh_dir("keep");
  Trainer trainer(tiny_run(dir).steps(12).checkpoint_every(4).eval_every(6).log_every(3), tiny_decoder(),
                  char_lm());
  const auto result = trainer.run();
  EXPECT_TRUE(result.validated);
  const auto listed = list_checkpoints(dir);
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].step, 12);
  EXPECT_EQ(listed[1].step, 8);
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();

  std::ifstream in(fs::path(dir) / "metrics.jsonl");
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(records.size(), 4u);  // steps 3, 6, 9, 12
  for (const auto& r : records) {
    for (const char* key : {"step", "loss", "bpc", "accuracy", "lr", "tokens_per_s", "elapsed", "grad_norm"})
      EXPECT_TRUE(r.contains(key)) << key << " missing in " << r.dump();
    EXPECT_NEAR(r["bpc"].get<double>(), r["loss"].get<double>() / std::log(2.0), 1e-12);
    EXPECT_GT(r["loss"].get<double>(), 0);
  }
  EXPECT_TRUE(records[1].contains("valid_bpc"));  // step 6
  EXPECT_FALSE(records[2].contains("valid_bpc"));  // step 9
  EXPECT_TRUE(records[3].contains("valid_bpc"));  // the end
  EXPECT_DOUBLE_EQ(records[0]["lr"].get<double>(), learning_rate(trainer.options(), 2));

  // The header names what built the model.
  const auto stored = read_stored_options(dir);
  EXPECT_EQ(stored.step, 12);
  EXPECT_EQ(stored.model.width(), 32);
  EXPECT_EQ(stored.task.name, "char-lm");
  EXPECT_EQ(stored.trainer.seed(), 3u);
}

TEST(TrainTrainer, RefusalsLeaveTheRunUntouched) {
  ThreadsGuard threads;
  const auto dir = fresh_dir("refuse");
  Trainer(tiny_run(dir).steps(6).checkpoint_every(3), tiny_decoder(), char_lm()).run();
  const auto before = snapshot(dir);
  ASSERT_EQ(before.count(checkpoint_name(6)), 1u);

  // A fresh run into a directory with checkpoints.
  EXPECT_NE(error_of([&] { Trainer(tiny_run(dir), tiny_decoder(), char_lm()); }).find("already holds checkpoints"),
            std::string::npos);
  // Resume with other model options: every difference named.
  const auto mismatch = error_of([&] {
    Trainer(tiny_run(dir).resume(true).lr(1e-2), tiny_decoder().width(64).heads(4), char_lm());
  });
  EXPECT_NE(mismatch.find("cannot resume from"), std::string::npos) << mismatch;
  EXPECT_NE(mismatch.find(checkpoint_name(6)), std::string::npos) << mismatch;
  EXPECT_NE(mismatch.find("model width: checkpoint 32, now 64"), std::string::npos) << mismatch;
  EXPECT_NE(mismatch.find("model heads"), std::string::npos) << mismatch;
  EXPECT_NE(mismatch.find("trainer lr"), std::string::npos) << mismatch;
  // Another task.
  EXPECT_NE(error_of([&] {
              Trainer(tiny_run(dir).resume(true), tiny_decoder().architecture(models::Architecture::encoder),
                      {"copy", "", 8});
            }).find("cannot resume"),
            std::string::npos);
  EXPECT_EQ(snapshot(dir), before);

  // A flipped bit in the newest checkpoint: refused by resume and by load_run,
  // naming the file and the older checkpoint; nothing written.
  const auto newest = (fs::path(dir) / checkpoint_name(6)).string();
  auto corrupt = before.at(checkpoint_name(6));
  corrupt[corrupt.size() / 2] ^= 0x04;
  { std::ofstream(newest, std::ios::binary | std::ios::trunc) << corrupt; }
  const auto damaged = snapshot(dir);
  for (const auto& msg : {error_of([&] { Trainer(tiny_run(dir).resume(true), tiny_decoder(), char_lm()).run(); }),
                          error_of([&] { load_run(dir); })}) {
    EXPECT_NE(msg.find(newest), std::string::npos) << msg;
    EXPECT_NE(msg.find("CRC-32 mismatch"), std::string::npos) << msg;
    EXPECT_NE(msg.find(checkpoint_name(3)), std::string::npos) << msg;  // the way back
  }
  EXPECT_EQ(snapshot(dir), damaged);

  // Truncated.
  { std::ofstream(newest, std::ios::binary | std::ios::trunc) << before.at(checkpoint_name(6)).substr(0, 1000); }
  const auto truncated = snapshot(dir);
  const auto msg = error_of([&] { Trainer(tiny_run(dir).resume(true), tiny_decoder(), char_lm()); });
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_EQ(snapshot(dir), truncated);

  // With the damaged file moved aside, resume continues from the older one.
  fs::rename(newest, fs::path(dir) / "damaged.ckpt.bak");
  Trainer again(tiny_run(dir).steps(6).resume(true), tiny_decoder(), char_lm());
  EXPECT_EQ(again.start_step(), 3);
}

TEST(TrainTrainer, BadOptionsAreRefused) {
  const auto dir = fresh_dir("bad");
  EXPECT_NE(error_of([&] { Trainer(tiny_run(dir), tiny_decoder().architecture(models::Architecture::encoder), char_lm()); })
                .find("needs architecture 'decoder'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Trainer(tiny_run(dir).steps(0), tiny_decoder(), char_lm()); }).find("steps must be >= 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Trainer(tiny_run(dir), tiny_decoder().vocab_size(5), char_lm()); }).find("vocab_size"),
            std::string::npos);
  EXPECT_TRUE(list_checkpoints(dir).empty());
}

// Swap-in evaluation: every mechanism of the registry behind the projections
// of a trained tiny model. Mechanisms usable in a decoder (the causal flag or
// a causal pattern) go into a char-lm decoder, the others into a copy-task
// encoder. Refused, with the builder's error: agglomerative attention (a layer
// with parameters of its own) and the graph patterns that add nodes of their
// own (sparse-bp-tree, sparse-star).
TEST(TrainTrainer, SwapInEvaluationOfEveryMechanism) {
  ThreadsGuard threads;
  const auto lm_dir = fresh_dir("swap_lm"), copy_dir = fresh_dir("swap_copy");
  Trainer(tiny_run(lm_dir).steps(8), tiny_decoder(), char_lm()).run();
  Trainer(tiny_run(copy_dir).steps(8).context(18),
          tiny_decoder().architecture(models::Architecture::encoder), {"copy", "", 8})
      .run();
  auto lm = load_run(lm_dir), copy = load_run(copy_dir);
  const std::map<std::string, std::string> refused = {
      {"agglomerative", "agglomerative"}, {"sparse-bp-tree", "adds nodes"}, {"sparse-star", "adds nodes"},
      {"sac", "edge predictor"}};
  int in_decoder = 0, in_encoder = 0;
  for (const auto& info : nn::mechanisms()) {
    SCOPED_TRACE(info.name);
    const bool decoder = nn::usable_in_decoder(info);
    auto& run = decoder ? lm : copy;
    const auto it = refused.find(info.name);
    if (it != refused.end()) {
      const auto msg = error_of([&] { run.model->set_attention({info.name}); });
      EXPECT_NE(msg.find(it->second), std::string::npos) << msg;
      continue;
    }
    ASSERT_EQ(error_of([&] { run.model->set_attention({info.name}); }), "(no error)");
    (decoder ? in_decoder : in_encoder)++;
    const auto m = evaluate(run.model, *run.task, tasks::Split::valid, 4, decoder ? 32 : 18, 1);
    EXPECT_GT(m.scored, 0);
    EXPECT_TRUE(std::isfinite(m.loss())) << m.loss();
  }
  EXPECT_GT(in_decoder, 0);
  EXPECT_GT(in_encoder, 0);
  // Back to the trained attention: the numbers of the trained model.
  auto fresh = load_run(lm_dir);
  lm.model->set_attention(fresh.model_options.attention());
  const auto a = evaluate(lm.model, *lm.task, tasks::Split::valid, 4, 32, 1);
  const auto b = evaluate(fresh.model, *fresh.task, tasks::Split::valid, 4, 32, 1);
  EXPECT_EQ(a.loss_sum, b.loss_sum);
}

// One process per run directory: a held RUN/.lock refuses run(); checkpoints
// that appear after the Trainer was built refuse it too.
TEST(TrainTrainer, RunDirectoryIsLockedAndRechecked) {
  ThreadsGuard threads;
  const auto dir = fresh_dir("lock");
  Trainer trainer(tiny_run(dir).steps(2), tiny_decoder(), char_lm());
  const int fd = ::open((fs::path(dir) / ".lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  EXPECT_NE(error_of([&] { trainer.run(); }).find("another process is training"), std::string::npos);
  ::close(fd);
  EXPECT_TRUE(list_checkpoints(dir).empty());

  Trainer late(tiny_run(dir).steps(2), tiny_decoder(), char_lm());
  Trainer(tiny_run(dir).steps(2), tiny_decoder(), char_lm()).run();  // another run got there first
  EXPECT_NE(error_of([&] { late.run(); }).find("changed since the run was opened"), std::string::npos);
  EXPECT_EQ(list_checkpoints(dir).size(), 1u);
}

}  // namespace trainer_test
