// The float32 sparse_attention op (kernels/sparse_attention.*) against the
// float64 reference (reference::sparse_attention, a masked dense softmax, with
// autograd): values and dq, dk, dv on shared and per-head lists, empty rows,
// random duplicate-free rows, banded patterns, one key, L != S, E != M,
// length 1, lengths that are no multiple of the kernel's blocks (32 rows or
// keys, 256-wide tiles), N H below 8 (a head's rows in several parts, whose key
// gradients are summed) and at 8 (one part), strided inputs, a scale option;
// all edges equal the exact softmax kernel; results are bitwise the same for 1
// and 2 threads, also with ALiBi slopes.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/sparse_cases.h"
#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::sparse_attention_kernel_test {
namespace {

using testing::f32;
using testing::f64;
using testing::rel_err;
using namespace testing::sparse;

TEST(SparseAttentionKernel, DispatchTakesTheKernelForFloat32AndBfloat16) {
  auto q = torch::randn({1, 2, 6, 3}), v = torch::randn({1, 2, 6, 2});
  const auto e = edges::local(6, 1);
  testing::expect_kernel(sparse_attention_dispatch(q, q, v, e));
  auto q64 = q.to(torch::kDouble), v64 = v.to(torch::kDouble);
  testing::expect_composite(
      sparse_attention_dispatch(q64, q64, v64, e),
      "q, k and v are float64; the edge-list kernel is float32 and bfloat16 only (the composite "
      "builds a dense L x S mask and score matrix per head, O(L S) time and memory whatever the "
      "number of edges)");
  // float64 is the reference itself, bit for bit.
  EXPECT_TRUE(torch::equal(sparse_attention(q64, q64, v64, e),
                           reference::sparse_attention(q64, q64, v64, e, {})));
  // bfloat16 takes the float32 kernel on converted inputs: its result is that
  // kernel's, rounded once, and so are the gradients.
  // (k is its own tensor: a tensor used twice would sum two rounded gradients.)
  auto leaf = [](const torch::Tensor& t, torch::ScalarType type) {
    return t.detach().to(type).requires_grad_();
  };
  auto qb = leaf(q, torch::kBFloat16), kb = leaf(torch::randn({1, 2, 6, 3}), torch::kBFloat16),
       vb = leaf(v, torch::kBFloat16);
  const auto d = sparse_attention_dispatch(qb, kb, vb, e);
  EXPECT_TRUE(d.uses_kernel());
  EXPECT_EQ(d.reason, "bf16 converted to float32 (no bf16 kernel for sparse attention)");
  auto out = sparse_attention(qb, kb, vb, e);
  out.sum().backward();
  auto q32 = leaf(qb, torch::kFloat), k32 = leaf(kb, torch::kFloat), v32 = leaf(vb, torch::kFloat);
  auto out32 = sparse_attention(q32, k32, v32, e);
  out32.sum().backward();
  EXPECT_TRUE(torch::equal(out, out32.to(torch::kBFloat16)));
  for (auto [ours, want] : {std::pair{qb.grad(), q32.grad()}, {kb.grad(), k32.grad()},
                            {vb.grad(), v32.grad()}})
    EXPECT_TRUE(torch::equal(ours, want.to(torch::kBFloat16)));
}

TEST(SparseAttentionKernel, RandomRowsMatchTheReference) {
  // Densities below and above the dense-tile threshold (half of a block's
  // rectangle), so both the edge-at-a-time and the tiled paths of every pass
  // run; 20% of rows empty on top.
  std::mt19937 rng(1);
  struct Shape {
    int64_t N, H, L, S, E, M;
  };
  for (const Shape& s : {Shape{2, 3, 37, 53, 24, 11}, Shape{1, 2, 130, 300, 16, 40},
                         Shape{1, 1, 1, 1, 5, 3}, Shape{2, 2, 65, 1, 8, 8},
                         Shape{1, 2, 1, 200, 7, 9}, Shape{1, 1, 300, 70, 33, 17},
                         Shape{2, 4, 100, 90, 16, 16}}) {
    const auto in = make_inputs(s.N, s.H, s.L, s.S, s.E, s.M, 2);
    for (double density : {0.05, 0.3, 0.8, 1.0}) {
      const std::string what = "N " + std::to_string(s.N) + " H " + std::to_string(s.H) + " L " +
                               std::to_string(s.L) + " S " + std::to_string(s.S) + " E " +
                               std::to_string(s.E) + " M " + std::to_string(s.M) + " density " +
                               std::to_string(density);
      expect_matches_reference(in, shared_list(random_rows(s.L, s.S, density, 0.2, rng)),
                               what + " shared");
      std::vector<EdgeList> heads;
      for (int64_t h = 0; h < s.H; ++h)
        heads.push_back(shared_list(random_rows(s.L, s.S, density * (h + 1) / s.H, 0.2, rng)));
      expect_matches_reference(in, per_head_list(heads), what + " per-head");
    }
  }
}

TEST(SparseAttentionKernel, BandedPatternsMatchTheReference) {
  // n = 300: nine full 32-row blocks and a partial one, one full and one
  // partial 256 tile; N H = 4 splits each head's rows in two parts.
  const int64_t n = 300;
  const auto in = make_inputs(2, 2, n, n, 32, 24, 3);
  expect_matches_reference(in, edges::local(n, 5), "local 5");
  expect_matches_reference(in, edges::local(n, 40), "local 40");
  expect_matches_reference(in, edges::local(n, 40, true), "causal local 40");
  expect_matches_reference(in, edges::segments(n, 50), "segments 50");
  expect_matches_reference(in, edges::segments(n, 70, true), "causal segments 70");
  expect_matches_reference(in, edges::causal(n, n), "causal");
  expect_matches_reference(in, edges::full(n, n), "full");
  expect_matches_reference(in, edges::strided(n, 17), "strided 17");
  // Mixed per head: a banded head next to a random one, each tiled or not by block.
  std::mt19937 rng(4);
  expect_matches_reference(in, per_head_list({edges::local(n, 30), shared_list(random_rows(n, n, 0.1, 0.3, rng))}),
                           "per-head local and random");
  // Head dims past one 64-column register tile, with tails (E = 80, M = 72),
  // on one head (the backward in 8 parts): the band kernels' column loops.
  const auto wide_dims = make_inputs(1, 1, 150, 150, 80, 72, 12);
  expect_matches_reference(wide_dims, edges::local(150, 20), "local 20, E 80, M 72");
  expect_matches_reference(wide_dims, edges::segments(150, 40, true), "causal segments 40, E 80, M 72");
  // N H = 8: one part per head.
  const auto eight = make_inputs(2, 4, n, n, 16, 16, 11);
  expect_matches_reference(eight, edges::local(n, 40), "local 40, N H = 8");
  expect_matches_reference(eight, per_head_list({edges::local(n, 30), edges::causal(n, n),
                                                 shared_list(random_rows(n, n, 0.1, 0.3, rng)),
                                                 edges::segments(n, 50)}),
                           "per-head mixed, N H = 8");
  // L != S: causal is bottom-right aligned, keys S - L + i and before.
  const auto wide = make_inputs(1, 2, 70, 333, 16, 16, 5);
  expect_matches_reference(wide, edges::causal(70, 333), "causal L 70 S 333");
  expect_matches_reference(wide, edges::full(70, 333), "full L 70 S 333");
  const auto tall = make_inputs(1, 2, 333, 70, 16, 16, 6);
  expect_matches_reference(tall, edges::causal(333, 70), "causal L 333 S 70");
  // The patterns with extra nodes (2n - 1 and n + 1 positions).
  const auto tree = make_inputs(1, 2, 2 * 100 - 1, 2 * 100 - 1, 8, 8, 7);
  expect_matches_reference(tree, edges::bp_tree(100), "bp-tree 100");
  const auto star = make_inputs(1, 2, 101, 101, 8, 8, 8);
  expect_matches_reference(star, edges::star(100), "star 100");
}

TEST(SparseAttentionKernel, HeadsSharingColumnRangesMatchTheReference) {
  // Per-head offsets may point into the same columns: head 1 reuses head 0's
  // list, head 2 the second half of its rows shifted to the first half.
  const int64_t L = 90, S = 80;
  std::mt19937 rng(9);
  const auto base = shared_list(random_rows(L, S, 0.6, 0.1, rng));
  auto shifted = torch::cat({base.offsets.slice(0, L / 2, L + 1),
                             base.offsets[L].expand({L / 2})});
  const EdgeList lists{torch::stack({base.offsets, base.offsets, shifted}), base.columns};
  expect_matches_reference(make_inputs(2, 3, L, S, 12, 10, 10), lists, "shared ranges");
}

TEST(SparseAttentionKernel, EmptyRowsAndEmptyListsGiveZeros) {
  const int64_t L = 70, S = 50;
  const auto in = make_inputs(1, 2, L, S, 8, 6, 11);
  // Every row empty: out 0 and all gradients 0, as the reference.
  const EdgeList none{torch::zeros({L + 1}, torch::kLong), torch::empty({0}, torch::kLong)};
  const Result r = run(in, none, {}, false);
  EXPECT_TRUE(torch::equal(r.out, torch::zeros_like(r.out)));
  EXPECT_TRUE(torch::equal(r.dq, torch::zeros_like(r.dq)));
  EXPECT_TRUE(torch::equal(r.dk, torch::zeros_like(r.dk)));
  EXPECT_TRUE(torch::equal(r.dv, torch::zeros_like(r.dv)));
  expect_matches_reference(in, none, "no edges");
  // Banded rows with every third row empty: the tiled path with empty rows.
  std::vector<std::vector<int64_t>> rows(L);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = std::max<int64_t>(0, i - 30); j < std::min(S, i + 10) && i % 3; ++j)
      rows[i].push_back(j);
  const Result b = run(in, shared_list(rows), {}, false);
  for (int64_t i = 0; i < L; i += 3) {
    EXPECT_TRUE(torch::equal(b.out.select(2, i), torch::zeros_like(b.out.select(2, i))));
    EXPECT_TRUE(torch::equal(b.dq.select(2, i), torch::zeros_like(b.dq.select(2, i))));
  }
  expect_matches_reference(in, shared_list(rows), "banded with empty rows");
}

