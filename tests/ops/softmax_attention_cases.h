// What the tests of the exact kernel's features (grouped-query heads, ALiBi,
// rotary positions) share: a case of shapes and masks, its float64 inputs,
// one run of the op or of the reference giving the output and every input
// gradient, and the two checks each feature makes of those runs.
#pragma once

#include <attnkit/ops.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::testing::softmax {

using testing::relative_error;  // test_util.h

struct Case {
  std::string name;
  int64_t N = 2, H = 4, Hkv = 4, L = 5, S = 7, E = 4, M = 3;
  bool causal = false;
  std::vector<int64_t> key_lengths;  // empty: none
  std::vector<int64_t> bias_shape;   // empty: none; else with its gradient
  bool strided = false;              // q, k, v as (N, L, H, E) views
};

struct Inputs {
  torch::Tensor q, k, v, bias, key_lengths;
};

/// N(0, 1) inputs in float64 for case c, from `seed`.
inline Inputs make_inputs(const Case& c, uint64_t seed) {
  torch::manual_seed(seed);
  auto tensor = [&](int64_t heads, int64_t rows, int64_t cols) {
    if (!c.strided) return torch::randn({c.N, heads, rows, cols}, f64());
    return torch::randn({c.N, rows, heads, cols}, f64()).transpose(1, 2);
  };
  Inputs x{tensor(c.H, c.L, c.E), tensor(c.Hkv, c.S, c.E), tensor(c.Hkv, c.S, c.M), {}, {}};
  if (!c.bias_shape.empty()) x.bias = torch::randn(c.bias_shape, f64());
  if (!c.key_lengths.empty()) x.key_lengths = torch::tensor(c.key_lengths, torch::kLong);
  return x;
}

/// out and the gradients of q, k, v (and of the bias, when the case has one)
/// in `dtype` under the cotangent `cot`, by the op or by the reference.
/// `features` holds the options under test; the case's mask, key lengths and
/// bias are added to it.
inline std::vector<torch::Tensor> run(const Case& c, const Inputs& x, SoftmaxAttentionFuncOptions features,
                                      torch::ScalarType dtype, const torch::Tensor& cot, bool reference) {
  auto leaf = [&](const torch::Tensor& t) { return t.to(dtype).clone().requires_grad_(); };
  std::vector<torch::Tensor> in{leaf(x.q), leaf(x.k), leaf(x.v)};
  auto o = features.causal(c.causal).key_lengths(x.key_lengths);
  if (x.bias.defined()) {
    in.push_back(leaf(x.bias));
    o.bias(in.back());
  }
  const auto out = reference ? reference::softmax_attention(in[0], in[1], in[2], o)
                             : attnkit::softmax_attention(in[0], in[1], in[2], o);
  (out * cot.to(dtype)).sum().backward();
  std::vector<torch::Tensor> result{out.detach()};
  for (const auto& t : in) result.push_back(t.grad());
  return result;
}

/// The float32 kernel against the float64 reference within `tolerance`
/// (relative_error), values and gradients, all finite; and the float64 op
/// (its composite path) against the reference to rounding (1e-12).
inline void expect_matches_reference(const Case& c, const Inputs& x, const SoftmaxAttentionFuncOptions& features,
                                     double tolerance) {
  const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
  const auto want = run(c, x, features, torch::kDouble, cot, true);
  const auto got = run(c, x, features, torch::kFloat, cot, false);
  const char* names[] = {"out", "dq", "dk", "dv", "dbias"};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), torch::kFloat) << names[i];
    EXPECT_TRUE(all_finite(got[i])) << names[i];
    EXPECT_LE(relative_error(got[i], want[i]), tolerance) << names[i];
  }
  const auto composite = run(c, x, features, torch::kDouble, cot, false);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_LE(relative_error(composite[i], want[i]), 1e-12) << names[i];
}

/// The float32 op's values and gradients are bitwise the same on 1 and 2 threads.
inline void expect_same_on_one_and_two_threads(const Case& c, const Inputs& x,
                                               const SoftmaxAttentionFuncOptions& features) {
  const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
  std::vector<torch::Tensor> one, two;
  {
    ThreadsGuard threads(1);
    one = run(c, x, features, torch::kFloat, cot, false);
  }
  {
    ThreadsGuard threads(2);
    two = run(c, x, features, torch::kFloat, cot, false);
  }
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << i;
}

}  // namespace attnkit::testing::softmax
