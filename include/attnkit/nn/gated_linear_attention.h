// The cheap-linear-attention paper's gated linear attention as a module (docs/MATH.md, "Gated
// linear attention"). In MultiheadAttention it is "gated-linear": the key projection is the
// gate's pre-activation and the value projection the gated state, f = sigmoid(k) * v.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <attnkit/nn/dense.h>
#include <torch/nn/pimpl.h>

namespace attnkit::nn {

struct GatedLinearAttentionOptions {
  explicit GatedLinearAttentionOptions(int64_t dim) : dim_(dim) {}
  /// The paper's k: size of the hidden states and of the queries.
  TORCH_ARG(int64_t, dim);
};

/// The gated linear attention of the cheap-linear-attention paper: the
/// document's hidden states h_t are gated, f_t = sigmoid(W h_t + b) * h_t, and
/// summed into C = sum_t f_t f_t^T (all t, or t <= i + n - m for query i when
/// causal); query q reads C q. With the paper's alpha = beta = 1 the recurrence
/// C_t = C_{t-1} + f_t f_t^T is linear attention with keys = values = f
/// (identity map, no normaliser), computed so here; that also lets the number of
/// queries m differ from the document length n. General gates alpha_t, beta_t:
/// gated_linear_attention. For a persistent document representation append
/// features(h) to a DocumentMemory.
class GatedLinearAttentionImpl : public torch::nn::Cloneable<GatedLinearAttentionImpl> {
 public:
  explicit GatedLinearAttentionImpl(const GatedLinearAttentionOptions& options);
  void reset() override;
  /// f = sigmoid(W h + b) * h for hidden states (..., dim).
  torch::Tensor features(const torch::Tensor& hidden);
  /// hidden (N, n, dim), queries (N, m, dim) -> (N, m, dim).
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& queries,
                        bool causal = false);

  GatedLinearAttentionOptions options;
  Linear gate{nullptr};  // W, b
};
TORCH_MODULE(GatedLinearAttention);

}  // namespace attnkit::nn
