// What every task shares: split names, metrics, the masked cross-entropy
// (loss and score against hand-computed values, gradients), and make_task.
#include <attnkit/tasks/char_lm.h>
#include <attnkit/tasks/copy.h>
#include <attnkit/tasks/task.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <filesystem>

#include <unistd.h>

#include "test_util.h"

namespace task_test {

namespace fs = std::filesystem;
using attnkit::tasks::Batch;
using attnkit::tasks::Metrics;
using attnkit::tasks::Split;
using attnkit::testing::expect_error;

TEST(TaskSplit, NamesRoundTrip) {
  for (const auto split : {Split::train, Split::valid, Split::test})
    EXPECT_EQ(attnkit::tasks::split_from_string(attnkit::tasks::to_string(split)), split);
  EXPECT_EQ(attnkit::tasks::to_string(Split::valid), "valid");
  expect_error([] { attnkit::tasks::split_from_string("validation"); },
               {"train, valid, test", "'validation'"});
}

TEST(TaskMetrics, SumAndDerive) {
  Metrics a;
  EXPECT_EQ(a.loss(), 0);
  EXPECT_EQ(a.accuracy(), 0);
  a.loss_sum = 2;
  a.correct = 1;
  a.scored = 2;
  a.positions = 5;
  Metrics b;
  b.loss_sum = 4;
  b.correct = 2;
  b.scored = 2;
  b.positions = 7;
  a += b;
  EXPECT_EQ(a.loss_sum, 6);
  EXPECT_EQ(a.correct, 3);
  EXPECT_EQ(a.scored, 4);
  EXPECT_EQ(a.positions, 12);
  EXPECT_DOUBLE_EQ(a.loss(), 1.5);
  EXPECT_DOUBLE_EQ(a.bits(), 1.5 / std::log(2.0));
  EXPECT_DOUBLE_EQ(a.accuracy(), 0.75);
}

namespace {

// N = 2, L = 3, V = 3. Row 0: uniform logits (target 2: -log(1/3), argmax tie
// -> id 0, wrong); softmax (1/4, 1/2, 1/4) (target 1: -log(1/2), right); a
// padded position with an infinite logit (weight 0: ignored). Row 1: one
// scored position, softmax (1/4, 1/4, 1/2) with target 0: -log(1/4), wrong.
Batch hand_batch() {
  Batch b;
  b.input = torch::zeros({2, 3}, torch::kInt64);
  b.target = torch::tensor({2, 1, 0, 0, 0, 0}, torch::kInt64).view({2, 3});
  b.weight = torch::tensor({1.f, 1.f, 0.f, 1.f, 0.f, 0.f}).view({2, 3});
  return b;
}

torch::Tensor hand_logits() {
  const double l2 = std::log(2.0), inf = std::numeric_limits<double>::infinity();
  return torch::tensor({0.0, 0.0, 0.0, 0.0, l2, 0.0, -inf, 3.0, 1.0,
                        0.0, 0.0, l2, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0},
                       torch::kFloat64)
      .view({2, 3, 3});
}

}  // namespace

TEST(TaskLoss, MatchesHandComputedValues) {
  const auto b = hand_batch();
  const double expected = (std::log(3.0) + std::log(2.0) + std::log(4.0)) / 3;
  auto logits = hand_logits().requires_grad_();
  auto l = attnkit::tasks::loss(logits, b);
  EXPECT_NEAR(l.item<double>(), expected, 1e-15);
  // d loss / d logits = weight * (softmax - onehot(target)) / scored.
  l.backward();
  auto want = torch::zeros({2, 3, 3}, torch::kFloat64);
  want[0][0] = torch::tensor({1.0 / 3, 1.0 / 3, 1.0 / 3 - 1}, torch::kFloat64) / 3;
  want[0][1] = torch::tensor({0.25, 0.5 - 1, 0.25}, torch::kFloat64) / 3;
  want[1][0] = torch::tensor({0.25 - 1, 0.25, 0.5}, torch::kFloat64) / 3;
  EXPECT_LT((logits.grad() - want).abs().max().item<double>(), 1e-15) << logits.grad();

  const auto m = attnkit::tasks::score(hand_logits(), b);
  EXPECT_NEAR(m.loss_sum, 3 * expected, 1e-14);
  EXPECT_EQ(m.correct, 1);
  EXPECT_EQ(m.scored, 3);
  EXPECT_EQ(m.positions, static_cast<double>(b.input.numel()));  // scored or not
  EXPECT_NEAR(m.bits(), expected / std::log(2.0), 1e-14);

  // float32 logits give the same to float32 rounding.
  auto l32 = attnkit::tasks::loss(hand_logits().to(torch::kFloat32), b);
  EXPECT_EQ(l32.scalar_type(), torch::kFloat32);
  EXPECT_NEAR(l32.item<double>(), expected, 1e-6);
  // Nothing scored: loss 0 with zero gradients, metrics all 0.
  auto none = b;
  none.weight = torch::zeros({2, 3});
  auto l0 = attnkit::tasks::loss(hand_logits().requires_grad_(), none);
  EXPECT_EQ(l0.item<double>(), 0.0);
  EXPECT_EQ(attnkit::tasks::score(hand_logits(), none).scored, 0.0);
}

TEST(TaskLoss, RefusesMismatchedInputs) {
  const auto b = hand_batch();
  expect_error([&] { attnkit::tasks::loss(torch::zeros({2, 3}), b); }, {"loss", "(N, L, V)", "2-D"});
  expect_error([&] { attnkit::tasks::score(torch::zeros({2, 4, 3}), b); },
               {"score", "batch.target", "(2, 4)", "[2, 3]"});
  expect_error([&] { attnkit::tasks::loss(torch::zeros({2, 3, 2}), b); },
               {"loss", "[0, 2)", "[0, 2]"});
  expect_error([&] { attnkit::tasks::loss(torch::zeros({2, 3, 3}, torch::kInt64), b); },
               {"floating point"});
  auto bad = b;
  bad.weight = torch::ones({2, 2});
  expect_error([&] { attnkit::tasks::loss(torch::zeros({2, 3, 3}), bad); }, {"batch.weight"});
}

TEST(MakeTask, BuildsTheKnownTasksAndExplainsTheRest) {
  attnkit::tasks::TaskOptions options;
  options.name = "copy";
  options.copy_length = 20;
  auto copy = attnkit::tasks::make_task(options);
  EXPECT_EQ(copy->name(), "copy");
  EXPECT_EQ(copy->sequence_length(0), 42);

  options.name = "char-lm";
  expect_error([&] { attnkit::tasks::make_task(options); },
               {"char-lm", "--data", "attnkit data char-lm --input"});
  const auto dir = fs::temp_directory_path() / ("attnkit_make_task_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  options.data_dir = dir.string();
  expect_error([&] { attnkit::tasks::make_task(options); },
               {dir.string(), "no train.txt", "attnkit data char-lm --input FILE... --out " + dir.string()});
  attnkit::tasks::prepare_char_lm({(fs::path(ATTNKIT_TEST_DATA_DIR) / "genesis-1-2.txt").string()},
                                  dir.string(), /*force=*/true);
  auto lm = attnkit::tasks::make_task(options);
  EXPECT_EQ(lm->name(), "char-lm");
  EXPECT_EQ(lm->vocab_size(), 27);
  options.name = "masked-char";
  auto masked = attnkit::tasks::make_task(options);
  EXPECT_EQ(masked->name(), "masked-char");
  EXPECT_EQ(masked->vocab_size(), 28);
  EXPECT_FALSE(masked->causal());
  options.data_dir.clear();
  expect_error([&] { attnkit::tasks::make_task(options); }, {"task masked-char", "--data"});
  fs::remove_all(dir);

  options.name = "cloze";
  expect_error([&] { attnkit::tasks::make_task(options); },
               {"unknown task 'cloze'", "known tasks: char-lm, masked-char, copy"});
  options.name = "copy";
  options.copy_length = 1;
  expect_error([&] { attnkit::tasks::make_task(options); }, {"task copy", "got 1"});
}

}  // namespace task_test
