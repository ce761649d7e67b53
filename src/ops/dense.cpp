// Op boundary of the dense layer: validation, dispatch, autograd, and the
// registration of its schemas (linear and the kernel ops) at its bottom.
// float32 runs kernels/dense on oneDNN's sgemm; bfloat16 runs kernels/dense
// on oneDNN's bf16 matmul (or float32 conversion where the CPU lacks
// AVX512_BF16); float64 runs at::linear.
#include "kernels/dense.h"

#include <attnkit/ops.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "ops/checks.h"
#include "ops/autograd_util.h"
#include "ops/dispatch_util.h"
#include "ops/kernel_op.h"

namespace attnkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

constexpr const char* kLinearOp = "linear";

void check_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  TORCH_CHECK(x.defined(), kLinearOp, ": argument 'x' is undefined");
  TORCH_CHECK(x.dim() >= 1, kLinearOp, ": argument 'x' must have at least 1 dimension (..., in), "
              "got a 0-dimensional tensor");
  detail::check_float_tensor(kLinearOp, "x", x, x.dim());
  detail::check_float_tensor(kLinearOp, "weight", weight, 2);
  detail::check_same_dtype(kLinearOp, "weight", weight, "input", x);
  TORCH_CHECK(weight.size(1) == x.size(-1), kLinearOp, ": argument 'weight' has shape ",
              detail::shape_str(weight), " (out, in), so x must end in in = ", weight.size(1),
              ", got x of shape ", detail::shape_str(x));
  if (!bias.defined()) return;
  detail::check_float_tensor(kLinearOp, "bias", bias, 1);
  detail::check_same_dtype(kLinearOp, "bias", bias, "input", x);
  TORCH_CHECK(bias.size(0) == weight.size(0), kLinearOp, ": argument 'bias' must have shape (",
              weight.size(0), ") like weight's out, got ", detail::shape_str(bias));
}

/// t (..., columns) as a 2-D (rows, columns) matrix the kernel can read: unit
/// column stride, row stride >= columns. A view when the layout allows it,
/// else a contiguous copy. Rows are counted explicitly, so empty sizes work.
torch::Tensor as_rows(const torch::Tensor& t, int64_t columns) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  auto m = t.reshape({rows, columns});
  const bool readable = m.stride(1) == 1 && (m.size(0) <= 1 || m.stride(0) >= columns);
  return readable ? m : m.contiguous();
}

/// The weight (out, in) as the kernel reads it: as stored when its rows or
/// its columns are contiguous (the latter is the .t() view of an (in, out)
/// parameter: no copy), else a contiguous copy.
struct WeightView {
  torch::Tensor stored;  // (out, in), or (in, out) when transposed
  bool transposed = false;
};
WeightView bind_weight(const torch::Tensor& weight) {
  const int64_t out = weight.size(0), in = weight.size(1);
  if (weight.stride(1) == 1 && (out <= 1 || weight.stride(0) >= in)) return {weight, false};
  if (weight.stride(0) == 1 && (in <= 1 || weight.stride(1) >= out)) return {weight.t(), true};
  return {weight.contiguous(), false};
}

int64_t row_stride(const torch::Tensor& m) {
  return m.size(0) <= 1 ? std::max<int64_t>(m.size(1), 1) : m.stride(0);
}

/// The kernel's element type for a tensor's data: float, or kernels::bf16
/// (layout-compatible with c10::BFloat16).
template <typename T>
T* data(const torch::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    return t.data_ptr<float>();
  } else {
    static_assert(std::is_same_v<T, kernels::bf16> && sizeof(c10::BFloat16) == sizeof(kernels::bf16));
    return reinterpret_cast<kernels::bf16*>(t.data_ptr<c10::BFloat16>());
  }
}

template <typename T>
kernels::LinearParamsT<T> make_params(const torch::Tensor& x2, const WeightView& w,
                                      const torch::Tensor& bias) {
  kernels::LinearParamsT<T> p;
  p.x = data<T>(x2);
  p.x_row_stride = row_stride(x2);
  p.weight = data<T>(w.stored);
  p.weight_row_stride = row_stride(w.stored);
  p.weight_transposed = w.transposed;
  p.bias = bias.defined() ? data<T>(bias) : nullptr;
  p.rows = x2.size(0), p.in = x2.size(1);
  p.out = w.transposed ? w.stored.size(1) : w.stored.size(0);
  return p;
}

/// Stands for an absent bias in LinearFunction::apply, which cannot take an
/// undefined tensor (it records every tensor argument's device).
struct NoBias {};

/// Runs the kernel's forward for T = float or kernels::bf16.
template <typename T>
void kernel_forward(const torch::Tensor& x2, const WeightView& w, const torch::Tensor& bias,
                    torch::Tensor& y, int64_t out) {
  kernels::linear_forward(make_params<T>(x2, w, bias), data<T>(y), std::max<int64_t>(out, 1));
}

