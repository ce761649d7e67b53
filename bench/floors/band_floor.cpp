// The floor of banded sparse attention computed through small GEMM tiles
// (docs/PERFORMANCE.md, "Sparse attention over edge lists"): only the forward's
// two products per block, through oneDNN's sgemm as the kernel calls them, no
// softmax and no masking. A local pattern of span w = 64 (129 edges per row)
// in blocks of b rows covers b + 2w key columns: S = Q_b K^T (b x (b + 2w) x 64)
// and O = P V (b x 64 x (b + 2w)), per edge. Against it, the exact kernel's
// products (128-row blocks over 256-key tiles) per (query, key) pair, and the
// same shapes' GFLOP/s. One thread, one head of L = 4096 rows, E = M = 64.
//   g++ -O2 -march=native bench/floors/band_floor.cpp -ldnnl -o /tmp/band_floor && OMP_NUM_THREADS=1 /tmp/band_floor
#include <dnnl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace {

constexpr long kL = 4096, kE = 64, kSpan = 64;

// Seconds per pass over all row blocks of b rows, each attending to `cols` keys
// (the products only), best of 5 passes.
double pass_seconds(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                    std::vector<float>& s, std::vector<float>& o, long b, long cols) {
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i0 = 0; i0 + b <= kL; i0 += b) {
      const long j0 = std::clamp(i0 - kSpan, 0L, kL - cols);
      dnnl_sgemm('N', 'T', b, cols, kE, 1.f, &q[i0 * kE], kE, &k[j0 * kE], kE, 0.f, s.data(), cols);
      dnnl_sgemm('N', 'N', b, kE, cols, 1.f, s.data(), cols, &v[j0 * kE], kE, 0.f, &o[i0 * kE], kE);
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main() {
  std::vector<float> q(kL * kE, 0.01f), k(kL * kE, 0.02f), v(kL * kE, 0.03f), s(256 * 512), o(kL * kE);
  // The exact kernel's shapes: 128-row blocks over 256 keys at a time; per pair.
  const double exact = pass_seconds(q, k, v, s, o, 128, 256) / (kL * 256.0);
  const double flops_per_pair = 4.0 * kE;
  std::printf("exact tiles 128 x 256: %.3f ns per pair, %.1f GFLOP/s\n", exact * 1e9,
              flops_per_pair / exact * 1e-9);
  for (long b : {16L, 32L, 64L, 128L}) {
    const long cols = b + 2 * kSpan;
    const double per_edge = pass_seconds(q, k, v, s, o, b, cols) / (kL * (2.0 * kSpan + 1));
    const double gflops = flops_per_pair * cols / (2.0 * kSpan + 1) / per_edge * 1e-9;
    std::printf("band b = %3ld (%3ld columns, %.2fx the edges' work): %.3f ns per edge = %.2fx exact's "
                "per pair; tiles at %.1f GFLOP/s\n",
                b, cols, cols / (2.0 * kSpan + 1), per_edge * 1e9, per_edge / exact, gflops);
  }
}
