// The GatedLinearAttention module (docs/MATH.md, "Gated linear attention"):
// the gate f = sigmoid(W h + b) * h, then linear attention with keys = values = f.
#include <attnkit/nn/gated_linear_attention.h>

#include <attnkit/ops.h>

#include "ops/checks.h"

namespace attnkit::nn {

GatedLinearAttentionImpl::GatedLinearAttentionImpl(const GatedLinearAttentionOptions& options_)
    : options(options_) {
  reset();
}

void GatedLinearAttentionImpl::reset() {
  TORCH_CHECK(options.dim() > 0, "GatedLinearAttention: option 'dim' must be positive, got ",
              options.dim());
  gate = register_module("gate", Linear(options.dim(), options.dim()));
}

torch::Tensor GatedLinearAttentionImpl::features(const torch::Tensor& hidden) {
  return torch::sigmoid(gate(hidden)) * hidden;
}

torch::Tensor GatedLinearAttentionImpl::forward(const torch::Tensor& hidden,
                                                const torch::Tensor& queries, bool causal) {
  constexpr const char* module = "GatedLinearAttention";
  detail::check_float_tensor(module, "hidden", hidden, 3);
  detail::check_float_tensor(module, "queries", queries, 3);
  detail::check_parameter_dtype(module, "hidden", hidden, gate->weight);
  detail::check_same_dtype(module, "queries", queries, "hidden", hidden);
  detail::check_dim(module, "hidden", hidden, 2, options.dim(), "feature size dim");
  detail::check_dim(module, "queries", queries, 2, options.dim(), "feature size dim");
  detail::check_dim(module, "queries", queries, 0, hidden.size(0), "batch size N");
  // One head: (N, T, dim) -> (N, 1, T, dim).
  const auto f = features(hidden).unsqueeze(1);
  return linear_attention(queries.unsqueeze(1), f, f, LinearAttentionFuncOptions().causal(causal))
      .squeeze(1);
}

}  // namespace attnkit::nn
