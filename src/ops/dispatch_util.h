// Helpers for the ops' `<op>_dispatch` functions (see include/attnkit/dispatch.h).
#pragma once

#include <attnkit/dispatch.h>
#include <torch/types.h>

#include <initializer_list>
#include <string>
#include <utility>

namespace attnkit::detail {

/// The dtype as users write it: float32, float64, float16, bfloat16, ...
inline std::string dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    default: return c10::toString(type);
  }
}

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
