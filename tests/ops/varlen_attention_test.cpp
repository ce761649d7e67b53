// Packed variable-length batches: attnkit::varlen_attention and
// varlen_linear_attention. Checked three ways, on batches with sequences of
// length 0 and 1, lengths that are not multiples of the kernels' blocks,
// Lb != Sb, grouped-query heads and every position feature:
// - against the float64 reference run sequence by sequence (values and the
//   gradients of q, k, v);
// - against the float32 op on each sequence alone, given its view of the
//   packed tensors: bitwise, values and gradients (each sequence is one
//   kernel call over that view), also where one sequence takes the forward's
//   key split;
// - bitwise the same on 1 and 2 threads;
// and the arguments' checks, empty batches and bfloat16 inputs.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/varlen_cases.h"
#include "test_util.h"

namespace varlen_attention_test {

namespace {

using attnkit::LinearAttentionFuncOptions;
using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::expect_error;
using attnkit::testing::f64;
using attnkit::testing::relative_error;
using attnkit::testing::ThreadsGuard;
namespace varlen = attnkit::testing::varlen;

// float32 kernels against float64: max |op - reference| / max(max |reference|, 1),
// the tolerance of the single-sequence tests (tests/ops/softmax_attention_gqa_test.cpp):
// N(0, 1) inputs, O(1) terms, float32 rounding over <= 2100 keys below
// sqrt(S) u = 3e-6 of that scale; 2e-5 leaves room for the exponentials.
constexpr double kTolerance = 2e-5;

struct Batch {
  std::string name;
  std::vector<int64_t> q_lengths, k_lengths;
  int64_t H = 4, Hkv = 2, E = 8, M = 5;
};

using varlen::Packed;

Packed make(const Batch& b, uint64_t seed) { return varlen::pack(b.q_lengths, b.k_lengths, b.H, b.Hkv, b.E, b.M, seed); }

/// q, k, v in `dtype` as new leaves that require grad (detached first: in
/// float64 `to` returns the tensor itself, and p's must stay untouched).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> leaves(const Packed& p, torch::ScalarType dtype) {
  return {p.q.detach().to(dtype).requires_grad_(true), p.k.detach().to(dtype).requires_grad_(true),
          p.v.detach().to(dtype).requires_grad_(true)};
}

/// out and the gradients of q, k, v of `f` on the packed inputs in `dtype`,
/// for the cotangent dout.
using PackedOp = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
std::vector<torch::Tensor> run(const PackedOp& f, const Packed& p, torch::ScalarType dtype) {
  auto [q, k, v] = leaves(p, dtype);
  auto out = f(q, k, v);
  out.backward(p.dout.to(dtype));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

/// The same results computed sequence by sequence with `single` (an op on
/// (1, H, L, E) batches), packed again.
using SingleOp = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
std::vector<torch::Tensor> run_one_by_one(const SingleOp& single, const Packed& p, torch::ScalarType dtype) {
  auto [q, k, v] = leaves(p, dtype);
  auto view = [](const torch::Tensor& t, int64_t begin, int64_t end) {
    return t.narrow(0, begin, end - begin).permute({1, 0, 2}).unsqueeze(0);
  };
  std::vector<torch::Tensor> rows;
  for (std::size_t b = 0; b + 1 < p.offsets_q.size(); ++b) {
    const auto out = single(view(q, p.offsets_q[b], p.offsets_q[b + 1]), view(k, p.offsets_k[b], p.offsets_k[b + 1]),
                            view(v, p.offsets_k[b], p.offsets_k[b + 1]));
    rows.push_back(out.squeeze(0).permute({1, 0, 2}));
  }
  auto out = torch::cat(rows, 0);
  out.backward(p.dout.to(dtype));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

const char* const kWhat[] = {"out", "dq", "dk", "dv"};

void expect_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  for (int i = 0; i < 4; ++i) EXPECT_LT(relative_error(got[i], want[i]), kTolerance) << kWhat[i];
}

void expect_bitwise(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(got[i].sizes(), want[i].sizes()) << kWhat[i];
    EXPECT_TRUE(torch::equal(got[i], want[i])) << kWhat[i] << ": max difference "
                                               << (got[i] - want[i]).abs().max().item<double>();
  }
}

std::vector<Batch> batches() {
  return {
      {"mixed lengths with empty sequences, L != S", {5, 1, 0, 130, 7, 3}, {5, 3, 4, 130, 0, 9}},
      {"one sequence", {17}, {17}, 3, 3, 6, 4},
      {"multi-query, lengths across blocks of 128 and 256", {129, 2, 257}, {129, 300, 257}, 4, 1, 8, 8},
  };
}

struct Variant {
  std::string name;
  SoftmaxAttentionFuncOptions options;
};

std::vector<Variant> softmax_variants(int64_t H) {
  return {{"plain", SoftmaxAttentionFuncOptions()},
          {"causal", SoftmaxAttentionFuncOptions().causal(true)},
          {"scale", SoftmaxAttentionFuncOptions().scale(0.3)},
          {"causal rotary", SoftmaxAttentionFuncOptions().causal(true).rotary_dim(4)},
          {"alibi", SoftmaxAttentionFuncOptions().alibi_slopes(attnkit::alibi_slopes(H))},
          {"causal window 3", SoftmaxAttentionFuncOptions().causal(true).window(3)},
          {"symmetric window 5, rotary on 2 of E", SoftmaxAttentionFuncOptions().window(5).rotary_dim(2)}};
}

PackedOp packed_softmax(const Packed& p, const SoftmaxAttentionFuncOptions& o) {
  return [&p, o](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return attnkit::varlen_attention(q, k, v, p.cu_q, p.cu_k, o);
  };
}

SingleOp single_softmax(const SoftmaxAttentionFuncOptions& o) {
  return [o](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return attnkit::softmax_attention(q, k, v, o);
  };
}

TEST(VarlenAttention, MatchesTheFloat64ReferenceSequenceBySequence) {
  for (const auto& b : batches()) {
    for (const auto& variant : softmax_variants(b.H)) {
      SCOPED_TRACE(b.name + ", " + variant.name);
      const auto p = make(b, 3);
      expect_close(run(packed_softmax(p, variant.options), p, torch::kFloat),
                   run_one_by_one(single_softmax(variant.options), p, torch::kDouble));
    }
  }
}

TEST(VarlenAttention, EqualsEachSequenceAloneBitwise) {
  auto all = batches();
  // One query over 2100 keys next to a long sequence: the first takes the
  // forward's key split and the backward's key parts, the other not.
  all.push_back({"key split beside a plain sequence", {1, 200}, {2100, 200}, 4, 2, 16, 8});
  for (const auto& b : all) {
    for (const auto& variant : softmax_variants(b.H)) {
      SCOPED_TRACE(b.name + ", " + variant.name);
      const auto p = make(b, 4);
      expect_bitwise(run(packed_softmax(p, variant.options), p, torch::kFloat),
                     run_one_by_one(single_softmax(variant.options), p, torch::kFloat));
    }
  }
}

TEST(VarlenAttention, BitwiseTheSameOnOneAndTwoThreads) {
  const Batch b{"mixed", {1, 300, 0, 77}, {2100, 260, 5, 77}, 4, 2, 16, 8};
  const auto p = make(b, 5);
  const auto o = SoftmaxAttentionFuncOptions().causal(true).rotary_dim(8);
  std::vector<torch::Tensor> one, two;
  {
    ThreadsGuard guard(1);
    one = run(packed_softmax(p, o), p, torch::kFloat);
  }
  {
    ThreadsGuard guard(2);
    two = run(packed_softmax(p, o), p, torch::kFloat);
  }
  expect_bitwise(two, one);
}

TEST(VarlenAttention, EmptyBatchesAndEmptySequences) {
  for (const auto& b : {Batch{"no sequence", {}, {}}, Batch{"only empty sequences", {0, 0}, {0, 0}},
                        Batch{"queries without keys", {3, 2}, {0, 0}}, Batch{"keys without queries", {0}, {6}}}) {
    SCOPED_TRACE(b.name);
    const auto p = make(b, 6);
    const auto got = run(packed_softmax(p, SoftmaxAttentionFuncOptions().causal(true)), p, torch::kFloat);
    EXPECT_EQ(got[0].sizes(), (std::vector<int64_t>{p.q.size(0), b.H, b.M}));
    // A query that sees no key outputs zeros; every gradient is zero here.
    for (const auto& t : got) EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0);
    const auto linear = run(
        [&p](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
          return attnkit::varlen_linear_attention(q, k, v, p.cu_q, p.cu_k);
        },
        p, torch::kFloat);
    for (const auto& t : linear) EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0);
  }
}

