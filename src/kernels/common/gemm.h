// The one place that calls BLAS. Row-major single-precision GEMM through
// oneDNN's dnnl_sgemm, which detects AVX-512 on CPUs where Debian's OpenBLAS
// falls back to SSE kernels.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

/// C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C, all row-major.
/// op(X) = X^T when trans_x; lda/ldb/ldc are the row strides of A, B, C as stored.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
           int64_t ldc);

}  // namespace attnkit::kernels
