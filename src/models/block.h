// One transformer block: self-attention (any mechanism of the registry behind
// multi-head projections, Shaw's relative-position attention, or an
// agglomerative-attention layer), cross-attention in an encoder-decoder's
// decoder, and the position-wise feed-forward network (relu or SwiGLU), each
// sub-layer with its residual connection, normalisation (layer norm or
// RMSNorm) and dropout. Internal to src/models.
#pragma once

#include <attnkit/models/transformer.h>
#include <attnkit/nn/decoding.h>
#include <attnkit/nn/registry.h>
#include <attnkit/nn/sac.h>

#include <memory>
#include <string>

namespace attnkit::models {

/// The normalisation over the last dimension (TransformerOptions::normalization):
/// layer norm with torch::nn::LayerNorm's parameters, names and eps (weight,
/// and bias unless the model has none), or RMSNorm, x / sqrt(mean(x^2) + 1e-6)
/// times weight, computed in float32 for 16-bit inputs (as layer norm is).
class FeatureNormImpl : public torch::nn::Module {
 public:
  FeatureNormImpl(int64_t width, Normalization kind, bool bias);
  torch::Tensor forward(const torch::Tensor& x);

  static constexpr double kLayerEps = 1e-5;  // torch::nn::LayerNorm's default
  static constexpr double kRmsEps = 1e-6;    // LLaMA's
  torch::Tensor weight, bias;                // bias: layer norm with biases only

 private:
  Normalization kind_;
};
TORCH_MODULE(FeatureNorm);

/// What one block carries from one decoded token to the next.
struct BlockState {
  int64_t position = 0;
  std::unique_ptr<nn::CausalState> self;    // multi-head blocks
  bool self_rotates = false;                // `self` applies the rotary positions itself
  nn::KeyValueCache relative;               // relative-position blocks
  nn::AgglomerativeState agglomerative;     // agglomerative blocks
  torch::Tensor cross_keys, cross_values;   // (N, H or kv heads, S, dh): the projected encoder output
  torch::Tensor memory_lengths;
};

class TransformerBlockImpl : public torch::nn::Module {
 public:
  enum class Kind { multihead, relative, agglomerative };

  /// `causal`: a decoder block (self-attention sees no later position);
  /// `cross`: with cross-attention over an encoder's output.
  TransformerBlockImpl(const TransformerOptions& options, const std::string& spec, bool causal,
                       bool cross);

  /// x (N, L, d) -> (N, L, d). key_lengths: padding of x (encoder blocks);
  /// memory (N, S, d) and memory_lengths: the encoder output (cross blocks).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& key_lengths = {},
                        const torch::Tensor& memory = {}, const torch::Tensor& memory_lengths = {});

  /// A fresh decoding state (the encoder output projected once for cross blocks).
  std::unique_ptr<BlockState> start_decoding(const torch::Tensor& memory,
                                             const torch::Tensor& memory_lengths);
  /// x_t (N, d) at the state's next position -> (N, d).
  torch::Tensor step(const torch::Tensor& x_t, BlockState& state);

  /// Another self-attention behind the same projections (multi-head blocks).
  void set_attention(const std::string& spec);
  Kind kind() const { return kind_; }
  /// True when the self-attention is "sac" (its structures come from the model).
  bool uses_sac() const { return sac_ != nullptr; }
  /// SAC blocks: the structures of the next forward calls, one per sequence.
  void set_structures(const std::vector<EdgeList>& structures) {
    if (sac_) sac_->set_structures(structures);
  }
  /// Multi-head blocks: the self-attention's probe (nn::MultiheadAttentionImpl::probe);
  /// other kinds ignore it.
  void set_self_attention_probe(
      std::function<void(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)> probe) {
    if (kind_ == Kind::multihead) self_->probe = std::move(probe);
  }

 private:
  torch::Tensor self_attention(const torch::Tensor& h, const torch::Tensor& key_lengths);
  torch::Tensor self_attention_step(const torch::Tensor& h_t, BlockState& state);
  torch::Tensor cross_attention_step(const torch::Tensor& h_t, BlockState& state);
  torch::Tensor feed_forward(const torch::Tensor& h);
  /// The residual sub-layer: x + drop(f(LN(x))) pre-norm, LN(x + drop(f(x))) post-norm.
  template <typename F>
  torch::Tensor sublayer(const torch::Tensor& x, FeatureNorm& norm, F&& f);

  TransformerOptions options_;
  bool causal_;
  Kind kind_;
  std::string spec_;
  const nn::MechanismInfo* info_ = nullptr;
  nn::MultiheadAttention self_{nullptr}, cross_{nullptr};
  nn::SacAttentionImpl* sac_ = nullptr;  // self_'s mechanism when it is "sac"
  nn::RelativePositionAttention relative_{nullptr};
  nn::AgglomerativeAttention agglomerative_{nullptr};
  nn::Linear ff1_{nullptr}, ff2_{nullptr}, ff3_{nullptr};  // ff3: SwiGLU's second input projection
  FeatureNorm norm_self_{nullptr}, norm_cross_{nullptr}, norm_ff_{nullptr};
};

}  // namespace attnkit::models
