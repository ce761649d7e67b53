// Multi-head attention with any mechanism of the registry (nn/registry.h)
// behind the same projections.
#pragma once

#include <attnkit/nn/registry.h>
#include <attnkit/ops.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <attnkit/nn/dense.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <string>
#include <vector>

namespace attnkit::nn {

struct MultiheadAttentionOptions {
  MultiheadAttentionOptions(int64_t width, int64_t heads)
      : width_(width), heads_(heads) {}
  TORCH_ARG(int64_t, width);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(bool, bias) = true;
  /// The mechanism behind the projections, as a registry spec string
  /// (nn/registry.h), e.g. "improved-clustered:clusters=25,topk=32".
  TORCH_ARG(std::string, attention) = "full";
};

/// Concat(head_1..head_h) W^O with head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).
class MultiheadAttentionImpl : public torch::nn::Cloneable<MultiheadAttentionImpl> {
 public:
  explicit MultiheadAttentionImpl(const MultiheadAttentionOptions& options);
  void reset() override;
  /// Cloneable's copy of the parameters, plus a deep copy of the current
  /// mechanism (also one swapped in with set_attention) and its state.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override;
  /// Swaps the mechanism behind the same projections (e.g. into a trained
  /// model): updates options.attention and the `attention` submodule.
  void set_attention(const std::string& spec);
  /// query (N, L, D), key and value (N, S, D) -> (N, L, D).
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& key,
                        const torch::Tensor& value, const torch::Tensor& key_lengths = {},
                        bool causal = false);

  MultiheadAttentionOptions options;
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  /// When set, forward() first hands it the per-head inputs of the mechanism,
  /// q (N, H, L, D/H), k and v (N, H, S, D/H) (strided views, part of the
  /// autograd graph): to study what a trained model's attention sees (e.g.
  /// `attnkit approx --run`). Not part of the module's state; not cloned.
  std::function<void(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v)> probe;
  /// The registry's module for options.attention (registered as "attention",
  /// so a mechanism's state, e.g. clustered attention's seed counter, is in
  /// the state_dict).
  std::shared_ptr<MechanismImpl> attention;
};
TORCH_MODULE(MultiheadAttention);

}  // namespace attnkit::nn
