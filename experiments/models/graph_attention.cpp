// The graph attention network of experiments/models/graph_attention.h.
#include "models/graph_attention.h"

#include <attnkit/nn/registry.h>

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

namespace attnkit::experiments {

namespace {

constexpr const char* kModel = "GraphAttentionNetwork";

/// What the layers attend over: "input", "input+random" (the structure's
/// edges), "full" or "sac" (the attention mechanism).
std::string kind_of(const GraphAttentionOptions& o) {
  return nn::MechanismSpec::parse(o.attention().empty() ? o.structure() : o.attention()).name;
}

/// A shared list repeated for `heads` heads (the heads share its columns).
EdgeList per_head(const EdgeList& shared, int64_t heads) {
  return {shared.offsets.unsqueeze(0).expand({heads, shared.offsets.numel()}).contiguous(), shared.columns};
}

/// `graph` plus `predicted` (shared or per head).
EdgeList with_graph(const EdgeList& graph, const EdgeList& predicted) {
  if (!predicted.per_head()) return edges::merge(graph, predicted);
  return edges::merge(per_head(graph, predicted.offsets.size(0)), predicted);
}

}  // namespace

void validate(const GraphAttentionOptions& o) {
  TORCH_CHECK(o.features() >= 1 && o.classes() >= 2, kModel, ": needs features >= 1 and classes >= 2, got ",
              o.features(), " and ", o.classes());
  TORCH_CHECK(o.width() >= 1 && o.heads() >= 1 && o.width() % o.heads() == 0, kModel, ": width ", o.width(),
              " must be a positive multiple of heads ", o.heads());
  TORCH_CHECK(o.layers() >= 1, kModel, ": needs layers >= 1, got ", o.layers());
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, kModel, ": dropout must be in [0, 1), got ", o.dropout());
  TORCH_CHECK(o.samples() >= 1, kModel, ": samples must be >= 1, got ", o.samples());
  const auto structure = nn::MechanismSpec::parse(o.structure());
  if (structure.name == "input" || structure.name == "self") {
    TORCH_CHECK(structure.options.empty(), kModel, ": structure '", o.structure(), "' takes no options");
  } else if (structure.name == "input+oracle") {
    for (const auto& [key, value] : structure.options)
      TORCH_CHECK(key == "seed", kModel, ": structure '", o.structure(), "': unknown option '", key,
                  "' (input+oracle takes seed)");
  } else if (structure.name == "input+random") {
    for (const auto& [key, value] : structure.options)
      TORCH_CHECK(key == "alpha" || key == "seed", kModel, ": structure '", o.structure(), "': unknown option '",
                  key, "' (input+random takes alpha and seed)");
    TORCH_CHECK(structure.get_int("alpha", 1) >= 1, kModel, ": structure '", o.structure(),
                "': alpha must be >= 1");
  } else {
    TORCH_CHECK(false, kModel, ": unknown structure '", structure.name,
                "'; expected input, input+random[:alpha=A,seed=S], input+oracle[:seed=S] or self");
  }
  if (o.attention().empty()) return;
  const auto spec = nn::MechanismSpec::parse(o.attention());
  if (spec.name == "full") {
    TORCH_CHECK(spec.options.empty(), kModel, ": attention '", o.attention(), "' takes no options");
  } else if (spec.name == "sac") {
    nn::SacOptions::from_spec(nn::resolve_mechanism(o.attention()).second);  // checks keys and values
  } else {
    TORCH_CHECK(false, kModel, ": unknown attention '", spec.name,
                "'; expected full or sac[:options of `attnkit mechanisms`] (or none: attention over the "
                "structure's edges)");
  }
  TORCH_CHECK(structure.name == "input", kModel, ": attention '", spec.name, "' ",
              spec.name == "full" ? "attends over every pair of nodes" : "adds its edges to the input graph's",
              "; it takes structure 'input', got '", o.structure(), "'");
}

GraphAttentionNetworkImpl::GraphAttentionNetworkImpl(const GraphAttentionOptions& options)
    : options_(options) {
  validate(options_);
  kind_ = kind_of(options_);
  input_ = register_module("input", nn::Linear(options_.features(), options_.width()));
  for (int64_t l = 0; l < options_.layers(); ++l)
    qkv_.push_back(register_module("qkv" + std::to_string(l), nn::Linear(options_.width(), 3 * options_.width())));
  output_ = register_module("output", nn::Linear(options_.width(), options_.classes()));
  if (kind_ == "input+random" || kind_ == "input+oracle") {
    const auto spec = nn::MechanismSpec::parse(options_.structure());
    random_alpha_ = spec.get_int("alpha", 1);
    random_seed_ = static_cast<uint64_t>(spec.get_int("seed", 0));
  }
  if (kind_ == "sac") {
    sac_options_ = nn::SacOptions::from_spec(nn::resolve_mechanism(options_.attention()).second);
    edge_predictor_ = register_module(
        "edge_predictor", nn::EdgePredictor(sac_options_.predictor(options_.width(), options_.heads())));
  }
}

