// The mechanism registry (include/attnkit/nn/registry.h): each mechanism is
// written down once, here.
#include <attnkit/nn/clustered.h>
#include <attnkit/nn/linear.h>
#include <attnkit/nn/registry.h>
#include <attnkit/nn/sac.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>

#include "ops/checks.h"
#include "reference/reference.h"

namespace attnkit::nn {

// --- Spec strings ----------------------------------------------------------------------

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

}  // namespace

MechanismSpec MechanismSpec::parse(const std::string& text) {
  MechanismSpec spec;
  const auto colon = text.find(':');
  spec.name = trim(text.substr(0, colon));
  TORCH_CHECK(!spec.name.empty(), "mechanism spec '", text,
              "': expected NAME[:key=value,...], e.g. 'improved-clustered:clusters=25,topk=32'");
  if (colon == std::string::npos) return spec;
  std::stringstream rest(text.substr(colon + 1));
  for (std::string item; std::getline(rest, item, ',');) {
    const auto eq = item.find('=');
    const std::string key = trim(item.substr(0, eq));
    TORCH_CHECK(eq != std::string::npos && !key.empty(), "mechanism spec '", text,
                "': option '", trim(item), "' is not of the form key=value");
    TORCH_CHECK(!spec.has(key), "mechanism spec '", text, "': option '", key, "' given twice");
    spec.options.emplace_back(key, trim(item.substr(eq + 1)));
  }
  return spec;
}

std::string MechanismSpec::str() const {
  std::string s = name;
  for (size_t i = 0; i < options.size(); ++i)
    s += (i ? "," : ":") + options[i].first + "=" + options[i].second;
  return s;
}

bool MechanismSpec::has(const std::string& key) const {
  return std::any_of(options.begin(), options.end(), [&](const auto& kv) { return kv.first == key; });
}

std::string MechanismSpec::get(const std::string& key, const std::string& fallback) const {
  for (const auto& [k, v] : options)
    if (k == key) return v;
  return fallback;
}

namespace {

/// Parses all of `text` with `convert` (std::stoll, std::stod); nullopt if
/// it does not parse or leaves characters over.
template <typename T, typename Convert>
c10::optional<T> parse_whole(const std::string& text, Convert convert) {
  size_t used = 0;
  try {
    const T x = convert(text, &used);
    if (used == text.size() && !text.empty()) return x;
  } catch (const std::exception&) {
  }
  return c10::nullopt;
}

}  // namespace

int64_t MechanismSpec::get_int(const std::string& key, int64_t fallback) const {
  if (!has(key)) return fallback;
  const std::string value = get(key, "");
  const auto x = parse_whole<int64_t>(value, [](const std::string& t, size_t* n) {
    return std::stoll(t, n);
  });
  TORCH_CHECK(x, "mechanism '", str(), "': option '", key, "' must be an integer, got '", value, "'");
  return *x;
}

double MechanismSpec::get_double(const std::string& key, double fallback) const {
  if (!has(key)) return fallback;
  const std::string value = get(key, "");
  const auto x = parse_whole<double>(value, [](const std::string& t, size_t* n) {
    return std::stod(t, n);
  });
  TORCH_CHECK(x && std::isfinite(*x), "mechanism '", str(), "': option '", key,
              "' must be a finite number, got '", value, "'");
  return *x;
}

bool MechanismSpec::get_bool(const std::string& key, bool fallback) const {
  if (!has(key)) return fallback;
  const std::string value = get(key, "");
  if (value == "true" || value == "1") return true;
  if (value == "false" || value == "0") return false;
  TORCH_CHECK(false, "mechanism '", str(), "': option '", key,
              "' must be true or false, got '", value, "'");
}

// --- Sparse patterns --------------------------------------------------------------------

