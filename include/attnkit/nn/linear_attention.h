// Linear attention as modules (the cheap-linear-attention paper and its
// feature-map generalisation; docs/MATH.md, "Linear attention" and "Gated
// linear attention"), and the recurrent state that decodes causal linear attention token by token.
//
// In MultiheadAttention the same mechanisms are picked by name: "linear" and
// "causal-linear" (their spec options feature_map and normalize) are
// LinearAttention behind the projections, and "gated-linear" is
// GatedLinearAttention with the key projection as the gate's pre-activation
// and the value projection as the gated state: f = sigmoid(k) * v.
#pragma once

#include <attnkit/ops.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <attnkit/nn/dense.h>
#include <torch/nn/pimpl.h>

namespace attnkit::nn {

struct LinearAttentionStateOptions {
  TORCH_ARG(FeatureMap, feature_map) = FeatureMap::identity;
  TORCH_ARG(bool, normalize) = false;
  TORCH_ARG(double, eps) = 1e-6;
  /// Rotary positions as linear_attention's rotary_dim and rotary_base: step
  /// t turns phi(q_t) and phi(k_t) to position t in the numerator. 0: none.
  TORCH_ARG(int64_t, rotary_dim) = 0;
  TORCH_ARG(double, rotary_base) = 10000.0;
};

/// The recurrent form of causal linear attention for decoding: per key/value
/// head the state S = sum_s phi(k_s) v_s^T (E x M) and z = sum_s phi(k_s) (E),
/// updated by each step in O(E M) whatever the number of tokens so far (with
/// rotary positions S sums the rotated phi(k_s), z the unrotated). The
/// outputs of step() for tokens 0, 1, ... equal linear_attention(q, k, v,
/// causal) on the whole sequence (L = S), up to float rounding. Grouped-query
/// heads: k and v with Hk heads, a divisor of q's H; the state keeps Hk heads
/// and each serves its group of H / Hk query heads. Dtype-generic; steps are
/// differentiable (autograd records them) when their inputs require grad.
class LinearAttentionState {
 public:
  explicit LinearAttentionState(const LinearAttentionStateOptions& options = {});

  /// q (N, H, E), k (N, Hk, E), v (N, Hk, M) of the next token -> (N, H, M):
  /// its attention over every token stepped so far, itself included. Every
  /// step must keep the first step's N, H, Hk, E, M and dtype.
  torch::Tensor step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

  /// Forgets every token (the next step starts a new sequence, of any shape).
  void reset();

  int64_t steps() const { return steps_; }
  /// S (N, Hk, E, M) and z (N, Hk, E); undefined before the first step.
  const torch::Tensor& sum_kv() const { return S_; }
  const torch::Tensor& sum_k() const { return z_; }
  const LinearAttentionStateOptions& options() const { return options_; }

 private:
  LinearAttentionStateOptions options_;
  torch::Tensor S_, z_;
  int64_t heads_ = 0;  // q's H of the first step
  int64_t steps_ = 0;
};

/// The module's options are the op's (libtorch's idiom when a module adds
/// nothing to its functional form, e.g. torch::nn::functional::DropoutFuncOptions),
/// defaults included: the identity map without normaliser. The registry's
/// "linear" mechanism (MultiheadAttention, attnkit bench) defaults instead to
/// the normalised elu form of Katharopoulos et al.: "linear:feature_map=elu,normalize=true".
using LinearAttentionOptions = attnkit::LinearAttentionFuncOptions;

/// Linear attention without parameters, (N, H, L, E) queries, (N, H, S, E)
/// keys, (N, H, S, M) values -> (N, H, L, M): linear_attention with these options.
class LinearAttentionImpl : public torch::nn::Cloneable<LinearAttentionImpl> {
 public:
  explicit LinearAttentionImpl(const LinearAttentionOptions& options = {});
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
  /// A decoding state with this module's feature map, normaliser and eps.
  LinearAttentionState state() const;

  LinearAttentionOptions options;
};
TORCH_MODULE(LinearAttention);

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
