// A graph attention network for node classification (GAT's layout, the SAC
// paper's Table 3 setting) whose attention structure is chosen by spec:
//
//   h_0 = W_in dropout(x)                      x: the nodes' features (n, F)
//   h_l = dropout(ELU(MultiHead_l(h_{l-1})))   l = 1..layers, heads concatenated
//         (+ h_{l-1} with residual)
//   logits = W_out h_layers
//
// MultiHead_l is scaled dot-product attention (one fused q/k/v projection,
// width / heads per head, no output projection: the heads' outputs are
// concatenated as in GAT). Without an `attention` mechanism it runs over the
// edges of `structure`:
//   "input"                 the graph's own edges and self-edges (GAT; its
//                           additive scores replaced by the dot product of the
//                           SAC paper's equation 2)
//   "input+random:alpha=A,seed=S"
//                           the graph's edges plus A random destinations per node
//                           (edges::random): the control for SAC's edge count
//   "input+oracle:seed=S"   the graph's edges plus, per node, one edge to another
//                           node of its class drawn uniformly (oracle_edges:
//                           needs the labels, set_labels): what SAC could at
//                           best add with one correct edge per node, a ceiling
//   "self"                  each node attends to itself only: a network that
//                           sees its own features and no neighbour, the
//                           features-only control (an MLP of the same layers)
// An `attention` mechanism (the structure then stays "input") replaces that:
//   "full"                  every node attends to every node (exact attention)
//   "sac:alpha=A,..."       the graph's edges plus the edges an EdgePredictor
//                           predicts (the registry's "sac" options; the
//                           distance encoding uses hop distances on the input
//                           graph): SAC initialised from the input graph, free
//                           to add edges. The predictor reads h_0 detached;
//                           in training it samples `samples` structures per
//                           forward (the logits then have one row per sample),
//                           in eval mode it decodes one by beam search.
#pragma once

#include <attnkit/models/transformer.h>
#include <attnkit/nn/dense.h>
#include <attnkit/nn/edge_predictor.h>
#include <attnkit/nn/sac.h>
#include <attnkit/ops.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace attnkit::experiments {

struct GraphAttentionOptions {
  GraphAttentionOptions(int64_t features = 0, int64_t classes = 0) : features_(features), classes_(classes) {}
  TORCH_ARG(int64_t, features);
  TORCH_ARG(int64_t, classes);
  TORCH_ARG(int64_t, width) = 64;
  TORCH_ARG(int64_t, heads) = 8;
  TORCH_ARG(int64_t, layers) = 2;
  TORCH_ARG(double, dropout) = 0.6;
  /// The edges attended over: "input", "input+random:alpha=A,seed=S",
  /// "input+oracle:seed=S" or "self" (above).
  TORCH_ARG(std::string, structure) = "input";
  /// Empty (attention over `structure`'s edges), "full" or "sac:..." (above).
  TORCH_ARG(std::string, attention) = "";
  /// sac, training mode: structures sampled per forward.
  TORCH_ARG(int64_t, samples) = 1;
  /// Adds each layer's input to its output (GAT has none on the citation
  /// graphs). Without it a node's own features reach the next layer only as
  /// one of its attention's values, which full attention over thousands of
  /// nodes averages away.
  TORCH_ARG(bool, residual) = false;
};

/// Checks `options` (sizes, the structure and attention specs and their keys)
/// and throws the builder's error.
void validate(const GraphAttentionOptions& options);

/// The oracle's edges over labelled nodes (labels int64 (n)): node i sees
/// itself and one other node of its class drawn uniformly from a generator
/// seeded with `seed` (only itself when its class has no other node). A pure
/// function of (labels, seed).
EdgeList oracle_edges(const torch::Tensor& labels, uint64_t seed);

class GraphAttentionNetworkImpl : public torch::nn::Module {
 public:
  explicit GraphAttentionNetworkImpl(const GraphAttentionOptions& options);

  /// features float32 (n, F), `graph` the input graph's attention edges (a
  /// shared square list over n nodes, self-edges included: NodeGraph::edges);
  /// `distances` the hop distances for a "sac" predictor (int64 (n, n),
  /// edges::hop_distances(graph, max_distance); computed here when undefined).
  /// Returns logits (B, n, classes): B = samples for "sac" in training mode,
  /// else 1.
  torch::Tensor forward(const torch::Tensor& features, const EdgeList& graph,
                        const torch::Tensor& distances = {});

  /// "input+oracle": every node's label (int64 (n), all of them: the oracle
  /// knows what the network is asked), before the first forward().
  void set_labels(const torch::Tensor& labels);

  /// The structure of every row of the last forward() (B lists, each the one
  /// all layers attended over; "full": none, nothing was built).
  const std::vector<EdgeList>& structures() const { return sac_.edges; }
  /// "sac": the last forward's predictor output (models::SacStructures, for
  /// train::sac_reinforce); also holds the structures of the other specs.
  const models::SacStructures& sac_structures() const { return sac_; }
  /// The predictor of a "sac" model (null otherwise).
  nn::EdgePredictor& edge_predictor() { return edge_predictor_; }
  const nn::SacOptions& sac_options() const { return sac_options_; }
  const GraphAttentionOptions& options() const { return options_; }
  int64_t parameter_count() const;

 private:
  /// The structures of a forward over `nodes` (n, width).
  void build_structures(const torch::Tensor& nodes, const EdgeList& graph, const torch::Tensor& distances);

  GraphAttentionOptions options_;
  std::string kind_;  // input | input+random | input+oracle | self | full | sac
  int64_t random_alpha_ = 0;
  uint64_t random_seed_ = 0;  // input+random, input+oracle
  EdgeList oracle_;           // input+oracle: oracle_edges(labels, seed)
  nn::Linear input_{nullptr}, output_{nullptr};
  std::vector<nn::Linear> qkv_;
  nn::EdgePredictor edge_predictor_{nullptr};
  nn::SacOptions sac_options_;
  models::SacStructures sac_;
};
TORCH_MODULE(GraphAttentionNetwork);

}  // namespace attnkit::experiments
