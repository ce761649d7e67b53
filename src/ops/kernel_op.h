// Helpers for an op whose kernels are ops of their own (attnkit::_<op>_forward
// and _<op>_backward, with CPU and Meta kernels): its autograd Function calls
// them through the dispatcher, so that a tracer (torch.compile, torch.export)
// shapes their outputs with the Meta kernels instead of running code that
// reads data pointers. ops/softmax_attention.cpp is the first such op.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/types.h>

namespace attnkit::detail {

/// A schema's `Tensor?` argument as a kernel receives it.
using OptionalTensor = c10::optional<torch::Tensor>;

/// An optional tensor argument of a schema (`Tensor?`) from a tensor that may
/// be undefined.
inline OptionalTensor as_optional(const torch::Tensor& t) { return t.defined() ? OptionalTensor(t) : c10::nullopt; }

/// The registered op `qualified_name` ("attnkit::_softmax_attention_forward")
/// with the C++ signature of its kernels; call it once per call site (a
/// function-local static) and then .call(...) it.
template <typename Signature>
c10::TypedOperatorHandle<Signature> kernel_op(const char* qualified_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").typed<Signature>();
}

}  // namespace attnkit::detail
