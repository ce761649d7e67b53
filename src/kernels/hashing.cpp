#include "kernels/hashing.h"

#include <omp.h>

#include <algorithm>
#include <limits>

#include "kernels/gemm.h"
#include "kernels/memory.h"
#include "kernels/random.h"
#include "kernels/threading.h"

#ifdef __AVX512F__
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace attnkit::kernels {

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
  const int64_t blocks = (p.L + kBlock - 1) / kBlock, items = p.N * p.H * blocks;
  // Thresholds padded with +inf: a projection is never > +inf, so bits >= B are 0
  // (and NaN projections give 0 bits, as the reference's comparison does).
  alignas(64) float thresholds[kWidth];
  std::fill(thresholds, thresholds + kWidth, std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < B; ++b) thresholds[b] = p.planes[b * (E + 1) + E];
  // sgemm reads rows with unit column stride and a row stride of at least E.
  const bool packed_q = !((p.q_stride[3] == 1 || E == 1) && p.q_stride[2] >= E);

  const int threads = num_threads();
  const int64_t per_thread = kBlock * kWidth + (packed_q ? kBlock * E : 0);
  Buffer<float> scratch(static_cast<std::size_t>(threads * per_thread));
#pragma omp parallel num_threads(threads)
  {
    omp_set_num_threads(1);  // oneDNN inside runs on this thread only
    float* proj = scratch.data() + omp_get_thread_num() * per_thread;
    float* qpack = proj + kBlock * kWidth;
    std::fill(proj, proj + kBlock * kWidth, 0.f);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < items; ++t) {
      const int64_t nh = t / blocks, i0 = (t % blocks) * kBlock;
      const int64_t n = nh / p.H, h = nh % p.H, rows = std::min(kBlock, p.L - i0);
      const float* q = p.q + n * p.q_stride[0] + h * p.q_stride[1] + i0 * p.q_stride[2];
      int64_t ldq = p.q_stride[2];
      if (packed_q) {
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t e = 0; e < E; ++e) qpack[r * E + e] = q[r * p.q_stride[2] + e * p.q_stride[3]];
        q = qpack;
        ldq = E;
      }
      // proj[r, b] = sum_e q[r, e] P[b, e]: the planes' first E columns, transposed.
      sgemm(false, true, rows, B, E, 1.f, q, ldq, p.planes, E + 1, 0.f, proj, kWidth);
      int64_t* out = p.hashes + nh * p.L + i0;
      for (int64_t r = 0; r < rows; ++r) out[r] = pack_row(proj + r * kWidth, thresholds);
    }
  }
}

}  // namespace attnkit::kernels
