// Linear attention as a module (the cheap-linear-attention paper and its
// feature-map generalisation; docs/MATH.md, "Linear attention"), and the
// recurrent state that decodes causal linear attention token by token. The
// gated form, GatedLinearAttention, is in attnkit/nn/gated_linear_attention.h,
// included here for the code that found it here.
//
// In MultiheadAttention the same mechanisms are picked by name: "linear" and
// "causal-linear" (their spec options feature_map and normalize) are
// LinearAttention behind the projections.
#pragma once

#include <attnkit/ops.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <attnkit/nn/gated_linear_attention.h>
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

}  // namespace attnkit::nn
