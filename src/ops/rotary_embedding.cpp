// Op boundary of rotary positions: validation, the dispatch between the
// kernel (float32; bfloat16 through float32) and the composite reference
// (float64), and the kernel's autograd (the inverse rotation).
#include "kernels/rotary.h"

#include <torch/autograd.h>

#include "base/checks.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

constexpr const char* kRotaryOp = "rotary_embedding";

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

/// y = x rotated (or rotated back) by the kernel; y contiguous.
torch::Tensor rotate(const torch::Tensor& x, const RotaryEmbeddingFuncOptions& o, bool inverse) {
  auto y = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
  kernels::RotaryParams p;
  detail::bind(p.x, p.x_stride, x);
  p.y = y.data_ptr<float>();
  p.N = x.size(0), p.H = x.size(1), p.T = x.size(2), p.E = x.size(3);
  p.dim = o.dim(), p.base = o.base(), p.offset = o.offset(), p.inverse = inverse;
  kernels::rotary_embedding(p);
  return y;
}

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t dim, double base,
                               int64_t offset) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["base"] = base;
    ctx->saved_data["offset"] = offset;
    return rotate(x, RotaryEmbeddingFuncOptions(dim).base(base).offset(offset), /*inverse=*/false);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto o = RotaryEmbeddingFuncOptions(ctx->saved_data["dim"].toInt())
                       .base(ctx->saved_data["base"].toDouble())
                       .offset(ctx->saved_data["offset"].toInt());
    // Linear in x: the gradient is the transpose of the rotation, computed by
    // the same kernel, so a gradient of the gradient would be this op again.
    // The kernel records no graph, hence once_differentiable.
    const auto dx = rotate(grads[0], o, /*inverse=*/true);
    return detail::once_differentiable(kRotaryOp, {dx, torch::Tensor(), torch::Tensor(), torch::Tensor()},
                                       {grads[0]});
  }
};

}  // namespace

torch::Tensor rotary_embedding(const torch::Tensor& x, const RotaryEmbeddingFuncOptions& options) {
  detail::check_float_tensor(kRotaryOp, "x", x, 4);
  detail::check_rotary(kRotaryOp, "dim", options.dim(), "base", options.base(), x.size(3));
  TORCH_CHECK(options.dim() > 0, kRotaryOp, ": option 'dim' must be >= 2, got 0 (nothing to rotate)");
  // Dispatch: float32 takes the kernel, bfloat16 the kernel through float32
  // (its angles need float32 anyway), float64 the composite reference.
  if (x.scalar_type() == torch::kDouble) return reference::rotary_embedding(x, options);
  if (x.scalar_type() == torch::kBFloat16)
    return rotary_embedding(x.to(torch::kFloat), options).to(torch::kBFloat16);
  return RotaryFunction::apply(x, options.dim(), options.base(), options.offset());
}

}  // namespace attnkit
