// Rotary positions: the op of their own (attnkit::rotary_embedding) and inside
// exact attention (SoftmaxAttentionFuncOptions::rotary_dim), where the kernel
// rotates each block of q and k as it loads it and rotates dq and dk back.
// Checked:
// - the op against its definition by hand, and against the float64
//   reference (values and gradients), with an offset of either sign, a part
//   of the features rotated and strided input;
// - attention against the float64 reference (which rotates q and k first),
//   values and the gradients of q, k, v and a bias, on awkward shapes: L = 1,
//   L != S both ways, lengths past the 128 x 256 blocks, causal and not, key
//   lengths with an empty row, a bias per head and one shared by the heads
//   (the backward's two bias paths), grouped heads, strided views, rotary_dim
//   < E, and the shapes that take the forward's key split and the backward's
//   key parts;
// - attention with rotary_dim equals attention on q and k rotated by the op
//   (query i at position i + S - L, key j at j);
// - decoding: one query over a cache of keys rotated by the op, one step at a
//   time, equals row t of the causal pass;
// - scores depend on the positions' difference alone (a common shift of every
//   position changes nothing beyond rounding);
// - bitwise the same on 1 and 2 threads; the dispatch and the refusals.
#include <attnkit/ops.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "ops/softmax_attention_cases.h"
#include "reference/reference.h"
#include "test_util.h"

