// Attention sinks (SoftmaxAttentionFuncOptions::sinks), soft-capping
// (::softcap: c tanh(s / c) before ALiBi and the masks), the log-sum-exp out
// (softmax_attention_with_lse) with its gradient, and merge_attention.
// Checked against a float64 formula written here (a softmax over the visible
// scores and one more column holding the head's sink, which has no value):
// - values and the gradients of q, k, v and the sinks, through out and
//   through lse, on L != S both ways, causal, key lengths with a row that
//   sees nothing (out 0, lse = sink), grouped heads (decoding too: L = 1),
//   a block mask, ALiBi, the forward's key split (L = 1 over 2100 keys) and
//   the backward's key parts; soft-capping on the lane tiles, the sgemm
//   tiles and the key split, alone and with sinks, ALiBi and a block mask;
// - the float64 op (the composite) against the same formula;
// - lse without sinks: -inf on a row that sees nothing, with zero gradients;
// - merge_attention of attention over three disjoint key sets == attention
//   over all of them, values and gradients, and a row no set reaches;
// - bitwise the same on 1 and 2 threads; the bfloat16 dispatch reason; the
//   refusals.
#include <attnkit/block_mask.h>
#include <attnkit/ops.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "test_util.h"

namespace softmax_attention_sinks_test {

namespace {

using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::f64;
using attnkit::testing::relative_error;

// float32 kernel against float64, as for the exact kernel's other features
// (tests/ops/softmax_attention_window_test.cpp): 2e-5.
constexpr double kTolerance = 2e-5;
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Case {
  std::string name;
  int64_t N = 2, H = 4, Hkv = 4, L = 5, S = 7, E = 8, M = 6;
  bool causal = false;
  std::vector<int64_t> key_lengths;  // empty: none
  bool sinks = true, alibi = false, block_mask = false;
  double softcap = 0.0;  // soft-capping too when > 0
};

std::vector<Case> cases() {
  return {
      {"L < S"},
      {"L > S, causal, a row that sees nothing", 2, 4, 4, 9, 5, 8, 6, true},
      {"key lengths with an empty batch entry", 2, 2, 2, 6, 9, 8, 4, false, {9, 0}},
      {"grouped heads", 1, 6, 2, 40, 50, 8, 8, true},
      {"decoding with grouped heads (L = 1)", 2, 4, 2, 1, 33, 8, 8, true},
      {"key split: L = 1 over 2100 keys", 1, 2, 2, 1, 2100, 8, 4, true},
      {"backward key parts, 300 x 300, ALiBi", 1, 2, 2, 300, 300, 16, 8, true, {}, true, true},
      {"a block mask", 1, 2, 2, 200, 260, 8, 8, false, {}, true, false, true},
      {"no sinks: lse alone", 2, 2, 2, 9, 5, 8, 6, true, {5, 2}, false},
      {"soft-capping 2 (scores well past it), lane tiles", 1, 2, 2, 100, 300, 16, 8, true, {}, false, false, false, 2.0},
      {"soft-capping with sinks, ALiBi, a block mask", 2, 2, 2, 150, 150, 16, 8, false, {}, true, true, true, 1.5},
      {"soft-capping, decoding: L = 1 over 2100 keys (key split)", 1, 2, 2, 1, 2100, 8, 4, true, {}, false, false, false, 3.0},
      {"soft-capping, sgemm tiles (L < 16), grouped heads", 1, 4, 2, 9, 40, 8, 8, true, {}, true, false, false, 1.0},
  };
}

struct Inputs {
  torch::Tensor q, k, v, sinks, key_lengths;
  c10::optional<attnkit::BlockMask> block_mask;
};

Inputs make(const Case& c) {
  torch::manual_seed(41);
  Inputs x{torch::randn({c.N, c.H, c.L, c.E}, f64()), torch::randn({c.N, c.Hkv, c.S, c.E}, f64()),
           torch::randn({c.N, c.Hkv, c.S, c.M}, f64()), torch::randn({c.H}, f64()) * 2, {}, c10::nullopt};
  if (!c.key_lengths.empty()) x.key_lengths = torch::tensor(c.key_lengths, torch::kLong);
  if (c.block_mask)
    x.block_mask = attnkit::create_block_mask(
        [](int64_t, int64_t h, int64_t q, int64_t kv) { return (q + kv + h) % 3 != 0 && kv < 2 * q + 30; }, 1, c.H,
        c.L, c.S, 64, 64);
  return x;
}

SoftmaxAttentionFuncOptions options(const Case& c, const Inputs& x, const torch::Tensor& sinks) {
  auto o = SoftmaxAttentionFuncOptions().causal(c.causal).key_lengths(x.key_lengths).block_mask(x.block_mask);
  if (c.sinks) o.sinks(sinks);
  if (c.alibi) o.alibi_slopes(attnkit::alibi_slopes(c.H).to(torch::kDouble));
  o.softcap(c.softcap);
  return o;
}

/// out and lse by the formula, in float64.
std::tuple<torch::Tensor, torch::Tensor> formula(const Case& c, const Inputs& x, const torch::Tensor& q,
                                                 const torch::Tensor& k, const torch::Tensor& v,
                                                 const torch::Tensor& sinks) {
  const int64_t G = c.H / c.Hkv;
  const auto keys = k.repeat_interleave(G, 1), values = v.repeat_interleave(G, 1);
  auto scores = torch::matmul(q, keys.transpose(-1, -2)) / std::sqrt(static_cast<double>(c.E));
  if (c.softcap > 0) scores = c.softcap * torch::tanh(scores / c.softcap);
  const auto i = torch::arange(c.L, torch::kLong).view({c.L, 1}), j = torch::arange(c.S, torch::kLong).view({1, c.S});
  if (c.alibi)
    scores = scores - attnkit::alibi_slopes(c.H).to(torch::kDouble).view({1, c.H, 1, 1}) *
                          (i + (c.S - c.L) - j).abs().to(torch::kDouble);
  auto visible = torch::ones({c.N, c.H, c.L, c.S}, torch::kBool);
  if (c.causal) visible = visible & (j <= i + (c.S - c.L));
  if (x.key_lengths.defined()) visible = visible & (j.view({1, 1, 1, c.S}) < x.key_lengths.view({c.N, 1, 1, 1}));
  if (x.block_mask) visible = visible & x.block_mask->to_dense();
  scores = scores.masked_fill(visible.logical_not(), -kInf);
  if (c.sinks) scores = torch::cat({scores, sinks.view({1, c.H, 1, 1}).expand({c.N, c.H, c.L, 1})}, -1);
  // A row that sees nothing (without a sink): weights 0, lse -inf, no NaN.
  const auto seen = visible.any(-1, true) | c.sinks;
  const auto safe = scores.masked_fill(seen.logical_not(), 0.0);
  auto weights = torch::softmax(safe, -1).masked_fill(seen.logical_not(), 0.0);
  const auto lse = torch::logsumexp(safe, -1).masked_fill(seen.squeeze(-1).logical_not(), -kInf);
  if (c.sinks) weights = weights.narrow(-1, 0, c.S);
  return {torch::matmul(weights, values), lse};
}

/// out, lse and the gradients of q, k, v (and the sinks) under the loss
/// sum(out * cot) + sum(lse * cot_lse) (finite rows of lse only).
std::vector<torch::Tensor> run(const Case& c, const Inputs& x, torch::ScalarType dtype, bool use_formula) {
  torch::manual_seed(43);
  const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64()), cot_lse = torch::randn({c.N, c.H, c.L}, f64());
  auto leaf = [&](const torch::Tensor& t) { return t.to(dtype).clone().requires_grad_(); };
  std::vector<torch::Tensor> in{leaf(x.q), leaf(x.k), leaf(x.v), leaf(x.sinks)};
  auto [out, lse] = use_formula ? formula(c, x, in[0], in[1], in[2], in[3])
                                : attnkit::softmax_attention_with_lse(in[0], in[1], in[2], options(c, x, in[3]));
  const auto finite = torch::isfinite(lse);
  const auto loss = (out * cot.to(dtype)).sum() + (lse.masked_fill(finite.logical_not(), 0) * cot_lse.to(lse.scalar_type())).sum();
  if (!c.sinks) in.pop_back();
  const auto grads = torch::autograd::grad({loss}, in, {}, false, false, /*allow_unused=*/true);
  std::vector<torch::Tensor> result{out.detach(), lse.detach()};
  for (const auto& g : grads) result.push_back(g);
  return result;
}

TEST(SoftmaxAttentionSinks, MatchTheFloat64Formula) {
  const char* names[] = {"out", "lse", "dq", "dk", "dv", "dsinks"};
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto want = run(c, x, torch::kDouble, true);
    const auto got = run(c, x, torch::kFloat, false);
    const auto composite = run(c, x, torch::kDouble, false);
    ASSERT_EQ(got.size(), want.size());
    for (size_t t = 0; t < want.size(); ++t) {
      // lse is -inf exactly where the formula's is (rows that see nothing, without sinks).
      const auto finite = torch::isfinite(want[t]);
      EXPECT_TRUE(torch::equal(finite, torch::isfinite(got[t]))) << names[t];
      EXPECT_LE(relative_error(got[t].masked_fill(finite.logical_not(), 0), want[t].masked_fill(finite.logical_not(), 0)),
                kTolerance)
          << names[t];
      EXPECT_LE(relative_error(composite[t].masked_fill(finite.logical_not(), 0),
                               want[t].masked_fill(finite.logical_not(), 0)),
                1e-12)
          << names[t];
    }
  }
}

