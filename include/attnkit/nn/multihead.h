// Multi-head attention with any attnkit mechanism behind the same projections,
// and the registry that picks a mechanism by name.
#pragma once

#include <attnkit/ops.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <attnkit/nn/dense.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

namespace attnkit::nn {

/// A mechanism and its settings; each mechanism reads only its own fields.
struct MechanismOptions {
  /// One of mechanism_names(): "full", "linear", "causal-linear", "gated-linear",
  /// "clustered", "improved-clustered", or "sparse-<pattern>" with a pattern of
  /// edges::by_name.
  TORCH_ARG(std::string, name) = "full";
  // linear, causal-linear (defaults: the normalised elu form of Katharopoulos et al.)
  TORCH_ARG(FeatureMap, feature_map) = FeatureMap::elu;
  TORCH_ARG(bool, normalize) = true;
  // clustered, improved-clustered (the paper's defaults)
  TORCH_ARG(int64_t, clusters) = 100;
  TORCH_ARG(int64_t, bits) = 63;
  TORCH_ARG(int64_t, iterations) = 10;
  TORCH_ARG(int64_t, topk) = 32;  // improved-clustered only
  TORCH_ARG(int64_t, seed) = 0;
  // sparse-*: span, segment length or stride of the pattern
  TORCH_ARG(int64_t, pattern_param) = 32;
};

/// The names attend() accepts.
std::vector<std::string> mechanism_names();

/// The edges a "sparse-<pattern>" mechanism uses over a self-attention
/// sequence of n nodes. bp-tree and star add nodes of their own: bp-tree over
/// t tokens has n = 2t - 1 nodes and star over t satellites n = t + 1.
EdgeList pattern_edges(const std::string& pattern, int64_t n, int64_t param);

/// q (N,H,L,E), k (N,H,S,E), v (N,H,S,M) -> (N,H,L,M) with the named mechanism.
/// `causal` and `key_lengths` follow ops.h; a mechanism that cannot honour one
/// of them raises an error naming it. Clustered mechanisms use
/// min(clusters, L) clusters and min(topk, S) keys.
torch::Tensor attend(const MechanismOptions& mechanism, const torch::Tensor& q,
                     const torch::Tensor& k, const torch::Tensor& v, bool causal = false,
                     const torch::Tensor& key_lengths = {});

struct MultiheadAttentionOptions {
  MultiheadAttentionOptions(int64_t embed_dim, int64_t heads)
      : embed_dim_(embed_dim), heads_(heads) {}
  TORCH_ARG(int64_t, embed_dim);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(MechanismOptions, mechanism) = {};
};

/// Concat(head_1..head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).
class MultiheadAttentionImpl : public torch::nn::Cloneable<MultiheadAttentionImpl> {
 public:
  explicit MultiheadAttentionImpl(const MultiheadAttentionOptions& options);
  void reset() override;
  /// query (N, L, D), key and value (N, S, D) -> (N, L, D).
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& key,
                        const torch::Tensor& value, const torch::Tensor& key_lengths = {},
                        bool causal = false);

  MultiheadAttentionOptions options;
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
};
TORCH_MODULE(MultiheadAttention);

}  // namespace attnkit::nn
