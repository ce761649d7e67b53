#include "kernels/kmeans.h"

#include <omp.h>

#include <algorithm>
#include <numeric>

#include "base/memory.h"
#include "base/random.h"
#include "kernels/common/simd.h"
#include "kernels/common/threading.h"
#include "kernels/common/visibility.h"

ATTNKIT_KERNELS_BEGIN

namespace {

int hamming(int64_t a, int64_t b) { return __builtin_popcountll(static_cast<uint64_t>(a ^ b)); }

// Bit counts of 64-bit lanes without AVX512_VPOPCNTDQ (which no ISA level
// assumes, isa.h): each byte's two nibbles looked up in a 16-entry table
// (vpshufb), the byte counts summed per lane (vpsadbw against zero).
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i popcount_lanes(__m512i x) {
  const __m512i table = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4));
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i low = _mm512_shuffle_epi8(table, _mm512_and_si512(x, nibble));
  const __m512i high = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble));
  return _mm512_sad_epu8(_mm512_add_epi8(low, high), _mm512_setzero_si512());
}
#elif ATTNKIT_AVX2
inline __m256i popcount_lanes(__m256i x) {
  const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4,
                                         0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i low = _mm256_shuffle_epi8(table, _mm256_and_si256(x, nibble));
  const __m256i high = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(x, 4), nibble));
  return _mm256_sad_epu8(_mm256_add_epi8(low, high), _mm256_setzero_si256());
}
#endif

/// labels[i] = argmin_c popcount(hashes[i] ^ centroids[c]), ties to the lowest c.
void assign(const int64_t* hashes, int64_t n, const int64_t* centroids, int64_t C,
            int64_t* labels) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // Eight queries per vector; centroids in increasing order with a strict
  // "closer" test keep the lowest index on ties, as the scalar loop does.
  for (; i < n; i += 8) {
    const __mmask8 lanes = static_cast<__mmask8>(n - i >= 8 ? 0xff : (1u << (n - i)) - 1u);
    const __m512i h = _mm512_maskz_loadu_epi64(lanes, hashes + i);
    __m512i best = _mm512_set1_epi64(65), arg = _mm512_setzero_si512();
    for (int64_t c = 0; c < C; ++c) {
      const __m512i d = popcount_lanes(_mm512_xor_si512(h, _mm512_set1_epi64(centroids[c])));
      const __mmask8 closer = _mm512_cmplt_epi64_mask(d, best);
      best = _mm512_mask_mov_epi64(best, closer, d);
      arg = _mm512_mask_mov_epi64(arg, closer, _mm512_set1_epi64(c));
    }
    _mm512_mask_storeu_epi64(labels + i, lanes, arg);
  }
#elif ATTNKIT_AVX2
  // Four queries per vector, likewise.
  for (; i < n; i += 4) {
    const __m256i lanes = _mm256_cmpgt_epi64(_mm256_set1_epi64x(std::min<int64_t>(4, n - i)),
                                             _mm256_setr_epi64x(0, 1, 2, 3));
    const __m256i h = _mm256_maskload_epi64(reinterpret_cast<const long long*>(hashes + i), lanes);
    __m256i best = _mm256_set1_epi64x(65), arg = _mm256_setzero_si256();
    for (int64_t c = 0; c < C; ++c) {
      const __m256i d = popcount_lanes(_mm256_xor_si256(h, _mm256_set1_epi64x(centroids[c])));
      const __m256i closer = _mm256_cmpgt_epi64(best, d);
      best = _mm256_blendv_epi8(best, d, closer);
      arg = _mm256_blendv_epi8(arg, _mm256_set1_epi64x(c), closer);
    }
    _mm256_maskstore_epi64(reinterpret_cast<long long*>(labels + i), lanes, arg);
  }
#endif
  for (; i < n; ++i) {
    int64_t arg = 0;
    int best = hamming(hashes[i], centroids[0]);
    for (int64_t c = 1; c < C; ++c) {
      const int d = hamming(hashes[i], centroids[c]);
      if (d < best) best = d, arg = c;
    }
    labels[i] = arg;
  }
}

/// count[c] = members of c; ones[c * 64 + b] = members of c with bit b set.
void count_bits(const int64_t* hashes, const int64_t* labels, int64_t n, int64_t C,
                int32_t* count, int32_t* ones) {
  std::fill(count, count + C, 0);
  std::fill(ones, ones + C * 64, 0);
  for (int64_t i = 0; i < n; ++i) {
    ++count[labels[i]];
    int32_t* o = ones + labels[i] * 64;
#ifdef __AVX512F__
    const uint64_t h = static_cast<uint64_t>(hashes[i]);
    const __m512i one = _mm512_set1_epi32(1);
    for (int w = 0; w < 4; ++w) {
      const __m512i acc = _mm512_loadu_si512(o + 16 * w);
      _mm512_storeu_si512(o + 16 * w, _mm512_mask_add_epi32(acc, static_cast<__mmask16>(h >> (16 * w)),
                                                            acc, one));
    }
#elif ATTNKIT_AVX2
    // Eight bits a step: lane l of step w counts bit 8 w + l.
    const uint64_t h = static_cast<uint64_t>(hashes[i]);
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int w = 0; w < 8; ++w) {
      const __m256i byte = _mm256_set1_epi32(static_cast<int>((h >> (8 * w)) & 0xffu));
      const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(byte, bit), bit);  // -1 where set
      __m256i* acc = reinterpret_cast<__m256i*>(o + 8 * w);
      _mm256_storeu_si256(acc, _mm256_sub_epi32(_mm256_loadu_si256(acc), set));
    }