namespace {

struct Pattern {
  const char* name;
  const char* param;  // the option naming edges::by_name's parameter, or nullptr
  const char* help;
};

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

// --- The entries --------------------------------------------------------------------

namespace {

using Inputs = MechanismInputs;

MechanismInputs sample_qkv(const AttentionShape& s, torch::Dtype dtype) {
  auto o = torch::TensorOptions().dtype(dtype);
  return {torch::randn({s.N, s.H, s.L, s.E}, o), torch::randn({s.N, s.H, s.S, s.E}, o),
          torch::randn({s.N, s.H, s.S, s.M}, o)};
}

/// A per-head mechanism as a module: the entry's functional form.
class FunctionalMechanism : public MechanismImpl {
 public:
  FunctionalMechanism(const MechanismInfo* info, MechanismSpec spec)
      : info_(info), spec_(std::move(spec)) {}
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttendArgs& args) override {
    detail::check_qkv(info_->name.c_str(), q, k, v);
    check_supports(*info_, q, k, v, args);
    return info_->run({q, k, v}, args, spec_);
  }
  std::shared_ptr<MechanismImpl> copy(const c10::optional<torch::Device>&) const override {
    return std::make_shared<FunctionalMechanism>(info_, spec_);  // stateless
  }
  void pretty_print(std::ostream& stream) const override {
    stream << "attnkit::nn::Mechanism(" << spec_.str() << ")";
  }

 private:
  const MechanismInfo* info_;
  MechanismSpec spec_;
};

/// The module of a q, k, v mechanism: its functional form. The entry is looked
/// up when the factory runs, after the static table is built.
std::shared_ptr<MechanismImpl> make_functional(const MechanismSpec& spec) {
  return std::make_shared<FunctionalMechanism>(&find_mechanism(spec.name), spec);
}

// full ------------------------------------------------------------------------------

SoftmaxAttentionFuncOptions softmax_options(const AttendArgs& a) {
  return SoftmaxAttentionFuncOptions().causal(a.causal).key_lengths(a.key_lengths);
}

MechanismInfo full_entry() {
  MechanismInfo m;
  m.name = "full";
  m.summary = "exact softmax attention (tiled kernel)";
  m.supports = {true, true, true, true, true};
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  m.start_decoding = [](const MechanismSpec&) -> std::unique_ptr<CausalState> {
    return std::make_unique<CachedSoftmaxState>([](int64_t) { return int64_t{0}; });
  };
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    return softmax_attention(x[0], x[1], x[2], softmax_options(a));
  };
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    return reference::softmax_attention(x[0], x[1], x[2], softmax_options(a));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    return softmax_attention_dispatch(x[0], x[1], x[2], softmax_options(a));
  };
  m.flops = [](const AttentionShape& s, bool causal, const MechanismSpec&) -> c10::optional<double> {
    // q k^T and P v: 2 (E + M) per visible (query, key) pair. Causal, query i
    // sees the keys j <= i + S - L: L (S - L) + L (L + 1) / 2 pairs when
    // L <= S, and S (S + 1) / 2 when L > S (the first L - S queries see none).
    const double L = double(s.L), S = double(s.S);
    const double pairs = !causal ? L * S : L <= S ? L * (S - L) + L * (L + 1) / 2 : S * (S + 1) / 2;
    return 2.0 * s.N * s.H * pairs * (s.E + s.M);
  };
  return m;
}

// linear, causal-linear ---------------------------------------------------------------

/// Causal linear attention decoded through its recurrent state (S, z), O(E M)
/// per position whatever the context. `gated`: the cheap-linear-attention
/// paper's form, keys = values = f = sigmoid(k) * v, identity map, no normaliser.
class LinearCausalState : public CausalState {
 public:
  LinearCausalState(const LinearAttentionStateOptions& options, bool gated)
      : state_(options), gated_(gated) {}
  torch::Tensor step(const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override {
    if (!gated_) return state_.step(q, k, v);
    const auto f = torch::sigmoid(k) * v;
    return state_.step(q, f, f);
  }
  int64_t steps() const override { return state_.steps(); }

 private:
  LinearAttentionState state_;
  bool gated_;
};

LinearAttentionFuncOptions linear_options(const MechanismSpec& spec, bool causal) {
  return LinearAttentionFuncOptions()
      .feature_map(feature_map_from_string(spec.get("feature_map", "elu")))
      .normalize(spec.get_bool("normalize", true))
      .eps(spec.get_double("eps", 1e-6))
      .causal(causal || spec.name == "causal-linear");
}

MechanismInfo linear_entry(const std::string& name) {
  MechanismInfo m;
  m.name = name;
  m.summary = name == "linear" ? "linear attention phi(q) (sum phi(k) v^T) / normaliser"
                               : "linear attention, always causal (the RNN form)";
  m.options = {{"feature_map", "elu", "identity or elu (elu(x) + 1)"},
               {"normalize", "true", "divide by phi(q) . sum phi(k) + eps"},
               {"eps", "1e-6", "added to the normaliser"}};
  // Decoding state: LinearAttentionState, for "linear" when called causal.
  m.supports = {true, false, true, true, true};
  m.always_causal = name == "causal-linear";
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  m.start_decoding = [](const MechanismSpec& spec) -> std::unique_ptr<CausalState> {
    const auto o = linear_options(spec, true);
    return std::make_unique<LinearCausalState>(
        LinearAttentionStateOptions().feature_map(o.feature_map()).normalize(o.normalize()).eps(o.eps()),
        /*gated=*/false);
  };
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return linear_attention(x[0], x[1], x[2], linear_options(spec, a.causal));
  };
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return reference::linear_attention(x[0], x[1], x[2], linear_options(spec, a.causal));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return linear_attention_dispatch(x[0], x[1], x[2], linear_options(spec, a.causal));
  };
  m.flops = [](const AttentionShape& s, bool, const MechanismSpec&) -> c10::optional<double> {
    // phi(k)^T v (S E M) and phi(q) times that (L E M), 2 flops each.
    return 2.0 * s.N * s.H * (s.S + s.L) * s.E * s.M;
  };
  return m;
}