template <typename T>
void kernel_backward(const torch::Tensor& x2, const WeightView& w, const torch::Tensor& dy,
                     int64_t ldy, const torch::Tensor& dx, const torch::Tensor& dw,
                     const torch::Tensor& db) {
  kernels::LinearGradientsT<T> g;
  if (dx.defined()) g.dx = data<T>(dx);
  if (dw.defined()) g.dweight = data<T>(dw);
  if (db.defined()) g.dbias = data<T>(db);
  kernels::linear_backward(make_params<T>(x2, w, torch::Tensor()), data<T>(dy), ldy, g);
}

// ---------------------------------------------------------------------------
// The kernels as ops of their own (ops/kernel_op.h): attnkit::_linear_forward
// and attnkit::_linear_backward, with CPU and Meta kernels, called by the
// autograd Function below through the dispatcher. Their CPU kernels check
// their arguments as linear does (Python can call them directly).
// ---------------------------------------------------------------------------

constexpr const char* kLinearForwardOp = "_linear_forward";
constexpr const char* kLinearBackwardOp = "_linear_backward";
using detail::OptionalTensor;
using LinearForwardSignature = torch::Tensor(const torch::Tensor&, const torch::Tensor&, const OptionalTensor&);
using LinearBackwardResult = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
using LinearBackwardSignature = LinearBackwardResult(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                     bool, bool, bool);

void check_linear_kernel_arguments(const char* op, const torch::Tensor& x, const torch::Tensor& weight,
                                   const torch::Tensor& bias) {
  check_linear(x, weight, bias);
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, op,
              ": the kernels take float32 or bfloat16, got ", detail::dtype_name(x.scalar_type()));
}

/// y (..., out) in x's dtype, allocated in its final shape (not a view of a
/// 2-D result: a view made inside a custom Function could not be modified in
/// place by the caller).
torch::Tensor linear_output(const torch::Tensor& x, const torch::Tensor& weight) {
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return torch::empty(sizes, x.options());
}

torch::Tensor linear_forward_cpu(const torch::Tensor& x, const torch::Tensor& weight, const OptionalTensor& bias) {
  const auto b = bias ? bias->contiguous() : torch::Tensor();
  check_linear_kernel_arguments(kLinearForwardOp, x, weight, b);
  const int64_t in = weight.size(1), out = weight.size(0);
  const auto x2 = as_rows(x, in);
  const auto w = bind_weight(weight);
  auto y = linear_output(x, weight);
  if (x.scalar_type() == torch::kBFloat16)
    kernel_forward<kernels::bf16>(x2, w, b, y, out);
  else
    kernel_forward<float>(x2, w, b, y, out);
  return y;
}

torch::Tensor linear_forward_meta(const torch::Tensor& x, const torch::Tensor& weight, const OptionalTensor&) {
  return linear_output(x, weight);
}

/// The gradients asked for (the rest are empty (0) tensors): dx in x's shape,
/// contiguous; dweight (out, in) in the weight's stored layout (the kernel
/// writes it so: no transposing copy; the .t() view of an (in, out) buffer
/// when the weight is one); dbias (out).
LinearBackwardResult linear_gradients(const torch::Tensor& x, const torch::Tensor& weight, bool dx_asked,
                                      bool dweight_asked, bool dbias_asked) {
  const int64_t in = weight.size(1), out = weight.size(0);
  // (Each its own tensor: an op's outputs must not alias one another.)
  auto none = [&] { return torch::empty({0}, x.options()); };
  const bool transposed = bind_weight(weight).transposed;
  return {dx_asked ? torch::empty(x.sizes(), x.options()) : none(),
          !dweight_asked ? none()
          : transposed   ? torch::empty({in, out}, x.options()).t()
                         : torch::empty({out, in}, x.options()),
          dbias_asked ? torch::empty({out}, x.options()) : none()};
}

LinearBackwardResult linear_backward_meta(const torch::Tensor& /*dy*/, const torch::Tensor& x,
                                          const torch::Tensor& weight, bool dx, bool dweight, bool dbias) {
  return linear_gradients(x, weight, dx, dweight, dbias);
}

