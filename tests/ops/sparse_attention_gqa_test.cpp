// Grouped-query heads in sparse attention: k and v with Hkv heads, a divisor
// of q's H, read in place (query head h reads key/value head h / (H / Hkv));
// the kernel writes each query head's share of dk and dv and the op sums each
// group in increasing head order. Checked:
// - against the float64 reference (k and v repeated), values and gradients,
//   element by element (tests/kernels/sparse_cases.h), over the kernel's
//   paths (band blocks, tiles, one edge at a time), shared and per-head
//   lists, multi-query (Hkv = 1), L != S, E != M, strided views, N H below
//   and at 8 (the backward's parts);
// - equal to the same op on k and v repeated over each group: out and dq
//   bitwise (the same rows in the same order), dk and dv to rounding (the
//   group's shares added in another order);
// - bitwise the same on 1 and 2 threads;
// - the refusals.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>
#include <string>
#include <vector>

#include "kernels/sparse_cases.h"
#include "test_util.h"

namespace attnkit::sparse_attention_gqa_test {
namespace {

using namespace testing::sparse;
using testing::expect_error;
using testing::rel_err;

struct GroupedCase {
  std::string name;
  int64_t N, H, Hkv, L, S, E, M;
};

/// The patterns each case runs over (square ones when L == S).
std::vector<std::pair<std::string, EdgeList>> patterns(const GroupedCase& c, std::mt19937& rng) {
  std::vector<std::pair<std::string, EdgeList>> p{
      {"causal", edges::causal(c.L, c.S)},
      {"random rows", shared_list(random_rows(c.L, c.S, 0.1, 0.2, rng))}};
  if (c.L == c.S) {
    p.push_back({"local (band)", edges::local(c.L, 20)});
    p.push_back({"causal local (band)", edges::local(c.L, 20, true)});
    p.push_back({"segments", edges::segments(c.L, 30)});
    std::vector<EdgeList> heads;
    for (int64_t h = 0; h < c.H; ++h)
      heads.push_back(h % 2 ? edges::local(c.L, 10 + h) : shared_list(random_rows(c.L, c.S, 0.1, 0.2, rng)));
    p.push_back({"per-head lists", per_head_list(heads)});
  }
  return p;
}

std::vector<GroupedCase> cases() {
  return {{"H 4 over 2", 1, 4, 2, 130, 130, 16, 8},
          {"multi-query: H 3 over 1", 2, 3, 1, 70, 70, 8, 12},
          {"H 8 over 2, N H = 8", 1, 8, 2, 100, 100, 8, 8},
          {"L != S", 1, 4, 2, 40, 170, 16, 16},
          {"L = 1", 2, 4, 1, 1, 90, 8, 4}};
}

TEST(SparseAttentionGroupedHeads, MatchesTheFloat64Reference) {
  std::mt19937 rng(51);
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto in = make_inputs(c.N, c.H, c.L, c.S, c.E, c.M, 52, c.Hkv);
    for (const auto& [name, e] : patterns(c, rng)) expect_matches_reference(in, e, name);
  }
  // The bp-tree's extra nodes.
  expect_matches_reference(make_inputs(1, 4, 2 * 60 - 1, 2 * 60 - 1, 8, 8, 53, 2), edges::bp_tree(60), "bp-tree");
}

TEST(SparseAttentionGroupedHeads, StridedViewsMatchTheFloat64Reference) {
  // q, k, v and dout as (N, L, H, E) buffers viewed as (N, H, L, E).
  const auto in = transposed_views(make_inputs(2, 4, 100, 100, 16, 12, 54, /*Hkv=*/2));
  expect_matches_reference(in, edges::local(100, 20), "local 20");
  expect_matches_reference(in, edges::random(100, 6, 7), "random");
}

TEST(SparseAttentionGroupedHeads, EqualsRepeatingKeysAndValues) {
  std::mt19937 rng(55);
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto in = make_inputs(c.N, c.H, c.L, c.S, c.E, c.M, 56, c.Hkv);
    const int64_t group = c.H / c.Hkv;
    const Inputs repeated{in.q, in.k.repeat_interleave(group, 1), in.v.repeat_interleave(group, 1), in.dout};
    for (const auto& [name, e] : patterns(c, rng)) {
      SCOPED_TRACE(name);
      for (const auto& o : {SparseAttentionFuncOptions(), SparseAttentionFuncOptions().alibi_slopes(alibi_slopes(c.H))}) {
        const Result grouped = run(in, e, o, false), full = run(repeated, e, o, false);
        EXPECT_TRUE(torch::equal(grouped.out, full.out));
        EXPECT_TRUE(torch::equal(grouped.dq, full.dq));
        // The shares of a group in increasing head order, against autograd's
        // sum of repeat_interleave's copies: float32 rounding of a sum of
        // `group` terms, relative to each tensor's largest entry.
        const auto summed = [&](const torch::Tensor& g) {
          return g.view({c.N, c.Hkv, group, c.S, g.size(3)}).sum(2);
        };
        EXPECT_LT(rel_err(grouped.dk, summed(full.dk)), 1e-6);
        EXPECT_LT(rel_err(grouped.dv, summed(full.dv)), 1e-6);
        EXPECT_EQ(grouped.dk.sizes(), in.k.sizes());
        EXPECT_EQ(grouped.dv.sizes(), in.v.sizes());
      }
    }
  }
}

TEST(SparseAttentionGroupedHeads, BitwiseTheSameOnOneAndTwoThreads) {
  std::mt19937 rng(57);
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto in = make_inputs(c.N, c.H, c.L, c.S, c.E, c.M, 58, c.Hkv);
    for (const auto& [name, e] : patterns(c, rng)) {
      SCOPED_TRACE(name);
      expect_same_on_one_and_two_threads(in, e, SparseAttentionFuncOptions().alibi_slopes(alibi_slopes(c.H)));
    }
  }
}

TEST(SparseAttentionGroupedHeads, Refusals) {
  const auto q = torch::randn({1, 4, 6, 8});
  const auto e = edges::local(6, 1);
  expect_error([&] { sparse_attention(q, torch::randn({1, 3, 6, 8}), torch::randn({1, 3, 6, 8}), e); },
               {"sparse_attention", "head count 3", "must divide q's head count 4"});
  expect_error([&] { sparse_attention(q, torch::randn({1, 2, 6, 8}), torch::randn({1, 4, 6, 8}), e); },
               {"sparse_attention", "v", "head count"});
  // Per-head lists are per query head.
  const auto two_lists = per_head_list({edges::local(6, 1), edges::local(6, 2)});
  expect_error([&] { sparse_attention(q, torch::randn({1, 2, 6, 8}), torch::randn({1, 2, 6, 8}), two_lists); },
               {"sparse_attention"});
}

}  // namespace
}  // namespace attnkit::sparse_attention_gqa_test
