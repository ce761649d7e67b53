#include "kernels/dense.h"

#include <algorithm>
#include <cstring>

#include "base/memory.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/threading.h"
#include "kernels/gemm_bf16.h"

ATTNKIT_KERNELS_BEGIN

namespace {

// sgemm and gemm_bf16 under one name (alpha 1, beta 0), so that the
// backward's products are written once for both element types.
void product(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
             int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  sgemm(trans_a, trans_b, m, n, k, 1.f, a, lda, b, ldb, 0.f, c, ldc);
}
void product(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const bf16* a,
             int64_t lda, const bf16* b, int64_t ldb, bf16* c, int64_t ldc) {
  gemm_bf16(trans_a, trans_b, m, n, k, 1.f, a, lda, b, ldb, 0.f, c, ldc);
}

// dx and dW of y = x W^T + b for either element type; db differs by type.
template <typename Params, typename T, typename Gradients>
void input_and_weight_gradients(const Params& p, const T* dy, int64_t dy_row_stride,
                                const Gradients& g) {
  if (g.dx) {  // dx (rows, in) = dy (rows, out) W (out, in)
    product(false, p.weight_transposed, p.rows, p.in, p.out, dy, dy_row_stride, p.weight,
            p.weight_row_stride, g.dx, p.in);
  }
  if (g.dweight && !p.weight_transposed) {  // dW (out, in) = dy^T (out, rows) x (rows, in)
    product(true, false, p.out, p.in, p.rows, dy, dy_row_stride, p.x, p.x_row_stride, g.dweight,
            p.in);
  }
  if (g.dweight && p.weight_transposed) {  // dW^T (in, out) = x^T (in, rows) dy (rows, out)
    product(true, false, p.in, p.out, p.rows, p.x, p.x_row_stride, dy, dy_row_stride, g.dweight,
            p.out);
  }
}

}  // namespace

void linear_forward(const LinearParams& p, float* y, int64_t y_row_stride) {
  if (p.rows == 0 || p.out == 0) return;
  ThreadScope scope;  // oneDNN's threads follow num_threads()
  float beta = 0.f;
  if (p.bias) {
    // y starts as the bias in every row; the product is added to it (beta = 1),
    // one pass over y instead of a second sweep after the GEMM.
#pragma omp parallel for num_threads(num_threads()) schedule(static)
    for (int64_t r = 0; r < p.rows; ++r)
      std::memcpy(y + r * y_row_stride, p.bias, sizeof(float) * p.out);
    beta = 1.f;
  }
  // B = W^T (in, out): the stored (out, in) matrix transposed, or the stored
  // (in, out) matrix as it is.
  sgemm(false, !p.weight_transposed, p.rows, p.out, p.in, 1.f, p.x, p.x_row_stride, p.weight,
        p.weight_row_stride, beta, y, y_row_stride);
}

void linear_backward(const LinearParams& p, const float* dy, int64_t dy_row_stride,
                     const LinearGradients& g) {
  ThreadScope scope;
  input_and_weight_gradients(p, dy, dy_row_stride, g);
  if (g.dbias) {  // db (out) = dy^T (out, rows) 1 (rows): a GEMV, so oneDNN threads it
    Buffer<float> ones(static_cast<std::size_t>(std::max<int64_t>(p.rows, 1)));
    std::fill(ones.data(), ones.data() + p.rows, 1.f);
    sgemm(true, false, p.out, 1, p.rows, 1.f, dy, dy_row_stride, ones.data(), 1, 0.f, g.dbias, 1);
  }
}

// ---------------------------------------------------------------------------
// bfloat16: the same products through gemm_bf16, float32 accumulation, each
// result rounded once to bf16.
// ---------------------------------------------------------------------------

void linear_forward(const LinearParamsBf16& p, bf16* y, int64_t y_row_stride) {
  if (p.rows == 0 || p.out == 0) return;
  ThreadScope scope;
  // The bias goes into the matmul (added to the float32 accumulator before the
  // rounding), so y is written once.
  gemm_bf16(false, !p.weight_transposed, p.rows, p.out, p.in, 1.f, p.x, p.x_row_stride, p.weight,
            p.weight_row_stride, 0.f, y, y_row_stride, p.bias);
}

void linear_backward(const LinearParamsBf16& p, const bf16* dy, int64_t dy_row_stride,
                     const LinearGradientsBf16& g) {
  ThreadScope scope;
  input_and_weight_gradients(p, dy, dy_row_stride, g);
  if (g.dbias) {
    // db (out) = column sums of dy, in float32 down the rows, one block of
    // columns per work item: each sum has a fixed order, whatever the thread
    // count. (A GEMV with a ones vector, as the float32 kernel does, would
    // need a bf16 ones vector and a float32 result to round anyway.)
    constexpr int64_t kColumns = 64;
    const int64_t blocks = ceil_div(p.out, kColumns);
#pragma omp parallel for num_threads(num_threads()) schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t j0 = block * kColumns, width = std::min(kColumns, p.out - j0);
      float sum[kColumns] = {};
      for (int64_t r = 0; r < p.rows; ++r) {
        const bf16* row = dy + r * dy_row_stride + j0;
        for (int64_t j = 0; j < width; ++j) sum[j] += to_float(row[j]);
      }
      for (int64_t j = 0; j < width; ++j) g.dbias[j0 + j] = to_bf16(sum[j]);
    }
  }
}

ATTNKIT_KERNELS_END
