// The kernel ops' checks that linear attention (ops/linear_attention.cpp) and
// gated linear attention (ops/gated_linear_attention.cpp) share: an argument
// in float32, the kernels' dtype, and of a known shape.
#pragma once

#include <torch/types.h>

#include "ops/checks.h"

namespace attnkit::detail {

inline void check_float32_kernel(const char* op, const torch::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat, op, ": the kernel takes float32, got ",
              detail::dtype_name(q.scalar_type()));
}

/// A kernel's float32 tensor argument of a known shape (grad_out, out).
inline void check_float32_shape(const char* op, const char* name, const torch::Tensor& t, torch::IntArrayRef shape) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.sizes() == shape, op, ": argument '", name,
              "' must be float32 of shape ", shape, ", got ", detail::dtype_name(t.scalar_type()), " ",
              detail::shape_str(t));
}

}  // namespace attnkit::detail
