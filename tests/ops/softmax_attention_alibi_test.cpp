// ALiBi inside exact attention (SoftmaxAttentionFuncOptions::alibi_slopes):
// the kernel adds -slope_h |i + S - L - j| to the scores of each tile, with no
// L x S tensor. Checked:
// - against the float64 reference (which forms the penalty as a tensor),
//   values and the gradients of q, k, v and a bias, on awkward shapes: L = 1,
//   L != S both ways, lengths that are not multiples of the 128 x 256 blocks,
//   causal and not, key lengths, a bias, grouped heads, strided views, negative
//   slopes, and the shapes that take the forward's key split and the
//   backward's key parts;
// - against the same op given the penalty as a bias tensor (to rounding: the
//   tile computes slope * distance itself, fused into one multiply-add);
// - bitwise the same on 1 and 2 threads;
// - decoding: one query over a cache of t + 1 keys equals row t of the causal
//   pass (the bottom-right alignment puts that query at the cache's end);
// - the paper's slopes, and the refusals.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "ops/softmax_attention_cases.h"
#include "test_util.h"

namespace softmax_attention_alibi_test {

namespace {

using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::f64;
using namespace attnkit::testing::softmax;

// float32 kernel against float64: max |op - reference| / max(max |reference|, 1),
// 2e-5, as for the kernel without ALiBi (tests/ops/softmax_attention_gqa_test.cpp):
// the penalty is one more float32 term per score, exact in its distance (an
// integer < 2^24) and rounded once in slope * distance.
constexpr double kTolerance = 2e-5;

struct AlibiCase : Case {
  bool negative = false;  // slopes of both signs
};

std::vector<AlibiCase> cases() {
  std::vector<AlibiCase> c;
  const auto add = [&](Case shape, bool negative = false) { c.push_back({std::move(shape), negative}); };
  add({"plain"});
  add({"causal L = S", 2, 4, 4, 6, 6, 4, 3, true});
  add({"causal L < S", 2, 4, 4, 4, 9, 4, 3, true});
  add({"causal L > S, key lengths (an empty row)", 2, 4, 4, 7, 5, 4, 3, true, {5, 0}});
  add({"L = 1 over many keys", 1, 2, 2, 1, 300, 8, 8, true});
  add({"past the blocks: 130 x 300", 1, 2, 2, 130, 300, 16, 8, false});
  add({"causal past the blocks, E != M", 1, 2, 2, 257, 257, 8, 5, true});
  add({"with a bias and its gradient", 2, 4, 4, 5, 7, 4, 3, false, {}, {1, 4, 1, 7}});
  add({"grouped heads", 2, 6, 2, 5, 7, 4, 3, true});
  add({"strided views, slopes of both signs", 2, 4, 4, 5, 7, 4, 3, false, {7, 3}, {}, true}, true);
  // N H ceil(L / 128) < 64 and S >= 2048: the forward splits the keys; N H < 8
  // without a bias: the backward splits each head's keys into parts.
  add({"long keys: key split and backward parts", 1, 2, 2, 3, 2100, 8, 4, true});
  return c;
}

Inputs make(const AlibiCase& c) { return make_inputs(c, 23); }

/// The paper's slopes, in (0, 1); with S up to 2100 the far keys are then
/// hidden by the penalty alone, so the near ones carry the check too.
torch::Tensor slopes(const AlibiCase& c) {
  auto s = attnkit::alibi_slopes(c.H).to(torch::kDouble);
  if (c.negative) s = s * torch::tensor({1.0, -1.0}, f64()).repeat(c.H / 2);
  return s;
}

SoftmaxAttentionFuncOptions alibi(const AlibiCase& c) { return SoftmaxAttentionFuncOptions().alibi_slopes(slopes(c)); }

TEST(SoftmaxAttentionAlibi, MatchesTheFloat64Reference) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_matches_reference(c, make(c), alibi(c), kTolerance);
  }
}

TEST(SoftmaxAttentionAlibi, TheReferenceIsTheDistancePenalty) {
  // A hand-made case: one head of slope 0.5, L = 2 over S = 3, not causal.
  // Query 0 sits at key position 1, query 1 at 2: penalties 0.5 |1 - j|, 0.5 |2 - j|.
  const auto q = torch::zeros({1, 1, 2, 1}, f64()), k = torch::zeros({1, 1, 3, 1}, f64());
  const auto v = torch::tensor({1.0, 10.0, 100.0}, f64()).view({1, 1, 3, 1});
  const auto out = attnkit::reference::softmax_attention(
      q, k, v, SoftmaxAttentionFuncOptions().alibi_slopes(torch::tensor({0.5}, f64())));
  auto expected = [](std::vector<double> penalty) {
    double num = 0, den = 0;
    const double values[] = {1, 10, 100};
    for (int j = 0; j < 3; ++j) num += values[j] * std::exp(-penalty[j]), den += std::exp(-penalty[j]);
    return num / den;
  };
  EXPECT_NEAR(out[0][0][0][0].item<double>(), expected({0.5, 0.0, 0.5}), 1e-12);
  EXPECT_NEAR(out[0][0][1][0].item<double>(), expected({1.0, 0.5, 0.0}), 1e-12);
}

