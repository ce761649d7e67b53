// Grouped-query heads in attnkit::softmax_attention: k and v with Hkv heads,
// a divisor of q's H, read in place by the float32 kernel (query head h reads
// key and value head h / (H / Hkv)). Checked three ways:
// - against the float64 reference (which repeats k and v), values and the
//   gradients of q, k, v and a bias, with every mask, L != S, L = 1, strided
//   views, multi-query (Hkv = 1), and the shapes that take the forward's key
//   split and the backward's key parts;
// - against the same op on k and v repeated to H heads: the output and dq
//   bitwise (the kernel does the same arithmetic), dk and dv bitwise equal to
//   the repeated run's per-head gradients summed over each group in head order;
// - bitwise the same on 1 and 2 threads.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "reference/reference.h"
#include "test_util.h"

namespace {

using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::f64;

// float32 kernel against float64: max |op - reference| / max(max |reference|, 1),
// 2e-5. The inputs and the cotangent are N(0, 1), so the terms of every sum are
// O(1) and float32 rounding over S <= 2100 terms stays below ~sqrt(S) u = 3e-6
// of that scale; 2e-5 leaves room for the exponentials.
constexpr double kTolerance = 2e-5;

double err(const torch::Tensor& a, const torch::Tensor& b) {
  const auto a64 = a.detach().to(torch::kDouble), b64 = b.detach().to(torch::kDouble);
  EXPECT_EQ(a64.sizes(), b64.sizes());
  return (a64 - b64).abs().max().item<double>() / std::max(b64.abs().max().item<double>(), 1.0);
}

struct Case {
  std::string name;
  int64_t N = 2, H = 6, Hkv = 2, L = 5, S = 7, E = 4, M = 3;
  bool causal = false;
  std::vector<int64_t> key_lengths;  // empty: none
  std::vector<int64_t> bias_shape;   // empty: none; else with its gradient
  bool strided = false;              // q, k, v as (N, L, H, E) views
};

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"plain"});
  c.push_back({"causal L < S", 2, 6, 3, 4, 9, 4, 3, true});
  c.push_back({"causal L > S, key lengths", 2, 4, 2, 7, 5, 4, 3, true, {5, 2}});
  c.push_back({"multi-query", 2, 4, 1, 5, 7, 8, 2});
  c.push_back({"L = 1", 1, 4, 2, 1, 6, 4, 4});
  c.push_back({"bias per head with its gradient", 2, 6, 2, 5, 7, 4, 3, false, {}, {1, 6, 1, 7}});
  c.push_back({"bias shared by the heads", 2, 6, 3, 5, 7, 4, 3, true, {}, {2, 1, 5, 7}});
  c.push_back({"strided views", 2, 6, 2, 5, 7, 4, 3, false, {7, 3}, {}, true});
  c.push_back({"equal heads", 2, 3, 3, 5, 7, 4, 3, true});
  // N H ceil(L / 128) < 64 and S >= 2048: the forward splits the keys; N H < 8
  // without a bias: the backward splits each head's keys into parts.
  c.push_back({"long keys: key split and backward parts", 1, 4, 2, 3, 2100, 8, 4, true});
  return c;
}

struct Inputs {
  torch::Tensor q, k, v, bias, key_lengths;
};

Inputs make(const Case& c) {
  torch::manual_seed(21);
  auto tensor = [&](int64_t heads, int64_t rows, int64_t cols) {
    if (!c.strided) return torch::randn({c.N, heads, rows, cols}, f64());
    return torch::randn({c.N, rows, heads, cols}, f64()).transpose(1, 2);
  };
  Inputs x{tensor(c.H, c.L, c.E), tensor(c.Hkv, c.S, c.E), tensor(c.Hkv, c.S, c.M), {}, {}};
  if (!c.bias_shape.empty()) x.bias = torch::randn(c.bias_shape, f64());
  if (!c.key_lengths.empty()) x.key_lengths = torch::tensor(c.key_lengths, torch::kLong);
  return x;
}

