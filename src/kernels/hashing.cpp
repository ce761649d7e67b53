#include "kernels/hashing.h"

#include <algorithm>
#include <limits>

#include "base/random.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"
#include "kernels/common/strided.h"

ATTNKIT_KERNELS_BEGIN

namespace {

// Queries per sgemm. Fixed (not derived from the thread count) so that every
// projection is computed by the same call shape whatever the threads.
constexpr int64_t kBlock = 256;
// Projection rows are padded to 64 columns: one 64-bit word of bits per row.
constexpr int64_t kWidth = 64;

/// Packs row r of `proj` (kWidth floats, columns >= B are never set) against
/// the thresholds (kWidth floats, +inf past B, so those bits stay 0).
int64_t pack_row(const float* proj, const float* thresholds) {
#ifdef __AVX512F__
  uint64_t h = 0;
  for (int w = 0; w < 4; ++w) {
    const __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(proj + 16 * w),
                                           _mm512_loadu_ps(thresholds + 16 * w), _CMP_GT_OQ);
    h |= static_cast<uint64_t>(m) << (16 * w);
  }
  return static_cast<int64_t>(h);
#elif ATTNKIT_AVX2
  uint64_t h = 0;
  for (int w = 0; w < 8; ++w) {
    const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(proj + 8 * w),
                                                   _mm256_loadu_ps(thresholds + 8 * w), _CMP_GT_OQ));
    h |= static_cast<uint64_t>(m) << (8 * w);
  }
  return static_cast<int64_t>(h);
#else
  uint64_t h = 0;
  for (int64_t b = 0; b < kWidth; ++b) h |= static_cast<uint64_t>(proj[b] > thresholds[b]) << b;
  return static_cast<int64_t>(h);
#endif
}

}  // namespace

void hash_planes(int64_t bits, int64_t E, int64_t seed, bool hash_bias, float* planes) {
  for (int64_t b = 0; b < bits; ++b)
    for (int64_t e = 0; e <= E; ++e)
      planes[b * (E + 1) + e] = static_cast<float>(
          random::normal(static_cast<uint64_t>(seed), random::kPlanesStream, b * (E + 1) + e));
  if (!hash_bias)
    for (int64_t b = 0; b < bits; ++b) planes[b * (E + 1) + E] = 0.f;
}

void hash_queries(const HashParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return;
  const int64_t E = p.E, B = p.B;
  const int64_t blocks = ceil_div(p.L, kBlock), items = p.N * p.H * blocks;
  // Thresholds padded with +inf: a projection is never > +inf, so bits >= B are 0
  // (and NaN projections give 0 bits, as the reference's comparison does).
  alignas(64) float thresholds[kWidth];
  std::fill(thresholds, thresholds + kWidth, std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < B; ++b) thresholds[b] = p.planes[b * (E + 1) + E];
  const Strided q_all{p.q, p.q_stride[2], p.q_stride[3]};
  const bool packed_q = needs_pack(q_all, 1, E);

  parallel_for(items, kBlock * kWidth + (packed_q ? kBlock * E : 0), [&](int64_t t, float* w) {
    float* proj = w;  // columns >= B stay 0: their thresholds are +inf anyway
    float* qpack = proj + kBlock * kWidth;
    std::fill(proj, proj + kBlock * kWidth, 0.f);
    const int64_t nh = t / blocks, i0 = (t % blocks) * kBlock;
    const int64_t n = nh / p.H, h = nh % p.H, rows = std::min(kBlock, p.L - i0);
    const Rows q = rows_of(head_matrix(p.q, p.q_stride, n, h), i0, rows, E, qpack);
    // proj[r, b] = sum_e q[r, e] P[b, e]: the planes' first E columns, transposed.
    sgemm(false, true, rows, B, E, 1.f, q.data, q.ld, p.planes, E + 1, 0.f, proj, kWidth);
    int64_t* out = p.hashes + nh * p.L + i0;
    for (int64_t r = 0; r < rows; ++r) out[r] = pack_row(proj + r * kWidth, thresholds);
  });
}

ATTNKIT_KERNELS_END
