// sgemm throughput of the oneDNN wrapper at the block shapes attention kernels
// use (queries x keys x head dim) and at a large square size (the peak).
#include <benchmark/benchmark.h>

#include "base/memory.h"
#include "kernels/common/gemm.h"
#include "kernels/common/threading.h"

namespace {

using attnkit::kernels::Buffer;

// Block scores S = Q K^T: (m x k) times (n x k)^T.
void BM_SgemmNT(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  Buffer<float> a(m * k), b(n * k), c(m * n);
  for (int64_t i = 0; i < m * k; ++i) a[i] = 0.001f * static_cast<float>(i % 97);
  for (int64_t i = 0; i < n * k; ++i) b[i] = 0.001f * static_cast<float>(i % 89);
  attnkit::kernels::ThreadScope threads;
  for (auto _ : state) {
    attnkit::kernels::sgemm(false, true, m, n, k, 1.f, a.data(), k, b.data(), k, 0.f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * m * n * k, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_SgemmNT)
    ->Args({64, 64, 64})
    ->Args({128, 128, 64})
    ->Args({128, 256, 64})
    ->Args({256, 256, 64})
    ->Args({128, 128, 128})
    ->Args({1024, 1024, 1024});

}  // namespace

BENCHMARK_MAIN();
