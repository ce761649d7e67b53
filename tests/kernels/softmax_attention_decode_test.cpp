// Decoding through the op: one to three new queries over a long key/value
// cache that lives in a larger buffer (k = cache.narrow(2, 0, S)), the shapes
// for which the forward kernel splits the keys across threads
// (src/kernels/softmax_attention.h). attnkit::softmax_attention in float32
// against the float64 composite reference: the output and the gradients that
// autograd sends back through the views into q and the caches (so the
// backward runs on the lse the split forward saved). And the same bits on one
// and two threads.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/softmax_attention.h"
#include "reference/reference.h"
#include "test_util.h"

namespace softmax_attention_decode_test {

namespace {

using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::f32;
using attnkit::testing::f64;
using attnkit::testing::ThreadsGuard;

// Per element |op - reference| <= kTolerance * mag, mag the element's error
// scale as in softmax_attention_kernel_test.cpp: the sum of the absolute
// values of the terms that make it up, P weighted by 1 + sigma_i (sigma_i the
// largest |score term| of row i). 64 u, u = 2^-24; that file explains why the
// split forward's 20000-term sums stay within it; measured worst here: out
// 0.7 u, dq 0.1 u, dk 0.9 u, dv 3.4 u. Where mag is 0 the result
// must be exactly 0 (masked rows, keys no query sees, the cache past S).
constexpr double kTolerance = 64.0 / (1 << 24);

struct DecodeCase {
  int64_t N, H, L, S, E, M;
  bool causal;
  std::vector<int64_t> key_lengths;  // empty: none

