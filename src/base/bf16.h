// The bfloat16 storage type and its scalar conversions, shared by the bf16
// GEMM, the AMX tile kernels and the ops that hand torch's bf16 tensors to
// them. Torch-free.
#pragma once

#include <cstdint>
#include <cstring>

#include "base/isa_namespace.h"

namespace attnkit::kernels {

/// bfloat16 storage: the upper 16 bits of an IEEE float32 (layout-compatible
/// with c10::BFloat16, so a torch tensor's data pointer can be reinterpreted).
struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 must be 2 bytes");

}  // namespace attnkit::kernels

ATTNKIT_KERNELS_BEGIN

inline float to_float(bf16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// Round to nearest, ties to even (the rounding of c10::BFloat16 and of
/// vcvtneps2bf16); NaN stays a (quiet) NaN of the same sign, infinities and
/// overflow to infinity as in IEEE arithmetic.
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

ATTNKIT_KERNELS_END
