// Op boundary of gated linear attention: validation, then float32 through the kernels of
// src/kernels/gated_linear_attention (an autograd Function), other dtypes through the
// composite. Registers its schemas (gated_linear_attention, the kernel ops) at its bottom.
#include "kernels/gated_linear_attention.h"

#include <torch/library.h>

#include <string>
#include <tuple>

#include "ops/checks.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/dispatch_util.h"
#include "ops/kernel_op.h"
#include "ops/linear_attention.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using detail::check_float32_kernel;
using detail::check_float32_shape;

// The kernels as ops of their own (ops/kernel_op.h), with CPU and Meta
// kernels, called by the autograd Function below through the dispatcher:
// attnkit::_gated_linear_attention_forward / _backward. Their CPU kernels
// check their arguments as the op does (Python can call them directly).

using GatedForwardSignature = torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                            const torch::Tensor&, bool);
using GatedGradients = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>;
using GatedBackwardSignature = GatedGradients(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                              const torch::Tensor&, const torch::Tensor&, bool, bool, bool);

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

/// gated_linear_attention's checks of f, q, alpha and beta.
void check_gated(const char* op, const torch::Tensor& f, const torch::Tensor& q, const torch::Tensor& alpha,
                 const torch::Tensor& beta) {
  detail::check_float_tensor(op, "f", f, 4);
  detail::check_float_tensor(op, "q", q, 4);
  detail::check_float_tensor(op, "alpha", alpha, 3);
  detail::check_float_tensor(op, "beta", beta, 3);
  detail::check_same_dtype(op, "q", q, "f", f);
  detail::check_same_dtype(op, "alpha", alpha, "f", f);
  detail::check_same_dtype(op, "beta", beta, "f", f);
  TORCH_CHECK(q.sizes() == f.sizes(), op, ": argument 'q' must have the shape of 'f' ", detail::shape_str(f), ", got ",
              detail::shape_str(q));
  // (N, H, L) from the sizes alone: f.select(3, 0) would itself raise when E = 0.
  const auto nhl = f.sizes().slice(0, 3);
  const std::string nhl_str =
      "(" + std::to_string(nhl[0]) + ", " + std::to_string(nhl[1]) + ", " + std::to_string(nhl[2]) + ")";
  TORCH_CHECK(alpha.sizes() == nhl, op, ": argument 'alpha' must have shape (N, H, L) = ", nhl_str, ", got ",
              detail::shape_str(alpha));
  TORCH_CHECK(beta.sizes() == nhl, op, ": argument 'beta' must have shape (N, H, L) = ", nhl_str, ", got ",
              detail::shape_str(beta));
}

torch::Tensor gated_output(const torch::Tensor& f) { return torch::empty(f.sizes(), f.options()); }

torch::Tensor gated_forward_cpu(const torch::Tensor& f, const torch::Tensor& q, const torch::Tensor& alpha,
                                const torch::Tensor& beta, bool causal) {
  constexpr const char* op = "_gated_linear_attention_forward";
  check_gated(op, f, q, alpha, beta);
  check_float32_kernel(op, f);
  auto out = gated_output(f);
  auto p = gated_params(f, q, alpha, beta, causal);
  detail::bind(p.out, p.out_stride, out);
  kernels::gated_linear_attention_forward(p);
  return out;
}

torch::Tensor gated_forward_meta(const torch::Tensor& f, const torch::Tensor&, const torch::Tensor&,
                                 const torch::Tensor&, bool) {
  return gated_output(f);
}

/// df and dq in f's shape; dalpha and dbeta in alpha's when asked for (their
/// gradients cost an extra O(chunk^2) per chunk), else empty (0) tensors.
GatedGradients gated_gradients(const torch::Tensor& f, const torch::Tensor& alpha, bool alpha_grad, bool beta_grad) {
  auto none = [&] { return torch::empty({0}, f.options()); };
  return {torch::empty(f.sizes(), f.options()), torch::empty(f.sizes(), f.options()),
          alpha_grad ? torch::empty(alpha.sizes(), alpha.options()) : none(),
          beta_grad ? torch::empty(alpha.sizes(), alpha.options()) : none()};
}

