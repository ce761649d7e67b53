// Agglomerative attention layer (the agglomerative-attention paper; docs/MATH.md,
// "Agglomerative attention") and its streaming state for causal decoding.
//
// m classes over a model width d (d divisible by m). No query/key/value
// projections: the inputs feed two classifiers and the value projection P.
//   c^q = softmax(x_query W^q + b^q),  c^r = softmax(x_ref W^r + b^r)   (W: d x m)
//   class k averages the projected reference rows x_t P^k, P^k the k-th block
//   of d/m columns of P, weighted by c^r_tk: over all t (full) or over the
//   prefix t <= i + S - L (causal), dividing by max(sum c^r_tk, 1e-3);
//   p_i = concat_k(c^q_ik a^k_i),  out = dropout(p) Q   (Q: d x d, no bias).
// The averaging is attnkit::agglomerative_attention with H = m heads, so the
// layer runs in O(L d^2) time (the projections) and O(L d) memory.
#pragma once

#include <ATen/core/Generator.h>
#include <attnkit/ops.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace attnkit::nn {

struct AgglomerativeAttentionOptions {
  AgglomerativeAttentionOptions(int64_t width, int64_t classes)
      : width_(width), classes_(classes) {}
  /// Model width d; a multiple of `classes`.
  TORCH_ARG(int64_t, width);
  /// Class count m (the paper uses 8).
  TORCH_ARG(int64_t, classes);
  /// Lower bound of a class's weight sum, the op's option of the same name
  /// (AgglomerativeAttentionFuncOptions::clip in attnkit/ops.h, its default),
  /// in forward() and step() alike.
  TORCH_ARG(double, clip) = 1e-3;
  /// Attention dropout: in training, each element of p is zeroed with this
  /// probability and the rest are scaled by 1 / (1 - dropout).
  TORCH_ARG(double, dropout) = 0.0;
  /// Draws the dropout masks; unset means torch's default generator.
  TORCH_ARG(c10::optional<at::Generator>, generator) = c10::nullopt;
};

/// Causal self-attention state after t tokens: per class k the sums
/// sum_{s<=t} c^r_sk x_s P^k and sum_{s<=t} c^r_sk. A default-constructed state
/// is the empty prefix; the first step() sizes it to the batch.
struct AgglomerativeState {
  torch::Tensor sums;    // (N, m, d/m)
  torch::Tensor counts;  // (N, m)
};

class AgglomerativeAttentionImpl : public torch::nn::Cloneable<AgglomerativeAttentionImpl> {
 public:
  explicit AgglomerativeAttentionImpl(const AgglomerativeAttentionOptions& options);
  /// Glorot-uniform W^q, W^r, P and Q (the Keras default of the authors' code),
  /// zero biases.
  void reset() override;

  /// x_query (N, L, d) and x_ref (N, S, d) -> (N, L, d). An undefined x_ref
  /// means self-attention (x_ref = x_query). `causal`: query i averages the
  /// reference rows t <= i + S - L (the paper's masked form).
  torch::Tensor forward(const torch::Tensor& x_query, const torch::Tensor& x_ref = {},
                        bool causal = false);

  /// One token of causal self-attention: x_t (N, d) -> (N, d), updating
  /// `state`. Fed x[:, 0], x[:, 1], ... from an empty state, it returns
  /// forward(x, {}, true)[:, t] in turn, in O(d^2) per token. The state is an
  /// argument rather than a member so that one module can decode many streams.
  torch::Tensor step(const torch::Tensor& x_t, AgglomerativeState& state);

  AgglomerativeAttentionOptions options;
  torch::Tensor W_q, b_q;  // query classifier (d, m), (m)
  torch::Tensor W_r, b_r;  // reference classifier (d, m), (m)
  torch::Tensor P;         // value projection (d, d); class k uses columns [k d/m, (k+1) d/m)
  torch::Tensor Q;         // output projection (d, d)

 private:
  torch::Tensor dropout(const torch::Tensor& p);
};
TORCH_MODULE(AgglomerativeAttention);

}  // namespace attnkit::nn
