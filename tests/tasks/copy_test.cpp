// The masked copy task: the layout [SEP, x, SEP, x], masks on different
// positions of the two halves (so the target is reconstructable), weights on
// the masked positions only, determinism, and the fixed evaluation sets.
#include <attnkit/tasks/copy.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_util.h"

namespace copy_test {

using attnkit::tasks::Batch;
using attnkit::tasks::CopyTask;
using attnkit::tasks::Split;
using attnkit::testing::expect_error;

namespace {

// Checks every invariant of one batch of the task with `length` symbols per half.
void expect_copy_batch(const Batch& b, int64_t length, int64_t rows) {
  const int64_t L = 2 * length + 2;
  ASSERT_EQ(b.input.sizes(), torch::IntArrayRef({rows, L}));
  ASSERT_EQ(b.target.sizes(), torch::IntArrayRef({rows, L}));
  ASSERT_EQ(b.weight.sizes(), torch::IntArrayRef({rows, L}));
  EXPECT_EQ(b.input.scalar_type(), torch::kInt64);
  EXPECT_EQ(b.target.scalar_type(), torch::kInt64);
  EXPECT_EQ(b.weight.scalar_type(), torch::kFloat32);
  const auto first = b.target.slice(1, 1, length + 1), second = b.target.slice(1, length + 2);
  // Target: SEP, x, SEP, x with x over the symbols 1..10.
  EXPECT_TRUE(b.target.select(1, 0).eq(CopyTask::kSep).all().item<bool>());
  EXPECT_TRUE(b.target.select(1, length + 1).eq(CopyTask::kSep).all().item<bool>());
  EXPECT_TRUE(torch::equal(first, second));
  EXPECT_TRUE(first.ge(1).logical_and(first.le(CopyTask::kSymbols)).all().item<bool>());
  // Input: the target with MASK exactly where the weight is 1, weights 0 or 1.
  const auto masked = b.weight.eq(1);
  EXPECT_TRUE(masked.logical_or(b.weight.eq(0)).all().item<bool>());
  EXPECT_TRUE(torch::equal(b.input.eq(CopyTask::kMask), masked));
  EXPECT_TRUE(torch::equal(b.input.masked_select(~masked), b.target.masked_select(~masked)));
  // SEP is never masked; each half masks masked_per_half(length) positions,
  // and never a position masked in the other half.
  EXPECT_FALSE(masked.select(1, 0).any().item<bool>());
  EXPECT_FALSE(masked.select(1, length + 1).any().item<bool>());
  // partners(): every masked position's partner holds the symbol it must copy.
  const auto partner = CopyTask(length).partners(0);
  ASSERT_EQ(static_cast<int64_t>(partner.size()), L);
  EXPECT_EQ(partner[0], -1);
  EXPECT_EQ(partner[length + 1], -1);
  for (int64_t i = 0; i < L; ++i) {
    if (partner[i] < 0) continue;
    EXPECT_EQ(partner[partner[i]], i);
    for (int64_t r = 0; r < rows; ++r)
      if (masked[r][i].item<bool>()) {
        EXPECT_EQ(b.input[r][partner[i]].item<int64_t>(), b.target[r][i].item<int64_t>());
      }
  }
  const auto m1 = masked.slice(1, 1, length + 1), m2 = masked.slice(1, length + 2);
  const auto k = CopyTask::masked_per_half(length);
  EXPECT_TRUE(m1.sum(1).eq(k).all().item<bool>());
  EXPECT_TRUE(m2.sum(1).eq(k).all().item<bool>());
  EXPECT_FALSE(m1.logical_and(m2).any().item<bool>());
}

// What a perfect copier predicts: each masked symbol read from the other half.
torch::Tensor copy_from_other_half(const torch::Tensor& input, int64_t length) {
  auto out = input.clone();
  auto first = out.slice(1, 1, length + 1), second = out.slice(1, length + 2);
  const auto in1 = input.slice(1, 1, length + 1), in2 = input.slice(1, length + 2);
  first.copy_(torch::where(in1.eq(CopyTask::kMask), in2, in1));
  second.copy_(torch::where(in2.eq(CopyTask::kMask), in1, in2));
  return out;
}

}  // namespace

TEST(CopyTask, DescribesItself) {
  CopyTask task(64);
  EXPECT_EQ(task.name(), "copy");
  EXPECT_EQ(task.vocab_size(), 12);
  EXPECT_FALSE(task.causal());
  EXPECT_EQ(task.metric_name(), "accuracy");
  attnkit::tasks::Metrics m;
  m.correct = 3;
  m.scored = 4;
  EXPECT_DOUBLE_EQ(task.metric(m), 0.75);
  EXPECT_EQ(task.sequence_length(512), 130);
  EXPECT_EQ(CopyTask::masked_per_half(2), 1);
  EXPECT_EQ(CopyTask::masked_per_half(4), 1);
  EXPECT_EQ(CopyTask::masked_per_half(10), 2);
  EXPECT_EQ(CopyTask::masked_per_half(64), 13);
  EXPECT_EQ(CopyTask::masked_per_half(128), 26);
  expect_error([&] { task.encode("abc"); }, {"encode", "'copy'", "not over text"});
  expect_error([&] { task.decode(torch::zeros({3}, torch::kInt64)); }, {"decode", "'copy'"});
}

TEST(CopyTask, BatchesHaveTheLayoutAndReconstructableMasks) {
  for (const int64_t length : {2, 3, 4, 10, 64}) {
    CopyTask task(length);
    for (const int64_t step : {0, 1, 99}) {
      const auto b = task.train_batch(5, step, 16, /*context=*/0);
      expect_copy_batch(b, length, 16);
      // Every masked symbol is visible in the other half: the perfect copier
      // rebuilds the target and scores accuracy 1 (and wrong answers do not).
      const auto copied = copy_from_other_half(b.input, length);
      EXPECT_TRUE(torch::equal(copied, b.target)) << "length " << length;
      const auto logits = torch::one_hot(copied, task.vocab_size()).to(torch::kFloat32) * 10;
      const auto m = attnkit::tasks::score(logits, b);
      EXPECT_EQ(m.scored, 16.0 * 2 * CopyTask::masked_per_half(length));
      EXPECT_EQ(m.correct, m.scored);
      const auto masks = torch::one_hot(b.input, task.vocab_size()).to(torch::kFloat32) * 10;
      EXPECT_EQ(attnkit::tasks::score(masks, b).correct, 0.0);  // predicting MASK is never right
    }
  }
}

TEST(CopyTask, TrainBatchIsAPureFunctionOfSeedAndStep) {
  CopyTask task(16);
  const auto a = task.train_batch(3, 10, 8, 0);
  torch::manual_seed(1);
  const auto b = task.train_batch(3, 10, 8, 34);  // the context does not matter
  EXPECT_TRUE(torch::equal(a.input, b.input));
  EXPECT_TRUE(torch::equal(a.target, b.target));
  EXPECT_TRUE(torch::equal(a.weight, b.weight));
  EXPECT_FALSE(torch::equal(task.train_batch(3, 11, 8, 0).target, a.target));
  EXPECT_FALSE(torch::equal(task.train_batch(4, 10, 8, 0).target, a.target));
  expect_error([&] { task.train_batch(3, -1, 8, 0); }, {"step", ">= 0"});
  expect_error([&] { task.train_batch(3, 0, 0, 0); }, {"batch", ">= 1"});
}

TEST(CopyTask, SymbolsAndMaskedPositionsAreUniform) {
  // length 8 masks 2 of 8 positions per half: each first-half position with
  // probability 1/4, each second-half one with (6/8) * (2/6) = 1/4.
  const int64_t length = 8, rows = 4000;
  CopyTask task(length);
  const auto b = task.train_batch(11, 0, rows, 0);
  const auto masked = b.weight.to(torch::kFloat64);
  const double p = 0.25, sigma = std::sqrt(rows * p * (1 - p));
  for (const auto& half : {masked.slice(1, 1, length + 1), masked.slice(1, length + 2)}) {
    const auto counts = half.sum(0);
    EXPECT_LT((counts - rows * p).abs().max().item<double>(), 5 * sigma) << counts;
  }
  // Symbols 1..10 each with probability 1/10.
  const auto symbols = b.target.slice(1, 1, length + 1).reshape(-1);
  const auto counts = torch::bincount(symbols, {}, CopyTask::kSymbols + 1).to(torch::kFloat64);
  const double n = static_cast<double>(symbols.numel());
  EXPECT_EQ(counts[0].item<double>(), 0.0);
  EXPECT_LT((counts.slice(0, 1) - n / 10).abs().max().item<double>(),
            5 * std::sqrt(n * 0.1 * 0.9)) << counts;
}

TEST(CopyTask, EvalSetsAreFixedPerSplitWhateverTheBatch) {
  CopyTask task(12);
  auto gather = [&](Split split, int64_t batch) {
    std::vector<torch::Tensor> inputs, targets, weights;
    for (const auto& b : task.eval_batches(split, batch, 0)) {
      EXPECT_LE(b.input.size(0), batch);
      expect_copy_batch(b, 12, b.input.size(0));
      inputs.push_back(b.input);
      targets.push_back(b.target);
      weights.push_back(b.weight);
    }
    return Batch{torch::cat(inputs), torch::cat(targets), torch::cat(weights)};
  };
  const auto valid = gather(Split::valid, 32);
  EXPECT_EQ(valid.input.size(0), CopyTask::kEvalSequences);
  EXPECT_EQ(task.eval_batches(Split::valid, 32, 0).size(), 4u);
  EXPECT_EQ(task.eval_batches(Split::valid, 50, 0).size(), 3u);
  const auto again = gather(Split::valid, 5);
  EXPECT_TRUE(torch::equal(valid.input, again.input));
  EXPECT_TRUE(torch::equal(valid.weight, again.weight));
  // Another task object, the same set; other splits, other sets.
  EXPECT_TRUE(torch::equal(gather(Split::valid, 128).target, CopyTask(12).eval_batches(Split::valid, 128, 0)[0].target));
  EXPECT_FALSE(torch::equal(gather(Split::test, 32).target, valid.target));
  EXPECT_FALSE(torch::equal(gather(Split::train, 32).target, valid.target));
}

TEST(CopyTask, RefusesLengthsThatCannotMaskBothHalves) {
  expect_error([] { CopyTask task(1); }, {"task copy", "length", "[2, ", "got 1"});
  expect_error([] { CopyTask task(0); }, {"got 0"});
  expect_error([] { CopyTask task(-5); }, {"got -5"});
}

}  // namespace copy_test
