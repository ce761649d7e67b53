// What the tests of the sparse_attention op share (tests/kernels/
// sparse_attention_kernel_test.cpp and the tests of its features, ALiBi and
// grouped-query heads, in tests/ops): inputs, one run of the op or of the
// float64 reference giving out and every input gradient, the per-element
// error scales of those, the check against the reference, and edge lists
// built by hand.
#pragma once

#include <attnkit/ops.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::testing::sparse {

// Float32 against float64, element by element, relative to the element's
// error scale: the sum of the absolute values of the terms that make it
// (Magnitudes below), so that an entry near zero by cancellation (with one key
// per row every dq and dk is exactly 0 in exact arithmetic) is judged by the
// size of what cancelled, not by its own. Every term is a product of a
// softmax weight P_ij, whose float32 relative error is that of the exponent
// scale q_i . k_j - lse_i (a few units of 2^-24 = 6e-8 times the size of the
// score and of lse), with float32 sums of up to a few hundred terms. Measured
// worst over this file (also with every block forced onto the tiled path and,
// separately, onto the edge-at-a-time path): 1.0e-6 at the default scale,
// 4.7e-6 (5.3e-6 all tiled) with scale 2.5, whose scores reach about 40.
// 1e-5 is the project's float32 bound (the clustered kernels' kF32Tol). A
// wrong column, row, mask or gradient term shows up at 1e-2 or more.
inline constexpr double kFloatTol = 1e-5;

struct Inputs {
  torch::Tensor q, k, v, dout;  // float32 values; the reference reads them cast to float64
};

/// N(0, 1) inputs from `seed`; k and v with Hkv heads (grouped-query heads),
/// H when Hkv is 0.
inline Inputs make_inputs(int64_t N, int64_t H, int64_t L, int64_t S, int64_t E, int64_t M,
                          uint64_t seed, int64_t Hkv = 0) {
  torch::manual_seed(seed);
  const int64_t Hk = Hkv > 0 ? Hkv : H;
  return {torch::randn({N, H, L, E}, f32()), torch::randn({N, Hk, S, E}, f32()),
          torch::randn({N, Hk, S, M}, f32()), torch::randn({N, H, L, M}, f32())};
}

/// The same values as (N, L, H, X) buffers viewed as (N, H, L, X): strided
/// inputs, which the op reads in place (run keeps the views as its leaves).
inline Inputs transposed_views(const Inputs& in) {
  auto view = [](const torch::Tensor& x) { return x.transpose(1, 2).contiguous().transpose(1, 2); };
  return {view(in.q), view(in.k), view(in.v), view(in.dout)};
}

struct Result {
  torch::Tensor out, dq, dk, dv;
};