TEST(VarlenAttention, Bfloat16TakesTheFloat32KernelAndRoundsOnce) {
  const Batch b{"mixed", {5, 9}, {7, 9}};
  const auto p = make(b, 7);
  const auto q = p.q.to(torch::kBFloat16), k = p.k.to(torch::kBFloat16), v = p.v.to(torch::kBFloat16);
  const auto got = attnkit::varlen_attention(q, k, v, p.cu_q, p.cu_k);
  ASSERT_EQ(got.scalar_type(), torch::kBFloat16);
  const auto want = attnkit::varlen_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat),
                                              p.cu_q, p.cu_k)
                        .to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(got, want));
}

struct LinearVariant {
  std::string name;
  LinearAttentionFuncOptions options;
};

std::vector<LinearVariant> linear_variants() {
  using attnkit::FeatureMap;
  return {{"plain", LinearAttentionFuncOptions()},
          {"causal", LinearAttentionFuncOptions().causal(true)},
          {"elu, normalised", LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true)},
          {"causal elu, normalised, rotary",
           LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true).causal(true).rotary_dim(4)}};
}

PackedOp packed_linear(const Packed& p, const LinearAttentionFuncOptions& o) {
  return [&p, o](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return attnkit::varlen_linear_attention(q, k, v, p.cu_q, p.cu_k, o);
  };
}

