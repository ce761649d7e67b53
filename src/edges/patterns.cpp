// Edge-pattern builders: the attention patterns of earlier models as CSR edge
// lists for one sparse kernel (the special cases of the SAC paper; docs/MATH.md,
// "Sparse attention").
#include <attnkit/ops.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

namespace attnkit::edges {

namespace {

/// CSR from a row-wise predicate over an L x S grid.
EdgeList from_predicate(int64_t L, int64_t S, const std::function<bool(int64_t, int64_t)>& sees) {
  std::vector<int64_t> offsets{0}, columns;
  offsets.reserve(L + 1);
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < S; ++j)
      if (sees(i, j)) columns.push_back(j);
    offsets.push_back(static_cast<int64_t>(columns.size()));
  }
  auto opts = torch::TensorOptions().dtype(torch::kLong);
  return {torch::tensor(offsets, opts), torch::tensor(columns, opts)};
}

/// CSR from explicit neighbour sets (sorted and de-duplicated here).
EdgeList from_rows(std::vector<std::vector<int64_t>> rows) {
  std::vector<int64_t> offsets{0}, columns;
  for (auto& r : rows) {
    std::sort(r.begin(), r.end());
    r.erase(std::unique(r.begin(), r.end()), r.end());
    columns.insert(columns.end(), r.begin(), r.end());
    offsets.push_back(static_cast<int64_t>(columns.size()));
  }
  auto opts = torch::TensorOptions().dtype(torch::kLong);
  return {torch::tensor(offsets, opts), torch::tensor(columns, opts)};
}

void check_size(const char* builder, const char* name, int64_t value, int64_t min) {
  TORCH_CHECK(value >= min, "edges::", builder, ": argument '", name, "' must be >= ", min,
              ", got ", value);
}

/// The most edges (and, for the grid builders, the most (i, j) cells visited)
/// a builder makes: every edge is held in memory twice (a vector, then the
/// columns tensor) at 8 bytes each, so 2^30 edges already take 16 GiB.
constexpr int64_t kMaxEdges = int64_t{1} << 30;

/// Refuses a pattern whose edge count (an upper bound, computed in double so
/// that it cannot overflow) exceeds kMaxEdges, before anything is allocated.
void check_edge_count(const char* builder, const std::string& sizes, double bound) {
  TORCH_CHECK(bound <= static_cast<double>(kMaxEdges), "edges::", builder, ": ", sizes,
              " gives up to ", bound, " edges, more than the limit of ", kMaxEdges,
              " (2^30) edges a pattern may have");
}

std::string sizes_str(const char* a, int64_t x) { return std::string(a) + " = " + std::to_string(x); }
std::string sizes_str(const char* a, int64_t x, const char* b, int64_t y) {
  return sizes_str(a, x) + ", " + sizes_str(b, y);
}

}  // namespace

EdgeList full(int64_t L, int64_t S) {
  check_size("full", "L", L, 0);
  check_size("full", "S", S, 0);
  check_edge_count("full", sizes_str("L", L, "S", S), double(L) * double(S));
  return from_predicate(L, S, [](int64_t, int64_t) { return true; });
}

EdgeList causal(int64_t L, int64_t S) {
  check_size("causal", "L", L, 0);
  check_size("causal", "S", S, 0);
  check_edge_count("causal", sizes_str("L", L, "S", S), double(L) * double(S));  // cells visited
  return from_predicate(L, S, [&](int64_t i, int64_t j) { return j <= i + (S - L); });
}

EdgeList local(int64_t n, int64_t span, bool is_causal) {
  check_size("local", "n", n, 0);
  check_size("local", "span", span, 0);
  check_edge_count("local", sizes_str("n", n, "span", span),
                   double(n) * std::min(double(n), 2.0 * double(span) + 1.0));
  span = std::min(span, n);  // the same rows, and i + span cannot overflow
  std::vector<std::vector<int64_t>> rows(n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = std::max<int64_t>(0, i - span); j <= (is_causal ? i : std::min(n - 1, i + span)); ++j)
      rows[i].push_back(j);
  return from_rows(std::move(rows));
}