TEST(SparseAttentionKernel, EmptyBatchAndNoQueries) {
  for (auto [N, L] : {std::pair<int64_t, int64_t>{0, 5}, {2, 0}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " L " + std::to_string(L));
    auto q = torch::randn({N, 2, L, 3}).requires_grad_(), k = torch::randn({N, 2, 5, 3}).requires_grad_(),
         v = torch::randn({N, 2, 5, 4}).requires_grad_();
    const EdgeList e = L == 0 ? EdgeList{torch::zeros({2, 1}, torch::kLong), torch::empty({0}, torch::kLong)}
                              : edges::local(5, 1);
    auto out = sparse_attention(q, k, v, e);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{N, 2, L, 4}));
    out.sum().backward();
    EXPECT_TRUE(torch::equal(k.grad(), torch::zeros_like(k)));
    EXPECT_TRUE(torch::equal(v.grad(), torch::zeros_like(v)));
  }
}

TEST(SparseAttentionKernel, OneKeyAndScaleOption) {
  // One key per row: the output is that key's value whatever the scores.
  const int64_t L = 77, S = 9;
  const auto in = make_inputs(2, 2, L, S, 6, 5, 12);
  std::vector<std::vector<int64_t>> rows(L);
  for (int64_t i = 0; i < L; ++i) rows[i] = {(i * 5) % S};
  const auto one = shared_list(rows);
  const Result r = run(in, one, {}, false);
  EXPECT_TRUE(torch::equal(r.out, in.v.index_select(2, one.columns)));
  expect_matches_reference(in, one, "one key per row");
  expect_matches_reference(make_inputs(1, 2, 40, 1, 4, 4, 13), edges::full(40, 1), "S 1");
  for (double scale : {0.3, 2.5}) {
    const auto o = SparseAttentionFuncOptions().scale(scale);
    std::mt19937 rng(14);
    const auto in2 = make_inputs(1, 3, 100, 100, 20, 12, 15);
    expect_matches_reference(in2, edges::local(100, 20), "scale local", o);
    expect_matches_reference(in2, shared_list(random_rows(100, 100, 0.1, 0.1, rng)), "scale random", o);
  }
}