LinearBackwardResult linear_backward_cpu(const torch::Tensor& grad_y, const torch::Tensor& x,
                                         const torch::Tensor& weight, bool dx_asked, bool dweight_asked,
                                         bool dbias_asked) {
  check_linear_kernel_arguments(kLinearBackwardOp, x, weight, torch::Tensor());
  auto y_sizes = x.sizes().vec();
  y_sizes.back() = weight.size(0);
  TORCH_CHECK(grad_y.scalar_type() == x.scalar_type() && grad_y.sizes() == torch::IntArrayRef(y_sizes),
              kLinearBackwardOp, ": argument 'grad_y' must be ", detail::dtype_name(x.scalar_type()), " of shape ",
              torch::IntArrayRef(y_sizes), " (x's with the weight's out), got ",
              detail::dtype_name(grad_y.scalar_type()), " ", detail::shape_str(grad_y));
  const int64_t in = weight.size(1), out = weight.size(0);
  const auto x2 = as_rows(x, in);
  const auto w = bind_weight(weight);
  // sum().backward() hands us a stride-0 gradient: as_rows materialises it.
  const auto dy = as_rows(grad_y, out);
  auto grads = linear_gradients(x, weight, dx_asked, dweight_asked, dbias_asked);
  auto& [dx, dweight, dbias] = grads;
  // The kernel writes what it is given; undefined: not asked for.
  auto asked = [](bool yes, const torch::Tensor& t) { return yes ? t : torch::Tensor(); };
  const auto dw_stored = dweight_asked && w.transposed ? dweight.t() : dweight;
  const int64_t ldy = row_stride(dy);
  if (x.scalar_type() == torch::kBFloat16)
    kernel_backward<kernels::bf16>(x2, w, dy, ldy, asked(dx_asked, dx), asked(dweight_asked, dw_stored),
                                   asked(dbias_asked, dbias));
  else
    kernel_backward<float>(x2, w, dy, ldy, asked(dx_asked, dx), asked(dweight_asked, dw_stored),
                           asked(dbias_asked, dbias));
  return grads;
}

/// y = x W^T + b by kernels/dense (float32 or bfloat16: every tensor has x's
/// dtype), through the two ops above; the backward computes only the
/// gradients autograd asks for.
class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, NoBias) {
    return forward(ctx, x, weight, torch::Tensor());
  }
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias) {
    static const auto op = detail::kernel_op<LinearForwardSignature>("attnkit::_linear_forward");
    auto y = op.call(x, weight, detail::as_optional(bias));
    // The originals: they carry the autograd edges that once_differentiable
    // attaches its error node to (and the version checks).
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.defined();
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = detail::kernel_op<LinearBackwardSignature>("attnkit::_linear_backward");
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const bool asked[3] = {ctx->needs_input_grad(0), ctx->needs_input_grad(1), has_bias && ctx->needs_input_grad(2)};
    // Gradients in the inputs' dtype (autograd hands dy in the output's dtype).
    auto [dx, dw, db] = op.call(grads[0], x, weight, asked[0], asked[1], asked[2]);
    tensor_list result = {asked[0] ? dx : torch::Tensor(), asked[1] ? dw : torch::Tensor(),
                          asked[2] ? db : torch::Tensor()};
    if (x.scalar_type() != torch::kBFloat16)
      return detail::once_differentiable(kLinearOp, std::move(result), {x, weight, grads[0]});
    return detail::once_differentiable(
        kLinearOp, std::move(result), {x, weight, grads[0]},
        "double backward (the gradient of a gradient) is not supported by the bfloat16 kernel; "
        "use float64 inputs, which take the differentiable composite path");
  }
};

torch::Tensor linear_op(const torch::Tensor& x, const torch::Tensor& weight,
                        const c10::optional<torch::Tensor>& bias) {
  return linear(x, weight, bias.value_or(torch::Tensor()));
}

}  // namespace

Dispatch linear_dispatch(const torch::Tensor& x, const torch::Tensor& weight,
                         const torch::Tensor& bias) {
  check_linear(x, weight, bias);  // weight and bias have x's dtype
  switch (x.scalar_type()) {
    case torch::kFloat:
      return Dispatch::kernel();
    case torch::kBFloat16: {
      // The kernel either way; the reason says how its products run.
      const auto path = kernels::bf16_gemm_path();
      if (path != kernels::Bf16Path::float32)
        return Dispatch::kernel(std::string("bf16 via oneDNN matmul (") + kernels::to_string(path) + ")");
      const auto isa = kernels::bf16_gemm_isa_path();
      if (isa == kernels::Bf16Path::float32)
        return Dispatch::kernel("bf16 converted to float32 (no AVX512_BF16)");
      return Dispatch::kernel(std::string("bf16 converted to float32 (forced, though the CPU has ") +
                              kernels::to_string(isa) + ")");
    }
    default:
      return Dispatch::composite("x is " + detail::dtype_name(x.scalar_type()) +
                                 "; the kernel is float32 and bfloat16 only");
  }
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  if (!linear_dispatch(x, weight, bias).uses_kernel()) return at::linear(x, weight, bias);
  return bias.defined() ? LinearFunction::apply(x, weight, bias)
                        : LinearFunction::apply(x, weight, NoBias{});
}

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", &linear_op);
  m.def("_linear_forward(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "_linear_backward(Tensor grad_y, Tensor x, Tensor weight, bool dx, bool dweight, bool dbias) "
      "-> (Tensor dx, Tensor dweight, Tensor dbias)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl(kLinearForwardOp, &linear_forward_cpu);
  m.impl(kLinearBackwardOp, &linear_backward_cpu);
}

TORCH_LIBRARY_IMPL(attnkit, Meta, m) {
  m.impl(kLinearForwardOp, &linear_forward_meta);
  m.impl(kLinearBackwardOp, &linear_backward_meta);
}

}  // namespace attnkit