EdgeList segments(int64_t n, int64_t segment, bool is_causal) {
  check_size("segments", "n", n, 0);
  check_size("segments", "segment", segment, 1);
  check_edge_count("segments", sizes_str("n", n, "segment", segment),
                   double(n) * std::min(double(n), 2.0 * double(segment)));
  segment = std::min(segment, std::max<int64_t>(n, 1));  // the same rows, no overflow
  std::vector<std::vector<int64_t>> rows(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = i / segment;
    const int64_t begin = std::max<int64_t>(0, s - 1) * segment;
    const int64_t end = is_causal ? i + 1 : std::min(n, (s + 1) * segment);
    for (int64_t j = begin; j < end; ++j) rows[i].push_back(j);
  }
  return from_rows(std::move(rows));
}

EdgeList bp_tree(int64_t n) {
  check_size("bp_tree", "n", n, 1);
  // Leaf rows hold their depth (<= ceil(log2 n)) + 1 ids, internal rows 2.
  check_edge_count("bp_tree", sizes_str("n", n), double(n) * (std::ceil(std::log2(double(n))) + 3.0));
  // Nodes: tokens 0..n-1; internal spans numbered from n in pre-order (root = n).
  std::vector<std::vector<int64_t>> rows(2 * n - 1);
  int64_t next_internal = n;
  // Builds the span [lo, hi) below an ancestor path of sibling ids; returns its node id.
  std::function<int64_t(int64_t, int64_t, std::vector<int64_t>&)> build =
      [&](int64_t lo, int64_t hi, std::vector<int64_t>& context) -> int64_t {
    if (hi - lo == 1) {
      rows[lo] = context;   // the spans that tile the rest of the sequence
      rows[lo].push_back(lo);
      return lo;
    }
    const int64_t id = next_internal++;
    const int64_t mid = lo + (hi - lo + 1) / 2;
    // The ids of the two children are known only after they are built, and each
    // child's context needs its sibling: reserve ids by building sizes first.
    const int64_t left_id = (mid - lo == 1) ? lo : next_internal;
    const int64_t right_id = (hi - mid == 1) ? mid : next_internal + (mid - lo - 1);
    context.push_back(right_id);
    build(lo, mid, context);
    context.back() = left_id;
    build(mid, hi, context);
    context.pop_back();
    rows[id] = {left_id, right_id};
    return id;
  };
  std::vector<int64_t> context;
  build(0, n, context);
  return from_rows(std::move(rows));
}

EdgeList star(int64_t n) {
  check_size("star", "n", n, 1);
  check_edge_count("star", sizes_str("n", n), 5.0 * double(n) + 1.0);
  std::vector<std::vector<int64_t>> rows(n + 1);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = std::max<int64_t>(0, i - 1); j <= std::min(n - 1, i + 1); ++j) rows[i].push_back(j);
    rows[i].push_back(n);
  }
  for (int64_t j = 0; j <= n; ++j) rows[n].push_back(j);
  return from_rows(std::move(rows));
}

EdgeList strided(int64_t n, int64_t stride) {
  check_size("strided", "n", n, 0);
  check_size("strided", "stride", stride, 1);
  check_edge_count("strided", sizes_str("n", n, "stride", stride), double(n) * double(n));  // cells visited
  return from_predicate(n, n, [&](int64_t i, int64_t j) {
    return j <= i && (i - j < stride || (i - j) % stride == 0);
  });
}

EdgeList random(int64_t n, int64_t per_node, uint64_t seed) {
  TORCH_CHECK(n >= 1 && per_node >= 1, "edges::random: needs n >= 1 and per_node >= 1, got n = ", n,
              ", per_node = ", per_node);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto drawn = torch::randint(n, {n, per_node}, generator, torch::kInt64).contiguous();
  const int64_t* d = drawn.data_ptr<int64_t>();
  std::vector<int64_t> offsets{0}, columns;
  columns.reserve(n * (per_node + 1));
  std::vector<int64_t> row;
  for (int64_t i = 0; i < n; ++i) {
    row.assign(d + i * per_node, d + (i + 1) * per_node);
    row.push_back(i);
    std::sort(row.begin(), row.end());
    row.erase(std::unique(row.begin(), row.end()), row.end());
    columns.insert(columns.end(), row.begin(), row.end());
    offsets.push_back(static_cast<int64_t>(columns.size()));
  }
  return {torch::tensor(offsets, torch::kInt64), torch::tensor(columns, torch::kInt64)};
}

