// Writing schemas' defaults. Each op file of src/ops registers its ops as
// torch.ops.attnkit.<name> at its bottom, in one
// TORCH_LIBRARY_FRAGMENT(attnkit, m) (fragments alone define the namespace;
// there is no TORCH_LIBRARY block). A schema names the keyword arguments
// Python callers use; its wrapper only unpacks them into the C++ options
// struct and calls the C++ op, so both languages share one implementation and
// one set of checks. The ops are composite (their autograd comes from the
// functions they call), hence CompositeImplicitAutograd (m.def with the
// wrapper); the two tensor factories, attention_dropout_mask
// (ops/softmax_attention.cpp) and edge_pattern (ops/sparse_attention.cpp), are
// CompositeExplicitAutograd kernels instead, and the comment beside
// attention_dropout_mask's says why.
#pragma once

#include <cstdio>
#include <string>

namespace attnkit::detail {

/// A bool default as a schema writes it.
inline std::string schema_bool(bool x) { return x ? "True" : "False"; }

/// A float default as a schema writes it: 17 significant digits, which read
/// back as x.
inline std::string schema_float(double x) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", x);
  return text;
}

}  // namespace attnkit::detail
