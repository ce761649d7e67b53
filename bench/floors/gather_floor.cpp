// The floor of edge-at-a-time sparse attention over a uniformly random pattern
// (docs/PERFORMANCE.md, "Sparse attention over edge lists"): only the gathers
// of each edge's key and value rows (64 floats each), summed so the compiler
// keeps them, without and with software prefetching 8 edges ahead; one head,
// 129 edges per query, one core.
//   g++ -O2 -march=native bench/floors/gather_floor.cpp -o /tmp/gather_floor && /tmp/gather_floor
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <random>
#include <vector>
int main() {
  const int E = 64;
  for (long L : {4096L, 16384L}) {
    // one head's K and V: L x 64 floats each
    std::vector<float> K(L * E, 1.0f), V(L * E, 2.0f);
    const long edges = L * 129;
    std::vector<int64_t> idx(edges);
    std::mt19937_64 rng(1);
    for (auto& x : idx) x = rng() % L;
    for (int pass = 0; pass < 2; ++pass) {
      for (int pf = 0; pf < 2; ++pf) {
        __m512 acc = _mm512_setzero_ps();
        auto t0 = std::chrono::steady_clock::now();
        for (int rep = 0; rep < 8; ++rep)
          for (long e = 0; e < edges; ++e) {
            if (pf && e + 8 < edges) {
              const float* kp = &K[idx[e + 8] * E]; const float* vp = &V[idx[e + 8] * E];
              for (int c = 0; c < E; c += 16) { __builtin_prefetch(kp + c); __builtin_prefetch(vp + c); }
            }
            const float* k = &K[idx[e] * E]; const float* v = &V[idx[e] * E];
            for (int c = 0; c < E; c += 16) acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_loadu_ps(k + c), _mm512_loadu_ps(v + c)));
          }
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        double per = s / (8.0 * edges) * 1e9;
        if (pass) std::printf("L=%ld prefetch=%d: %.2f ns per edge (512 B), %.1f GB/s  [%g]\n", L, pf, per, 512 / per, _mm512_reduce_add_ps(acc));
      }
    }
  }
}
