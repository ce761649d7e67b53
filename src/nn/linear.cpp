// Linear attention modules and the decoding state (docs/MATH.md, "Linear
// attention" and "Gated linear attention").
#include <attnkit/nn/linear.h>

#include "base/checks.h"

namespace attnkit::nn {

namespace {

torch::Tensor feature_map(const torch::Tensor& x, FeatureMap map) {
  return map == FeatureMap::elu ? torch::elu(x) + 1 : x;
}

/// q (N, H, E), k (N, H, E), v (N, H, M): ranks, dtypes, matching sizes.
void check_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  constexpr const char* where = "LinearAttentionState::step";
  detail::check_float_tensor(where, "q", q, 3);
  detail::check_float_tensor(where, "k", k, 3);
  detail::check_float_tensor(where, "v", v, 3);
  detail::check_same_dtype(where, "k", k, "q", q);
  detail::check_same_dtype(where, "v", v, "q", q);
  for (int64_t d = 0; d < 2; ++d) {
    const char* what = d == 0 ? "batch size N" : "head count H";
    detail::check_dim(where, "k", k, d, q.size(d), what);
    detail::check_dim(where, "v", v, d, q.size(d), what);
  }
  detail::check_dim(where, "k", k, 2, q.size(2), "feature size E");
}

}  // namespace

// --- LinearAttentionState ----------------------------------------------------------

LinearAttentionState::LinearAttentionState(const LinearAttentionStateOptions& options)
    : options_(options) {
  detail::check_finite("LinearAttentionState", "eps", options.eps());
  TORCH_CHECK(options.eps() >= 0, "LinearAttentionState: option 'eps' must be >= 0, got ",
              options.eps());
}

torch::Tensor LinearAttentionState::step(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v) {
  check_step(q, k, v);
  if (steps_ > 0) {
    const auto want = S_.sizes();  // (N, H, E, M)
    TORCH_CHECK(q.size(0) == want[0] && q.size(1) == want[1] && q.size(2) == want[2] &&
                    v.size(2) == want[3] && q.scalar_type() == S_.scalar_type(),
                "LinearAttentionState::step: this state holds (N, H, E, M) = ",
                detail::shape_str(S_), " in ", S_.scalar_type(), ", got q ", detail::shape_str(q),
                " and v ", detail::shape_str(v), " in ", q.scalar_type(), " (reset() starts anew)");
  }
  const auto fq = feature_map(q, options_.feature_map());
  const auto fk = feature_map(k, options_.feature_map());
  const auto kv = fk.unsqueeze(-1) * v.unsqueeze(-2);  // phi(k) v^T: (N, H, E, M)
  S_ = steps_ > 0 ? S_ + kv : kv;
  ++steps_;
  auto out = torch::matmul(fq.unsqueeze(-2), S_).squeeze(-2);  // phi(q)^T S: (N, H, M)
  if (!options_.normalize()) return out;
  z_ = steps_ > 1 ? z_ + fk : fk;
  return out / ((fq * z_).sum(-1, /*keepdim=*/true) + options_.eps());
}

void LinearAttentionState::reset() {
  S_ = torch::Tensor();
  z_ = torch::Tensor();
  steps_ = 0;
}

// --- LinearAttention ----------------------------------------------------------------

LinearAttentionImpl::LinearAttentionImpl(const LinearAttentionOptions& options_)
    : options(options_) {}

torch::Tensor LinearAttentionImpl::forward(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v) {
  return linear_attention(q, k, v, options);
}

LinearAttentionState LinearAttentionImpl::state() const {
  return LinearAttentionState(LinearAttentionStateOptions()
                                  .feature_map(options.feature_map())
                                  .normalize(options.normalize())
                                  .eps(options.eps()));
}

// --- GatedLinearAttention -----------------------------------------------------------

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
