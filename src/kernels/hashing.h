// Locality-sensitive hashing of queries by the signs of random projections
// (see docs/MATH.md, Clustered attention). Torch-free.
//
// Bit b of query q is 1 iff sum_e q_e P[b, e] > P[b, E] (strict), with planes P
// of shape (B, E + 1) whose last column is a threshold. Bits are packed
// little-endian into one int64 per query (plane 0 = bit 0); B <= 63 keeps the
// packed value non-negative. The projection is one small sgemm per block of
// queries, followed by a compare.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

/// Writes the planes (B, E + 1), row-major, for `seed`: the float64 values of
/// reference::hash_planes rounded to float (both draw from base/random.h).
/// hash_bias = false zeroes the threshold column: hyperplanes through 0.
void hash_planes(int64_t bits, int64_t E, int64_t seed, bool hash_bias, float* planes);

struct HashParams {
  const float* q = nullptr;       // (N, H, L, E)
  int64_t q_stride[4] = {};       // in elements, any strides
  const float* planes = nullptr;  // (B, E + 1) row-major
  int64_t* hashes = nullptr;      // (N, H, L) contiguous, written
  int64_t N = 0, H = 0, L = 0, E = 0, B = 0;  // 1 <= B <= 63
};

/// Writes every query's packed hash. The projections are computed in float32
/// in fixed blocks of queries, so the bits are the same for any thread count.
/// Threads: num_threads() over (batch, head, query block).
void hash_queries(const HashParams& p);

}  // namespace attnkit::kernels
