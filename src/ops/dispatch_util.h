// Helpers for the ops' `<op>_dispatch` functions (see include/attnkit/dispatch.h).
#pragma once

#include <attnkit/dispatch.h>
#include <torch/types.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "ops/checks.h"

namespace attnkit::detail {

/// The kernel when every named tensor is float32; otherwise the composite,
/// naming the first tensor that is not ("q is float64; the kernel is float32
/// only"). Undefined tensors (absent optional inputs) are skipped.
inline Dispatch float32_kernel_or_composite(
    std::initializer_list<std::pair<const char*, const torch::Tensor*>> tensors) {
  for (const auto& [name, t] : tensors) {
    if (!t->defined() || t->scalar_type() == torch::kFloat) continue;
    return Dispatch::composite(std::string(name) + " is " + dtype_name(t->scalar_type()) +
                               "; the kernel is float32 only");
  }
  return Dispatch::kernel();
}

}  // namespace attnkit::detail