// gated-linear --------------------------------------------------------------------------

MechanismInfo gated_linear_entry() {
  MechanismInfo m;
  m.name = "gated-linear";
  m.summary =
      "cheap linear attention with a document memory: f = sigmoid(k) * v, out = (sum f f^T) q";
  m.supports = {true, false, true, false, true};
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  m.start_decoding = [](const MechanismSpec&) -> std::unique_ptr<CausalState> {
    return std::make_unique<LinearCausalState>(LinearAttentionStateOptions(), /*gated=*/true);
  };
  // The paper's gated form with alpha = beta = 1: C = sum_t f_t f_t^T is linear
  // attention with keys = values = f (identity map, no normaliser), which also
  // lets the number of queries differ from the document length.
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    const auto f = torch::sigmoid(x[1]) * x[2];
    return linear_attention(x[0], f, f, LinearAttentionFuncOptions().causal(a.causal));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    return linear_attention_dispatch(x[0], x[1], x[2], LinearAttentionFuncOptions().causal(a.causal));
  };
  // Its definition is the recurrence C_t = C_{t-1} + f_t f_t^T read out by q
  // (a different computation from the one above), where L = S allows it.
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    const auto f = torch::sigmoid(x[1]) * x[2];
    if (x[0].size(2) != f.size(2))
      return reference::linear_attention(x[0], f, f, LinearAttentionFuncOptions().causal(a.causal));
    const auto ones = torch::ones({f.size(0), f.size(1), f.size(2)}, f.options());
    return reference::gated_linear_attention(f, x[0], ones, ones,
                                             GatedLinearAttentionFuncOptions().causal(a.causal));
  };
  m.flops = [](const AttentionShape& s, bool, const MechanismSpec&) -> c10::optional<double> {
    return 2.0 * s.N * s.H * (s.S + s.L) * s.E * s.E;
  };
  return m;
}

// clustered, improved-clustered -------------------------------------------------------

ClusteredAttentionOptions clustered_module_options(const MechanismSpec& spec) {
  const bool improved = spec.name == "improved-clustered";
  return ClusteredAttentionOptions()
      .clusters(spec.get_int("clusters", 100))
      .bits(spec.get_int("bits", 63))
      .iterations(spec.get_int("iterations", 10))
      .topk(improved ? spec.get_int("topk", 32) : 0)
      .hash_bias(spec.get_bool("hash_bias", true))
      .seed(spec.get_int("seed", 0))
      .advance_seed(spec.get_bool("advance_seed", true));
}

/// The op's options for one call: the module's, capped at what the input has.
ClusteredAttentionFuncOptions clustered_options(const MechanismSpec& spec, const Inputs& x,
                                            const AttendArgs& a) {
  const auto o = clustered_module_options(spec);
  const int64_t L = x[0].size(2), S = x[1].size(2);
  return ClusteredAttentionFuncOptions()
      .clusters(std::max<int64_t>(1, std::min(o.clusters(), L)))
      .bits(o.bits())
      .iterations(o.iterations())
      .topk(std::min(o.topk(), S))
      .hash_bias(o.hash_bias())
      .seed(o.seed())
      .key_lengths(a.key_lengths);
}