TEST(SoftmaxAttentionSinks, ARowThatSeesNothingGivesZeroAndTheSink) {
  const Case c{"", 2, 2, 2, 3, 4, 8, 4, false, {4, 0}};
  const auto x = make(c);
  const auto sinks = x.sinks.narrow(0, 0, 2).to(torch::kFloat);
  auto [out, lse] = attnkit::softmax_attention_with_lse(x.q.to(torch::kFloat), x.k.to(torch::kFloat),
                                                        x.v.to(torch::kFloat), options(c, x, sinks));
  EXPECT_TRUE(torch::equal(out[1], torch::zeros_like(out[1])));
  EXPECT_TRUE(torch::equal(lse[1], sinks.view({2, 1}).expand({2, 3})));
}

TEST(SoftmaxAttentionSinks, BitwiseTheSameOnOneAndTwoThreads) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    std::vector<torch::Tensor> one, two;
    {
      attnkit::testing::ThreadsGuard threads(1);
      one = run(c, x, torch::kFloat, false);
    }
    {
      attnkit::testing::ThreadsGuard threads(2);
      two = run(c, x, torch::kFloat, false);
    }
    for (size_t t = 0; t < one.size(); ++t) EXPECT_TRUE(torch::equal(one[t], two[t])) << t;
  }
}

