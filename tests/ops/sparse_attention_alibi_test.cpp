// ALiBi inside sparse attention (SparseAttentionFuncOptions::alibi_slopes):
// each edge's score gets -slope_h |i + S - L - j|, computed where the score
// is (sgemm tiles, band blocks in registers, one edge at a time), in the
// forward and in the backward's recomputation. Checked:
// - against the float64 reference (which forms the penalty as a tensor),
//   values and the gradients of q, k, v, element by element against each
//   entry's error scale (tests/kernels/sparse_cases.h), over every path of
//   the kernel: band blocks (local, causal local), tiles with holes
//   (strided), tiles past one 256-key tile (full, segments), one edge at a
//   time (random, bp-tree), rows with no edges, L = 1, L != S both ways,
//   lengths that are no multiple of the 32-row blocks, E != M, strided
//   (N, L, H, E) views, per-head lists, grouped-query heads, negative slopes;
// - against exact attention over the same pattern given as a -inf bias, with
//   the same slopes (another float32 kernel: ties the two together);
// - bitwise the same on 1 and 2 threads (the lists of
//   SparseAttentionKernel.ResultsAreBitwiseTheSameForOneAndTwoThreads run with
//   slopes too, and every case of tests/ops/sparse_attention_gqa_test.cpp);
// - the refusals.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/sparse_cases.h"
#include "test_util.h"

