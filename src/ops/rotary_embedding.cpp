// Op boundary of rotary positions: validation, the dispatch between the
// kernel (float32; bfloat16 through float32) and the composite reference
// (float64), and the kernel's autograd (the inverse rotation). Registers its
// schemas (rotary_embedding and the kernel op) at its bottom.
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/checks.h"
#include "kernels/rotary_embedding.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/kernel_op.h"
#include "ops/schema.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

constexpr const char* kRotaryOp = "rotary_embedding";

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// The kernel as an op of its own (ops/kernel_op.h), for both directions:
// attnkit::_rotary_embedding(x, dim, base, offset, inverse), with CPU and
// Meta kernels; the autograd Function calls it through the dispatcher. Its
// CPU kernel checks its arguments as rotary_embedding does (Python can call
// it directly).

constexpr const char* kRotaryKernelOp = "_rotary_embedding";
using RotarySignature = torch::Tensor(const torch::Tensor&, int64_t, double, int64_t, bool);

void check_rotary_arguments(const char* op, const torch::Tensor& x, int64_t dim, double base) {
  detail::check_float_tensor(op, "x", x, 4);
  detail::check_rotary(op, "dim", dim, "base", base, x.size(3));
  TORCH_CHECK(dim > 0, op, ": option 'dim' must be >= 2, got 0 (nothing to rotate)");
}

/// y: x's shape and dtype, contiguous.
torch::Tensor rotary_output(const torch::Tensor& x) {
  return torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
}

/// y = x rotated (or rotated back, `inverse`) by the kernel.
torch::Tensor rotary_cpu(const torch::Tensor& x, int64_t dim, double base, int64_t offset, bool inverse) {
  check_rotary_arguments(kRotaryKernelOp, x, dim, base);
  TORCH_CHECK(x.scalar_type() == torch::kFloat, kRotaryKernelOp, ": the kernel takes float32, got ",
              detail::dtype_name(x.scalar_type()));
  auto y = rotary_output(x);
  kernels::RotaryParams p;
  detail::bind(p.x, p.x_stride, x);
  p.y = y.data_ptr<float>();
  p.N = x.size(0), p.H = x.size(1), p.T = x.size(2), p.E = x.size(3);
  p.dim = dim, p.base = base, p.offset = offset, p.inverse = inverse;
  kernels::rotary_embedding(p);
  return y;
}

torch::Tensor rotary_meta(const torch::Tensor& x, int64_t, double, int64_t, bool) { return rotary_output(x); }

torch::Tensor call_rotary(const torch::Tensor& x, int64_t dim, double base, int64_t offset, bool inverse) {
  static const auto op = detail::kernel_op<RotarySignature>("attnkit::_rotary_embedding");
  return op.call(x, dim, base, offset, inverse);
}

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t dim, double base,
                               int64_t offset) {
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["base"] = base;
    ctx->saved_data["offset"] = offset;
    return call_rotary(x, dim, base, offset, /*inverse=*/false);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    // Linear in x: the gradient is the transpose of the rotation, computed by
    // the same kernel, so a gradient of the gradient would be this op again.
    // The kernel records no graph, hence once_differentiable.
    const auto dx = call_rotary(grads[0], ctx->saved_data["dim"].toInt(), ctx->saved_data["base"].toDouble(),
                                ctx->saved_data["offset"].toInt(), /*inverse=*/true);
    return detail::once_differentiable(kRotaryOp, {dx, torch::Tensor(), torch::Tensor(), torch::Tensor()},
                                       {grads[0]});
  }
};

}  // namespace

torch::Tensor rotary_embedding(const torch::Tensor& x, const RotaryEmbeddingFuncOptions& options) {
  check_rotary_arguments(kRotaryOp, x, options.dim(), options.base());
  // Dispatch: float32 takes the kernel, bfloat16 the kernel through float32
  // (its angles need float32 anyway), float64 the composite reference.
  if (x.scalar_type() == torch::kDouble) return reference::rotary_embedding(x, options);
  if (x.scalar_type() == torch::kBFloat16)
    return rotary_embedding(x.to(torch::kFloat), options).to(torch::kBFloat16);
  return RotaryFunction::apply(x, options.dim(), options.base(), options.offset());
}

namespace {

torch::Tensor rotary_embedding_op(const torch::Tensor& x, int64_t dim, double base, int64_t offset) {
  return rotary_embedding(x, RotaryEmbeddingFuncOptions(dim).base(base).offset(offset));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def(("rotary_embedding(Tensor x, int dim, *, float base=" +
         detail::schema_float(RotaryEmbeddingFuncOptions(2).base()) + ", int offset=0) -> Tensor")
            .c_str(),
        &rotary_embedding_op);
  m.def("_rotary_embedding(Tensor x, int dim, float base, int offset, bool inverse) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) { m.impl(kRotaryKernelOp, &rotary_cpu); }

TORCH_LIBRARY_IMPL(attnkit, Meta, m) { m.impl(kRotaryKernelOp, &rotary_meta); }

}  // namespace attnkit
