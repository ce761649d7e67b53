// What differs between the two oneDNN major versions attnkit builds against
// (Debian 12: 2.6, Debian 13: 3.7), in one place. The rest of the code calls
// these and never tests the version itself.
//
// oneDNN 3 removed the operation descriptors (`dnnl::matmul::desc`: a
// primitive descriptor is built from the memory descriptors directly), the
// output scales of `primitive_attr` (scales became runtime arguments that
// apply to the source and weights, before the bias), the eltwise post-op's
// leading scale argument, and `dnnl_cpu_isa_all` (now `dnnl_cpu_isa_default`).
#pragma once

#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_version.h>

#if DNNL_VERSION_MAJOR < 2 || DNNL_VERSION_MAJOR > 3
#error "attnkit builds against oneDNN 2.x or 3.x (CMakeLists.txt checks the version)"
#endif

namespace attnkit::kernels::onednn {

/// The ISA value that lifts every cap (dnnl_set_max_cpu_isa).
inline constexpr dnnl_cpu_isa_t kNoIsaCap =
#if DNNL_VERSION_MAJOR >= 3
    dnnl_cpu_isa_default;
#else
    dnnl_cpu_isa_all;
#endif

/// A matmul primitive descriptor for dst = src x weights (+ bias), with attr.
/// `bias` may be a zero (empty) descriptor: no bias.
inline dnnl::matmul::primitive_desc matmul_primitive_desc(const dnnl::engine& engine,
                                                          const dnnl::memory::desc& src,
                                                          const dnnl::memory::desc& weights,
                                                          const dnnl::memory::desc& bias,
                                                          const dnnl::memory::desc& dst,
                                                          const dnnl::primitive_attr& attr = {}) {
#if DNNL_VERSION_MAJOR >= 3
  return bias.is_zero() ? dnnl::matmul::primitive_desc(engine, src, weights, dst, attr)
                        : dnnl::matmul::primitive_desc(engine, src, weights, bias, dst, attr);
#else
  return bias.is_zero()
             ? dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, dst), attr, engine)
             : dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, bias, dst), attr,
                                            engine);
#endif
}

/// Appends dst = alpha * dst, the whole result so far (products and bias),
/// as an eltwise post-op: the same meaning in both versions, unlike oneDNN
/// 2's output scales, which oneDNN 3 replaced by scales on the inputs.
inline void append_multiply(dnnl::post_ops& ops, float alpha) {
#if DNNL_VERSION_MAJOR >= 3
  ops.append_eltwise(dnnl::algorithm::eltwise_linear, alpha, 0.f);
#else
  ops.append_eltwise(1.f, dnnl::algorithm::eltwise_linear, alpha, 0.f);
#endif
}

}  // namespace attnkit::kernels::onednn