/// out and the gradients of q, k, v (and the bias) in dtype under cotangent cot.
std::vector<torch::Tensor> run(const Case& c, const Inputs& x, torch::ScalarType dtype, const torch::Tensor& cot,
                               bool reference) {
  auto leaf = [&](const torch::Tensor& t) { return t.to(dtype).clone().requires_grad_(); };
  std::vector<torch::Tensor> in{leaf(x.q), leaf(x.k), leaf(x.v)};
  auto o = SoftmaxAttentionFuncOptions().causal(c.causal).key_lengths(x.key_lengths);
  if (x.bias.defined()) {
    in.push_back(leaf(x.bias));
    o.bias(in.back());
  }
  const auto out = reference ? attnkit::reference::softmax_attention(in[0], in[1], in[2], o)
                             : attnkit::softmax_attention(in[0], in[1], in[2], o);
  (out * cot.to(dtype)).sum().backward();
  std::vector<torch::Tensor> result{out.detach()};
  for (const auto& t : in) result.push_back(t.grad());
  return result;
}

TEST(SoftmaxAttentionGqa, MatchesTheFloat64Reference) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
    const auto want = run(c, x, torch::kDouble, cot, true);
    const auto got = run(c, x, torch::kFloat, cot, false);
    const char* names[] = {"out", "dq", "dk", "dv", "dbias"};
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].scalar_type(), torch::kFloat) << names[i];
      EXPECT_TRUE(attnkit::testing::all_finite(got[i])) << names[i];
      EXPECT_LE(err(got[i], want[i]), kTolerance) << names[i];
    }
    // The float64 op (composite path) agrees with the reference to rounding.
    const auto composite = run(c, x, torch::kDouble, cot, false);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_LE(err(composite[i], want[i]), 1e-12) << names[i];
  }
}

TEST(SoftmaxAttentionGqa, EqualsRepeatingKeysAndValuesBitwise) {
  for (const auto& c : cases()) {
    if (c.Hkv == c.H) continue;
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
    const auto grouped = run(c, x, torch::kFloat, cot, false);
    const int64_t group = c.H / c.Hkv;
    Case repeated_case = c;
    repeated_case.Hkv = c.H;
    Inputs repeated = x;
    repeated.k = x.k.repeat_interleave(group, 1);
    repeated.v = x.v.repeat_interleave(group, 1);
    const auto full = run(repeated_case, repeated, torch::kFloat, cot, false);
    EXPECT_TRUE(torch::equal(grouped[0], full[0])) << "out";
    EXPECT_TRUE(torch::equal(grouped[1], full[1])) << "dq";
    for (int i : {2, 3}) {  // dk, dv: the repeated heads' gradients, each group summed in head order
      const auto heads = full[i].view({c.N, c.Hkv, group, c.S, full[i].size(3)});
      auto sum = heads.select(2, 0).clone();
      for (int64_t g = 1; g < group; ++g) sum.add_(heads.select(2, g));
      EXPECT_TRUE(torch::equal(grouped[i], sum)) << (i == 2 ? "dk" : "dv");
    }
    if (x.bias.defined()) EXPECT_TRUE(torch::equal(grouped[4], full[4])) << "dbias";
  }
}

TEST(SoftmaxAttentionGqa, BitwiseTheSameOnOneAndTwoThreads) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
    std::vector<torch::Tensor> one, two;
    {
      attnkit::testing::ThreadsGuard threads(1);
      one = run(c, x, torch::kFloat, cot, false);
    }
    {
      attnkit::testing::ThreadsGuard threads(2);
      two = run(c, x, torch::kFloat, cot, false);
    }
    for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << i;
  }
}

TEST(SoftmaxAttentionGqa, DispatchAndRefusals) {
  const auto q = torch::randn({1, 4, 3, 8}), k = torch::randn({1, 2, 5, 8}), v = torch::randn({1, 2, 5, 8});
  EXPECT_TRUE(attnkit::softmax_attention_dispatch(q, k, v).uses_kernel());
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  EXPECT_EQ(attnkit::softmax_attention_dispatch(bf(q), bf(k), bf(v)).reason,
            "bf16 converted to float32 (grouped-query heads)");
  EXPECT_EQ(attnkit::softmax_attention(bf(q), bf(k), bf(v)).scalar_type(), torch::kBFloat16);
  using attnkit::testing::expect_error;
  expect_error([&] { attnkit::softmax_attention(q, torch::randn({1, 3, 5, 8}), torch::randn({1, 3, 5, 8})); },
               {"softmax_attention", "argument 'k' has head count 3, which must divide q's head count 4"});
  expect_error([&] { attnkit::softmax_attention(q, k, torch::randn({1, 4, 5, 8})); },
               {"softmax_attention", "argument 'v'", "head count (k's) 4", "expected 2"});
}

}  // namespace