/// out and the gradients of sum(out * dout): the op on float32 leaves, or the
/// reference on float64 copies of the same values.
inline Result run(const Inputs& in, const EdgeList& edges, const SparseAttentionFuncOptions& o,
           bool reference) {
  const auto dtype = reference ? torch::kDouble : torch::kFloat;
  auto leaf = [&](const torch::Tensor& x) { return x.detach().to(dtype).requires_grad_(); };
  auto q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
  auto out = reference ? reference::sparse_attention(q, k, v, edges, o)
                       : sparse_attention(q, k, v, edges, o);
  if (!reference) {
    EXPECT_EQ(out.scalar_type(), torch::kFloat);
    EXPECT_NE(testing::grad_fn_name(out).find("SparseAttentionFunction"), std::string::npos)
        << testing::grad_fn_name(out);
  }
  out.backward(in.dout.to(dtype));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

/// The error scale of every entry of out, dq, dk, dv (float64): with the
/// reference weights P (zero off the edges), dP = dout v^T and
/// D_i = dout_i . out_i, the gradient dq_i = scale sum_j P_ij (dP_ij - D_i) k_j
/// has terms of size scale P_ij (|dout_i| . |v_j| + |dout_i| . |out_i|) |k_j|
/// (the dot products' own terms counted too: dP_ij - D_i cancels exactly when
/// a row has one edge, and the kernel computes dP and D in different orders);
/// likewise out_i = sum_j P_ij v_j, dk_j = scale sum_i P_ij (dP_ij - D_i) q_i
/// and dv_j = sum_i P_ij dout_i.
/// With grouped-query heads the key gradients' scales are summed over each
/// group, as the gradients are.
inline Result magnitudes(const Inputs& in, const EdgeList& edges, const SparseAttentionFuncOptions& o) {
  torch::NoGradGuard no_grad;
  auto q = in.q.to(torch::kDouble), k = in.k.to(torch::kDouble), v = in.v.to(torch::kDouble),
       dout = in.dout.to(torch::kDouble);
  torch::Tensor p;
  auto out = reference::sparse_attention(q, k, v, edges, o, &p);
  const double scale = o.scale() ? *o.scale() : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  const int64_t H = q.size(1), group = H / k.size(1);
  const auto keys = detail::repeat_kv_heads(k, H), values = detail::repeat_kv_heads(v, H);
  // (N, H, S, X) per query head -> (N, H / group, S, X), summed over each group.
  const auto per_kv_head = [&](const torch::Tensor& x) {
    return x.view({x.size(0), H / group, group, x.size(2), x.size(3)}).sum(2);
  };
  auto dp = torch::matmul(dout.abs(), values.abs().transpose(-2, -1));
  auto d = (dout.abs() * out.abs()).sum(-1, /*keepdim=*/true);
  auto t = p * (dp + d);
  return {torch::matmul(p, values.abs()), scale * torch::matmul(t, keys.abs()),
          per_kv_head(scale * torch::matmul(t.transpose(-2, -1), q.abs())),
          per_kv_head(torch::matmul(p.transpose(-2, -1), dout.abs()))};
}

/// Every entry of got within kFloatTol of its error scale from want.
inline void expect_close(const Result& got, const Result& want, const Result& scale) {
  EXPECT_TRUE(testing::all_finite(got.out) && testing::all_finite(got.dq) &&
              testing::all_finite(got.dk) && testing::all_finite(got.dv));
  EXPECT_LT(testing::scaled_err(got.out, want.out, scale.out), kFloatTol) << "out";
  EXPECT_LT(testing::scaled_err(got.dq, want.dq, scale.dq), kFloatTol) << "dq";
  EXPECT_LT(testing::scaled_err(got.dk, want.dk, scale.dk), kFloatTol) << "dk";
  EXPECT_LT(testing::scaled_err(got.dv, want.dv, scale.dv), kFloatTol) << "dv";
}

inline void expect_matches_reference(const Inputs& in, const EdgeList& edges, const std::string& what,
                              const SparseAttentionFuncOptions& o = {}) {
  SCOPED_TRACE(what);
  expect_close(run(in, edges, o, false), run(in, edges, o, true), magnitudes(in, edges, o));
}

/// CSR rows over S keys: each key with probability `density`, and a row empty
/// with probability `empty` (on top of the rows the draw leaves empty).
inline std::vector<std::vector<int64_t>> random_rows(int64_t L, int64_t S, double density, double empty,
                                              std::mt19937& rng) {
  std::bernoulli_distribution keep(density), drop(empty);
  std::vector<std::vector<int64_t>> rows(L);
  for (auto& row : rows) {
    if (drop(rng)) continue;
    for (int64_t j = 0; j < S; ++j)
      if (keep(rng)) row.push_back(j);
  }
  return rows;
}

inline EdgeList shared_list(const std::vector<std::vector<int64_t>>& rows) {
  return testing::edge_list_from_rows(rows);
}

/// One list per head, heads' columns laid one after the other.
inline EdgeList per_head_list(const std::vector<EdgeList>& heads) {
  std::vector<torch::Tensor> offsets, columns;
  int64_t base = 0;
  for (const auto& e : heads) {
    TORCH_CHECK(!e.per_head());
    offsets.push_back(e.offsets + base);
    columns.push_back(e.columns);
    base += e.num_edges();
  }
  return {torch::stack(offsets), torch::cat(columns)};
}


/// The op's values and gradients are bitwise the same on 1 and 2 threads.
inline void expect_same_on_one_and_two_threads(const Inputs& in, const EdgeList& edges,
                                               const SparseAttentionFuncOptions& o = {}) {
  Result one, two;
  {
    ThreadsGuard threads(1);
    one = run(in, edges, o, false);
  }
  {
    ThreadsGuard threads(2);
    two = run(in, edges, o, false);
  }
  EXPECT_TRUE(torch::equal(one.out, two.out));
  EXPECT_TRUE(torch::equal(one.dq, two.dq));
  EXPECT_TRUE(torch::equal(one.dk, two.dk));
  EXPECT_TRUE(torch::equal(one.dv, two.dv));
}

/// The float32 op equals exact attention (the other float32 kernel) under
/// `exact`'s options, which say the same as the edges: values and gradients,
/// kFloatTol relative to each tensor's largest entry (the same sums in other
/// tiles and orders).
inline void expect_equals_exact(const Inputs& in, const EdgeList& edges, const SparseAttentionFuncOptions& o,
                                const SoftmaxAttentionFuncOptions& exact) {
  auto leaves = [&] {
    return std::vector<torch::Tensor>{in.q.clone().requires_grad_(), in.k.clone().requires_grad_(),
                                      in.v.clone().requires_grad_()};
  };
  auto a = leaves(), b = leaves();
  auto sparse = sparse_attention(a[0], a[1], a[2], edges, o);
  auto dense = softmax_attention(b[0], b[1], b[2], exact);
  sparse.backward(in.dout);
  dense.backward(in.dout);
  EXPECT_LT(rel_err(sparse, dense), kFloatTol);
  for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(a[i].grad(), b[i].grad()), kFloatTol) << "input " << i;
}

}  // namespace attnkit::testing::sparse