TEST(SparseAttentionKernel, StridedInputsMatchTheReference) {
  // q and dout as (N, L, H, E) views, k with non-contiguous columns (a
  // transpose: the kernel copies it once), v a slice of a wider buffer.
  const int64_t N = 2, H = 3, L = 140, S = 140, E = 16, M = 12;
  const auto in = make_inputs(N, H, L, S, E, M, 16);
  std::mt19937 rng(17);
  const auto random = shared_list(random_rows(L, S, 0.15, 0.1, rng));
  for (const EdgeList& e : {edges::local(L, 20), random}) {
    auto q_base = in.q.permute({0, 2, 1, 3}).contiguous().requires_grad_();
    auto k_base = in.k.transpose(2, 3).contiguous().requires_grad_();
    auto v_base = torch::cat({in.v, torch::randn({N, H, S, 7})}, 3).requires_grad_();
    auto q = q_base.permute({0, 2, 1, 3}), k = k_base.transpose(2, 3), v = v_base.narrow(3, 0, M);
    auto dout = in.dout.permute({0, 2, 1, 3}).contiguous().permute({0, 2, 1, 3});
    ASSERT_FALSE(q.is_contiguous() || k.is_contiguous() || v.is_contiguous() || dout.is_contiguous());
    auto out = sparse_attention(q, k, v, e);
    out.backward(dout);
    const Result got{out.detach(), q_base.grad().permute({0, 2, 1, 3}),
                     k_base.grad().transpose(2, 3), v_base.grad().narrow(3, 0, M)};
    expect_close(got, run(in, e, {}, true), magnitudes(in, e, {}));
    EXPECT_TRUE(torch::equal(v_base.grad().narrow(3, M, 7), torch::zeros({N, H, S, 7})));
  }
  // Keys and values broadcast over heads (stride 0) and the all-zero-stride
  // gradient of out.sum().
  auto k1 = torch::randn({N, 1, S, E}, f32()), v1 = torch::randn({N, 1, S, M}, f32());
  const Inputs broadcast{in.q, k1.expand({N, H, S, E}), v1.expand({N, H, S, M}),
                         torch::ones({N, H, L, M}, f32())};
  for (const EdgeList& e : {random, edges::local(L, 20)}) {  // edge at a time, band kernels
    auto q = in.q.clone().requires_grad_();
    auto out = sparse_attention(q, broadcast.k, broadcast.v, e);
    out.sum().backward();
    const Result want = run(broadcast, e, {}, true), scale = magnitudes(broadcast, e, {});
    EXPECT_LT(testing::scaled_err(out, want.out, scale.out), kFloatTol);
    EXPECT_LT(testing::scaled_err(q.grad(), want.dq, scale.dq), kFloatTol);
  }
}