TEST(SoftmaxAttentionAlibi, EqualsThePenaltyGivenAsABias) {
  for (const auto& c : cases()) {
    if (c.Hkv != c.H || !c.bias_shape.empty()) continue;
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto q = x.q.to(torch::kFloat), k = x.k.to(torch::kFloat), v = x.v.to(torch::kFloat);
    const auto query_at = torch::arange(c.L, f64()).add(double(c.S - c.L)).view({c.L, 1});
    const auto penalty = -slopes(c).view({-1, 1, 1}) * (query_at - torch::arange(c.S, f64()).view({1, c.S})).abs();
    const auto as_bias = attnkit::softmax_attention(
        q, k, v, SoftmaxAttentionFuncOptions().causal(c.causal).key_lengths(x.key_lengths).bias(penalty.to(torch::kFloat)));
    const auto o = alibi(c).causal(c.causal).key_lengths(x.key_lengths);
    EXPECT_LE(relative_error(attnkit::softmax_attention(q, k, v, o), as_bias), kTolerance);
  }
}

TEST(SoftmaxAttentionAlibi, BitwiseTheSameOnOneAndTwoThreads) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_same_on_one_and_two_threads(c, make(c), alibi(c));
  }
}

TEST(SoftmaxAttentionAlibi, OneQueryOverACacheIsTheCausalRow) {
  torch::manual_seed(24);
  const int64_t H = 4, T = 40, E = 8;
  const auto q = torch::randn({1, H, T, E}), k = torch::randn({1, H, T, E}), v = torch::randn({1, H, T, E});
  const auto slopes = attnkit::alibi_slopes(H);
  const auto full = attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true).alibi_slopes(slopes));
  for (int64_t t : {int64_t{0}, int64_t{1}, int64_t{17}, T - 1}) {
    const auto step = attnkit::softmax_attention(q.narrow(2, t, 1), k.narrow(2, 0, t + 1), v.narrow(2, 0, t + 1),
                                                 SoftmaxAttentionFuncOptions().alibi_slopes(slopes));
    EXPECT_LE(relative_error(step, full.narrow(2, t, 1)), 1e-6) << "t " << t;
  }
}

TEST(SoftmaxAttentionAlibi, ThePapersSlopes) {
  // Powers of two: 2^(-8 h / H).
  const auto eight = attnkit::alibi_slopes(8);
  for (int64_t h = 0; h < 8; ++h) EXPECT_FLOAT_EQ(eight[h].item<float>(), std::exp2(-(h + 1.0)));
  // Otherwise the slopes of the power of two below, then every other one of twice it:
  // H = 6: those of 4 (2^-2, 2^-4, 2^-6, 2^-8), then 2^-1, 2^-3 (of 8's, the 1st and 3rd).
  const std::vector<float> six{0.25f, 0.0625f, 0.015625f, 0.00390625f, 0.5f, 0.125f};
  const auto got = attnkit::alibi_slopes(6);
  ASSERT_EQ(got.size(0), 6);
  for (int64_t h = 0; h < 6; ++h) EXPECT_FLOAT_EQ(got[h].item<float>(), six[h]) << h;
  EXPECT_FLOAT_EQ(attnkit::alibi_slopes(1)[0].item<float>(), 1.f / 256);
  // Every head count up to 128: bitwise the formula in double, rounded once.
  for (int64_t heads = 1; heads <= 128; ++heads) {
    int64_t p = 1;
    while (2 * p <= heads) p *= 2;
    const auto slopes = attnkit::alibi_slopes(heads);
    ASSERT_EQ(slopes.scalar_type(), torch::kFloat);
    ASSERT_EQ(slopes.size(0), heads);
    for (int64_t h = 1; h <= heads; ++h) {
      const double exponent = h <= p ? -8.0 * h / p : -4.0 * (2 * (h - p) - 1) / p;
      EXPECT_EQ(slopes[h - 1].item<float>(), static_cast<float>(std::exp2(exponent))) << heads << " heads, head " << h;
    }
  }
}

TEST(SoftmaxAttentionAlibi, DispatchAndRefusals) {
  const auto q = torch::randn({1, 4, 3, 8}), k = torch::randn({1, 4, 5, 8}), v = torch::randn({1, 4, 5, 8});
  const auto slopes = attnkit::alibi_slopes(4);
  const auto o = SoftmaxAttentionFuncOptions().alibi_slopes(slopes);
  EXPECT_TRUE(attnkit::softmax_attention_dispatch(q, k, v, o).uses_kernel());
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  EXPECT_EQ(attnkit::softmax_attention_dispatch(bf(q), bf(k), bf(v), o).reason,
            "bf16 converted to float32 (ALiBi slopes)");
  // bf16 inputs (8 bits of mantissa: 2^-9 relative) through the float32
  // kernel: a few 2^-9 of the output's scale from the float32 inputs' result.
  EXPECT_LE(relative_error(attnkit::softmax_attention(bf(q), bf(k), bf(v), o), attnkit::softmax_attention(q, k, v, o)), 2e-2);
  using attnkit::testing::expect_error;
  expect_error([&] { attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().alibi_slopes(torch::ones({3}))); },
               {"softmax_attention", "'alibi_slopes'", "shape (H) = (4)", "got (3)"});
  expect_error([&] {
    attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().alibi_slopes(torch::ones({4}).requires_grad_()));
  }, {"'alibi_slopes' requires grad", "constants"});
  expect_error([&] {
    attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().alibi_slopes(torch::tensor({1.f, NAN, 1.f, 1.f})));
  }, {"'alibi_slopes' has a non-finite entry"});
  expect_error([&] { attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().alibi_slopes(torch::ones({4}, torch::kLong))); },
               {"'alibi_slopes' must be a floating CPU tensor"});
  expect_error([] { attnkit::alibi_slopes(0); }, {"alibi_slopes: heads must be >= 1"});
}

}  // namespace

}  // namespace softmax_attention_alibi_test