/// nn::ClusteredAttention behind the registry's interface, so that its seed
/// policy (fresh planes per training step) and `calls` buffer come along.
class ClusteredMechanism : public MechanismImpl {
 public:
  ClusteredMechanism(const MechanismInfo* info, const MechanismSpec& spec) : info_(info), spec_(spec) {
    module_ = register_module("clustered", ClusteredAttention(clustered_module_options(spec)));
  }
  /// A deep copy: the inner module's clone carries the `calls` counter.
  std::shared_ptr<MechanismImpl> copy(const c10::optional<torch::Device>& device) const override {
    auto copy = std::make_shared<ClusteredMechanism>(info_, spec_);
    copy->module_ = copy->replace_module(
        "clustered", ClusteredAttention(std::dynamic_pointer_cast<ClusteredAttentionImpl>(
                         module_->clone(device))));
    return copy;
  }
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttendArgs& args) override {
    detail::check_qkv(info_->name.c_str(), q, k, v);
    check_supports(*info_, q, k, v, args);
    return module_->forward(q, k, v, args.key_lengths);
  }

 private:
  const MechanismInfo* info_;
  MechanismSpec spec_;
  ClusteredAttention module_{nullptr};
};

MechanismInfo clustered_entry(const std::string& name) {
  const bool improved = name == "improved-clustered";
  MechanismInfo m;
  m.name = name;
  m.summary = improved ? "clusters of queries attend through their centroid, plus exact "
                         "attention on each cluster's top-k keys"
                       : "queries grouped by LSH + Hamming K-means attend through their centroid";
  m.options = {{"clusters", "100", "query clusters (capped at L)"},
               {"bits", "63", "LSH hash bits"},
               {"iterations", "10", "Hamming K-means iterations"},
               {"hash_bias", "true", "hyperplanes with a threshold (false: through 0)"},
               {"seed", "0", "seed of the planes and the K-means start"},
               {"advance_seed", "true", "module: fresh planes per training-mode call"}};
  if (improved) m.options.push_back({"topk", "32", "keys attended exactly per cluster (capped at S)"});
  m.supports = {false, true, true, true, false};
  m.approximates_exact = true;
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = [](const MechanismSpec& spec) -> std::shared_ptr<MechanismImpl> {
    return std::make_shared<ClusteredMechanism>(&find_mechanism(spec.name), spec);
  };
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return clustered_attention(x[0], x[1], x[2], clustered_options(spec, x, a));
  };
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return reference::clustered_attention(x[0], x[1], x[2], clustered_options(spec, x, a));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return clustered_attention_dispatch(x[0], x[1], x[2], clustered_options(spec, x, a));
  };
  return m;
}

// agglomerative -------------------------------------------------------------------------

MechanismInfo agglomerative_entry() {
  MechanismInfo m;
  m.name = "agglomerative";
  m.summary = "one head per class: class-weighted value means (layer: nn::AgglomerativeAttention)";
  m.options = {{"clip", "1e-3", "lower bound of a class's weight sum"},
               {"classes", "0", "layer: class count m (0: the model's head count)"}};
  m.supports = {true, false, true, true, true};
  m.inputs = {"cq", "cr", "v"};
  m.sample = [](const AttentionShape& s, torch::Dtype dtype) -> MechanismInputs {
    // Class weights are softmaxes over the H classes, as the layer makes them.
    auto o = torch::TensorOptions().dtype(dtype);
    return {torch::softmax(torch::randn({s.N, s.L, s.H}, o), -1).permute({0, 2, 1}),
            torch::softmax(torch::randn({s.N, s.S, s.H}, o), -1).permute({0, 2, 1}),
            torch::randn({s.N, s.H, s.S, s.M}, o)};
  };
  auto options = [](const AttendArgs& a, const MechanismSpec& spec) {
    return AgglomerativeAttentionFuncOptions().causal(a.causal).clip(spec.get_double("clip", 1e-3));
  };
  m.run = [options](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return agglomerative_attention(x[0], x[1], x[2], options(a, spec));
  };
  m.reference = [options](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return reference::agglomerative_attention(x[0], x[1], x[2], options(a, spec));
  };
  m.dispatch = [options](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return agglomerative_attention_dispatch(x[0], x[1], x[2], options(a, spec));
  };
  m.flops = [](const AttentionShape& s, bool, const MechanismSpec&) -> c10::optional<double> {
    // Class sums (S M) and the read-out (L M), 2 flops each, per class.
    return 2.0 * s.N * s.H * (s.S + s.L) * s.M;
  };
  return m;
}

