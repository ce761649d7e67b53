#include "kernels/common/gemm.h"

#include <dnnl.h>

#include <stdexcept>
#include <string>

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

}  // namespace attnkit::kernels