namespace softmax_attention_rotary_test {

namespace {

using attnkit::RotaryEmbeddingFuncOptions;
using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::f64;
using namespace attnkit::testing::softmax;

// float32 kernel against float64, as for the kernel without rotation
// (tests/ops/softmax_attention_gqa_test.cpp): 2e-5. A rotation is orthogonal,
// so rotated inputs keep their scale; the table's angles are float32
// roundings of exact values (2^-24 relative), one more rounding per entry.
constexpr double kTolerance = 2e-5;

struct RotaryCase : Case {
  int64_t rotary_dim = 0;  // 0: E
  double base = 10000.0;
};

std::vector<RotaryCase> cases() {
  std::vector<RotaryCase> c;
  const auto add = [&](Case shape, int64_t dim = 0, double base = 10000.0) {
    c.push_back({std::move(shape), dim, base});
  };
  add({"plain"});
  add({"causal L = S, base 100 (fast angles)", 2, 4, 4, 6, 6, 8, 3, true}, 0, 100.0);
  add({"causal L < S, half the features rotated", 2, 4, 4, 4, 9, 8, 3, true}, 4);
  add({"causal L > S, key lengths (an empty row)", 2, 4, 4, 7, 5, 4, 3, true, {5, 0}});
  add({"L = 1 over many keys", 1, 2, 2, 1, 300, 8, 8, true});
  add({"past the blocks: 130 x 300, E = 16, rotary_dim 10", 1, 2, 2, 130, 300, 16, 8, false}, 10);
  add({"causal past the blocks, E != M", 1, 2, 2, 257, 257, 8, 5, true});
  add({"a bias per head with its gradient", 2, 4, 4, 5, 7, 4, 3, false, {}, {1, 4, 1, 7}});
  add({"a bias shared by the heads with its gradient", 2, 4, 4, 130, 7, 4, 3, true, {}, {2, 1, 130, 7}});
  add({"grouped heads", 2, 6, 2, 5, 7, 4, 3, true});
  add({"strided views, rotary_dim 2 of 6", 2, 4, 4, 5, 7, 6, 3, false, {7, 3}, {}, true}, 2);
  // N H ceil(L / 128) < 64 and S >= 2048: the forward splits the keys; N H < 8
  // without a bias: the backward splits each head's keys into parts.
  add({"long keys: key split and backward parts", 1, 2, 2, 3, 2100, 8, 4, true});
  return c;
}

Inputs make(const RotaryCase& c) { return make_inputs(c, 25); }

SoftmaxAttentionFuncOptions rotary(const RotaryCase& c) {
  return SoftmaxAttentionFuncOptions().rotary_dim(c.rotary_dim ? c.rotary_dim : c.E).rotary_base(c.base);
}

TEST(RotaryEmbedding, IsTheRotationByHand) {
  // dim 2 at base 10000: theta_0 = 1, so row t turns (x0, x1) by t radians;
  // the entries from dim on are copied.
  const auto x = torch::tensor({1.f, 0.f, 5.f, 0.f, 1.f, 7.f}).view({1, 1, 2, 3});
  const auto y = attnkit::rotary_embedding(x, RotaryEmbeddingFuncOptions(2).offset(3));
  EXPECT_NEAR(y[0][0][0][0].item<double>(), std::cos(3.0), 1e-6);
  EXPECT_NEAR(y[0][0][0][1].item<double>(), std::sin(3.0), 1e-6);
  EXPECT_EQ(y[0][0][0][2].item<float>(), 5.f);
  EXPECT_NEAR(y[0][0][1][0].item<double>(), -std::sin(4.0), 1e-6);
  EXPECT_NEAR(y[0][0][1][1].item<double>(), std::cos(4.0), 1e-6);
  EXPECT_EQ(y[0][0][1][2].item<float>(), 7.f);
  // dim 4: pairs (0, 2) and (1, 3), the second at theta_1 = 10000^(-1/2) = 0.01.
  const auto z = attnkit::rotary_embedding(torch::tensor({0.f, 1.f, 0.f, 0.f}).view({1, 1, 1, 4}),
                                           RotaryEmbeddingFuncOptions(4).offset(50));
  EXPECT_NEAR(z[0][0][0][1].item<double>(), std::cos(0.5), 1e-6);
  EXPECT_NEAR(z[0][0][0][3].item<double>(), std::sin(0.5), 1e-6);
}

TEST(RotaryEmbedding, MatchesTheFloat64Reference) {
  torch::manual_seed(26);
  struct Shape {
    int64_t T, E, dim, offset;
    double base;
    bool strided;
  };
  for (const Shape s : {Shape{1, 2, 2, 0, 10000.0, false}, Shape{37, 8, 8, -20, 10000.0, false},
                        Shape{300, 16, 10, 4000, 500.0, true}, Shape{5, 6, 2, -3, 10000.0, true}}) {
    SCOPED_TRACE("T " + std::to_string(s.T) + " E " + std::to_string(s.E) + " offset " + std::to_string(s.offset));
    auto x = s.strided ? torch::randn({2, s.T, 3, s.E}, f64()).transpose(1, 2) : torch::randn({2, 3, s.T, s.E}, f64());
    const auto cot = torch::randn({2, 3, s.T, s.E}, f64());
    const auto o = RotaryEmbeddingFuncOptions(s.dim).base(s.base).offset(s.offset);
    auto x32 = x.to(torch::kFloat).requires_grad_(), x64 = x.clone().requires_grad_();
    const auto got = attnkit::rotary_embedding(x32, o), want = attnkit::reference::rotary_embedding(x64, o);
    (got * cot.to(torch::kFloat)).sum().backward();
    (want * cot).sum().backward();
    // Each output entry is two products of O(1) terms: float32 rounding of
    // the inputs and angles, a few 2^-24; the positions reach 4300 radians,
    // whose float32 cosine the table takes from double (not from a float angle).
    EXPECT_LE(relative_error(got, want), 1e-6);
    EXPECT_LE(relative_error(x32.grad(), x64.grad()), 1e-6);
    // The gradient is the inverse rotation: rotating it forward gives back cot.
    EXPECT_LE(relative_error(attnkit::reference::rotary_embedding(x64.grad(), o), cot), 1e-12);
    // float64 takes the reference itself.
    EXPECT_LE(relative_error(attnkit::rotary_embedding(x, o), want), 1e-15);
  }
}

TEST(SoftmaxAttentionRotary, MatchesTheFloat64Reference) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_matches_reference(c, make(c), rotary(c), kTolerance);
  }
}

TEST(SoftmaxAttentionRotary, EqualsAttentionOnRotatedQueriesAndKeys) {
  for (const auto& c : cases()) {
    if (!c.bias_shape.empty()) continue;
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto q = x.q.to(torch::kFloat), k = x.k.to(torch::kFloat), v = x.v.to(torch::kFloat);
    const auto r = rotary(c);
    const auto by_op = [&](const torch::Tensor& t, int64_t offset) {
      return attnkit::rotary_embedding(t, RotaryEmbeddingFuncOptions(r.rotary_dim()).base(r.rotary_base()).offset(offset));
    };
    const auto plain = SoftmaxAttentionFuncOptions().causal(c.causal).key_lengths(x.key_lengths);
    const auto separate = attnkit::softmax_attention(by_op(q, c.S - c.L), by_op(k, 0), v, plain);
    auto fused_options = r;
    fused_options.causal(c.causal).key_lengths(x.key_lengths);
    // The same rotated rows (one table, one rotation), so the same products;
    // only where the kernel reads them from differs.
    EXPECT_LE(relative_error(attnkit::softmax_attention(q, k, v, fused_options), separate), 1e-6);
  }
}

