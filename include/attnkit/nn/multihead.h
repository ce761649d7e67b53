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
  /// Key/value heads (grouped-query attention; 1: multi-query): a divisor of
  /// heads, each key/value head serving heads / kv_heads query heads; k_proj
  /// and v_proj then have kv_heads * width / heads outputs. 0: as many as heads.
  TORCH_ARG(int64_t, kv_heads) = 0;
  TORCH_ARG(bool, bias) = true;
  /// ALiBi: the mechanism (one with MechanismSupports::alibi) penalises each
  /// head's scores by slope_h times the query-key distance, with the paper's
  /// slopes (attnkit::alibi_slopes(heads)).
  TORCH_ARG(bool, alibi) = false;
  /// Rotary positions (RoPE): the first rotary_dim entries (even, at most
  /// width / heads) of each head's queries and keys turned to their
  /// positions (query i of L at i + S - L, key j at j: ops.h
  /// rotary_embedding), inside the kernel for a mechanism that rotates
  /// (RotarySupport::kernel), else on q and k before the call
  /// (RotarySupport::inputs). 0: none.
  TORCH_ARG(int64_t, rotary_dim) = 0;
  TORCH_ARG(double, rotary_base) = 10000.0;
  /// Attention dropout on the attention weights, in training only
  /// (is_training()), inside the kernel of a mechanism that takes it
  /// (MechanismSupports::dropout: "full"); in [0, 1). 0: none.
  TORCH_ARG(double, dropout) = 0.0;
  /// The mechanism behind the projections, as a registry spec string
  /// (nn/registry.h), e.g. "improved-clustered:clusters=25,topk=32".
  TORCH_ARG(std::string, attention) = "full";
};

/// Concat(head_1..head_h) W^O with head_i = Attention(Q W_i^Q, K W_g^K, V W_g^V),
/// g = i for full heads, g = floor(i / (heads / kv_heads)) for grouped ones.
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

  /// The attention weights P of forward(query, key, value, key_lengths,
  /// causal): (N, heads, L, S), or their mean over the heads (N, L, S) when
  /// `average` (torch.nn.MultiheadAttention's need_weights and
  /// average_attn_weights). The same projections, positions, masks and
  /// mechanism options (a window, ALiBi, rotary) as forward, rows with no
  /// visible key all zeros, the weights before attention dropout;
  /// differentiable. Only an exact mechanism (MechanismInfo::exact) forms
  /// them: any other is refused. Costs an (N, heads, L, S) tensor.
  torch::Tensor attention_weights(const torch::Tensor& query, const torch::Tensor& key,
                                  const torch::Tensor& key_lengths = {}, bool causal = false,
                                  bool average = true);

  /// options.kv_heads, or heads when it is 0.
  int64_t kv_head_count() const;
  /// ALiBi's slopes (float32 (heads)) when options.alibi, else undefined.
  const torch::Tensor& alibi_slopes() const { return alibi_slopes_; }
  /// Per-head rows x (N, heads, T, width / heads) turned to the positions
  /// offset + t by the module's rotary positions; x itself when it has none.
  /// Decoding rotates each step's query and key with it (offset: the step's
  /// position), so that a cache holds rotated keys.
  torch::Tensor rotate(const torch::Tensor& x, int64_t offset) const;
  /// Projected keys or values with kv_head_count() heads along `head_dim`, as
  /// the mechanism takes them: unchanged when it reads grouped heads
  /// (MechanismSupports::grouped_heads), else each head repeated over its
  /// group (query head h reads copy h). Decoding and cross-attention states
  /// pass theirs through it too.
  torch::Tensor for_mechanism(const torch::Tensor& kv, int64_t head_dim = 1) const;

  MultiheadAttentionOptions options;
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  /// When set, forward() first hands it the per-head inputs of the mechanism,
  /// q (N, H, L, D/H), k and v (N, H, S, D/H) (with rotary positions q and k
  /// rotated, also when the kernel would rotate them; strided views, part of the
  /// autograd graph; with grouped heads k and v as for_mechanism gives them,
  /// kv_heads heads when the mechanism reads groups): to study what a trained model's attention sees (e.g.
  /// `attnkit approx --run`). Not part of the module's state; not cloned.
  std::function<void(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v)> probe;
  /// The registry's module for options.attention (registered as "attention",
  /// so a mechanism's state, e.g. clustered attention's seed counter, is in
  /// the state_dict).
  std::shared_ptr<MechanismImpl> attention;

 private:
  /// forward's per-head queries and keys as the mechanism takes them (checked,
  /// projected, rotated unless its kernel rotates them, keys as for_mechanism
  /// gives them) and its arguments; `what` names the caller in errors.
  struct Heads {
    torch::Tensor q, k;
    AttendArgs args;
  };
  Heads queries_and_keys(const char* what, const torch::Tensor& query, const torch::Tensor& key,
                         const torch::Tensor& key_lengths, bool causal);

  bool mechanism_reads_groups_ = false;  // attention's MechanismSupports::grouped_heads
  bool mechanism_rotates_ = false;       // attention's RotarySupport::kernel
  torch::Tensor alibi_slopes_;           // constants, not state: made from options
};
TORCH_MODULE(MultiheadAttention);

}  // namespace attnkit::nn
