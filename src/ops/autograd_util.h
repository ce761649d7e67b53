// Autograd helpers shared by the ops' torch::autograd::Function classes.
#pragma once

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

namespace attnkit::detail {

/// Call first in a kernel-backed Function's backward. Our kernels compute
/// first-order gradients only; with create_graph=True (grad mode on during
/// backward) the returned gradients would silently lack their own graph, so
/// second-order terms would be dropped. Raise instead, naming the way out.
inline void check_no_double_backward(const char* op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), op,
              ": the float32 kernel computes first-order gradients only, so backward with "
              "create_graph=True (double backward) is not supported; run the op in float64 (the "
              "composite backend, which supports higher-order gradients) if you need them");
}

}  // namespace attnkit::detail
