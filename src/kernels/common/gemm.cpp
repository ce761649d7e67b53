#include "kernels/common/gemm.h"

#include <dnnl.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/memory.h"
#include "kernels/threading.h"

namespace attnkit::kernels {

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
           int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // oneDNN rejects K = 0; the product is empty, C = beta * C.
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    return;
  }
  const dnnl_status_t status =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb,
                 beta, c, ldc);
  if (status != dnnl_success)
    throw std::runtime_error("attnkit: dnnl_sgemm failed with status " +
                             std::to_string(static_cast<int>(status)));
}

double measure_sgemm_gflops(int64_t size, int repeats) {
  Buffer<float> a(size * size), b(size * size), c(size * size);
  for (int64_t i = 0; i < size * size; ++i) {
    a[i] = static_cast<float>((i * 7 + 3) % 17) / 17.f - 0.5f;
    b[i] = static_cast<float>((i * 5 + 1) % 13) / 13.f - 0.5f;
  }
  ThreadScope scope;  // oneDNN's own threads follow our setting
  sgemm(false, false, size, size, size, 1.f, a.data(), size, b.data(), size, 0.f, c.data(), size);
  std::vector<double> seconds;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    sgemm(false, false, size, size, size, 1.f, a.data(), size, b.data(), size, 0.f, c.data(),
          size);
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + repeats / 2, seconds.end());
  return 2.0 * size * size * size / seconds[repeats / 2] / 1e9;
}

}  // namespace attnkit::kernels
