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
//   except when decoding (L = 1), where the forward attends each group's query
//   heads as the rows of one block over their shared keys (one read of the
//   cache per group), other products than head by head: equal to rounding;
// - bitwise the same on 1 and 2 threads.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "ops/softmax_attention_cases.h"
#include "test_util.h"

namespace softmax_attention_gqa_test {

namespace {

using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::f64;
using namespace attnkit::testing::softmax;

// float32 kernel against float64: max |op - reference| / max(max |reference|, 1),
// 2e-5. The inputs and the cotangent are N(0, 1), so the terms of every sum are
// O(1) and float32 rounding over S <= 2100 terms stays below ~sqrt(S) u = 3e-6
// of that scale; 2e-5 leaves room for the exponentials.
constexpr double kTolerance = 2e-5;

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back({"plain", 2, 6, 2, 5, 7, 4, 3});
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
  // L = 1: decoding, where each group's query heads are attended as the rows
  // of one block over their shared keys; over a long cache with the key split.
  c.push_back({"decoding over a long cache, multi-query", 2, 8, 1, 1, 3000, 16, 8, true, {3000, 1777}});
  c.push_back({"decoding, strided", 1, 6, 3, 1, 40, 4, 4, false, {}, {}, true});
  return c;
}

Inputs make(const Case& c) { return make_inputs(c, 21); }

TEST(SoftmaxAttentionGqa, MatchesTheFloat64Reference) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_matches_reference(c, make(c), {}, kTolerance);
  }
}

/// The grouped run of case c and the repeated run's results in the grouped
/// shapes (dk, dv: each group's per-head gradients summed in head order).
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> grouped_and_repeated(const Case& c) {
  const auto x = make(c);
  const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
  const auto grouped = run(c, x, {}, torch::kFloat, cot, false);
  const int64_t group = c.H / c.Hkv;
  Case repeated_case = c;
  repeated_case.Hkv = c.H;
  Inputs repeated = x;
  repeated.k = x.k.repeat_interleave(group, 1);
  repeated.v = x.v.repeat_interleave(group, 1);
  auto full = run(repeated_case, repeated, {}, torch::kFloat, cot, false);
  for (int i : {2, 3}) {
    const auto heads = full[i].view({c.N, c.Hkv, group, c.S, full[i].size(3)});
    auto sum = heads.select(2, 0).clone();
    for (int64_t g = 1; g < group; ++g) sum.add_(heads.select(2, g));
    full[i] = sum;
  }
  return {grouped, full};
}

TEST(SoftmaxAttentionGqa, EqualsRepeatingKeysAndValuesBitwise) {
  const char* names[] = {"out", "dq", "dk", "dv", "dbias"};
  for (const auto& c : cases()) {
    if (c.Hkv == c.H || c.L == 1) continue;
    SCOPED_TRACE(c.name);
    const auto [grouped, repeated] = grouped_and_repeated(c);
    for (size_t i = 0; i < grouped.size(); ++i) EXPECT_TRUE(torch::equal(grouped[i], repeated[i])) << names[i];
  }
}

TEST(SoftmaxAttentionGqa, DecodingEqualsRepeatingKeysAndValues) {
  // L = 1: each group's heads are one block of G rows against the shared keys,
  // the repeated run G blocks of one row: the same float32 sums, in other
  // products. Bound: 1e-6 of the largest entry, float32 rounding over sums of
  // up to 3000 O(1) terms taken in two orders (at most 4.3e-7 measured).
  const char* names[] = {"out", "dq", "dk", "dv"};
  int decoding_cases = 0;
  for (const auto& c : cases()) {
    if (c.Hkv == c.H || c.L != 1) continue;
    SCOPED_TRACE(c.name);
    ++decoding_cases;
    const auto [grouped, repeated] = grouped_and_repeated(c);
    for (size_t i = 0; i < grouped.size(); ++i) EXPECT_LE(relative_error(grouped[i], repeated[i]), 1e-6) << names[i];
  }
  EXPECT_EQ(decoding_cases, 3);
}

TEST(SoftmaxAttentionGqa, BitwiseTheSameOnOneAndTwoThreads) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_same_on_one_and_two_threads(c, make(c), {});
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

}  // namespace softmax_attention_gqa_test
