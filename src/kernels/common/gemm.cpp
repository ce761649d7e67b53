#include "kernels/common/gemm.h"

#include <dnnl.h>

#include "kernels/common/isa.h"

#include <stdexcept>
#include <string>

namespace attnkit::kernels {

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
           int64_t ldc) {
  // The level decision caps oneDNN (ATTNKIT_MAX_ISA), which only works before
  // oneDNN's first use: decide it first, whoever calls (once; then a load).
  isa::current();
  if (m == 0 || n == 0) return;
  // oneDNN rejects K = 0, and with alpha = 0 its SSE4.1 kernels (what a
  // baseline CPU, or ATTNKIT_MAX_ISA=baseline, runs) read C even when beta = 0,
  // turning garbage scratch into NaN (0 * NaN). Either way the product
  // contributes nothing: C = beta * C, and C is not read when beta = 0.
  if (k == 0 || alpha == 0.f) {
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

}  // namespace attnkit::kernels