GatedGradients gated_backward_meta(const torch::Tensor&, const torch::Tensor& f, const torch::Tensor&,
                                   const torch::Tensor& alpha, const torch::Tensor&, bool, bool alpha_grad,
                                   bool beta_grad) {
  return gated_gradients(f, alpha, alpha_grad, beta_grad);
}

GatedGradients gated_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& f, const torch::Tensor& q,
                                  const torch::Tensor& alpha, const torch::Tensor& beta, bool causal, bool alpha_grad,
                                  bool beta_grad) {
  constexpr const char* op = "_gated_linear_attention_backward";
  check_gated(op, f, q, alpha, beta);
  check_float32_kernel(op, f);
  check_float32_shape(op, "grad_out", grad_out, f.sizes());
  auto p = gated_params(f, q, alpha, beta, causal);
  auto grads = gated_gradients(f, alpha, alpha_grad, beta_grad);
  auto& [df, dq, dalpha, dbeta] = grads;
  detail::bind(p.dout, p.dout_stride, grad_out);
  detail::bind(p.df, p.df_stride, df);
  detail::bind(p.dq, p.dq_stride, dq);
  p.dalpha = alpha_grad ? dalpha.data_ptr<float>() : nullptr;
  p.dbeta = beta_grad ? dbeta.data_ptr<float>() : nullptr;
  kernels::gated_linear_attention_backward(p);
  return grads;
}

class GatedLinearAttentionFunction : public torch::autograd::Function<GatedLinearAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& f, const torch::Tensor& q,
                               const torch::Tensor& alpha, const torch::Tensor& beta, bool causal) {
    static const auto op = detail::kernel_op<GatedForwardSignature>("attnkit::_gated_linear_attention_forward");
    auto out = op.call(f, q, alpha, beta, causal);
    ctx->save_for_backward({f, q, alpha, beta});
    ctx->saved_data["causal"] = causal;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = detail::kernel_op<GatedBackwardSignature>("attnkit::_gated_linear_attention_backward");
    const auto saved = ctx->get_saved_variables();
    const auto &f = saved[0], &q = saved[1], &alpha = saved[2], &beta = saved[3];
    const bool alpha_grad = ctx->needs_input_grad(2), beta_grad = ctx->needs_input_grad(3);
    auto [df, dq, dalpha, dbeta] =
        op.call(grads[0], f, q, alpha, beta, ctx->saved_data["causal"].toBool(), alpha_grad, beta_grad);
    return detail::once_differentiable(
        "gated_linear_attention",
        {df, dq, alpha_grad ? dalpha : torch::Tensor(), beta_grad ? dbeta : torch::Tensor(), torch::Tensor()},
        {f, q, alpha, beta, grads[0]});
  }
};

}  // namespace

torch::Tensor gated_linear_attention(const torch::Tensor& f, const torch::Tensor& q,
                                     const torch::Tensor& alpha, const torch::Tensor& beta,
                                     const GatedLinearAttentionFuncOptions& options) {
  check_gated("gated_linear_attention", f, q, alpha, beta);
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

namespace {

torch::Tensor gated_linear_attention_op(const torch::Tensor& f, const torch::Tensor& q,
                                        const torch::Tensor& alpha, const torch::Tensor& beta,
                                        bool causal) {
  return gated_linear_attention(f, q, alpha, beta, GatedLinearAttentionFuncOptions().causal(causal));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def("gated_linear_attention(Tensor f, Tensor q, Tensor alpha, Tensor beta, *, "
        "bool causal=False) -> Tensor",
        &gated_linear_attention_op);
  m.def("_gated_linear_attention_forward(Tensor f, Tensor q, Tensor alpha, Tensor beta, bool causal) -> Tensor");
  m.def(
      "_gated_linear_attention_backward(Tensor grad_out, Tensor f, Tensor q, Tensor alpha, Tensor beta, "
      "bool causal, bool alpha_grad, bool beta_grad) -> (Tensor df, Tensor dq, Tensor dalpha, Tensor dbeta)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("_gated_linear_attention_forward", &gated_forward_cpu);
  m.impl("_gated_linear_attention_backward", &gated_backward_cpu);
}

TORCH_LIBRARY_IMPL(attnkit, Meta, m) {
  m.impl("_gated_linear_attention_forward", &gated_forward_meta);
  m.impl("_gated_linear_attention_backward", &gated_backward_meta);
}

}  // namespace attnkit
