// The namespace of the instruction-set level a translation unit is compiled
// for: kernels/common/isa.h explains the levels and why every level's code,
// inline helpers of shared headers included, lives in a namespace of its own.
// It is here, at the bottom, because the bottom's own inline helpers (the
// scratch Buffer of base/memory.h, the streams of base/random.h, the bf16
// conversions of base/bf16.h) are compiled into every level too.
#pragma once

#ifndef ATTNKIT_ISA_NAMESPACE
#define ATTNKIT_ISA_NAMESPACE isa_generic
#endif

/// Opens / closes attnkit::kernels and, inside it, the namespace of the level
/// this translation unit is compiled for.
#define ATTNKIT_KERNELS_BEGIN \
  namespace attnkit::kernels {  \
  inline namespace ATTNKIT_ISA_NAMESPACE {
#define ATTNKIT_KERNELS_END \
  }                         \
  }