void GraphAttentionNetworkImpl::build_structures(const torch::Tensor& nodes, const EdgeList& graph,
                                                 const torch::Tensor& distances) {
  sac_ = {};
  const int64_t n = nodes.size(0);
  if (kind_ == "full") return;
  if (kind_ == "input") {
    sac_.edges = {graph};
    return;
  }
  if (kind_ == "input+random") {
    sac_.edges = {edges::merge(graph, edges::random(n, random_alpha_, random_seed_))};
    return;
  }
  if (kind_ == "input+oracle") {
    TORCH_CHECK(oracle_.offsets.defined(), kModel, ": structure '", options_.structure(),
                "' needs the labels: call set_labels first");
    TORCH_CHECK(oracle_.num_queries() == n, kModel, ": the labels set are of ", oracle_.num_queries(),
                " nodes, the graph has ", n);
    sac_.edges = {edges::merge(graph, oracle_)};
    return;
  }
  if (kind_ == "self") {
    sac_.edges = {edges::local(n, 0)};
    return;
  }
  // SAC: the predictor reads the nodes without sending gradients into them.
  torch::Tensor hops = distances;
  if (!hops.defined() && sac_options_.max_distance > 0) hops = edges::hop_distances(graph, sac_options_.max_distance);
  const auto x = nodes.detach();
  if (is_training()) {
    const int64_t S = options_.samples();
    auto sample = edge_predictor_->sample_many(x, S, c10::nullopt, hops);
    for (const auto& predicted : sample.edges) sac_.edges.push_back(with_graph(graph, predicted));
    sac_.log_prob = sample.log_prob;
    sac_.tokens = sample.tokens;
    sac_.step_log_prob = sample.step_log_prob;
    sac_.entropy = sample.entropy;
  } else {
    sac_.edges = {with_graph(graph, edge_predictor_->beam_search(x, sac_options_.beam, hops).edges)};
  }
}

torch::Tensor GraphAttentionNetworkImpl::forward(const torch::Tensor& features, const EdgeList& graph,
                                                 const torch::Tensor& distances) {
  TORCH_CHECK(features.defined(), kModel, ": features are undefined");
  TORCH_CHECK(features.dim() == 2 && features.size(1) == options_.features(), kModel,
              ": features must have shape (n, ", options_.features(), "), got ", features.sizes());
  TORCH_CHECK(features.scalar_type() == torch::kFloat32, kModel, ": features must be float32, got ",
              features.scalar_type());
  const int64_t n = features.size(0), d = options_.width(), H = options_.heads();
  TORCH_CHECK(n >= 1, kModel, ": needs at least one node");
  check_edge_list(graph, n, n, 1, kModel);
  TORCH_CHECK(!graph.per_head(), kModel, ": the input graph must be one shared edge list");
  if (distances.defined())
    TORCH_CHECK(distances.dim() == 2 && distances.size(0) == n && distances.size(1) == n, kModel,
                ": distances must have shape (", n, ", ", n, ")");
  namespace F = torch::nn::functional;
  const auto h0 = input_(F::dropout(features, F::DropoutFuncOptions().p(options_.dropout()).training(is_training())));
  build_structures(h0, graph, distances);
  const int64_t B = kind_ == "full" ? 1 : static_cast<int64_t>(sac_.edges.size());
  auto x = h0.unsqueeze(0).expand({B, n, d});
  for (auto& qkv : qkv_) {
    // (B, n, 3d) -> three (B, H, n, d / H).
    const auto parts = qkv(x).view({B, n, 3, H, d / H}).permute({2, 0, 3, 1, 4});
    const auto q = parts[0], k = parts[1], v = parts[2];
    torch::Tensor y;
    if (kind_ == "full") {
      y = softmax_attention(q, k, v);
    } else {
      std::vector<torch::Tensor> rows;
      rows.reserve(B);
      for (int64_t b = 0; b < B; ++b)
        rows.push_back(sparse_attention(q.narrow(0, b, 1), k.narrow(0, b, 1), v.narrow(0, b, 1), sac_.edges[b]));
      y = B == 1 ? rows[0] : torch::cat(rows, 0);
    }
    auto out = F::dropout(torch::elu(y.permute({0, 2, 1, 3}).reshape({B, n, d})),
                          F::DropoutFuncOptions().p(options_.dropout()).training(is_training()));
    x = options_.residual() ? out + x : out;
  }
  return output_(x);
}

void GraphAttentionNetworkImpl::set_labels(const torch::Tensor& labels) {
  TORCH_CHECK(kind_ == "input+oracle", kModel, ": labels are for structure input+oracle, this one is '", kind_, "'");
  oracle_ = oracle_edges(labels, random_seed_);
}

EdgeList oracle_edges(const torch::Tensor& labels, uint64_t seed) {
  TORCH_CHECK(labels.defined() && labels.dim() == 1 && labels.scalar_type() == torch::kInt64 && labels.numel() >= 1,
              "oracle_edges: labels must be int64 (n) with n >= 1");
  const auto l = labels.contiguous();
  const int64_t n = l.numel();
  const int64_t* label = l.data_ptr<int64_t>();
  std::map<int64_t, std::vector<int64_t>> members;  // class -> its nodes, ascending
  for (int64_t i = 0; i < n; ++i) members[label[i]].push_back(i);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto draws = torch::rand({n}, generator, torch::kFloat64).contiguous();
  const double* u = draws.data_ptr<double>();
  std::vector<int64_t> offsets{0}, columns;
  columns.reserve(2 * n);
  for (int64_t i = 0; i < n; ++i) {
    const auto& same = members[label[i]];
    const auto others = static_cast<int64_t>(same.size()) - 1;
    if (others == 0) {
      columns.push_back(i);
    } else {
      // The k-th of the class's other nodes, k uniform in [0, others).
      const auto k = std::min<int64_t>(others - 1, static_cast<int64_t>(u[i] * static_cast<double>(others)));
      const auto self = std::lower_bound(same.begin(), same.end(), i) - same.begin();
      const int64_t j = same[k < self ? k : k + 1];
      columns.push_back(std::min(i, j));
      columns.push_back(std::max(i, j));
    }
    offsets.push_back(static_cast<int64_t>(columns.size()));
  }
  return {torch::tensor(offsets, torch::kInt64), torch::tensor(columns, torch::kInt64)};
}

int64_t GraphAttentionNetworkImpl::parameter_count() const {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.numel();
  return count;
}

}  // namespace attnkit::experiments