namespace attnkit::sparse_attention_alibi_test {
namespace {

using namespace testing::sparse;
using testing::expect_error;
using testing::rel_err;

SparseAttentionFuncOptions alibi(int64_t H) { return SparseAttentionFuncOptions().alibi_slopes(alibi_slopes(H)); }

// kFloatTol (1e-5 of each entry's error scale, sparse_cases.h) as without
// ALiBi: the penalty is one more float32 term per score, exact in its
// distance (an integer < 2^24) and rounded once in slope * distance. The
// paper's slopes are at most 1/4 at H = 4: a row's retained scores (those
// within a few units of its largest) carry penalties of their own size, so
// the exponents' rounding stays that of the scores without ALiBi.

TEST(SparseAttentionAlibi, TheReferenceIsThePenaltyOnTheEdges) {
  // By hand: L = 2 queries over S = 3 keys, q = k = 0 (scores 0), values 1,
  // 10, 100; edges: query 0 -> keys {0, 2}, query 1 -> keys {1, 2}. Two query
  // heads of slopes 0.5 and 0 over one key/value head. Query 0 sits at key
  // position 1 (penalties 0.5 and 0.5), query 1 at 2 (0.5 and 0).
  const auto q = torch::zeros({1, 2, 2, 1}, testing::f64()), k = torch::zeros({1, 1, 3, 1}, testing::f64());
  const auto v = torch::tensor({1.0, 10.0, 100.0}, testing::f64()).view({1, 1, 3, 1});
  const auto e = shared_list({{0, 2}, {1, 2}});
  const auto out = reference::sparse_attention(q, k, v, e, SparseAttentionFuncOptions().alibi_slopes(torch::tensor({0.5, 0.0})));
  const double w = std::exp(-0.5);
  EXPECT_NEAR(out[0][0][0][0].item<double>(), 50.5, 1e-12);
  EXPECT_NEAR(out[0][0][1][0].item<double>(), (10 * w + 100) / (w + 1), 1e-12);
  EXPECT_NEAR(out[0][1][0][0].item<double>(), 50.5, 1e-12);
  EXPECT_NEAR(out[0][1][1][0].item<double>(), 55.0, 1e-12);
}

TEST(SparseAttentionAlibi, PatternsMatchTheFloat64Reference) {
  // n = 300: nine full 32-row blocks and a partial one; N H = 4 below 8, so
  // the backward splits each head's rows into parts.
  const int64_t n = 300;
  const auto in = make_inputs(1, 4, n, n, 32, 24, 31);
  std::mt19937 rng(32);
  const std::vector<std::pair<std::string, EdgeList>> patterns{
      {"local 40 (band)", edges::local(n, 40)},
      {"causal local 40 (band)", edges::local(n, 40, true)},
      {"segments 50", edges::segments(n, 50)},
      {"causal segments 70", edges::segments(n, 70, true)},
      {"full (two tiles)", edges::full(n, n)},
      {"strided 17 (holes)", edges::strided(n, 17)},
      {"random 8 (edge at a time)", edges::random(n, 8, 3)},
      {"random rows, 20% empty", shared_list(random_rows(n, n, 0.05, 0.2, rng))},
      {"per-head: local, random, causal, segments",
       per_head_list({edges::local(n, 30), shared_list(random_rows(n, n, 0.1, 0.3, rng)), edges::causal(n, n),
                      edges::segments(n, 50)})},
  };
  for (const auto& [name, e] : patterns) expect_matches_reference(in, e, name, alibi(4));
  const auto tree = make_inputs(1, 2, 2 * 100 - 1, 2 * 100 - 1, 8, 8, 33);
  expect_matches_reference(tree, edges::bp_tree(100), "bp-tree 100", alibi(2));
}

TEST(SparseAttentionAlibi, AwkwardShapesMatchTheFloat64Reference) {
  // L != S: query i sits at key position i + S - L.
  const auto wide = make_inputs(2, 2, 70, 333, 16, 12, 34);
  expect_matches_reference(wide, edges::causal(70, 333), "causal L 70 S 333", alibi(2));
  expect_matches_reference(wide, edges::full(70, 333), "full L 70 S 333", alibi(2));
  const auto tall = make_inputs(1, 2, 333, 70, 16, 12, 35);
  expect_matches_reference(tall, edges::causal(333, 70), "causal L 333 S 70 (empty rows)", alibi(2));
  // L = 1 over many keys (one decoding step), and over one key.
  expect_matches_reference(make_inputs(1, 4, 1, 300, 8, 8, 36), edges::full(1, 300), "L 1 S 300", alibi(4));
  expect_matches_reference(make_inputs(1, 2, 1, 1, 5, 3, 37), edges::full(1, 1), "L 1 S 1", alibi(2));
  // Lengths off the blocks, E != M, E and M past a 64-column register tile.
  const auto odd = make_inputs(1, 1, 150, 150, 80, 72, 38);
  expect_matches_reference(odd, edges::local(150, 20), "local 20, E 80, M 72", alibi(1));
  // Rows without edges inside band blocks: every third row empty.
  const int64_t L = 70, S = 50;
  std::vector<std::vector<int64_t>> rows(L);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = std::max<int64_t>(0, i - 30); j < std::min(S, i + 10) && i % 3; ++j) rows[i].push_back(j);
  expect_matches_reference(make_inputs(2, 2, L, S, 8, 6, 39), shared_list(rows), "banded with empty rows", alibi(2));
  // Slopes of both signs (a negative one rewards distance) and a scale.
  const auto small = make_inputs(1, 2, 100, 100, 16, 16, 40);
  const auto both = SparseAttentionFuncOptions().scale(0.5).alibi_slopes(torch::tensor({0.1, -0.02}));
  expect_matches_reference(small, edges::local(100, 20), "local 20, slopes of both signs", both);
  expect_matches_reference(small, edges::random(100, 6, 4), "random, slopes of both signs", both);
  // Grouped-query heads: 4 query heads over 2 key/value heads.
  const auto grouped = make_inputs(1, 4, 130, 130, 16, 8, 41, /*Hkv=*/2);
  expect_matches_reference(grouped, edges::local(130, 20, true), "grouped, causal local", alibi(4));
  expect_matches_reference(grouped, edges::random(130, 6, 5), "grouped, random", alibi(4));
}

TEST(SparseAttentionAlibi, StridedViewsMatchTheFloat64Reference) {
  // q, k, v and dout as (N, L, H, E) buffers viewed as (N, H, L, E).
  const auto in = transposed_views(make_inputs(2, 2, 140, 140, 16, 12, 42));
  ASSERT_FALSE(in.q.is_contiguous() || in.k.is_contiguous() || in.v.is_contiguous());
  expect_matches_reference(in, edges::local(140, 20), "local 20", alibi(2));
  expect_matches_reference(in, edges::random(140, 6, 6), "random", alibi(2));
}

TEST(SparseAttentionAlibi, EqualsExactAttentionWithThePatternAsABias) {
  // The pattern as a bias of 0 on its edges and -inf elsewhere, the same
  // slopes: the exact kernel computes the same function. Both float32 (other
  // tiles, other orders): kFloatTol relative to each tensor's largest entry.
  std::mt19937 rng(44);
  struct Pattern {
    std::string name;
    EdgeList e;
    int64_t L, S;
  };
  for (const auto& [name, e, L, S] : std::vector<Pattern>{
           {"causal L 150 S 280", edges::causal(150, 280), 150, 280},
           {"random rows L 150 S 280", shared_list(random_rows(150, 280, 0.1, 0.1, rng)), 150, 280},
           {"local 30 (band)", edges::local(200, 30), 200, 200}}) {
    SCOPED_TRACE(name);
    const auto in = make_inputs(1, 4, L, S, 24, 20, 43);
    const auto mask = reference::edge_mask(e, 4, L, S).unsqueeze(0);
    const auto bias = torch::zeros({1, 1, L, S}).masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
    expect_equals_exact(in, e, alibi(4), SoftmaxAttentionFuncOptions().bias(bias).alibi_slopes(alibi_slopes(4)));
  }
}

TEST(SparseAttentionAlibi, Refusals) {
  const auto q = torch::randn({1, 4, 6, 8}), v = torch::randn({1, 4, 6, 8});
  const auto e = edges::local(6, 1);
  auto with = [](torch::Tensor slopes) { return SparseAttentionFuncOptions().alibi_slopes(std::move(slopes)); };
  expect_error([&] { sparse_attention(q, q, v, e, with(alibi_slopes(2))); },
               {"sparse_attention", "alibi_slopes", "shape (H) = (4)", "got (2)"});
  expect_error([&] { sparse_attention(q, q, v, e, with(torch::ones({4}).requires_grad_())); },
               {"sparse_attention", "alibi_slopes", "constants"});
  expect_error([&] { sparse_attention(q, q, v, e, with(torch::tensor({1.f, NAN, 1.f, 1.f}))); },
               {"sparse_attention", "alibi_slopes", "non-finite"});
  expect_error([&] { sparse_attention(q, q, v, e, with(torch::ones({4}, torch::kLong))); },
               {"sparse_attention", "alibi_slopes", "floating"});
  // float64 takes the composite, with the same penalty.
  const auto q64 = q.to(torch::kDouble), v64 = v.to(torch::kDouble);
  EXPECT_TRUE(torch::equal(sparse_attention(q64, q64, v64, e, alibi(4)),
                           reference::sparse_attention(q64, q64, v64, e, alibi(4))));
}

}  // namespace
}  // namespace attnkit::sparse_attention_alibi_test