SingleOp single_linear(const LinearAttentionFuncOptions& o) {
  return [o](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return attnkit::linear_attention(q, k, v, o);
  };
}

// Linear attention sums products of unbounded terms (no softmax weights below
// 1): measured against the reference's scale per tensor, with the tolerance of
// tests/ops/linear_attention_gqa_rotary_test.cpp's plain comparisons.
TEST(VarlenLinearAttention, MatchesTheFloat64ReferenceSequenceBySequence) {
  for (const auto& b : batches()) {
    for (const auto& variant : linear_variants()) {
      SCOPED_TRACE(b.name + ", " + variant.name);
      const auto p = make(b, 8);
      const auto got = run(packed_linear(p, variant.options), p, torch::kFloat);
      const auto want = run_one_by_one(single_linear(variant.options), p, torch::kDouble);
      for (int i = 0; i < 4; ++i) EXPECT_LT(attnkit::testing::rel_err(got[i], want[i]), 1e-4) << kWhat[i];
    }
  }
}

TEST(VarlenLinearAttention, EqualsEachSequenceAloneBitwise) {
  for (const auto& b : batches()) {
    for (const auto& variant : linear_variants()) {
      SCOPED_TRACE(b.name + ", " + variant.name);
      const auto p = make(b, 9);
      expect_bitwise(run(packed_linear(p, variant.options), p, torch::kFloat),
                     run_one_by_one(single_linear(variant.options), p, torch::kFloat));
    }
  }
}