  std::string str() const {
    std::ostringstream s;
    s << "N=" << N << " H=" << H << " L=" << L << " S=" << S << " E=" << E << " M=" << M
      << " causal=" << causal << " key_lengths=[";
    for (auto k : key_lengths) s << k << ",";
    s << "]";
    return s.str();
  }
};

constexpr int64_t kSpareRows = 100;  // cache rows past S: the room a decoder grows into

/// The leaves: q stored as (N, L, H, E) (the projection layout), the caches as
/// (N, H, S + kSpareRows, .), and the output gradient.
struct Leaves {
  torch::Tensor q, k_cache, v_cache, dout;
};

Leaves make_leaves(const DecodeCase& c, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({c.N, c.L, c.H, c.E}, f32()),
          torch::randn({c.N, c.H, c.S + kSpareRows, c.E}, f32()),
          torch::randn({c.N, c.H, c.S + kSpareRows, c.M}, f32()),
          torch::randn({c.N, c.H, c.L, c.M}, f32())};
}

SoftmaxAttentionFuncOptions options(const DecodeCase& c) {
  auto o = SoftmaxAttentionFuncOptions().causal(c.causal);
  if (!c.key_lengths.empty())
    o.key_lengths(torch::tensor(c.key_lengths, torch::TensorOptions().dtype(torch::kLong)));
  return o;
}

/// The output and the gradients of the leaves q, k_cache, v_cache (in the
/// leaves' dtype) for the output gradient dout; `op` is the op or the reference.
template <typename Op>
std::vector<torch::Tensor> run(const DecodeCase& c, const Leaves& x, torch::Dtype dtype, Op op) {
  auto q = x.q.detach().to(dtype).requires_grad_(true);
  auto k_cache = x.k_cache.detach().to(dtype).requires_grad_(true);
  auto v_cache = x.v_cache.detach().to(dtype).requires_grad_(true);
  auto out = op(q.transpose(1, 2), k_cache.narrow(2, 0, c.S), v_cache.narrow(2, 0, c.S), options(c));
  out.backward(x.dout.to(dtype));
  return {out.detach(), q.grad(), k_cache.grad(), v_cache.grad()};
}

/// The error scales of out, dq, dk, dv (as the leaves: q (N, L, H, E), the
/// caches (N, H, S + kSpareRows, .)), in float64.
std::vector<torch::Tensor> error_scales(const DecodeCase& c, const Leaves& x) {
  const auto q = x.q.to(torch::kDouble).transpose(1, 2);
  const auto k = x.k_cache.to(torch::kDouble).narrow(2, 0, c.S);
  const auto v = x.v_cache.to(torch::kDouble).narrow(2, 0, c.S);
  const auto dout = x.dout.to(torch::kDouble);
  const double scale = 1.0 / std::sqrt(double(c.E));
  // visible[n, 0, i, j]
  const auto i = torch::arange(c.L, torch::kLong).view({1, 1, c.L, 1});
  const auto j = torch::arange(c.S, torch::kLong).view({1, 1, 1, c.S});
  auto visible = torch::ones({c.N, 1, c.L, c.S}, torch::kBool);
  if (c.causal) visible = visible & (j <= i + (c.S - c.L));
  if (!c.key_lengths.empty())
    visible = visible & (j < torch::tensor(c.key_lengths, torch::kLong).view({c.N, 1, 1, 1}));
  const double inf = std::numeric_limits<double>::infinity();
  const auto s = (scale * torch::matmul(q, k.transpose(-2, -1))).masked_fill(~visible, -inf);
  const auto rows_seen = visible.any(-1, /*keepdim=*/true);
  const auto p = torch::softmax(s, -1).masked_fill(~rows_seen, 0.0);  // 0, not NaN, when none seen
  const auto sigma = (scale * torch::matmul(q.abs(), k.abs().transpose(-2, -1)))
                         .masked_fill(~visible, 0.0)
                         .amax(-1, /*keepdim=*/true);
  const auto wp = (1.0 + sigma) * p;  // P with its relative error scale
  const auto dp_mag = torch::matmul(dout.abs(), v.abs().transpose(-2, -1));
  const auto d_mag = (p * dp_mag).sum(-1, /*keepdim=*/true);
  const auto ds_mag = wp * (dp_mag + d_mag);
  const auto out = torch::matmul(wp, v.abs());
  const auto dq = scale * torch::matmul(ds_mag, k.abs());
  const auto dk = scale * torch::matmul(ds_mag.transpose(-2, -1), q.abs());
  const auto dv = torch::matmul(wp.transpose(-2, -1), dout.abs());
  // Into the leaves' shapes; the cache past S gets no gradient: scale 0.
  const auto pad = [&](const torch::Tensor& t) {
    return torch::cat({t, torch::zeros({c.N, c.H, kSpareRows, t.size(3)}, f64())}, 2);
  };
  return {out, dq.transpose(1, 2), pad(dk), pad(dv)};
}

bool same_bits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

TEST(SoftmaxAttentionDecode, NarrowedCacheMatchesFloat64ReferenceOnOneAndTwoThreads) {
  const DecodeCase cases[] = {
      {1, 1, 1, 20000, 64, 64, false, {}},
      {1, 2, 1, 16384, 64, 32, true, {}},
      {2, 2, 3, 5000, 32, 48, true, {0, 4000}},
      {3, 1, 2, 4097, 16, 80, false, {5, 4097, 1500}},
  };
  const char* names[] = {"out", "dq", "dk", "dv"};
  uint64_t seed = 11;
  for (const DecodeCase& c : cases) {
    SCOPED_TRACE(c.str());
    attnkit::kernels::SoftmaxAttentionParams p;
    p.N = c.N, p.H = c.H, p.L = c.L, p.S = c.S;
    ASSERT_GT(attnkit::kernels::softmax_attention_forward_key_chunks(p), 1)
        << "the case must take the split forward";
    const Leaves x = make_leaves(c, seed++);
    const auto op = [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const SoftmaxAttentionFuncOptions& o) {
      return attnkit::softmax_attention(q, k, v, o);
    };
    const auto reference =
        run(c, x, torch::kDouble,
            [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
               const SoftmaxAttentionFuncOptions& o) {
              return attnkit::reference::softmax_attention(q, k, v, o);
            });
    const auto scales = error_scales(c, x);
    std::vector<torch::Tensor> one, two;
    {
      ThreadsGuard threads(1);
      one = run(c, x, torch::kFloat, op);
    }
    {
      ThreadsGuard threads(2);
      two = run(c, x, torch::kFloat, op);
    }
    for (int t = 0; t < 4; ++t) {
      EXPECT_LE(attnkit::testing::scaled_err(one[t], reference[t], scales[t]), kTolerance)
          << names[t] << " (1 thread)";
      EXPECT_LE(attnkit::testing::scaled_err(two[t], reference[t], scales[t]), kTolerance)
          << names[t] << " (2 threads)";
      EXPECT_TRUE(same_bits(one[t], two[t])) << names[t] << ": 1 and 2 threads differ";
    }
  }
}

}  // namespace

}  // namespace softmax_attention_decode_test
