#include "kernels/peak.h"

#include <omp.h>

#include <algorithm>
#include <chrono>

#include "base/memory.h"
#include "kernels/common/gemm.h"
#include "kernels/common/threading.h"

namespace attnkit::kernels {

namespace {

void fill(float* x, int64_t n, int salt) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>((i * 7 + salt) % 17) / 17.f - 0.5f;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double sgemm_peak_gflops(int64_t size, int repeats) {
  const int threads = num_threads();
  const int64_t n2 = size * size;
  Buffer<float> a(static_cast<std::size_t>(n2 * threads)), b(static_cast<std::size_t>(n2 * threads)),
      c(static_cast<std::size_t>(n2 * threads));
  fill(a.data(), n2 * threads, 3);
  fill(b.data(), n2 * threads, 1);
  const double flop = 2.0 * size * size * size;
  auto product = [&](int t) {
    sgemm(false, false, size, size, size, 1.f, a.data() + t * n2, size, b.data() + t * n2, size,
          0.f, c.data() + t * n2, size);
  };

  double best_threaded = 0, best_per_thread = 0;
  {  // (a) one product, oneDNN's threads
    ThreadScope scope;
    product(0);  // warm-up: JIT and thread pool
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      product(0);
      best_threaded = std::max(best_threaded, flop / seconds_since(t0) / 1e9);
    }
  }
  if (threads > 1) {  // (b) one product per thread, each single-threaded
    for (int r = 0; r <= repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
      {
        omp_set_num_threads(1);  // oneDNN inside runs on this thread alone
        product(omp_get_thread_num());
      }
      if (r > 0) best_per_thread = std::max(best_per_thread, threads * flop / seconds_since(t0) / 1e9);
    }
  }
  return std::max(best_threaded, best_per_thread);
}

}  // namespace attnkit::kernels