// sparse-<pattern> ------------------------------------------------------------------------

using EdgeBuilder = std::function<EdgeList(int64_t, const MechanismSpec&)>;

/// The edge lists a builder made last, by (n, spec). A model calls its
/// mechanism with the same length in every layer and step, and rebuilding the
/// pattern each call (a vector per row, sorted, then copied into tensors) took
/// about a fifth of a sparse-local:span=64 forward call at L = 4096 (perf,
/// 2026-11-23). The kernels only read the lists, so the cached tensors are
/// shared; `MechanismInfo::edges` still returns fresh lists, which a caller
/// may modify. Holds at most kEntries lists (17 MiB each for a span-64 band at
/// L = 16384).
class EdgeListCache {
 public:
  explicit EdgeListCache(EdgeBuilder build) : build_(std::move(build)) {}

  EdgeList operator()(int64_t n, const MechanismSpec& spec) {
    const std::string key = std::to_string(n) + " " + spec.str();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = entries_.begin(); it != entries_.end(); ++it)
        if (it->first == key) {
          entries_.splice(entries_.begin(), entries_, it);  // most recently used first
          return it->second;
        }
    }
    EdgeList built = build_(n, spec);  // outside the lock: building can take a while
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.emplace_front(key, built);
    if (entries_.size() > kEntries) entries_.pop_back();
    return built;
  }

 private:
  static constexpr std::size_t kEntries = 4;
  EdgeBuilder build_;
  std::mutex mutex_;
  std::list<std::pair<std::string, EdgeList>> entries_;
};

/// Fills the functional forms of a mechanism that is sparse_attention over the
/// edge list `build(L, spec)` of L nodes: run, reference, dispatch (through an
/// EdgeListCache), and flops (exact attention's count per visible pair, per
/// edge: q . k and p v, 2 (E + M), over every edge of every head; a shared list
/// serves H heads).
void attend_over_edges(MechanismInfo& m, EdgeBuilder build) {
  m.edges = build;
  const auto cache = std::make_shared<EdgeListCache>(build);
  const auto edges = [cache](int64_t n, const MechanismSpec& spec) { return (*cache)(n, spec); };
  m.run = [edges](const Inputs& x, const AttendArgs&, const MechanismSpec& spec) {
    return sparse_attention(x[0], x[1], x[2], edges(x[0].size(2), spec));
  };
  m.reference = [edges](const Inputs& x, const AttendArgs&, const MechanismSpec& spec) {
    return reference::sparse_attention(x[0], x[1], x[2], edges(x[0].size(2), spec), {});
  };
  m.dispatch = [edges](const Inputs& x, const AttendArgs&, const MechanismSpec& spec) {
    return sparse_attention_dispatch(x[0], x[1], x[2], edges(x[0].size(2), spec));
  };
  m.flops = [edges](const AttentionShape& s, bool, const MechanismSpec& spec) -> c10::optional<double> {
    const auto e = edges(s.L, spec);
    const double per_head = e.per_head() ? 1.0 : double(s.H);
    return 2.0 * double(s.E + s.M) * double(s.N) * per_head * double(e.num_edges());
  };
}

MechanismInfo sparse_entry(const Pattern& pattern) {
  MechanismInfo m;
  m.name = std::string("sparse-") + pattern.name;
  m.summary = std::string("attention over a fixed edge list: ") + pattern.help;
  if (pattern.param) m.options = {{pattern.param, "32", "pattern parameter"}};
  const std::string name = pattern.name;
  m.always_causal = name == "causal" || name == "local-causal" || name == "segments-causal" ||
                    name == "strided";
  m.supports = {false, false, false, true, m.always_causal};
  if (m.always_causal) {
    m.start_decoding = [name, pattern](const MechanismSpec& spec) -> std::unique_ptr<CausalState> {
      const int64_t p = pattern.param ? spec.get_int(pattern.param, 32) : 0;
      // The keys of query t, as the pattern's edge list has them (row t does
      // not depend on the sequence length for these causal patterns).
      if (name == "causal")
        return std::make_unique<CachedSoftmaxState>([](int64_t) { return int64_t{0}; });
      if (name == "local-causal")
        return std::make_unique<CachedSoftmaxState>([p](int64_t t) { return t - p; });
      if (name == "segments-causal")
        return std::make_unique<CachedSoftmaxState>(
            [p](int64_t t) { return std::max<int64_t>(0, t / p - 1) * p; });
      return CachedSoftmaxState::gathered([p](int64_t t) {  // strided
        // j <= t with t - j < p or t - j a multiple of p: O(t / p + p) per query.
        std::vector<int64_t> seen;
        for (int64_t j = (t - p) % p; j >= 0 && j <= t - p; j += p) seen.push_back(j);
        for (int64_t j = std::max<int64_t>(0, t - p + 1); j <= t; ++j) seen.push_back(j);
        return seen;
      });
    };
  }
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  attend_over_edges(m, [pattern](int64_t n, const MechanismSpec& spec) {
    return pattern_edges(pattern.name, n, pattern.param ? spec.get_int(pattern.param, 32) : 0);
  });
  return m;
}

