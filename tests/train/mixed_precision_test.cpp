// Mixed-precision training (TrainerOptions::dtype(DType::bf16)): the forward
// and backward passes run on a bfloat16 working copy, while the weights the
// optimiser updates, its state, the gradients it reads and the checkpoints
// stay float32. Bitwise resume in bf16 is in trainer_test.cpp, the
// data-parallel all-reduce of bf16 gradients in distributed_test.cpp.
#include <attnkit/nn/registry.h>
#include <attnkit/runtime.h>
#include <attnkit/train/trainer.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "test_util.h"
#include "train/train_test_util.h"

namespace mixed_precision_test {

using namespace attnkit;
using namespace attnkit::train;
using attnkit::testing::char_lm_data;
using attnkit::testing::fresh_dir;

namespace {

using attnkit::testing::ThreadsGuard;

models::TransformerOptions tiny_decoder() {
  return models::TransformerOptions().layers(2).width(32).heads(2).ffn(64).dropout(0.0);
}

TrainerOptions bf16_run(const std::string& out) {
  return TrainerOptions().batch(4).context(32).lr(3e-3).warmup(4).min_lr(3e-4).seed(5).threads(1)
      .log_every(100).checkpoint_every(1000).eval_batches(1).display(Display::quiet).dtype(DType::bf16).out(out);
}

tasks::TaskOptions char_lm() { return {"char-lm", char_lm_data(), 0}; }

std::map<std::string, torch::Tensor> copy_of(models::Transformer& model) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

}  // namespace

// One step with clipping off: each float32 parameter's gradient is its bf16
// copy's gradient converted exactly, and AdamW's state is float32.
TEST(TrainMixedPrecision, GradientsReachTheFloat32WeightsExactly) {
  ThreadsGuard threads;
  const auto dir = fresh_dir("bf16_grad");
  Trainer trainer(bf16_run(dir).steps(1).clip(0), tiny_decoder(), char_lm());
  ASSERT_FALSE(trainer.compute_model().ptr() == trainer.model().ptr());
  trainer.run();
  const auto master = trainer.model()->named_parameters();
  const auto copy = trainer.compute_model()->named_parameters();
  ASSERT_EQ(master.size(), copy.size());
  int64_t with_grad = 0;
  for (const auto& item : master) {
    SCOPED_TRACE(item.key());
    const auto& c = copy[item.key()];
    EXPECT_EQ(item.value().scalar_type(), torch::kFloat32);
    EXPECT_EQ(c.scalar_type(), torch::kBFloat16);
    ASSERT_EQ(item.value().grad().defined(), c.grad().defined());
    if (!c.grad().defined()) continue;
    ++with_grad;
    EXPECT_EQ(c.grad().scalar_type(), torch::kBFloat16);
    EXPECT_EQ(item.value().grad().scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(item.value().grad(), c.grad().to(torch::kFloat32)));
  }
  EXPECT_EQ(with_grad, static_cast<int64_t>(master.size()));  // every parameter is used
  // AdamW holds the float32 parameters (each once), not their copies.
  std::set<const void*> float32_params;
  for (const auto& p : trainer.model()->parameters()) float32_params.insert(p.unsafeGetTensorImpl());
  std::size_t optimised = 0;
  for (const auto& group : trainer.optimizer().param_groups())
    for (const auto& p : group.params()) {
      EXPECT_EQ(float32_params.count(p.unsafeGetTensorImpl()), 1u);
      ++optimised;
    }
  EXPECT_EQ(optimised, float32_params.size());
  EXPECT_EQ(trainer.optimizer().state().size(), optimised);  // one state per float32 parameter
  for (const auto& [key, state] : trainer.optimizer().state()) {
    const auto& adamw = static_cast<const torch::optim::AdamWParamState&>(*state);
    EXPECT_EQ(adamw.exp_avg().scalar_type(), torch::kFloat32);
    EXPECT_EQ(adamw.exp_avg_sq().scalar_type(), torch::kFloat32);
  }
}

// A tiny bf16 model on the shipped text: the training loss falls, the
// float32 weights move by updates finer than bfloat16 resolves (so they are
// no longer bf16 values: the updates accumulate in float32), and after the run
// the working copy holds exactly those weights rounded to bf16 (the final
// validation refreshed it).
TEST(TrainMixedPrecision, Float32WeightsLearnAndStayFloat32) {
  ThreadsGuard threads;
  const auto dir = fresh_dir("bf16_learn");
  Trainer trainer(bf16_run(dir).steps(150).batch(8).lr(5e-3).warmup(10).weight_decay(0.0), tiny_decoder(),
                  char_lm());
  const auto initial = copy_of(trainer.model());
  const auto before = evaluate(trainer.compute_model(), trainer.task(), tasks::Split::train, 8, 32, 4);
  const auto result = trainer.run();
  const auto after = evaluate(trainer.compute_model(), trainer.task(), tasks::Split::train, 8, 32, 4);
  std::printf("bf16: training-split loss %.4f -> %.4f after 150 steps; valid bpc %.4f\n", before.loss(),
              after.loss(), result.valid.bits());
  ASSERT_TRUE(result.validated);
  EXPECT_TRUE(std::isfinite(result.valid.loss()));
  EXPECT_LT(after.loss(), before.loss() - 1.0);
  const auto copy = trainer.compute_model()->named_parameters();
  int64_t elements = 0, off_grid = 0;
  for (const auto& item : trainer.model()->named_parameters()) {
    SCOPED_TRACE(item.key());
    const auto& w = item.value();
    EXPECT_EQ(w.scalar_type(), torch::kFloat32);
    EXPECT_FALSE(torch::equal(w, initial.at(item.key()))) << "not trained";
    EXPECT_TRUE(torch::equal(copy[item.key()], w.to(torch::kBFloat16)));
    elements += w.numel();
    off_grid += w.ne(w.to(torch::kBFloat16).to(torch::kFloat32)).sum().item<int64_t>();
  }
  // Float32 weights initialised off the bf16 grid stay off it; at least most
  // of them (an element lands on the grid with probability ~2^-16).
  EXPECT_GT(off_grid, elements * 9 / 10) << off_grid << " of " << elements;
  // The checkpoint holds float32 weights, bitwise the trained ones.
  auto run = load_run(dir);
  for (const auto& item : run.model->named_parameters()) {
    EXPECT_EQ(item.value().scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(item.value(), trainer.model()->named_parameters()[item.key()]));
  }
}

// Every mechanism of the registry (each one the transformer builder accepts
// with its default options) trains in bf16: decoder mechanisms (the causal
// flag or a causal pattern) in a char-lm decoder, the others in a copy-task
// encoder; three steps, finite losses, float32 weights that moved.
TEST(TrainMixedPrecision, EveryMechanismTrainsInBf16) {
  ThreadsGuard threads;
  int trained = 0;
  std::string names;
  for (const auto& info : nn::mechanisms()) {
    SCOPED_TRACE(info.name);
    const bool decoder = nn::usable_in_decoder(info);
    const auto model = tiny_decoder()
                           .architecture(decoder ? models::Architecture::decoder : models::Architecture::encoder)
                           .attention({info.name});
    const tasks::TaskOptions task = decoder ? char_lm() : tasks::TaskOptions{"copy", "", 8};
    const int64_t context = decoder ? 32 : 18;
    const auto dir = fresh_dir("bf16_mech_" + info.name);
    Trainer trainer(bf16_run(dir).steps(3).context(context), model, task);
    const auto initial = copy_of(trainer.model());
    const auto result = trainer.run();
    ASSERT_TRUE(result.validated);
    EXPECT_TRUE(std::isfinite(result.train.loss())) << result.train.loss();
    EXPECT_TRUE(std::isfinite(result.valid.loss())) << result.valid.loss();
    int64_t moved = 0;
    for (const auto& item : trainer.model()->named_parameters()) {
      EXPECT_EQ(item.value().scalar_type(), torch::kFloat32) << item.key();
      moved += !torch::equal(item.value(), initial.at(item.key()));
    }
    EXPECT_GT(moved, 0);
    ++trained;
    names += " " + info.name;
    std::filesystem::remove_all(dir);
  }
  std::printf("trained in bf16 (%d of %zu):%s\n", trained, nn::mechanisms().size(), names.c_str());
  EXPECT_EQ(trained, static_cast<int>(nn::mechanisms().size()));
}

}  // namespace mixed_precision_test
