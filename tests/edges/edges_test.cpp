// The edges:: pattern builders (src/edges/patterns.cpp) against independent dense
// definitions written out here from the rules in include/attnkit/ops.h, the
// CSR invariants, check_edge_list, the binary-partition tree's tiling property,
// by_name, and the builders' argument errors.
#include <attnkit/ops.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::edges_test {
namespace {

using testing::expect_error;
using Rows = std::vector<std::vector<int64_t>>;

/// The CSR invariants every builder promises, then its rows as vectors.
Rows rows_of(const EdgeList& e, int64_t expected_rows) {
  EXPECT_TRUE(e.offsets.defined() && e.columns.defined());
  EXPECT_EQ(e.offsets.scalar_type(), torch::kLong);
  EXPECT_EQ(e.columns.scalar_type(), torch::kLong);
  EXPECT_EQ(e.offsets.dim(), 1);
  EXPECT_FALSE(e.per_head());
  EXPECT_EQ(e.columns.dim(), 1);
  EXPECT_EQ(e.offsets.numel(), expected_rows + 1);
  EXPECT_EQ(e.num_queries(), expected_rows);
  auto off = e.offsets.contiguous();
  auto col = e.columns.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t* c = col.data_ptr<int64_t>();
  EXPECT_EQ(o[0], 0) << "offsets must start at 0";
  EXPECT_EQ(o[off.numel() - 1], col.numel()) << "offsets must end at nnz";
  EXPECT_EQ(e.num_edges(), col.numel());
  Rows rows(off.numel() - 1);
  for (int64_t i = 0; i + 1 < off.numel(); ++i) {
    EXPECT_LE(o[i], o[i + 1]) << "offsets must be non-decreasing at row " << i;
    for (int64_t p = o[i]; p < o[i + 1]; ++p) {
      if (p > o[i]) EXPECT_LT(c[p - 1], c[p]) << "row " << i << " is not strictly increasing";
      rows[i].push_back(c[p]);
    }
  }
  return rows;
}

/// Rows of an L x S grid by a rule, written independently of the library.
Rows dense_rows(int64_t L, int64_t S, const std::function<bool(int64_t, int64_t)>& sees) {
  Rows rows(L);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < S; ++j)
      if (sees(i, j)) rows[i].push_back(j);
  return rows;
}

/// Builder output equals the dense rule and passes the op's validation.
void expect_pattern(const EdgeList& e, int64_t L, int64_t S,
                    const std::function<bool(int64_t, int64_t)>& sees, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(rows_of(e, L), dense_rows(L, S, sees));
  EXPECT_NO_THROW(check_edge_list(e, L, S, /*H=*/1));
  EXPECT_NO_THROW(check_edge_list(e, L, S, /*H=*/4));  // a shared list serves any head count
}

TEST(EdgesTest, FullIsEveryPair) {
  for (auto [L, S] : {std::pair<int64_t, int64_t>{1, 1}, {4, 4}, {3, 5}, {5, 2}, {0, 3}, {3, 0}})
    expect_pattern(edges::full(L, S), L, S, [](int64_t, int64_t) { return true; },
                   "full L=" + std::to_string(L) + " S=" + std::to_string(S));
}

TEST(EdgesTest, CausalIsBottomRightAligned) {
  // Query i sees key j iff j <= i + (S - L); L > S leaves the first L - S rows empty.
  for (auto [L, S] : {std::pair<int64_t, int64_t>{4, 4}, {3, 6}, {6, 3}, {1, 5}, {5, 1}}) {
    auto e = edges::causal(L, S);
    expect_pattern(e, L, S, [L = L, S = S](int64_t i, int64_t j) { return j <= i + (S - L); },
                   "causal L=" + std::to_string(L) + " S=" + std::to_string(S));
    auto rows = rows_of(e, L);
    // Spelled out: the last query always sees every key.
    EXPECT_EQ(rows[L - 1].size(), static_cast<size_t>(S));
  }
  auto rows = rows_of(edges::causal(4, 2), 4);
  EXPECT_TRUE(rows[0].empty());
  EXPECT_TRUE(rows[1].empty());
  EXPECT_EQ(rows[2], (std::vector<int64_t>{0}));
  EXPECT_EQ(rows[3], (std::vector<int64_t>{0, 1}));
}

