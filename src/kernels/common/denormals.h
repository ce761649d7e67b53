// Subnormal floats as zero for the length of a kernel's work item (x86's
// MXCSR flush-to-zero and denormals-are-zero bits, restored after).
//
// Why: an attention row's weights run down to exp(-87) (vec::exp16 flushes
// below that), and a weight of 1e-37 times a value of 0.01 is a subnormal
// product. Intel cores finish each subnormal result of an FMA in microcode,
// many times a normal one's cost; with ALiBi, whose distances push most of a
// long row's weights that low, the products of P V took a sixth of the
// forward on an AMX Xeon (docs/PERFORMANCE.md, "Modern features"; AMD's Zen 4
// showed no such cost). A subnormal is below 1.2e-38: next to a row's
// largest weight of 1 it is nothing. The mode also reads subnormal inputs
// (q, k, v, dout, a bias) as zero and writes gradients below 1.2e-38 as
// zero: an absolute change under 1.2e-38 (docs/MATH.md says so). The guard
// covers the kernels' sweeps over key blocks (forward_keys, backward_keys);
// the final divisions and merges run in the calling threads' own mode.
// Other architectures: no change.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "kernels/common/isa.h"

ATTNKIT_KERNELS_BEGIN

/// For its lifetime, this thread's float arithmetic flushes subnormal
/// results and inputs to zero; then the previous mode comes back.
class SubnormalsAsZero {
 public:
#if defined(__x86_64__) || defined(__i386__)
  SubnormalsAsZero() : saved_(_mm_getcsr() & kModes) { _mm_setcsr(_mm_getcsr() | kModes); }
  // Only the two modes go back: exception flags raised meanwhile stay raised.
  ~SubnormalsAsZero() { _mm_setcsr((_mm_getcsr() & ~kModes) | saved_); }
#else
  SubnormalsAsZero() {}  // user-provided: a variable of it is not "unused"
#endif
  SubnormalsAsZero(const SubnormalsAsZero&) = delete;
  SubnormalsAsZero& operator=(const SubnormalsAsZero&) = delete;

 private:
#if defined(__x86_64__) || defined(__i386__)
  static constexpr unsigned kModes = 0x8000 | 0x0040;  // flush to zero, denormals are zero
  unsigned saved_;
#endif
};

ATTNKIT_KERNELS_END
