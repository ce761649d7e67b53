// The floor of non-causal linear attention with the elu + 1 feature map
// (docs/PERFORMANCE.md, "Linear attention family"): the kernel's two kinds of
// work timed apart, in the shapes and order the kernel uses at N = 1, H = 8,
// L = S = 4096, E = M = 64, one thread:
//   - the GEMMs: per head, the state S = phi(K)^T V over blocks of 1024 keys
//     (64 x 64 x 1024, accumulated) and the output phi(Q) S over blocks of
//     1024 queries (1024 x 64 x 64), through oneDNN's sgemm;
//   - the feature map: elu(x) + 1 of every query and key (2 L E per head),
//     through the kernels' own exp (src/kernels/common/vec.h), in the same
//     1024-row blocks (in cache).
// It prints each part's time, their sum, and what the sum would be as a
// fraction of the sgemm peak (1024^3, same process) under the bench's FLOP
// count, 2 (S E M + L E M) per head: the best the kernel could reach.
//   g++ -O2 -march=native -Isrc bench/floors/linear_floor.cpp -ldnnl -o /tmp/linear_floor && OMP_NUM_THREADS=1 /tmp/linear_floor
#include <dnnl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include "kernels/common/vec.h"

namespace {

constexpr long kL = 4096, kE = 64, kHeads = 8, kBlock = 1024;

double best_seconds(const std::function<void()>& run) {
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

void elu_plus_one(const float* x, float* out, long n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (long i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 positive = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_storeu_ps(out + i, _mm512_mask_add_ps(attnkit::kernels::vec::exp16(v), positive, v, one));
  }
}

}  // namespace

int main() {
  std::vector<float> x(kL * kE), f(kBlock * kE), v(kL * kE), state(kE * kE), out(kL * kE);
  for (long i = 0; i < kL * kE; ++i) x[i] = 0.01f * static_cast<float>(i % 200 - 100), v[i] = 0.5f;
  std::vector<float> a(1024 * 1024, 0.001f), b(1024 * 1024, 0.001f), c(1024 * 1024);
  const double peak_s = best_seconds([&] {
    dnnl_sgemm('N', 'N', 1024, 1024, 1024, 1.f, a.data(), 1024, b.data(), 1024, 0.f, c.data(), 1024);
  });
  const double peak = 2.0 * 1024 * 1024 * 1024 / peak_s * 1e-9;
  const double gemms = best_seconds([&] {
    for (long h = 0; h < kHeads; ++h) {
      std::fill(state.begin(), state.end(), 0.f);
      for (long j0 = 0; j0 < kL; j0 += kBlock)
        dnnl_sgemm('T', 'N', kE, kE, kBlock, 1.f, &x[j0 * kE], kE, &v[j0 * kE], kE, 1.f, state.data(), kE);
      for (long i0 = 0; i0 < kL; i0 += kBlock)
        dnnl_sgemm('N', 'N', kBlock, kE, kE, 1.f, &x[i0 * kE], kE, state.data(), kE, 0.f, &out[i0 * kE], kE);
    }
  });
  const double features = best_seconds([&] {
    for (long h = 0; h < kHeads; ++h)
      for (int which = 0; which < 2; ++which)  // keys, then queries
        for (long r0 = 0; r0 < kL; r0 += kBlock) elu_plus_one(&x[r0 * kE], f.data(), kBlock * kE);
  });
  const double flops = kHeads * 2.0 * (2.0 * kL * kE * kE);
  std::printf("sgemm peak %.1f GFLOP/s\n", peak);
  std::printf("GEMMs only:       %.2f ms (%.0f%% of peak)\n", gemms * 1e3, flops / gemms * 1e-9 / peak * 100);
  std::printf("feature map only: %.2f ms (%.2f ns per element)\n", features * 1e3,
              features / (kHeads * 2.0 * kL * kE) * 1e9);
  std::printf("sum:              %.2f ms = %.0f%% of peak at best\n", (gemms + features) * 1e3,
              flops / (gemms + features) * 1e-9 / peak * 100);
}
