// Op boundaries of linear and gated linear attention: validation, then the
// backend that <op>_dispatch names: float32 through the kernels of
// src/kernels/linear_attention (as autograd Functions, so C++ and Python
// callers get the kernels' backward), other dtypes through the composite.
#include "kernels/gated_linear_attention.h"
#include "kernels/linear_attention.h"

#include "base/checks.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/dispatch_util.h"
#include "ops/head_features.h"
#include "ops/varlen.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;


kernels::FeatureMapKind kernel_feature_map(FeatureMap map) {
  return map == FeatureMap::elu ? kernels::FeatureMapKind::elu : kernels::FeatureMapKind::identity;
}

/// Kernel parameters over q, k, v, out and den (undefined unless normalize).
kernels::LinearAttentionBackwardParams linear_params(const torch::Tensor& q, const torch::Tensor& k,
                                                     const torch::Tensor& v, torch::Tensor& out,
                                                     torch::Tensor& den,
                                                     const LinearAttentionFuncOptions& o) {
  kernels::LinearAttentionBackwardParams p;
  detail::bind_qkv(p, q, k, v, out);
  // Grouped-query heads: the kernel reads each key/value head for its group.
  p.kv_group = detail::kv_group(q, k);
  p.den = den.defined() ? den.data_ptr<float>() : nullptr;
  p.feature_map = kernel_feature_map(o.feature_map());
  p.normalize = o.normalize();
  p.causal = o.causal();
  p.eps = static_cast<float>(o.eps());
  p.rotary_dim = o.rotary_dim();
  p.rotary_base = o.rotary_base();
  return p;
}

/// The options as saved_data, read back by options_from.
void save_options(AutogradContext* ctx, const LinearAttentionFuncOptions& o) {
  ctx->saved_data["elu"] = o.feature_map() == FeatureMap::elu;
  ctx->saved_data["normalize"] = o.normalize();
  ctx->saved_data["causal"] = o.causal();
  ctx->saved_data["eps"] = o.eps();
  ctx->saved_data["rotary_dim"] = o.rotary_dim();
  ctx->saved_data["rotary_base"] = o.rotary_base();
}

LinearAttentionFuncOptions options_from(const AutogradContext* ctx) {
  const auto& d = ctx->saved_data;
  return LinearAttentionFuncOptions()
      .feature_map(d.at("elu").toBool() ? FeatureMap::elu : FeatureMap::identity)
      .normalize(d.at("normalize").toBool())
      .causal(d.at("causal").toBool())
      .eps(d.at("eps").toDouble())
      .rotary_dim(d.at("rotary_dim").toInt())
      .rotary_base(d.at("rotary_base").toDouble());
}

class LinearAttentionFunction : public torch::autograd::Function<LinearAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const LinearAttentionFuncOptions& o) {
    auto out = torch::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
    auto den = o.normalize() ? torch::empty({q.size(0), q.size(1), q.size(2)}, q.options())
                             : torch::Tensor();
    kernels::linear_attention_forward(linear_params(q, k, v, out, den, o));
    ctx->save_for_backward({q, k, v, out, den});
    save_options(ctx, o);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &den = saved[4];
    auto p = linear_params(q, k, v, out, den, options_from(ctx));
    const torch::Tensor& dout = grads[0];
    // Grouped-query heads: dk and dv in k's and v's head count, each summed
    // by the kernel over its group in head order (kernels/linear_attention.h).
    const auto [dq, dk, dv] = detail::bind_qkv_grads(p, q, k, v, dout);
    kernels::linear_attention_backward(p);
    return detail::once_differentiable("linear_attention", {dq, dk, dv, torch::Tensor()},
                                       {q, k, v, dout});
  }
};