#else
    for (int b = 0; b < 64; ++b) o[b] += (static_cast<uint64_t>(hashes[i]) >> b) & 1;
#endif
  }
}

/// Per-thread scratch of one sequence, sized for L queries and C clusters.
struct Scratch {
  int64_t* centroids;  // C
  int64_t* positions;  // L: initial shuffle, then the farthest-first order
  int64_t* previous;   // L: the labels of the previous assignment
  int32_t* count;      // C
  int32_t* ones;       // 64 C
  int32_t* distance;   // L
  int32_t* histogram;  // 65 (distances 0..64)
};

/// Clusters one sequence of n >= 1 valid hashes into C = min(clusters, n);
/// returns the iterations run.
int64_t kmeans_one(const KMeansParams& p, const int64_t* hashes, int64_t n, uint64_t stream,
                   int64_t* labels, const Scratch& w) {
  const int64_t C = std::min(p.clusters, n);
  const uint64_t seed = static_cast<uint64_t>(p.seed);
  const int64_t kept_bits = static_cast<int64_t>((uint64_t{1} << p.bits) - 1);  // bits <= 63

  // Initial centroids: a partial Fisher-Yates shuffle of the positions.
  std::iota(w.positions, w.positions + n, int64_t{0});
  for (int64_t c = 0; c < C; ++c)
    std::swap(w.positions[c], w.positions[c + random::below(seed, stream, c, n - c)]);
  for (int64_t c = 0; c < C; ++c) w.centroids[c] = hashes[w.positions[c]];

  for (int64_t it = 0; it < p.iterations; ++it) {
    assign(hashes, n, w.centroids, C, labels);
    // Converged: the update would give the centroids it gave last time, and
    // the final assignment these labels. Running `it` iterations gives them too.
    if (it > 0 && std::equal(labels, labels + n, w.previous)) return it;
    std::copy(labels, labels + n, w.previous);
    count_bits(hashes, labels, n, C, w.count, w.ones);
    int64_t empty = 0;
    for (int64_t c = 0; c < C; ++c) {
      if (w.count[c] == 0) {
        ++empty;
        continue;
      }
      int64_t h = 0;
      for (int b = 0; b < 64; ++b)
        if (2 * w.ones[c * 64 + b] > w.count[c]) h |= int64_t{1} << b;
      w.centroids[c] = h & kept_bits;
    }
    if (empty == 0) continue;
    // Farthest-first order, ties to the lower position: a stable counting
    // sort by decreasing distance to the (updated) centroid of one's cluster.
    std::fill(w.histogram, w.histogram + 65, 0);
    for (int64_t i = 0; i < n; ++i) {
      w.distance[i] = hamming(hashes[i], w.centroids[labels[i]]);
      ++w.histogram[w.distance[i]];
    }
    int32_t start = 0;  // histogram becomes the first slot of each distance
    for (int d = 64; d >= 0; --d) std::swap(start, w.histogram[d]), start += w.histogram[d];
    for (int64_t i = 0; i < n; ++i) w.positions[w.histogram[w.distance[i]]++] = i;
    for (int64_t c = 0, next = 0; c < C; ++c)
      if (w.count[c] == 0) w.centroids[c] = hashes[w.positions[next++]];
  }
  assign(hashes, n, w.centroids, C, labels);
  return p.iterations;
}

}  // namespace

void hamming_kmeans(const KMeansParams& p) {
  const int64_t heads = p.N * p.H, L = p.L, C = std::min(p.clusters, L);
  if (L == 0 && p.rounds) std::fill(p.rounds, p.rounds + heads, int64_t{0});
  if (heads == 0 || L == 0) return;
  const int threads = num_threads();
  const int64_t i64_per_thread = C + 2 * L, i32_per_thread = C + 64 * C + L + 65;
  Buffer<int64_t> i64(static_cast<std::size_t>(threads * i64_per_thread));
  Buffer<int32_t> i32(static_cast<std::size_t>(threads * i32_per_thread));
#pragma omp parallel num_threads(threads)
  {
    int64_t* a = i64.data() + omp_get_thread_num() * i64_per_thread;
    int32_t* b = i32.data() + omp_get_thread_num() * i32_per_thread;
    const Scratch w{a, a + C, a + C + L, b, b + C, b + C + 64 * C, b + C + 64 * C + L};
#pragma omp for schedule(dynamic, 1)
    for (int64_t nh = 0; nh < heads; ++nh) {
      const int64_t n = nh / p.H;
      const int64_t valid = key_limit(p.query_lengths, n, L);  // padding, as for keys
      int64_t* labels = p.labels + nh * L;
      std::fill(labels + valid, labels + L, int64_t{-1});
      const int64_t rounds =
          valid > 0 ? kmeans_one(p, p.hashes + nh * L, valid,
                                 random::kInitStream + static_cast<uint64_t>(nh), labels, w)
                    : 0;
      if (p.rounds) p.rounds[nh] = rounds;
    }
  }
}

ATTNKIT_KERNELS_END
