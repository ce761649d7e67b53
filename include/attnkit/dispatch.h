// Which implementation an op runs, and why.
//
// Every op has two backends: the float32 `kernel` (torch-free, tiled, threaded)
// and the `composite` (the dtype-generic libtorch definition in
// src/reference, which is also the float64 oracle of the tests). Each op
// decides in one function, `<op>_dispatch(...)`, declared next to the op in
// ops.h and taking the op's own arguments; the op itself calls that function,
// so what it reports is what runs. When the kernel is not taken, `reason` says
// why, in words a user can act on ("q is float64; the kernel is float32 only").
#pragma once

#include <string>

namespace attnkit {

enum class Backend { kernel, composite };

struct Dispatch {
  Backend backend = Backend::kernel;
  /// Why the composite runs; empty when the kernel runs, or naming how it runs
  /// where that varies (linear on bfloat16: "bf16 via oneDNN matmul (amx)").
  std::string reason;
  /// The instruction-set level the kernel runs at (runtime.h: isa()), e.g.
  /// "avx2"; empty for the composite.
  std::string isa;

  /// The kernel at the current level; `how` as for `reason`.
  static Dispatch kernel(std::string how = {});
  static Dispatch composite(std::string why) { return {Backend::composite, std::move(why), {}}; }
  bool uses_kernel() const { return backend == Backend::kernel; }
  /// One line for people: "kernel (avx2)", "kernel (amx; bf16 on AMX tiles)",
  /// "composite (q is float64; the kernel is float32 only)".
  std::string describe() const;
};

inline const char* to_string(Backend backend) {
  return backend == Backend::kernel ? "kernel" : "composite";
}

}  // namespace attnkit
