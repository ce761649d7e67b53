// The floor of a causal window's forward through oneDNN's sgemm
// (docs/PERFORMANCE.md, "Modern features"): only the two products per block,
// no softmax and no masking, per visible (query, key) pair. A block of BQ
// queries with window W = 256 covers a band of W + BQ - 1 keys, as the exact
// kernel computes it: S = Q K^T (BQ x band) then O = P V, or transposed,
// S^T = K Q^T (band x BQ) then O = (S^T)^T V. Against them, the dense causal
// kernel's products (128-row blocks over 256-key tiles up to the diagonal).
// One thread, one head of L = 16384 rows, E = M = 64.
//   g++ -O2 -march=native bench/floors/window_floor.cpp -ldnnl -o /tmp/window_floor && OMP_NUM_THREADS=1 /tmp/window_floor
#include <dnnl.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
constexpr long kL = 16384, kE = 64, kW = 256;
double dense_causal(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                    std::vector<float>& s, std::vector<float>& o, long BQ, long BK, double& pairs) {
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    pairs = 0;
    for (long i0 = 0; i0 < kL; i0 += BQ) {
      for (long j0 = 0; j0 < i0 + BQ; j0 += BK) {
        long cols = std::min(BK, i0 + BQ - j0);
        dnnl_sgemm('N', 'T', BQ, cols, kE, 1.f, &q[i0 * kE], kE, &k[j0 * kE], kE, 0.f, s.data(), BK);
        dnnl_sgemm('N', 'N', BQ, kE, cols, 1.f, s.data(), BK, &v[j0 * kE], kE, 1.f, &o[i0 * kE], kE);
      }
      for (long r = 0; r < BQ; ++r) pairs += i0 + r + 1;
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
double window(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
              std::vector<float>& s, std::vector<float>& o, long BQ, bool transposed, double& pairs) {
  double best = 1e30;
  const long cols_max = kW + BQ - 1;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    pairs = 0;
    for (long i0 = 0; i0 + BQ <= kL; i0 += BQ) {
      long j0 = std::max(0L, i0 - kW + 1), j1 = i0 + BQ;
      long cols = j1 - j0;
      if (!transposed) {
        dnnl_sgemm('N', 'T', BQ, cols, kE, 1.f, &q[i0 * kE], kE, &k[j0 * kE], kE, 0.f, s.data(), cols_max);
        dnnl_sgemm('N', 'N', BQ, kE, cols, 1.f, s.data(), cols_max, &v[j0 * kE], kE, 1.f, &o[i0 * kE], kE);
      } else {  // S^T = K Q^T (keys x rows), O^T... only the first product changes: O = (S^T)^T V
        dnnl_sgemm('N', 'T', cols, BQ, kE, 1.f, &k[j0 * kE], kE, &q[i0 * kE], kE, 0.f, s.data(), BQ);
        dnnl_sgemm('T', 'N', BQ, kE, cols, 1.f, s.data(), BQ, &v[j0 * kE], kE, 1.f, &o[i0 * kE], kE);
      }
      for (long r = 0; r < BQ; ++r) pairs += std::min(kW, i0 + r + 1);
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
int main() {
  std::vector<float> q(kL * kE, 0.01f), k(kL * kE, 0.02f), v(kL * kE, 0.03f), o(kL * kE), s(1024 * 1024);
  double pairs;
  double t = dense_causal(q, k, v, s, o, 128, 256, pairs);
  std::printf("dense causal 128x256: %.3f ns/pair (%.0f GFLOP/s)\n", 1e9 * t / pairs, 4 * kE * pairs / t / 1e9);
  for (long BQ : {16L, 32L, 48L, 64L, 96L, 128L}) {
    for (bool tr : {false, true}) {
      t = window(q, k, v, s, o, BQ, tr, pairs);
      std::printf("window BQ=%3ld %s: %.3f ns/visible pair (computed/visible %.2f)\n", BQ, tr ? "K Q^T" : "Q K^T",
                  1e9 * t / pairs, double(kW + BQ - 1) / kW);
    }
  }
}
