// The selection steps of clustered attention (see docs/MATH.md, Clustered
// attention and Improved clustered attention): which queries share a cluster
// (cluster_queries) and which keys a centroid attends to exactly
// (select_top_keys). Declared in clustered_attention.h.
#include <algorithm>

#include "base/memory.h"
#include "kernels/clustered_attention.h"  // declares both
#include "kernels/common/simd.h"
#include "kernels/hashing.h"
#include "kernels/kmeans.h"

ATTNKIT_KERNELS_BEGIN

void select_top_keys(const float* scores, int64_t valid, int64_t S, int64_t k, int64_t* top) {
  k = std::min(k, S);
  const int64_t kv = std::min(k, valid);
  // top[0, kv) holds the best keys so far, best first: higher score, then lower
  // index. A later key has a higher index, so it enters only with a strictly
  // higher score than the worst kept one.
  const auto before = [scores](int64_t a, int64_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  if (kv > 0) {
    for (int64_t j = 0; j < kv; ++j) top[j] = j;
    std::sort(top, top + kv, before);
    float worst = scores[top[kv - 1]];
    const auto offer = [&](int64_t j) {
      if (!(scores[j] > worst)) return;
      int64_t s = kv - 1;  // slide worse keys down, dropping the worst
      for (; s > 0 && scores[top[s - 1]] < scores[j]; --s) top[s] = top[s - 1];
      top[s] = j;
      worst = scores[top[kv - 1]];
    };
    int64_t j = kv;
#ifdef __AVX512F__
    // Sixteen keys per compare; most blocks hold none better than the worst kept.
    for (; j + 16 <= valid; j += 16) {
      __mmask16 better =
          _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + j), _mm512_set1_ps(worst), _CMP_GT_OQ);
      for (; better; better &= better - 1) offer(j + __builtin_ctz(better));
    }
#elif ATTNKIT_AVX2
    // Eight keys per compare, likewise.
    for (; j + 8 <= valid; j += 8) {
      unsigned better = static_cast<unsigned>(_mm256_movemask_ps(
          _mm256_cmp_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(worst), _CMP_GT_OQ)));
      for (; better; better &= better - 1) offer(j + __builtin_ctz(better));
    }
#endif
    for (; j < valid; ++j) offer(j);
    std::sort(top, top + kv);
  }
  for (int64_t s = kv; s < k; ++s) top[s] = valid + (s - kv);  // padded keys come last
}

void cluster_queries(const ClusterParams& p) {
  Buffer<float> planes(static_cast<std::size_t>(p.bits * (p.E + 1)));
  hash_planes(p.bits, p.E, p.seed, p.hash_bias, planes.data());
  Buffer<int64_t> hashes(static_cast<std::size_t>(p.N * p.H * p.L));
  HashParams hp;
  hp.q = p.q;
  std::copy(p.q_stride, p.q_stride + 4, hp.q_stride);
  hp.planes = planes.data();
  hp.hashes = hashes.data();
  hp.N = p.N, hp.H = p.H, hp.L = p.L, hp.E = p.E, hp.B = p.bits;
  hash_queries(hp);
  KMeansParams kp;
  kp.hashes = hashes.data();
  kp.labels = p.labels;
  kp.query_lengths = p.query_lengths;
  kp.N = p.N, kp.H = p.H, kp.L = p.L;
  kp.clusters = p.clusters, kp.bits = p.bits, kp.iterations = p.iterations, kp.seed = p.seed;
  hamming_kmeans(kp);
}

ATTNKIT_KERNELS_END