TEST(EdgesTest, LocalWindow) {
  for (int64_t n : {1, 2, 7})
    for (int64_t span : {0, 1, 2, 10}) {
      const std::string tag = "n=" + std::to_string(n) + " span=" + std::to_string(span);
      expect_pattern(edges::local(n, span), n, n,
                     [span](int64_t i, int64_t j) { return std::abs(i - j) <= span; }, "local " + tag);
      expect_pattern(edges::local(n, span, /*causal=*/true), n, n,
                     [span](int64_t i, int64_t j) { return i - span <= j && j <= i; },
                     "local causal " + tag);
    }
  // Span 0 is the identity pattern.
  auto rows = rows_of(edges::local(3, 0), 3);
  EXPECT_EQ(rows, (Rows{{0}, {1}, {2}}));
}

TEST(EdgesTest, SegmentsSeeOwnAndPreviousSegment) {
  for (int64_t n : {1, 6, 7, 10})
    for (int64_t seg : {1, 2, 3, 4, 20}) {
      const std::string tag = "n=" + std::to_string(n) + " segment=" + std::to_string(seg);
      auto same_or_previous = [seg](int64_t i, int64_t j) {
        const int64_t si = i / seg, sj = j / seg;
        return sj == si || sj == si - 1;
      };
      expect_pattern(edges::segments(n, seg), n, n, same_or_previous, "segments " + tag);
      expect_pattern(edges::segments(n, seg, /*causal=*/true), n, n,
                     [&](int64_t i, int64_t j) { return j <= i && same_or_previous(i, j); },
                     "segments causal " + tag);
    }
  // n = 7, segment 3 (does not divide n): segments {0,1,2} {3,4,5} {6}.
  auto rows = rows_of(edges::segments(7, 3), 7);
  EXPECT_EQ(rows[0], (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(rows[4], (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(rows[6], (std::vector<int64_t>{3, 4, 5, 6}));
  auto causal_rows = rows_of(edges::segments(7, 3, true), 7);
  EXPECT_EQ(causal_rows[4], (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(EdgesTest, StridedPattern) {
  for (int64_t n : {1, 5, 9})
    for (int64_t stride : {1, 2, 3, 4}) {
      expect_pattern(edges::strided(n, stride), n, n,
                     [stride](int64_t i, int64_t j) {
                       return j <= i && (i - j < stride || (i - j) % stride == 0);
                     },
                     "strided n=" + std::to_string(n) + " stride=" + std::to_string(stride));
    }
  auto rows = rows_of(edges::strided(8, 3), 8);
  EXPECT_EQ(rows[7], (std::vector<int64_t>{1, 4, 5, 6, 7}));
  // Stride 1 is the causal pattern.
  EXPECT_EQ(rows_of(edges::strided(6, 1), 6), rows_of(edges::causal(6, 6), 6));
}

TEST(EdgesTest, StarHasRelayNode) {
  for (int64_t n : {1, 2, 3, 6}) {
    SCOPED_TRACE("star n=" + std::to_string(n));
    auto e = edges::star(n);
    auto rows = rows_of(e, n + 1);
    ASSERT_EQ(static_cast<int64_t>(rows.size()), n + 1);
    // Satellites: i-1, i, i+1 within [0, n) and the relay n.
    auto expected = dense_rows(n + 1, n + 1, [n](int64_t i, int64_t j) {
      if (i == n) return true;  // relay sees every node, itself included
      return j == n || (j < n && std::abs(i - j) <= 1);
    });
    EXPECT_EQ(rows, expected);
    std::vector<int64_t> all(n + 1);
    for (int64_t j = 0; j <= n; ++j) all[j] = j;
    EXPECT_EQ(rows[n], all);
    EXPECT_EQ(e.num_edges(), (n == 1 ? 2 : 3 * n - 2 + n) + (n + 1));
    EXPECT_NO_THROW(check_edge_list(e, n + 1, n + 1, 2));
  }
}

// --- Binary-partition tree -------------------------------------------------------------

/// Spans [lo, hi) of every node, derived only from the edge list: a token is
/// its own span, an internal node the union of its children's spans.
std::vector<std::pair<int64_t, int64_t>> node_spans(const Rows& rows, int64_t n) {
  const int64_t nodes = 2 * n - 1;
  std::vector<std::pair<int64_t, int64_t>> span(nodes, {-1, -1});
  std::function<std::pair<int64_t, int64_t>(int64_t, int)> get = [&](int64_t u, int depth) {
    if (u < n) return std::make_pair(u, u + 1);
    if (span[u].first >= 0) return span[u];
    EXPECT_LT(depth, 2 * n) << "cycle through node " << u;
    if (depth >= 2 * n || rows[u].size() != 2) return std::make_pair<int64_t, int64_t>(0, 0);
    auto a = get(rows[u][0], depth + 1), b = get(rows[u][1], depth + 1);
    if (b.first < a.first) std::swap(a, b);
    EXPECT_EQ(a.second, b.first) << "children of node " << u << " are not adjacent spans";
    span[u] = {a.first, b.second};
    return span[u];
  };
  for (int64_t u = 0; u < nodes; ++u) span[u] = get(u, 0);
  return span;
}

TEST(EdgesTest, BpTreeTilesTheSequence) {
  for (int64_t n : {1, 2, 3, 5, 8, 13}) {
    SCOPED_TRACE("bp_tree n=" + std::to_string(n));
    auto e = edges::bp_tree(n);
    const int64_t nodes = 2 * n - 1;
    auto rows = rows_of(e, nodes);
    ASSERT_EQ(static_cast<int64_t>(rows.size()), nodes);
    EXPECT_NO_THROW(check_edge_list(e, nodes, nodes, 1));

    // Internal nodes n..2n-2 see exactly two children, each with exactly one parent;
    // the root (node n; for n = 1 the single token) has none. Tokens are leaves.
    std::vector<int> parents(nodes, 0);
    for (int64_t u = n; u < nodes; ++u) {
      ASSERT_EQ(rows[u].size(), 2u) << "internal node " << u;
      for (int64_t c : rows[u]) {
        EXPECT_NE(c, u);
        ++parents[c];
      }
    }
    const int64_t root = n == 1 ? 0 : n;
    for (int64_t u = 0; u < nodes; ++u) EXPECT_EQ(parents[u], u == root ? 0 : 1) << "node " << u;

    auto span = node_spans(rows, n);
    if (n > 1) EXPECT_EQ(span[n], (std::pair<int64_t, int64_t>(0, n))) << "root span";
    for (int64_t u = n; u < nodes; ++u) {
      // Pre-order numbering, the left child takes the larger half (as docs/API.md states).
      const int64_t size = span[u].second - span[u].first;
      const int64_t left = span[rows[u][0]].first == span[u].first ? rows[u][0] : rows[u][1];
      EXPECT_EQ(span[left].second - span[left].first, (size + 1) / 2) << "node " << u;
      if (left >= n) EXPECT_EQ(left, u + 1) << "pre-order: left internal child of " << u;
    }

    // A token's row: itself plus spans that are disjoint and together cover [0, n).
    const int64_t log_bound = n == 1 ? 1 : 1 + static_cast<int64_t>(std::ceil(std::log2(double(n))));
    for (int64_t t = 0; t < n; ++t) {
      std::vector<int> covered(n, 0);
      EXPECT_TRUE(std::binary_search(rows[t].begin(), rows[t].end(), t)) << "token " << t << " sees itself";
      for (int64_t u : rows[t])
        for (int64_t p = span[u].first; p < span[u].second; ++p) ++covered[p];
      for (int64_t p = 0; p < n; ++p)
        EXPECT_EQ(covered[p], 1) << "token " << t << " covers position " << p << " " << covered[p] << " times";
      // O(log n): at most one span per tree level plus the token itself.
      EXPECT_LE(static_cast<int64_t>(rows[t].size()), log_bound) << "token " << t;
      // Every neighbour other than itself is a sibling of an ancestor: its span does not contain t.
      for (int64_t u : rows[t])
        if (u != t) EXPECT_FALSE(span[u].first <= t && t < span[u].second) << "token " << t << " node " << u;
    }
  }
}

TEST(EdgesTest, BpTreeSmallCasesSpelledOut) {
  // n = 1: one token that sees itself.
  EXPECT_EQ(rows_of(edges::bp_tree(1), 1), (Rows{{0}}));
  // n = 2: tokens 0, 1 and root 2 = [0, 2).
  EXPECT_EQ(rows_of(edges::bp_tree(2), 3), (Rows{{0, 1}, {0, 1}, {0, 1}}));
  // n = 5: root 5 = [0,5) -> 6 = [0,3), [3,5) = 8; 6 -> 7 = [0,2), 2; 7 -> 0, 1; 8 -> 3, 4.
  EXPECT_EQ(rows_of(edges::bp_tree(5), 9),
            (Rows{{0, 1, 2, 8}, {0, 1, 2, 8}, {2, 7, 8}, {3, 4, 6}, {3, 4, 6},
                  {6, 8}, {2, 7}, {0, 1}, {3, 4}}));
}

TEST(EdgesTest, ByNameMatchesBuilders) {
  const int64_t n = 9, p = 3;
  const std::vector<std::pair<std::string, EdgeList>> cases{
      {"full", edges::full(n, n)},
      {"causal", edges::causal(n, n)},
      {"local", edges::local(n, p)},
      {"local-causal", edges::local(n, p, true)},
      {"segments", edges::segments(n, p)},
      {"segments-causal", edges::segments(n, p, true)},
      {"bp-tree", edges::bp_tree(n)},
      {"star", edges::star(n)},
      {"strided", edges::strided(n, p)}};
  for (const auto& [name, expected] : cases) {
    SCOPED_TRACE(name);
    auto e = edges::by_name(name, n, p);
    EXPECT_TRUE(torch::equal(e.offsets, expected.offsets));
    EXPECT_TRUE(torch::equal(e.columns, expected.columns));
    EXPECT_NO_THROW(check_edge_list(e, e.num_queries(), e.num_queries(), 1));
  }
}

TEST(EdgesTest, ByNameUnknownListsPatterns) {
  expect_error([] { edges::by_name("dilated", 4, 1); },
               {"edges::by_name", "unknown pattern 'dilated'", "full", "causal", "local",
                "local-causal", "segments", "segments-causal", "bp-tree", "star", "strided"});
}

TEST(EdgesTest, BuildersRejectBadSizes) {
  expect_error([] { edges::full(-1, 2); }, {"edges::full", "'L'", ">= 0", "-1"});
  expect_error([] { edges::full(2, -3); }, {"edges::full", "'S'"});
  expect_error([] { edges::causal(2, -1); }, {"edges::causal", "'S'"});
  expect_error([] { edges::local(4, -1); }, {"edges::local", "'span'"});
  expect_error([] { edges::local(-2, 1); }, {"edges::local", "'n'"});
  expect_error([] { edges::segments(4, 0); }, {"edges::segments", "'segment'", ">= 1"});
  expect_error([] { edges::strided(4, 0); }, {"edges::strided", "'stride'", ">= 1"});
  expect_error([] { edges::bp_tree(0); }, {"edges::bp_tree", "'n'", ">= 1"});
  expect_error([] { edges::star(0); }, {"edges::star", "'n'", ">= 1"});
}

TEST(EdgesTest, CheckEdgeListRejectsMalformedLists) {
  auto t = [](std::vector<int64_t> v) { return torch::tensor(v, torch::kLong); };
  // A builder's list checked against the wrong size.
  expect_error([] { check_edge_list(edges::full(3, 3), 4, 3, 1); }, {"sparse_attention", "'offsets'", "L + 1"});
  expect_error([] { check_edge_list(edges::full(3, 3), 3, 2, 1); }, {"'columns'", "outside the key range"});
  // Hand-made defects.
  expect_error([&] { check_edge_list(EdgeList{t({0, 2, 3}), t({1, 0, 2})}, 2, 3, 1); },
               {"strictly increasing"});
  // Each way the branch-free row test can find a row bad: a repeated column
  // inside a row, a negative first column, a last column past S.
  expect_error(
      [&] {
        check_edge_list(EdgeList{t({0, 4}), t({0, 1, 1, 2})}, 1, 3, 1);
      },
      {"strictly increasing", "row 0 has 1 then 1"});
  expect_error(
      [&] {
        check_edge_list(EdgeList{t({0, 1, 3}), t({0, -1, 2})}, 2, 3, 1);
      },
      {"entry 1 is -1", "outside the key range"});
  expect_error(
      [&] {
        check_edge_list(EdgeList{t({0, 3}), t({0, 1, 3})}, 1, 3, 1);
      },
      {"entry 2 is 3", "outside the key range"});
  expect_error([&] { check_edge_list(EdgeList{t({1, 2, 3}), t({0, 1, 2})}, 2, 3, 1); },
               {"start at 0"});
  expect_error([&] { check_edge_list(EdgeList{t({0, 1, 2}), t({0, 1, 2})}, 2, 3, 1); },
               {"end at the number of columns"});
  expect_error([&] { check_edge_list(EdgeList{t({0, 2, 1, 3}), t({0, 1, 2})}, 3, 3, 1); },
               {"non-decreasing"});
  expect_error([&] { check_edge_list(EdgeList{t({0, 1}).to(torch::kInt), t({0})}, 1, 1, 1); },
               {"'offsets'", "int64"});
  expect_error([&] { check_edge_list(EdgeList{t({0, 1}), torch::Tensor()}, 1, 1, 1); },
               {"'columns'"});
  // Per-head lists need H rows.
  auto per_head = EdgeList{torch::stack({t({0, 1, 2}), t({2, 3, 4})}), t({0, 1, 1, 2})};
  EXPECT_TRUE(per_head.per_head());
  EXPECT_NO_THROW(check_edge_list(per_head, 2, 3, 2));
  expect_error([&] { check_edge_list(per_head, 2, 3, 3); }, {"per-head", "H = 3"});
}

// --- merge and hop_distances -----------------------------------------------------------

/// A shared list from rows (each sorted, duplicate-free), built by hand.
EdgeList list_of(const Rows& rows) { return testing::edge_list_from_rows(rows); }

/// A per-head list from rows per head, laid out as the predictor lays it out:
/// one columns array, head h's offsets continuing where head h - 1's end.
EdgeList per_head_list_of(const std::vector<Rows>& heads) {
  std::vector<int64_t> offsets, columns;
  for (const auto& rows : heads) {
    offsets.push_back(static_cast<int64_t>(columns.size()));
    for (const auto& r : rows) {
      columns.insert(columns.end(), r.begin(), r.end());
      offsets.push_back(static_cast<int64_t>(columns.size()));
    }
  }
  const int64_t H = static_cast<int64_t>(heads.size());
  return {torch::tensor(offsets, torch::kLong).view({H, -1}), torch::tensor(columns, torch::kLong)};
}

/// The rows of head h of a per-head list (read through its own offsets).
Rows head_rows(const EdgeList& e, int64_t h) { return testing::edge_rows(e, h); }

/// Random rows over an L x S grid: each cell with probability `density`, and
/// every third row (by a coin) left empty.
Rows random_rows(std::mt19937& rng, int64_t L, int64_t S, double density) {
  std::bernoulli_distribution cell(density), empty(1.0 / 3.0);
  Rows rows(L);
  for (int64_t i = 0; i < L; ++i) {
    if (empty(rng)) continue;
    for (int64_t j = 0; j < S; ++j)
      if (cell(rng)) rows[i].push_back(j);
  }
  return rows;
}

/// Brute-force union, row by row, through std::set.
Rows set_union_rows(const Rows& a, const Rows& b) {
  Rows out(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    std::set<int64_t> s(a[i].begin(), a[i].end());
    s.insert(b[i].begin(), b[i].end());
    out[i].assign(s.begin(), s.end());
  }
  return out;
}

TEST(EdgesMerge, SharedListsGiveTheRowByRowSetUnion) {
  std::mt19937 rng(2024);
  int cases = 0;
  for (auto [L, S] : {std::pair<int64_t, int64_t>{1, 1}, {5, 5}, {7, 3}, {3, 9}, {12, 12}, {4, 1}})
    for (double da : {0.0, 0.2, 0.6})
      for (double db : {0.0, 0.3, 1.0}) {
        SCOPED_TRACE("L=" + std::to_string(L) + " S=" + std::to_string(S) + " densities " +
                     std::to_string(da) + ", " + std::to_string(db));
        const auto ra = random_rows(rng, L, S, da), rb = random_rows(rng, L, S, db);
        const auto merged = edges::merge(list_of(ra), list_of(rb));
        EXPECT_EQ(rows_of(merged, L), set_union_rows(ra, rb));  // rows_of checks the CSR invariants
        EXPECT_NO_THROW(check_edge_list(merged, L, S, 1));
        // Union is symmetric and idempotent.
        EXPECT_EQ(rows_of(edges::merge(list_of(rb), list_of(ra)), L), set_union_rows(ra, rb));
        EXPECT_EQ(rows_of(edges::merge(list_of(ra), list_of(ra)), L), ra);
        ++cases;
      }
  EXPECT_EQ(cases, 54);
  // Spelled out, L = 3 rows over S = 5 keys, an empty row in each input and
  // one row empty in both.
  const Rows a{{0, 3}, {}, {}}, b{{1, 3, 4}, {2}, {}};
  EXPECT_EQ(rows_of(edges::merge(list_of(a), list_of(b)), 3), (Rows{{0, 1, 3, 4}, {2}, {}}));
  // Two lists without any edge.
  const auto none = edges::merge(list_of(Rows(4)), list_of(Rows(4)));
  EXPECT_EQ(rows_of(none, 4), Rows(4));
  EXPECT_EQ(none.num_edges(), 0);
}

TEST(EdgesMerge, PerHeadListsMergeHeadByHead) {
  std::mt19937 rng(7);
  const int64_t H = 3, L = 6, S = 8;
  std::vector<Rows> a, b;
  for (int64_t h = 0; h < H; ++h) {
    a.push_back(random_rows(rng, L, S, 0.3));
    b.push_back(random_rows(rng, L, S, 0.3));
  }
  const auto merged = edges::merge(per_head_list_of(a), per_head_list_of(b));
  ASSERT_TRUE(merged.per_head());
  ASSERT_EQ(merged.offsets.sizes(), (std::vector<int64_t>{H, L + 1}));
  EXPECT_NO_THROW(check_edge_list(merged, L, S, H));
  for (int64_t h = 0; h < H; ++h) EXPECT_EQ(head_rows(merged, h), set_union_rows(a[h], b[h])) << "head " << h;

  // A per-head list whose heads share one columns array (every head's offsets
  // the same, each starting at 0): the layout a shared list repeated per head
  // has; it is read through its offsets like any other.
  const Rows shared{{0}, {1, 2}, {}, {3}, {4, 7}, {5}};
  const auto base = list_of(shared);
  const EdgeList repeated{base.offsets.unsqueeze(0).expand({H, L + 1}).contiguous(), base.columns};
  const auto with_shared = edges::merge(repeated, per_head_list_of(b));
  for (int64_t h = 0; h < H; ++h)
    EXPECT_EQ(head_rows(with_shared, h), set_union_rows(shared, b[h])) << "head " << h;
}

TEST(EdgesMerge, RefusesListsThatDoNotFit) {
  const auto shared3 = list_of(Rows{{0}, {1}, {2}});
  const auto per_head3 = per_head_list_of({Rows{{0}, {1}, {2}}, Rows{{1}, {2}, {0}}});
  expect_error([&] { edges::merge(shared3, per_head3); },
               {"edges::merge", "cannot merge a shared list with a per-head one"});
  expect_error([&] { edges::merge(per_head3, shared3); },
               {"edges::merge", "cannot merge a shared list with a per-head one"});
  expect_error([&] { edges::merge(shared3, list_of(Rows{{0}, {1}, {2}, {3}})); },
               {"edges::merge", "3 and 4 queries"});
  expect_error([&] { edges::merge(per_head3, per_head_list_of({Rows{{0}, {1}, {2}}})); },
               {"edges::merge", "2 and 1 heads"});
  // Invalid lists: an unsorted row, a negative column, offsets that overrun.
  auto t = [](std::vector<int64_t> v) { return torch::tensor(v, torch::kLong); };
  expect_error([&] { edges::merge(shared3, EdgeList{t({0, 2, 2, 3}), t({1, 0, 2})}); },
               {"edges::merge", "strictly increasing"});
  expect_error([&] { edges::merge(EdgeList{t({0, 1, 2, 3}), t({0, -1, 2})}, shared3); },
               {"edges::merge", "outside the key range"});
  expect_error([&] { edges::merge(shared3, EdgeList{t({0, 1, 2, 5}), t({0, 1, 2})}); },
               {"edges::merge", "end at the number of columns"});
  expect_error([&] { edges::merge(shared3, EdgeList{}); }, {"edges::merge", "'offsets'"});
}

/// All-pairs fewest-edge distances by Floyd-Warshall over a directed
/// adjacency (i -> j for every column j of row i), then clipped: an
/// independent oracle for hop_distances.
std::vector<std::vector<int64_t>> floyd_warshall(const Rows& rows, int64_t clip) {
  const int64_t n = static_cast<int64_t>(rows.size()), inf = 1 << 20;
  std::vector<std::vector<int64_t>> d(n, std::vector<int64_t>(n, inf));
  for (int64_t i = 0; i < n; ++i) {
    d[i][i] = 0;
    for (int64_t j : rows[i])
      if (j != i) d[i][j] = 1;
  }
  for (int64_t k = 0; k < n; ++k)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) d[i][j] = std::min(d[i][j], d[i][k] + d[k][j]);
  for (auto& r : d)
    for (auto& x : r) x = std::min(x, clip);
  return d;
}

torch::Tensor matrix(const std::vector<std::vector<int64_t>>& m) {
  std::vector<torch::Tensor> rows;
  for (const auto& r : m) rows.push_back(torch::tensor(r, torch::kLong));
  return torch::stack(rows);
}

TEST(EdgesHopDistances, HandMadeDirectedGraph) {
  // 4 -> 0 -> 1 -> 2 -> 3, plus the shortcut 0 -> 2; 5 has only its self-edge;
  // 3 has no out-edge. Read as a directed graph: 1 does not reach 0.
  const Rows g{{1, 2}, {2}, {3}, {}, {0}, {5}};
  constexpr int64_t U = 10;  // max_distance 10: every path here is shorter, so U marks "unreachable"
  const auto d10 = edges::hop_distances(list_of(g), U);
  EXPECT_EQ(d10.scalar_type(), torch::kLong);
  ASSERT_EQ(d10.sizes(), (std::vector<int64_t>{6, 6}));
  const std::vector<std::vector<int64_t>> want10{
      //0  1  2  3  4  5
      {0, 1, 1, 2, U, U},  // 0: 2 directly, 3 via 2
      {U, 0, 1, 2, U, U},  // 1
      {U, U, 0, 1, U, U},  // 2
      {U, U, U, 0, U, U},  // 3: reaches nothing
      {1, 2, 2, 3, 0, U},  // 4: through 0
      {U, U, U, U, U, 0},  // 5: its self-edge only
  };
  EXPECT_TRUE(torch::equal(d10, matrix(want10))) << d10;
  // Clipped at 2: 0 -> 3 and 4 -> 3 (3 hops) become 2, unreachable pairs 2.
  const std::vector<std::vector<int64_t>> want2{
      {0, 1, 1, 2, 2, 2}, {2, 0, 1, 2, 2, 2}, {2, 2, 0, 1, 2, 2},
      {2, 2, 2, 0, 2, 2}, {1, 2, 2, 2, 0, 2}, {2, 2, 2, 2, 2, 0},
  };
  EXPECT_TRUE(torch::equal(edges::hop_distances(list_of(g), 2), matrix(want2)));
  // max_distance 1: 0 on the diagonal, 1 everywhere else (neighbour, farther
  // or unreachable alike); 0: all zeros.
  const auto eye = torch::eye(6, torch::kLong);
  EXPECT_TRUE(torch::equal(edges::hop_distances(list_of(g), 1), 1 - eye));
  EXPECT_TRUE(torch::equal(edges::hop_distances(list_of(g), 0), torch::zeros({6, 6}, torch::kLong)));
  // Self-edges change nothing: the diagonal stays 0.
  EXPECT_TRUE(torch::equal(edges::hop_distances(list_of(Rows{{0, 1, 2}, {1, 2}, {2}, {3}, {0, 4}, {5}}), U),
                           edges::hop_distances(list_of(Rows{{1, 2}, {2}, {}, {}, {0}, {}}), U)));
  // One node; a node-free graph.
  EXPECT_TRUE(torch::equal(edges::hop_distances(list_of(Rows{{0}}), 3), torch::zeros({1, 1}, torch::kLong)));
  EXPECT_EQ(edges::hop_distances(list_of(Rows{}), 3).sizes(), (std::vector<int64_t>{0, 0}));
}

TEST(EdgesHopDistances, RandomGraphsMatchFloydWarshall) {
  std::mt19937 rng(99);
  for (int64_t n : {2, 5, 9, 16})
    for (double density : {0.05, 0.15, 0.4})
      for (int64_t clip : {1, 2, 3, 100}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " density=" + std::to_string(density) +
                     " max_distance=" + std::to_string(clip));
        const auto g = random_rows(rng, n, n, density);
        const auto got = edges::hop_distances(list_of(g), clip);
        const auto want = matrix(floyd_warshall(g, clip));
        EXPECT_TRUE(torch::equal(got, want)) << got << "\n" << want;
      }
  // The path 0 - 1 - ... - 7 in both directions (an undirected graph, as a
  // NodeGraph stores one): |i - j| clipped.
  Rows path(8);
  for (int64_t i = 0; i < 8; ++i) {
    if (i > 0) path[i].push_back(i - 1);
    path[i].push_back(i);
    if (i < 7) path[i].push_back(i + 1);
  }
  const auto i = torch::arange(8, torch::kLong);
  EXPECT_TRUE(torch::equal(edges::hop_distances(list_of(path), 5),
                           (i.unsqueeze(1) - i.unsqueeze(0)).abs().clamp_max(5)));
}

TEST(EdgesHopDistances, Refusals) {
  const auto per_head = per_head_list_of({Rows{{0}, {1}}, Rows{{1}, {0}}});
  expect_error([&] { edges::hop_distances(per_head, 2); }, {"edges::hop_distances", "one shared edge list"});
  expect_error([] { edges::hop_distances(list_of(Rows{{1}, {0}}), -1); },
               {"hop_distances", "'max_distance'", ">= 0", "-1"});
  // Not square: a column outside the n nodes.
  expect_error([] { edges::hop_distances(list_of(Rows{{0, 2}, {1}}), 2); },
               {"edges::hop_distances", "outside the key range"});
  expect_error([] { edges::hop_distances(EdgeList{}, 2); }, {"edges::hop_distances"});
}

TEST(SparseDispatch, KernelForFloat32AndBfloat16CompositeOtherwiseSayingWhy) {
  // float32 (and bfloat16, converted) runs the edge-list kernel (tests/kernels/sparse_attention_kernel_test.cpp
  // checks it against the reference); float64 takes the composite, whose output
  // is exactly the reference's, and the reason says what it costs.
  const std::string why =
      "q, k and v are float64; the edge-list kernel is float32 and bfloat16 only (the composite "
      "builds a dense L x S mask and score matrix per head, O(L S) time and memory whatever the "
      "number of edges)";
  torch::manual_seed(13);
  const auto e = edges::local(6, 1);
  auto q = torch::randn({1, 2, 6, 3}), k = torch::randn({1, 2, 6, 3}), v = torch::randn({1, 2, 6, 2});
  testing::expect_kernel(sparse_attention_dispatch(q, k, v, e));
  auto q64 = q.to(torch::kDouble), k64 = k.to(torch::kDouble), v64 = v.to(torch::kDouble);
  testing::expect_composite(sparse_attention_dispatch(q64, k64, v64, e), why);
  EXPECT_TRUE(torch::equal(sparse_attention(q64, k64, v64, e),
                           reference::sparse_attention(q64, k64, v64, e, {})));
}

}  // namespace
}  // namespace attnkit::edges_test
