// Op boundary of the dense layer: validation, dispatch, autograd, registration.
// float32 runs kernels/linear on oneDNN's sgemm; bfloat16 runs kernels/linear
// on oneDNN's bf16 matmul (or float32 conversion where the CPU lacks
// AVX512_BF16); float64 runs at::linear.
#include "kernels/linear.h"

#include <attnkit/ops.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <type_traits>

#include "base/checks.h"
#include "ops/autograd_util.h"
#include "ops/dispatch_util.h"

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

/// y = x W^T + b by kernels/linear (float32 or bfloat16: every tensor has x's
/// dtype); the backward computes only the gradients autograd asks for.
class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, NoBias) {
    return forward(ctx, x, weight, torch::Tensor());
  }
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias) {
    const int64_t in = weight.size(1), out = weight.size(0);
    const auto x2 = as_rows(x, in);
    const auto w = bind_weight(weight);
    const auto b = bias.defined() ? bias.contiguous() : bias;
    // Allocated in its final shape (not a view of a 2-D result): a view made
    // inside a custom Function could not be modified in place by the caller.
    auto sizes = x.sizes().vec();
    sizes.back() = out;
    auto y = torch::empty(sizes, x.options());
    if (x.scalar_type() == torch::kBFloat16)
      kernel_forward<kernels::bf16>(x2, w, b, y, out);
    else
      kernel_forward<float>(x2, w, b, y, out);
    // The originals, not x2 / w.stored: they carry the autograd edges that
    // once_differentiable attaches its error node to (and the version checks).
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.defined();
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const int64_t in = weight.size(1), out = weight.size(0);
    const auto x2 = as_rows(x, in);
    const auto w = bind_weight(weight);
    const int64_t rows = x2.size(0);
    // sum().backward() hands us a stride-0 gradient: as_rows materialises it.
    const auto dy = as_rows(grads[0], out);
    // Gradients in the inputs' dtype (autograd hands dy in the output's dtype).
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0))  // in x's shape; the kernel sees (rows, in) rows
      dx = torch::empty(x.sizes(), x2.options());
    // In the weight's stored layout: no transposing copy (the kernel writes
    // the stored layout; autograd gets the (out, in) view).
    torch::Tensor dw_stored;
    if (ctx->needs_input_grad(1))
      dw_stored = w.transposed ? torch::empty({in, out}, x2.options()) : torch::empty({out, in}, x2.options());
    if (has_bias && ctx->needs_input_grad(2)) db = torch::empty({out}, x2.options());
    const int64_t ldy = rows <= 1 ? std::max<int64_t>(out, 1) : dy.stride(0);
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    if (bf16)
      kernel_backward<kernels::bf16>(x2, w, dy, ldy, dx, dw_stored, db);
    else
      kernel_backward<float>(x2, w, dy, ldy, dx, dw_stored, db);
    if (dw_stored.defined()) dw = w.transposed ? dw_stored.t() : dw_stored;
    if (!bf16) return detail::once_differentiable(kLinearOp, {dx, dw, db}, {x, weight, grads[0]});
    return detail::once_differentiable(
        kLinearOp, {dx, dw, db}, {x, weight, grads[0]},
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
}

}  // namespace attnkit