TEST(SparseAttentionKernel, AllEdgesEqualTheExactKernel) {
  // Ties the kernel to the other float32 kernel, not only to a shared reference.
  // Both are float32 results of the same sums in different orders and tiles:
  // kFloatTol relative to each tensor's largest entry.
  const auto in = make_inputs(1, 2, 150, 280, 24, 20, 18);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    const auto e = causal ? edges::causal(150, 280) : edges::full(150, 280);
    expect_equals_exact(in, e, {}, SoftmaxAttentionFuncOptions().causal(causal));
  }
}

TEST(SparseAttentionKernel, ResultsAreBitwiseTheSameForOneAndTwoThreads) {
  std::mt19937 rng(19);
  const int64_t L = 200, S = 260;
  const auto in = make_inputs(1, 2, L, S, 16, 16, 20);
  const std::vector<std::pair<std::string, EdgeList>> lists = {
      {"local", edges::local(L, 25)},
      {"random", shared_list(random_rows(L, S, 0.1, 0.1, rng))},
      {"per-head", per_head_list({edges::causal(L, S), shared_list(random_rows(L, S, 0.6, 0.1, rng))})}};
  for (const auto& [name, e] : lists) {
    SCOPED_TRACE(name);
    expect_same_on_one_and_two_threads(in, e);
    expect_same_on_one_and_two_threads(in, e, SparseAttentionFuncOptions().alibi_slopes(alibi_slopes(2)));
  }
}