EdgeList by_name(const std::string& name, int64_t n, int64_t param) {
  if (name == "full") return full(n, n);
  if (name == "causal") return causal(n, n);
  if (name == "local") return local(n, param);
  if (name == "local-causal") return local(n, param, true);
  if (name == "segments") return segments(n, param);
  if (name == "segments-causal") return segments(n, param, true);
  if (name == "bp-tree") return bp_tree(n);
  if (name == "star") return star(n);
  if (name == "strided") return strided(n, param);
  if (name == "random") return random(n, param, 0);
  TORCH_CHECK(false, "edges::by_name: unknown pattern '", name,
              "'; expected one of full, causal, local, local-causal, segments, "
              "segments-causal, bp-tree, star, strided, random");
}

EdgeList merge(const EdgeList& a, const EdgeList& b) {
  constexpr int64_t kAnyKey = std::numeric_limits<int64_t>::max();
  TORCH_CHECK(a.offsets.defined() && b.offsets.defined(), "edges::merge: both lists need 'offsets'");
  TORCH_CHECK(a.per_head() == b.per_head(), "edges::merge: cannot merge a shared list with a per-head one");
  const int64_t L = a.num_queries();
  TORCH_CHECK(b.num_queries() == L, "edges::merge: the lists have ", L, " and ", b.num_queries(),
              " queries");
  const int64_t heads = a.per_head() ? a.offsets.size(0) : 1;
  TORCH_CHECK(!a.per_head() || b.offsets.size(0) == heads, "edges::merge: the lists have ", heads,
              " and ", b.offsets.size(0), " heads");
  check_edge_list(a, L, kAnyKey, heads, "edges::merge");
  check_edge_list(b, L, kAnyKey, heads, "edges::merge");
  const auto ao = a.offsets.contiguous().view({heads, L + 1}), bo = b.offsets.contiguous().view({heads, L + 1});
  const auto ac = a.columns.contiguous(), bc = b.columns.contiguous();
  const int64_t *ca = ac.data_ptr<int64_t>(), *cb = bc.data_ptr<int64_t>();
  std::vector<int64_t> offsets, columns;
  offsets.reserve(heads * (L + 1));
  columns.reserve(a.num_edges() + b.num_edges());
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t *oa = ao[h].data_ptr<int64_t>(), *ob = bo[h].data_ptr<int64_t>();
    offsets.push_back(static_cast<int64_t>(columns.size()));
    for (int64_t i = 0; i < L; ++i) {
      // Both rows are sorted and duplicate-free: a sorted union.
      std::set_union(ca + oa[i], ca + oa[i + 1], cb + ob[i], cb + ob[i + 1], std::back_inserter(columns));
      offsets.push_back(static_cast<int64_t>(columns.size()));
    }
  }
  auto opts = torch::TensorOptions().dtype(torch::kLong);
  auto off = torch::tensor(offsets, opts);
  if (a.per_head()) off = off.view({heads, L + 1});
  return {off, torch::tensor(columns, opts)};
}

torch::Tensor hop_distances(const EdgeList& edges, int64_t max_distance) {
  TORCH_CHECK(edges.offsets.defined() && !edges.per_head(),
              "edges::hop_distances: needs one shared edge list (offsets of shape (n + 1))");
  check_size("hop_distances", "max_distance", max_distance, 0);
  const int64_t n = edges.num_queries();
  check_edge_list(edges, n, n, 1, "edges::hop_distances");
  TORCH_CHECK(static_cast<double>(n) * static_cast<double>(n) <= static_cast<double>(kMaxEdges),
              "edges::hop_distances: n = ", n, " nodes give an n x n matrix of more than 2^30 entries");
  auto out = torch::full({n, n}, max_distance, torch::kInt64);
  int64_t* d = out.data_ptr<int64_t>();
  const auto oc = edges.offsets.contiguous(), cc = edges.columns.contiguous();
  const int64_t *off = oc.data_ptr<int64_t>(), *col = cc.data_ptr<int64_t>();
  std::vector<int64_t> frontier, next;
  for (int64_t source = 0; source < n; ++source) {
    int64_t* row = d + source * n;
    row[source] = 0;
    frontier.assign(1, source);
    for (int64_t depth = 1; depth < max_distance && !frontier.empty(); ++depth) {
      next.clear();
      for (const int64_t u : frontier)
        for (int64_t e = off[u]; e < off[u + 1]; ++e)
          if (col[e] != source && row[col[e]] == max_distance) {
            row[col[e]] = depth;
            next.push_back(col[e]);
          }
      frontier.swap(next);
    }
  }
  return out;
}

}  // namespace attnkit::edges