// sac -------------------------------------------------------------------------------------

MechanismInfo sac_entry() {
  MechanismInfo m;
  m.name = "sac";
  m.summary = "SAC: attention over a structure that a learned edge predictor chooses per sequence "
              "(in a model; alone: over random_structure)";
  m.options = {{"alpha", "1", "predicted edges per node (plus the self-edge)"},
               {"variant", "shared", "shared | all-connected | head-adaptive"},
               {"max_distance", "16", "distance encoding clip (0: off)"},
               {"hidden", "64", "the edge predictor's LSTM width"},
               {"beam", "5", "beam width of the structure at evaluation"},
               {"seed", "0", "random_structure's seed when no predictor supplies one"},
               {"reward", "sequence", "REINFORCE credit: sequence (the paper) | edge (per edge's row)"},
               {"entropy", "0.0", "weight of an entropy bonus on the predictor (0: none, the paper)"}};
  m.supports = {false, false, false, true, false};
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = [](const MechanismSpec& spec) -> std::shared_ptr<MechanismImpl> {
    return std::make_shared<SacAttentionImpl>(spec);
  };
  attend_over_edges(m, [](int64_t n, const MechanismSpec& spec) {
    const auto o = SacOptions::from_spec(spec);
    return random_structure(n, o.alpha, o.seed);
  });
  return m;
}

std::vector<MechanismInfo> build_registry() {
  std::vector<MechanismInfo> r;
  r.push_back(full_entry());
  r.push_back(linear_entry("linear"));
  r.push_back(linear_entry("causal-linear"));
  r.push_back(gated_linear_entry());
  r.push_back(agglomerative_entry());
  r.push_back(clustered_entry("clustered"));
  r.push_back(clustered_entry("improved-clustered"));
  for (const auto& p : sparse_patterns()) r.push_back(sparse_entry(p));
  r.push_back(sac_entry());
  return r;
}

std::string known_names() {
  std::string s;
  for (const auto& m : mechanisms()) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

}  // namespace

const std::vector<MechanismInfo>& mechanisms() {
  static const std::vector<MechanismInfo> registry = build_registry();
  return registry;
}

const MechanismInfo& find_mechanism(const std::string& name) {
  for (const auto& m : mechanisms())
    if (m.name == name) return m;
  TORCH_CHECK(false, "unknown attention mechanism '", name, "'; known: ", known_names());
}