TEST(MergeAttention, EqualsAttentionOverTheUnionWithGradients) {
  torch::manual_seed(47);
  const int64_t N = 2, H = 3, L = 20, S = 300, E = 8, M = 5;
  const auto q0 = torch::randn({N, H, L, E}), k0 = torch::randn({N, H, S, E}), v0 = torch::randn({N, H, S, M});
  const auto cot = torch::randn({N, H, L, M});
  // Key lengths hide every key of batch entry 1 from the last set, and all
  // of them from row... none: a row no set reaches is checked below.
  const std::vector<std::pair<int64_t, int64_t>> sets{{0, 70}, {70, 200}, {200, S}};
  const auto o = SoftmaxAttentionFuncOptions().scale(0.3);
  auto leaves = [&] {
    return std::vector<torch::Tensor>{q0.clone().requires_grad_(), k0.clone().requires_grad_(),
                                      v0.clone().requires_grad_()};
  };
  auto whole = leaves();
  auto [out, lse] = attnkit::softmax_attention_with_lse(whole[0], whole[1], whole[2], o);
  const auto want = torch::autograd::grad({(out * cot).sum() + lse.sum()}, whole);
  auto parts = leaves();
  std::vector<torch::Tensor> outputs, lses;
  for (const auto& [begin, end] : sets) {
    auto [o_t, l_t] = attnkit::softmax_attention_with_lse(parts[0], parts[1].slice(2, begin, end),
                                                          parts[2].slice(2, begin, end), o);
    outputs.push_back(o_t);
    lses.push_back(l_t);
  }
  auto [merged, merged_lse] = attnkit::merge_attention(outputs, lses);
  EXPECT_LE(relative_error(merged, out), 1e-6);
  EXPECT_LE(relative_error(merged_lse, lse), 1e-6);
  const auto got = torch::autograd::grad({(merged * cot).sum() + merged_lse.sum()}, parts);
  for (size_t t = 0; t < got.size(); ++t) EXPECT_LE(relative_error(got[t], want[t]), 1e-5) << t;
}