TEST(SoftmaxAttentionRotary, DecodingOverACacheOfRotatedKeysIsTheCausalRow) {
  torch::manual_seed(27);
  const int64_t H = 4, T = 40, E = 16;
  const auto q = torch::randn({1, H, T, E}), k = torch::randn({1, H, T, E}), v = torch::randn({1, H, T, E});
  const auto full =
      attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true).rotary_dim(E));
  // A decoder keeps keys rotated at their positions and rotates each new query at its own.
  const auto rotated_keys = attnkit::rotary_embedding(k, RotaryEmbeddingFuncOptions(E));
  for (int64_t t : {int64_t{0}, int64_t{1}, int64_t{17}, T - 1}) {
    const auto query = attnkit::rotary_embedding(q.narrow(2, t, 1), RotaryEmbeddingFuncOptions(E).offset(t));
    const auto step = attnkit::softmax_attention(query, rotated_keys.narrow(2, 0, t + 1), v.narrow(2, 0, t + 1));
    EXPECT_LE(relative_error(step, full.narrow(2, t, 1)), 1e-6) << "t " << t;
  }
}

TEST(SoftmaxAttentionRotary, DependsOnPositionDifferencesAlone) {
  // Shifting every position by 1000 (rotating q and k with offsets 1000 and
  // 1000 + S - L) leaves every score, so the output, unchanged.
  torch::manual_seed(28);
  const auto q = torch::randn({1, 2, 6, 8}, f64()), k = torch::randn({1, 2, 9, 8}, f64());
  const auto v = torch::randn({1, 2, 9, 3}, f64());
  const auto shifted = [](const torch::Tensor& t, int64_t offset) {
    return attnkit::rotary_embedding(t, RotaryEmbeddingFuncOptions(8).offset(offset));
  };
  const auto in_kernel = attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true).rotary_dim(8));
  const auto moved = attnkit::softmax_attention(shifted(q, 1003), shifted(k, 1000), v,
                                                SoftmaxAttentionFuncOptions().causal(true));
  EXPECT_LE(relative_error(moved, in_kernel), 1e-12);
  // ... and the rotation does act: without it the output differs.
  EXPECT_GT(relative_error(attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true)), in_kernel),
            1e-3);
}

TEST(SoftmaxAttentionRotary, BitwiseTheSameOnOneAndTwoThreads) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_same_on_one_and_two_threads(c, make(c), rotary(c));
  }
}

TEST(SoftmaxAttentionRotary, DispatchAndRefusals) {
  const auto q = torch::randn({1, 4, 3, 8}), k = torch::randn({1, 4, 5, 8}), v = torch::randn({1, 4, 5, 8});
  const auto o = SoftmaxAttentionFuncOptions().rotary_dim(8);
  EXPECT_TRUE(attnkit::softmax_attention_dispatch(q, k, v, o).uses_kernel());
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  EXPECT_EQ(attnkit::softmax_attention_dispatch(bf(q), bf(k), bf(v), o).reason,
            "bf16 converted to float32 (rotary positions)");
  // bf16 inputs (2^-9 relative) through the float32 kernel.
  EXPECT_LE(relative_error(attnkit::softmax_attention(bf(q), bf(k), bf(v), o), attnkit::softmax_attention(q, k, v, o)),
            2e-2);
  EXPECT_EQ(attnkit::rotary_embedding(bf(q), RotaryEmbeddingFuncOptions(8)).scalar_type(), torch::kBFloat16);
  using attnkit::testing::expect_error;
  for (int64_t dim : {-2, 3, 10}) {
    expect_error([&] { attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().rotary_dim(dim)); },
                 {"softmax_attention", "option 'rotary_dim' must be 0 (no rotary positions) or an even number in [2, E] = [2, 8], got " +
                                           std::to_string(dim)});
  }
  for (double base : {0.0, -1.0, double(INFINITY), double(NAN)}) {
    expect_error([&] { attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().rotary_dim(8).rotary_base(base)); },
                 {"softmax_attention", "option 'rotary_base' must be finite and > 0"});
  }
  expect_error([&] { attnkit::rotary_embedding(q, RotaryEmbeddingFuncOptions(0)); },
               {"rotary_embedding", "option 'dim' must be >= 2, got 0"});
  expect_error([&] { attnkit::rotary_embedding(q, RotaryEmbeddingFuncOptions(9)); },
               {"rotary_embedding", "option 'dim'", "[2, E] = [2, 8], got 9"});
  expect_error([&] { attnkit::rotary_embedding(torch::randn({4, 3, 8}), RotaryEmbeddingFuncOptions(8)); },
               {"rotary_embedding", "argument 'x' must have 4 dimensions"});
}

}  // namespace

}  // namespace softmax_attention_rotary_test
