// The LinearAttention module and the decoding state (docs/MATH.md, "Linear
// attention"); GatedLinearAttention is in gated_linear_attention.cpp.
#include <attnkit/nn/linear_attention.h>

#include "ops/checks.h"

namespace attnkit::nn {

namespace {

torch::Tensor feature_map(const torch::Tensor& x, FeatureMap map) {
  return map == FeatureMap::elu ? torch::elu(x) + 1 : x;
}

/// q (N, H, E), k (N, Hk, E), v (N, Hk, M): ranks, dtypes, matching sizes,
/// Hk dividing H.
void check_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  constexpr const char* where = "LinearAttentionState::step";
  detail::check_float_tensor(where, "q", q, 3);
  detail::check_float_tensor(where, "k", k, 3);
  detail::check_float_tensor(where, "v", v, 3);
  detail::check_same_dtype(where, "k", k, "q", q);
  detail::check_same_dtype(where, "v", v, "q", q);
  detail::check_dim(where, "k", k, 0, q.size(0), "batch size N");
  detail::check_dim(where, "v", v, 0, q.size(0), "batch size N");
  const int64_t H = q.size(1), Hk = k.size(1);
  TORCH_CHECK(Hk == H || (Hk > 0 && H % Hk == 0), where, ": argument 'k' has head count ", Hk,
              ", which must divide q's head count ", H, " (grouped-query heads)");
  detail::check_dim(where, "v", v, 1, Hk, "head count (k's)");
  detail::check_dim(where, "k", k, 2, q.size(2), "feature size E");
}

/// Rows x (N, H, E) turned to `position` (RoPE's rotate-half pairs).
torch::Tensor rotate(const torch::Tensor& x, const LinearAttentionStateOptions& o, int64_t position) {
  return rotary_embedding(x.unsqueeze(2), RotaryEmbeddingFuncOptions(o.rotary_dim()).base(o.rotary_base()).offset(position))
      .squeeze(2);
}

}  // namespace

// --- LinearAttentionState ----------------------------------------------------------

LinearAttentionState::LinearAttentionState(const LinearAttentionStateOptions& options)
    : options_(options) {
  detail::check_finite("LinearAttentionState", "eps", options.eps());
  TORCH_CHECK(options.eps() >= 0, "LinearAttentionState: option 'eps' must be >= 0, got ",
              options.eps());
  TORCH_CHECK(options.rotary_dim() >= 0, "LinearAttentionState: option 'rotary_dim' must be >= 0, got ",
              options.rotary_dim());
}

torch::Tensor LinearAttentionState::step(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v) {
  check_step(q, k, v);
  if (steps_ > 0) {
    const auto want = S_.sizes();  // (N, Hk, E, M)
    TORCH_CHECK(q.size(0) == want[0] && q.size(1) == heads_ && k.size(1) == want[1] && q.size(2) == want[2] &&
                    v.size(2) == want[3] && q.scalar_type() == S_.scalar_type(),
                "LinearAttentionState::step: this state holds (N, Hk, E, M) = ", detail::shape_str(S_),
                " for ", heads_, " query heads in ", S_.scalar_type(), ", got q ", detail::shape_str(q), ", k ",
                detail::shape_str(k), " and v ", detail::shape_str(v), " in ", q.scalar_type(),
                " (reset() starts anew)");
  }
  const int64_t N = q.size(0), H = q.size(1), Hk = k.size(1), E = q.size(2), M = v.size(2);
  const int64_t G = H / std::max<int64_t>(Hk, 1);  // query heads per key/value head
  const auto fq = feature_map(q, options_.feature_map());
  const auto fk = feature_map(k, options_.feature_map());
  // Rotary positions: the numerator's features turned to this step's position.
  const bool rotary = options_.rotary_dim() > 0;
  const auto rq = rotary ? rotate(fq, options_, steps_) : fq;
  const auto rk = rotary ? rotate(fk, options_, steps_) : fk;
  const auto kv = rk.unsqueeze(-1) * v.unsqueeze(-2);  // phi(k) v^T: (N, Hk, E, M)
  S_ = steps_ > 0 ? S_ + kv : kv;
  heads_ = H;
  ++steps_;
  // Each key/value head's state read by its group's query heads: (N, Hk, H / Hk, E).
  auto out = torch::matmul(rq.reshape({N, Hk, G, E}), S_).reshape({N, H, M});
  if (!options_.normalize()) return out;
  z_ = steps_ > 1 ? z_ + fk : fk;
  const auto den = (fq.reshape({N, Hk, G, E}) * z_.unsqueeze(2)).sum(-1).reshape({N, H, 1});
  return out / (den + options_.eps());
}

void LinearAttentionState::reset() {
  S_ = torch::Tensor();
  z_ = torch::Tensor();
  heads_ = 0;
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
                                  .eps(options.eps())
                                  .rotary_dim(options.rotary_dim())
                                  .rotary_base(options.rotary_base()));
}

}  // namespace attnkit::nn