std::pair<const MechanismInfo*, MechanismSpec> resolve_mechanism(const std::string& spec_text) {
  auto spec = MechanismSpec::parse(spec_text);
  const MechanismInfo& info = find_mechanism(spec.name);
  for (const auto& option : spec.options) {
    // Not a structured binding: clang before 16 cannot capture one in a lambda.
    const std::string& key = option.first;
    const bool known = std::any_of(info.options.begin(), info.options.end(),
                                   [&](const MechanismOption& o) { return o.key == key; });
    if (known) continue;
    std::string accepted;
    for (const auto& o : info.options) accepted += (accepted.empty() ? "" : ", ") + o.key;
    TORCH_CHECK(false, "mechanism '", spec.name, "' has no option '", key, "'; ",
                accepted.empty() ? std::string("it takes none") : "accepted: " + accepted);
  }
  // Parse every value once now, so a typo fails here and not at the first call.
  for (const auto& o : info.options) {
    if (!spec.has(o.key)) continue;
    const std::string& d = o.default_value;
    if (d == "true" || d == "false") {
      spec.get_bool(o.key, false);
    } else if (o.key == "feature_map") {
      feature_map_from_string(spec.get(o.key, d));
    } else if (o.key == "variant") {
      edge_predictor_variant_from_string(spec.get(o.key, d));
    } else if (o.key == "reward") {
      SacOptions::from_spec(spec);  // the reward and what it needs
    } else if (d.find_first_of(".e") != std::string::npos) {
      spec.get_double(o.key, 0);
    } else {
      // Counts of things (clusters, bits, topk, spans) need one; seeds and
      // K-means iterations may be 0 (0 iterations: the initial assignment).
      // classes=0 is agglomerative attention's "the model's head count".
      // max_distance=0 turns SAC's distance encoding off.
      const int64_t least =
          o.key == "seed" || o.key == "iterations" || o.key == "classes" || o.key == "max_distance" ? 0 : 1;
      TORCH_CHECK(spec.get_int(o.key, 0) >= least, "mechanism '", spec.str(), "': option '", o.key,
                  "' must be >= ", least);
    }
  }
  return {&info, spec};
}

std::shared_ptr<MechanismImpl> make_mechanism(const std::string& spec_text) {
  auto [info, spec] = resolve_mechanism(spec_text);
  TORCH_CHECK(info->make, "mechanism '", info->name,
              "' replaces the whole attention layer (it holds its own class projections); "
              "build nn::AgglomerativeAttention instead of a per-head mechanism");
  return info->make(spec);
}

bool usable_in_decoder(const MechanismInfo& info) {
  return info.supports.causal || info.always_causal;
}

std::vector<std::string> mechanism_names() {
  std::vector<std::string> names;
  for (const auto& m : mechanisms()) names.push_back(m.name);
  return names;
}

torch::Tensor attend(const std::string& spec_text, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v, const AttendArgs& args) {
  auto [info, spec] = resolve_mechanism(spec_text);
  TORCH_CHECK(info->inputs == std::vector<std::string>({"q", "k", "v"}), "attend: mechanism '",
              info->name, "' does not take q, k, v (its inputs are class weights; see "
              "agglomerative_attention and nn::AgglomerativeAttention)");
  detail::check_qkv("attend", q, k, v);
  check_supports(*info, q, k, v, args);
  return info->run({q, k, v}, args, spec);
}

void check_supports(const MechanismInfo& info, const torch::Tensor& q, const torch::Tensor& k,
                    const torch::Tensor& v, const AttendArgs& args) {
  const auto& s = info.supports;
  const char* n = info.name.c_str();
  TORCH_CHECK(s.causal || !args.causal, n, ": this mechanism does not support the causal flag",
              info.name.rfind("sparse-", 0) == 0 ? " (choose a causal pattern instead)" : "");
  TORCH_CHECK(s.key_lengths || !args.key_lengths.defined(), n,
              ": this mechanism does not support key_lengths (padding)");
  TORCH_CHECK(s.cross || q.size(2) == k.size(2), n,
              ": this mechanism is self-attention only and needs L == S, got L = ", q.size(2),
              ", S = ", k.size(2));
  TORCH_CHECK(s.value_dim || k.size(3) == v.size(3), n,
              ": this mechanism needs values as wide as keys (M == E), got E = ", k.size(3),
              ", M = ", v.size(3));
}

std::string describe_mechanisms() {
  std::ostringstream o;
  o << "Mechanisms (spec: NAME[:key=value,...]).\n"
    << "supports: c = causal flag, p = key_lengths (padding), x = L != S, m = M != E,\n"
    << "          d = incremental decoding state\n\n";
  for (const auto& m : mechanisms()) {
    const auto& s = m.supports;
    std::string sup;
    sup += s.causal ? 'c' : '-';
    sup += s.key_lengths ? 'p' : '-';
    sup += s.cross ? 'x' : '-';
    sup += s.value_dim ? 'm' : '-';
    sup += s.decoding_state ? 'd' : '-';
    o << "  " << m.name << std::string(m.name.size() < 24 ? 24 - m.name.size() : 1, ' ') << sup
      << "  " << m.summary << "\n";
    for (const auto& opt : m.options)
      o << "      " << opt.key << "=" << opt.default_value << "  " << opt.help << "\n";
  }
  return o.str();
}

}  // namespace attnkit::nn