TEST(VarlenAttention, DoubleBackwardThroughTheKernelsRaises) {
  const Batch b{"two", {3, 4}, {5, 2}};
  const auto p = make(b, 11);
  const std::vector<std::pair<std::string, PackedOp>> ops = {
      {"varlen_attention", packed_softmax(p, SoftmaxAttentionFuncOptions().causal(true))},
      {"varlen_linear_attention", packed_linear(p, LinearAttentionFuncOptions())}};
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    torch::Tensor q, k, v;  // not a structured binding: the lambda below captures q (C++17)
    std::tie(q, k, v) = leaves(p, torch::kFloat);
    const auto out = op(q, k, v);
    // First-order gradients with create_graph are right; differentiating
    // them again raises instead of dropping the second-order terms.
    const auto first = torch::autograd::grad({out.pow(2).sum()}, {q, k, v}, {}, true, /*create_graph=*/true);
    const auto plain = torch::autograd::grad({out.pow(2).sum()}, {q, k, v}, {}, true, false);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(first[i], plain[i])) << kWhat[i + 1];
    expect_error([&] { torch::autograd::grad({first[0].sum()}, {q}, {}, true, false, true); },
                 {name, "double backward"});
  }
}

TEST(VarlenAttention, RefusesBadArguments) {
  const Batch b{"two", {3, 2}, {3, 2}};
  const auto p = make(b, 10);
  const auto q = p.q.to(torch::kFloat), k = p.k.to(torch::kFloat), v = p.v.to(torch::kFloat);
  auto cu = [](std::vector<int64_t> c) { return torch::tensor(c, torch::kLong); };
  using attnkit::varlen_attention;
  expect_error([&] { varlen_attention(q, k, v, cu({1, 3, 5}), p.cu_k); },
               {"varlen_attention", "'cu_seqlens_q' must start at 0, got 1"});
  expect_error([&] { varlen_attention(q, k, v, cu({0, 4, 3, 5}), cu({0, 3, 3, 5})); },
               {"'cu_seqlens_q' must be non-decreasing, got 4 then 3 at entries 1 and 2"});
  expect_error([&] { varlen_attention(q, k, v, cu({0, 3, 4}), p.cu_k); },
               {"'cu_seqlens_q' must end at the packed length 5, got 4"});
  expect_error([&] { varlen_attention(q, k, v, p.cu_q, cu({0, 5})); },
               {"must describe as many sequences, got 2 and 1"});
  expect_error([&] { varlen_attention(q, k, v, p.cu_q.to(torch::kInt), p.cu_k); },
               {"'cu_seqlens_q' must be int64"});
  expect_error([&] { varlen_attention(q, k, v, cu({}), p.cu_k); }, {"must have shape (B + 1)"});
  expect_error([&] { varlen_attention(q.unsqueeze(0), k, v, p.cu_q, p.cu_k); },
               {"argument 'q' must have 3 dimensions"});
  expect_error([&] { varlen_attention(q.narrow(1, 0, 3), k, v, p.cu_q, p.cu_k); },
               {"head count 2, which must divide q's head count 3"});
  expect_error([&] { varlen_attention(q, k, v.narrow(0, 0, 4), p.cu_q, p.cu_k); },
               {"argument 'v' has packed key count Tk 4"});
  expect_error([&] { varlen_attention(q, k, v, p.cu_q, p.cu_k, SoftmaxAttentionFuncOptions().key_lengths(cu({3, 2}))); },
               {"option 'key_lengths' is not taken"});
  expect_error([&] { varlen_attention(q, k, v, p.cu_q, p.cu_k, SoftmaxAttentionFuncOptions().bias(torch::zeros({1}))); },
               {"option 'bias' is not taken"});
  expect_error([&] { varlen_attention(q, k, v, p.cu_q, p.cu_k, SoftmaxAttentionFuncOptions().rotary_dim(3)); },
               {"varlen_attention: option 'rotary_dim' must be 0"});
  expect_error([&] { attnkit::varlen_linear_attention(q, k, v, p.cu_q, cu({0, 2, 4})); },
               {"varlen_linear_attention", "'cu_seqlens_k' must end at the packed length 5, got 4"});
}

}  // namespace

}  // namespace varlen_attention_test
