// Counter-based random numbers: value i of stream s under seed x is a pure
// function of (x, s, i). Every random choice in attnkit (LSH planes, K-means
// initialisation) draws from here, so the same seed gives the same result in
// the reference and the fast kernels, on any thread count.
#pragma once

#include <cmath>
#include <cstdint>

#include "base/isa_namespace.h"

ATTNKIT_KERNELS_BEGIN
namespace random {

/// SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mixer.
inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// 64 random bits: number `i` of stream `stream` under `seed`.
inline uint64_t bits(uint64_t seed, uint64_t stream, uint64_t i) {
  return mix(mix(seed ^ mix(stream)) + i);
}

/// Uniform in the open interval (0, 1), 53 bits of precision.
inline double uniform(uint64_t seed, uint64_t stream, uint64_t i) {
  return (static_cast<double>(bits(seed, stream, i) >> 11) + 0.5) * 0x1.0p-53;
}

/// Standard normal by Box-Muller from uniforms 2i and 2i+1.
inline double normal(uint64_t seed, uint64_t stream, uint64_t i) {
  const double u1 = uniform(seed, stream, 2 * i);
  const double u2 = uniform(seed, stream, 2 * i + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

/// Integer uniform in [0, n) (n > 0); the modulo bias is below 2^-40 for n < 2^24.
inline uint64_t below(uint64_t seed, uint64_t stream, uint64_t i, uint64_t n) {
  return bits(seed, stream, i) % n;
}

// Stream numbers, one per kind of random choice.
constexpr uint64_t kPlanesStream = 1;
/// K-means initial positions of sequence (n, h) use stream kInitStream + n*H + h.
constexpr uint64_t kInitStream = 1ULL << 32;

}  // namespace random
ATTNKIT_KERNELS_END
