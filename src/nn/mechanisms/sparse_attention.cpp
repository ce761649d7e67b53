// "sparse-<pattern>": attention over a fixed edge list (ops.h
// sparse_attention; the patterns of src/edges, edges::by_name).
#include <algorithm>

#include "nn/mechanisms/mechanism.h"

namespace attnkit::nn {

namespace {

struct Pattern {
  const char* name;
  const char* param;  // the option naming edges::by_name's parameter, or nullptr
  const char* help;
};

/// The default of every pattern's parameter (span, segment, stride).
constexpr int64_t kPatternParam = 32;

const std::vector<Pattern>& sparse_patterns() {
  static const std::vector<Pattern> patterns{
      {"full", nullptr, "every query sees every key (the sparse kernel's identity with exact)"},
      {"causal", nullptr, "query i sees keys j <= i"},
      {"local", "span", "keys with |i - j| <= span"},
      {"local-causal", "span", "keys with i - span <= j <= i"},
      {"segments", "segment", "own and previous segment (Transformer-XL)"},
      {"segments-causal", "segment", "own and previous segment, keys j <= i"},
      {"bp-tree", nullptr, "binary-partition tree over t tokens: 2t - 1 nodes (BP-Transformer)"},
      {"star", nullptr, "t satellites and one relay node (Star-Transformer)"},
      {"strided", "stride", "causal strided pattern (Sparse Transformer)"},
      {"random", "edges", "itself and `edges` keys drawn uniformly, seed 0 (the control for SAC)"},
  };
  return patterns;
}

}  // namespace

EdgeList pattern_edges(const std::string& pattern, int64_t n, int64_t param) {
  if (pattern == "bp-tree") {
    TORCH_CHECK(n % 2 == 1, "sparse-bp-tree needs an odd node count 2t - 1, got ", n);
    return edges::bp_tree((n + 1) / 2);
  }
  if (pattern == "star") {
    TORCH_CHECK(n >= 2, "sparse-star needs at least 2 nodes, got ", n);
    return edges::star(n - 1);
  }
  return edges::by_name(pattern, n, param);
}

namespace registration {
namespace {

/// The spans of bp-tree's t - 1 span nodes over t tokens, in node order.
NodeSpans bp_tree_spans(int64_t tokens) {
  // A span node's row holds its two children; its span is theirs joined.
  const auto edges = pattern_edges("bp-tree", 2 * tokens - 1, 0);
  const auto off = edges.offsets.accessor<int64_t, 1>();
  const auto col = edges.columns.accessor<int64_t, 1>();
  NodeSpans spans(2 * tokens - 1);
  for (int64_t i = 0; i < tokens; ++i) spans[i] = {i, i + 1};
  // Children have larger ids than their parent (pre-order): fill from the last.
  for (int64_t node = 2 * tokens - 2; node >= tokens; --node) {
    TORCH_CHECK(off[node + 1] - off[node] == 2, "sparse-bp-tree: span node ", node, " has ",
                off[node + 1] - off[node], " children");
    spans[node] = {std::min(spans[col[off[node]]].first, spans[col[off[node] + 1]].first),
                   std::max(spans[col[off[node]]].second, spans[col[off[node] + 1]].second)};
  }
  return {spans.begin() + tokens, spans.end()};
}

/// Decoding a causal pattern: a key/value cache whose rows for query t are
/// the pattern's row t (which does not depend on the sequence length for
/// these patterns); the windowed ones keep only their window.
std::unique_ptr<CausalState> start_pattern_decoding(const std::string& name, int64_t p) {
  if (name == "causal")
    return std::make_unique<CachedSoftmaxState>([](int64_t) { return int64_t{0}; });
  if (name == "local-causal")
    return std::make_unique<CachedSoftmaxState>([p](int64_t t) { return t - p; });
  if (name == "segments-causal")
    return std::make_unique<CachedSoftmaxState>(
        [p](int64_t t) { return std::max<int64_t>(0, t / p - 1) * p; });
  TORCH_CHECK(name == "strided", "sparse-", name, " has no decoding state");
  return CachedSoftmaxState::gathered([p](int64_t t) {
    // j <= t with t - j < p or t - j a multiple of p: O(t / p + p) per query.
    std::vector<int64_t> seen;
    for (int64_t j = (t - p) % p; j >= 0 && j <= t - p; j += p) seen.push_back(j);
    for (int64_t j = std::max<int64_t>(0, t - p + 1); j <= t; ++j) seen.push_back(j);
    return seen;
  });
}

MechanismInfo sparse_entry(const Pattern& pattern) {
  MechanismInfo m;
  m.name = std::string("sparse-") + pattern.name;
  m.summary = std::string("attention over a fixed edge list: ") + pattern.help;
  if (pattern.param)
    m.options = {MechanismOption::integer(pattern.param, kPatternParam, 1, "pattern parameter")};
  const std::string name = pattern.name;
  const auto param = [pattern](const MechanismSpec& spec) {
    return pattern.param ? spec.get_int(pattern.param, kPatternParam) : int64_t{0};
  };
  m.always_causal = name == "causal" || name == "local-causal" || name == "segments-causal" ||
                    name == "strided";
  m.supports.value_dim = true;
  m.supports.grouped_heads = true;
  m.supports.alibi = true;
  // Rotary positions on q and k before the call: rotating keys as the
  // kernel loads them would repeat it per edge or band block (docs/MATH.md,
  // "Sparse attention", counts it).
  m.supports.rotary = RotarySupport::inputs;
  m.supports.decoding_state = m.always_causal;
  if (m.always_causal)
    m.start_decoding = [name, param](const MechanismSpec& spec) {
      return start_pattern_decoding(name, param(spec));
    };
  if (name == "bp-tree") m.node_spans = bp_tree_spans;
  if (name == "star") m.node_spans = [](int64_t tokens) { return NodeSpans{{0, tokens}}; };  // the relay
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  attend_over_edges(m, [name, param](int64_t n, const MechanismSpec& spec) {
    return pattern_edges(name, n, param(spec));
  });
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(sparse, 60, {
  std::vector<MechanismInfo> entries;
  for (const auto& pattern : sparse_patterns()) entries.push_back(sparse_entry(pattern));
  return entries;
});

}  // namespace registration
}  // namespace attnkit::nn
