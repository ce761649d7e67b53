// Clustered and improved-clustered attention (the clustered-attention paper;
// docs/MATH.md, "Clustered attention") as a module, so that it can be swapped
// into a model in place of exact attention.
//
// The module has no parameters: it maps q (N, H, L, E), k (N, H, S, E) and
// v (N, H, S, M) to (N, H, L, M) with attnkit::clustered_attention. It adapts
// the options to each call's shapes: min(clusters, L) clusters and
// min(topk, S) top keys, so one module serves sequences of any length.
//
// Seeds. The hashing planes and the K-means initialisation come from a seed.
// By default (advance_seed(true)) forward calls in training mode use seed,
// seed + 1, seed + 2, ... (fresh planes per step, as the authors' code draws
// them) and calls in eval mode use seed; with advance_seed(false) every call
// uses options.seed(), so the same inputs always give the same output. The
// count of training-mode calls is the buffer `calls`, saved and loaded
// with the module's state, so a resumed run continues the sequence. With
// advance_seed, concurrent training-mode calls of one module race on `calls`:
// give each thread its own module (clone()).
#pragma once

#include <attnkit/ops.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace attnkit::nn {

/// The settings of attnkit::ClusteredAttentionFuncOptions that do not depend on
/// the call (their defaults are the op's), plus the seed policy.
struct ClusteredAttentionOptions {
  TORCH_ARG(int64_t, clusters) = ClusteredAttentionFuncOptions().clusters();
  TORCH_ARG(int64_t, bits) = ClusteredAttentionFuncOptions().bits();
  TORCH_ARG(int64_t, iterations) = ClusteredAttentionFuncOptions().iterations();
  /// 0: plain clustered attention; > 0: improved clustered with this many keys.
  TORCH_ARG(int64_t, topk) = ClusteredAttentionFuncOptions().topk();
  TORCH_ARG(bool, hash_bias) = ClusteredAttentionFuncOptions().hash_bias();
  TORCH_ARG(int64_t, seed) = ClusteredAttentionFuncOptions().seed();
  /// Multiplies q k^T; unset means 1 / sqrt(E).
  TORCH_ARG(c10::optional<double>, scale) = ClusteredAttentionFuncOptions().scale();
  /// Training-mode calls use seed + (number of earlier training-mode calls):
  /// fresh hyperplanes at every training step, as the paper's implementation
  /// draws them, so that no query grouping is fixed for a whole run. On by
  /// default, here and in the registry's clustered mechanisms alike (one
  /// default); eval-mode calls always use `seed`, so evaluation is repeatable.
  TORCH_ARG(bool, advance_seed) = true;
};

class ClusteredAttentionImpl : public torch::nn::Cloneable<ClusteredAttentionImpl> {
 public:
  explicit ClusteredAttentionImpl(const ClusteredAttentionOptions& options = {});
  /// Checks the options and (re)registers the `calls` buffer at 0.
  void reset() override;

  /// key_lengths and query_lengths: optional int64 (N), as in ops.h; padded
  /// queries output zeros.
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& key_lengths = {},
                        const torch::Tensor& query_lengths = {});

  /// The seed the next forward call will use.
  int64_t next_seed() const;

  void pretty_print(std::ostream& stream) const override;

  ClusteredAttentionOptions options;
  torch::Tensor calls;  // int64 scalar buffer: training-mode calls so far
};
TORCH_MODULE(ClusteredAttention);

}  // namespace attnkit::nn
