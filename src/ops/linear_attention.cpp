// Op boundaries of linear and gated linear attention.
#include "ops/checks.h"
#include "reference/reference.h"

namespace attnkit {

FeatureMap feature_map_from_string(const std::string& name) {
  if (name == "identity") return FeatureMap::identity;
  if (name == "elu") return FeatureMap::elu;
  TORCH_CHECK(false, "linear_attention: option 'feature_map' must be 'identity' or 'elu', got '",
              name, "'");
}

std::string to_string(FeatureMap map) { return map == FeatureMap::elu ? "elu" : "identity"; }

torch::Tensor linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const LinearAttentionOptions& options) {
  constexpr const char* op = "linear_attention";
  detail::check_qkv(op, q, k, v);
  detail::check_finite(op, "eps", options.eps());
  TORCH_CHECK(options.eps() >= 0, op, ": option 'eps' must be >= 0, got ", options.eps());
  return reference::linear_attention(q, k, v, options);
}

torch::Tensor gated_linear_attention(const torch::Tensor& f, const torch::Tensor& q,
                                     const torch::Tensor& alpha, const torch::Tensor& beta,
                                     const GatedLinearAttentionOptions& options) {
  constexpr const char* op = "gated_linear_attention";
  detail::check_float_tensor(op, "f", f, 4);
  detail::check_float_tensor(op, "q", q, 4);
  detail::check_float_tensor(op, "alpha", alpha, 3);
  detail::check_float_tensor(op, "beta", beta, 3);
  detail::check_same_dtype(op, "q", q, f);
  detail::check_same_dtype(op, "alpha", alpha, f);
  detail::check_same_dtype(op, "beta", beta, f);
  TORCH_CHECK(q.sizes() == f.sizes(), op, ": argument 'q' must have the shape of 'f' ",
              detail::shape_str(f), ", got ", detail::shape_str(q));
  const auto nhl = f.sizes().slice(0, 3);
  TORCH_CHECK(alpha.sizes() == nhl, op, ": argument 'alpha' must have shape (N, H, L) = ",
              detail::shape_str(f.select(3, 0)), ", got ", detail::shape_str(alpha));
  TORCH_CHECK(beta.sizes() == nhl, op, ": argument 'beta' must have shape (N, H, L) = ",
              detail::shape_str(f.select(3, 0)), ", got ", detail::shape_str(beta));
  return reference::gated_linear_attention(f, q, alpha, beta, options);
}

}  // namespace attnkit