/// Linear attention over a packed batch (varlen_linear_attention): one kernel
/// call per sequence over views of the packed tensors, so each sequence is
/// bitwise the op on it alone. den (when normalize) holds H Tq floats,
/// sequence b's (H, Lb) block at H cu_q[b].
class VarlenLinearFunction : public torch::autograd::Function<VarlenLinearFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const LinearAttentionFuncOptions& o,
                               const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k) {
    auto out = torch::empty({q.size(0), q.size(1), v.size(2)}, q.options());
    auto den = o.normalize() ? torch::empty({q.size(1) * q.size(0)}, q.options()) : torch::Tensor();
    for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
      const detail::PackedSequence s(cu_q, cu_k, b);
      auto out_b = s.of(out), den_b = s.row_stats(den, q.size(1));
      kernels::linear_attention_forward(linear_params(s.of(q), s.keys(k), s.keys(v), out_b, den_b, o));
    }
    ctx->save_for_backward({q, k, v, out, den});
    save_options(ctx, o);
    ctx->saved_data["cu_q"] = cu_q;
    ctx->saved_data["cu_k"] = cu_k;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &den = saved[4];
    const auto o = options_from(ctx);
    const auto cu_q = ctx->saved_data["cu_q"].toIntVector(), cu_k = ctx->saved_data["cu_k"].toIntVector();
    const torch::Tensor& dout = grads[0];
    // Grouped-query heads: dk and dv in k's and v's head count, each summed
    // by the kernel over its group in head order (kernels/linear_attention.h).
    auto dq = torch::empty_like(q, torch::MemoryFormat::Contiguous);
    auto dk = torch::empty_like(k, torch::MemoryFormat::Contiguous);
    auto dv = torch::empty_like(v, torch::MemoryFormat::Contiguous);
    for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
      const detail::PackedSequence s(cu_q, cu_k, b);
      auto out_b = s.of(out), den_b = s.row_stats(den, q.size(1));
      auto p = linear_params(s.of(q), s.keys(k), s.keys(v), out_b, den_b, o);
      detail::bind(p.dout, p.dout_stride, s.of(dout));
      detail::bind(p.dq, p.dq_stride, s.of(dq));
      detail::bind(p.dk, p.dk_stride, s.keys(dk));
      detail::bind(p.dv, p.dv_stride, s.keys(dv));
      kernels::linear_attention_backward(p);
    }
    return detail::once_differentiable("varlen_linear_attention",
                                       {dq, dk, dv, torch::Tensor(), torch::Tensor(), torch::Tensor()},
                                       {q, k, v, dout});
  }
};

kernels::GatedLinearAttentionBackwardParams gated_params(const torch::Tensor& f,
                                                         const torch::Tensor& q,
                                                         const torch::Tensor& alpha,
                                                         const torch::Tensor& beta, bool causal) {
  kernels::GatedLinearAttentionBackwardParams p;
  detail::bind(p.f, p.f_stride, f);
  detail::bind(p.q, p.q_stride, q);
  detail::bind(p.alpha, p.alpha_stride, alpha);
  detail::bind(p.beta, p.beta_stride, beta);
  p.N = f.size(0);
  p.H = f.size(1);
  p.L = f.size(2);
  p.E = f.size(3);
  p.causal = causal;
  return p;
}

class GatedLinearAttentionFunction
    : public torch::autograd::Function<GatedLinearAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& f, const torch::Tensor& q,
                               const torch::Tensor& alpha, const torch::Tensor& beta, bool causal) {
    auto out = torch::empty(f.sizes(), f.options());
    auto p = gated_params(f, q, alpha, beta, causal);
    detail::bind(p.out, p.out_stride, out);
    kernels::gated_linear_attention_forward(p);
    ctx->save_for_backward({f, q, alpha, beta});
    ctx->saved_data["causal"] = causal;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto &f = saved[0], &q = saved[1], &alpha = saved[2], &beta = saved[3];
    auto p = gated_params(f, q, alpha, beta, ctx->saved_data["causal"].toBool());
    const torch::Tensor& dout = grads[0];
    auto df = torch::empty(f.sizes(), f.options());
    auto dq = torch::empty(q.sizes(), q.options());
    // The gates' gradients cost an extra O(chunk^2) per chunk: only when asked.
    auto dalpha =
        ctx->needs_input_grad(2) ? torch::empty(alpha.sizes(), alpha.options()) : torch::Tensor();
    auto dbeta =
        ctx->needs_input_grad(3) ? torch::empty(beta.sizes(), beta.options()) : torch::Tensor();
    detail::bind(p.dout, p.dout_stride, dout);
    detail::bind(p.df, p.df_stride, df);
    detail::bind(p.dq, p.dq_stride, dq);
    p.dalpha = dalpha.defined() ? dalpha.data_ptr<float>() : nullptr;
    p.dbeta = dbeta.defined() ? dbeta.data_ptr<float>() : nullptr;
    kernels::gated_linear_attention_backward(p);
    return detail::once_differentiable("gated_linear_attention",
                                       {df, dq, dalpha, dbeta, torch::Tensor()},
                                       {f, q, alpha, beta, dout});
  }
};

}  // namespace

FeatureMap feature_map_from_string(const std::string& name) {
  if (name == "identity") return FeatureMap::identity;
  if (name == "elu") return FeatureMap::elu;
  TORCH_CHECK(false, "linear_attention: option 'feature_map' must be 'identity' or 'elu', got '",
              name, "'");
}

std::string to_string(FeatureMap map) { return map == FeatureMap::elu ? "elu" : "identity"; }