TEST(SparseAttentionKernel, NothingOfSizeLTimesSAt16k) {
  // L = S = 16384 with 9 edges per row: a dense mask and scores would take
  // 1.25 GiB per head. The kernels' own scratch (counted always; this test
  // does not install the tensor-counting allocator, which would change later
  // tests in the same process) is the backward's key-gradient buffers (N H = 1
  // gives 8 parts whose key ranges cover the S keys, overlapping by 8 keys at
  // each of 7 part boundaries: (S + 56) (E + M) floats, 2.0 MiB) and per-thread
  // tiles; with tensors counted (when another test installed the allocator)
  // out, lse and the gradients add 4.1 MiB.
  constexpr int64_t kLength = 16384, kLimitBytes = int64_t{16} << 20;
  const auto e = edges::local(kLength, 4);
  auto q = torch::randn({1, 1, kLength, 16}).requires_grad_();
  auto k = torch::randn({1, 1, kLength, 16}).requires_grad_();
  auto v = torch::randn({1, 1, kLength, 16}).requires_grad_();
  auto dout = torch::randn({1, 1, kLength, 16});
  const int64_t before = memory::current_bytes();
  memory::reset_peak();
  {
    auto out = sparse_attention(q, k, v, e);
    out.backward(dout);
  }
  const int64_t extra = memory::peak_bytes() - before;
  EXPECT_LT(extra, kLimitBytes) << "peak extra bytes " << extra;
  EXPECT_GE(extra, kLength * 32 * int64_t{sizeof(float)}) << "the counter must see the key-gradient buffers";
  EXPECT_TRUE(testing::all_finite(q.grad()) && testing::all_finite(k.grad()) &&
              testing::all_finite(v.grad()));
}

TEST(SparseAttentionKernel, NaNScoreMakesOnlyItsRowNaN) {
  // A NaN in query 5 makes every score of row 5 NaN: its output is NaN, and
  // every other row is finite. Through the band path (local), the tiled path
  // with a gap in each row (strided) and with keys over more than one tile
  // (full, 300 keys), and one edge at a time (a sparse random list).
  const int64_t n = 300;
  std::mt19937 rng(21);
  auto q = torch::randn({1, 2, n, 16}, f32()), k = torch::randn({1, 2, n, 16}, f32()),
       v = torch::randn({1, 2, n, 8}, f32());
  q[0][1][5][3] = std::numeric_limits<float>::quiet_NaN();
  for (const auto& [name, e] : std::vector<std::pair<std::string, EdgeList>>{
           {"local", edges::local(n, 20)}, {"strided", edges::strided(n, 7)},
           {"full", edges::full(n, n)}, {"random", shared_list(random_rows(n, n, 0.05, 0.0, rng))}}) {
    SCOPED_TRACE(name);
    const auto out = sparse_attention(q, k, v, e);
    EXPECT_TRUE(torch::isnan(out[0][1][5]).all().item<bool>());
    EXPECT_TRUE(testing::all_finite(out[0][0]));
    EXPECT_TRUE(testing::all_finite(torch::cat({out[0][1].slice(0, 0, 5), out[0][1].slice(0, 6, n)})));
  }
}

TEST(SparseAttentionKernel, SecondOrderGradientsRaise) {
  auto q = torch::randn({1, 1, 5, 3}, f32()).requires_grad_();
  auto out = sparse_attention(q, q, q, edges::local(5, 1));
  auto g = torch::autograd::grad({out.sum()}, {q}, {}, true, true)[0];
  testing::expect_error([&] { g.sum().backward(); }, {"sparse_attention", "double backward"});
}

}  // namespace
}  // namespace attnkit::sparse_attention_kernel_test