TEST(MergeAttention, ARowNoSetReachesStaysZero) {
  const auto out = torch::ones({1, 1, 2, 3}), lse = torch::full({1, 1, 2}, -kInf);
  auto live = lse.clone();
  live[0][0][0] = 0.5;
  auto [merged, merged_lse] = attnkit::merge_attention({out, out * 2}, {lse, live});
  EXPECT_TRUE(torch::equal(merged[0][0][1], torch::zeros({3})));
  EXPECT_EQ(merged_lse[0][0][1].item<float>(), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(torch::allclose(merged[0][0][0], torch::full({3}, 2.f)));
  EXPECT_FLOAT_EQ(merged_lse[0][0][0].item<float>(), 0.5f);
}

TEST(SoftmaxAttentionSinks, DispatchAndRefusals) {
  const auto q = torch::randn({1, 4, 3, 8}), k = torch::randn({1, 4, 5, 8}), v = torch::randn({1, 4, 5, 8});
  const auto o = SoftmaxAttentionFuncOptions().sinks(torch::zeros({4}));
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  EXPECT_EQ(attnkit::softmax_attention_dispatch(bf(q), bf(k), bf(v), o).reason,
            "bf16 converted to float32 (attention sinks)");
  EXPECT_EQ(attnkit::softmax_attention_dispatch(bf(q), bf(k), bf(v), SoftmaxAttentionFuncOptions().softcap(5)).reason,
            "bf16 converted to float32 (soft-capping)");
  using attnkit::testing::expect_error;
  expect_error([&] { attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().softcap(-1)); },
               {"softmax_attention", "option 'softcap' must be finite and >= 0 (0: none), got -1"});
  const auto cu = torch::tensor(std::vector<int64_t>{0, 3});
  expect_error(
      [&] {
        attnkit::varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1).slice(0, 0, 3),
                                  v[0].transpose(0, 1).slice(0, 0, 3), cu, cu, SoftmaxAttentionFuncOptions().softcap(5));
      },
      {"varlen_attention", "'sinks' and 'softcap' are not taken"});
  expect_error([&] { attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().sinks(torch::zeros({3}))); },
               {"softmax_attention", "argument 'sinks' must be a floating CPU tensor of shape (H) = (4)"});
  expect_error([&] { attnkit::merge_attention({q}, {}); }, {"merge_attention", "one lse per output"});
  expect_error([&] { attnkit::merge_attention({q}, {torch::zeros({1, 4, 2})}); }, {"merge_attention", "lses[0]"});
}

}  // namespace

}  // namespace softmax_attention_sinks_test