torch::Tensor linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const LinearAttentionFuncOptions& options) {
  constexpr const char* op = "linear_attention";
  detail::check_qkv(op, q, k, v, /*grouped_heads=*/true);
  detail::check_finite_in(op, "eps", options.eps(), q.scalar_type());
  TORCH_CHECK(options.eps() >= 0, op, ": option 'eps' must be >= 0, got ", options.eps());
  detail::check_rotary(op, "rotary_dim", options.rotary_dim(), "rotary_base", options.rotary_base(), q.size(3));
  // bfloat16 keeps 8 bits: the normalised form's gradient subtracts nearly
  // equal terms (S v and z out), which in bfloat16 arithmetic lost up to 7%
  // (measured, tests/ops/regressions_test.cpp). So bf16 inputs take the
  // float32 kernel, and the result is rounded once.
  if (q.scalar_type() == torch::kBFloat16)
    return linear_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), options)
        .to(torch::kBFloat16);
  if (!linear_attention_dispatch(q, k, v, options).uses_kernel())
    return reference::linear_attention(q, k, v, options);
  return LinearAttentionFunction::apply(q, k, v, options);
}

torch::Tensor varlen_linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& cu_seqlens_q,
                                      const torch::Tensor& cu_seqlens_k,
                                      const LinearAttentionFuncOptions& options) {
  constexpr const char* op = "varlen_linear_attention";
  auto [cu_q, cu_k] = detail::check_packed(op, q, k, v, cu_seqlens_q, cu_seqlens_k);
  detail::check_finite_in(op, "eps", options.eps(), q.scalar_type());
  TORCH_CHECK(options.eps() >= 0, op, ": option 'eps' must be >= 0, got ", options.eps());
  detail::check_rotary(op, "rotary_dim", options.rotary_dim(), "rotary_base", options.rotary_base(), q.size(2));
  if (q.scalar_type() == torch::kBFloat16)  // the float32 kernel, as linear_attention does
    return varlen_linear_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), cu_seqlens_q,
                                   cu_seqlens_k, options)
        .to(torch::kBFloat16);
  if (q.scalar_type() != torch::kFloat) {  // the composite, sequence by sequence
    return detail::each_sequence(q, k, v, cu_q, cu_k, [&](const auto& qb, const auto& kb, const auto& vb) {
      return linear_attention(qb, kb, vb, options);
    });
  }
  return VarlenLinearFunction::apply(q, k, v, options, cu_q, cu_k);
}

Dispatch linear_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const LinearAttentionFuncOptions&) {
  if (q.scalar_type() == torch::kBFloat16)  // k and v too: the op checked they match q
    return Dispatch::kernel("bf16 converted to float32 (no bf16 kernel for linear attention)");
  return detail::float32_kernel_or_composite({{"q", &q}, {"k", &k}, {"v", &v}});
}

torch::Tensor gated_linear_attention(const torch::Tensor& f, const torch::Tensor& q,
                                     const torch::Tensor& alpha, const torch::Tensor& beta,
                                     const GatedLinearAttentionFuncOptions& options) {
  constexpr const char* op = "gated_linear_attention";
  detail::check_float_tensor(op, "f", f, 4);
  detail::check_float_tensor(op, "q", q, 4);
  detail::check_float_tensor(op, "alpha", alpha, 3);
  detail::check_float_tensor(op, "beta", beta, 3);
  detail::check_same_dtype(op, "q", q, "f", f);
  detail::check_same_dtype(op, "alpha", alpha, "f", f);
  detail::check_same_dtype(op, "beta", beta, "f", f);
  TORCH_CHECK(q.sizes() == f.sizes(), op, ": argument 'q' must have the shape of 'f' ",
              detail::shape_str(f), ", got ", detail::shape_str(q));
  // (N, H, L) from the sizes alone: f.select(3, 0) would itself raise when E = 0.
  const auto nhl = f.sizes().slice(0, 3);
  const std::string nhl_str = "(" + std::to_string(nhl[0]) + ", " + std::to_string(nhl[1]) +
                              ", " + std::to_string(nhl[2]) + ")";
  TORCH_CHECK(alpha.sizes() == nhl, op, ": argument 'alpha' must have shape (N, H, L) = ",
              nhl_str, ", got ", detail::shape_str(alpha));
  TORCH_CHECK(beta.sizes() == nhl, op, ": argument 'beta' must have shape (N, H, L) = ", nhl_str,
              ", got ", detail::shape_str(beta));
  if (!gated_linear_attention_dispatch(f, q, alpha, beta, options).uses_kernel())
    return reference::gated_linear_attention(f, q, alpha, beta, options);
  return GatedLinearAttentionFunction::apply(f, q, alpha, beta, options.causal());
}

Dispatch gated_linear_attention_dispatch(const torch::Tensor& f, const torch::Tensor& q,
                                         const torch::Tensor& alpha, const torch::Tensor& beta,
                                         const GatedLinearAttentionFuncOptions&) {
  return detail::float32_kernel_or_composite(
      {{"f", &f}, {"q", &q}, {"alpha", &alpha}, {"beta", &beta}});
}

}  // namespace attnkit
