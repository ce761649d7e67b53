#include "kernels/linear.h"

#include <algorithm>
#include <cstring>

#include "kernels/common/gemm.h"
#include "kernels/memory.h"
#include "kernels/threading.h"

namespace attnkit::kernels {

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
  if (g.dx) {  // dx (rows, in) = dy (rows, out) W (out, in)
    sgemm(false, p.weight_transposed, p.rows, p.in, p.out, 1.f, dy, dy_row_stride, p.weight,
          p.weight_row_stride, 0.f, g.dx, p.in);
  }
  if (g.dweight && !p.weight_transposed) {  // dW (out, in) = dy^T (out, rows) x (rows, in)
    sgemm(true, false, p.out, p.in, p.rows, 1.f, dy, dy_row_stride, p.x, p.x_row_stride, 0.f,
          g.dweight, p.in);
  }
  if (g.dweight && p.weight_transposed) {  // dW^T (in, out) = x^T (in, rows) dy (rows, out)
    sgemm(true, false, p.in, p.out, p.rows, 1.f, p.x, p.x_row_stride, dy, dy_row_stride, 0.f,
          g.dweight, p.out);
  }
  if (g.dbias) {  // db (out) = dy^T (out, rows) 1 (rows): a GEMV, so oneDNN threads it
    Buffer<float> ones(static_cast<std::size_t>(std::max<int64_t>(p.rows, 1)));
    std::fill(ones.data(), ones.data() + p.rows, 1.f);
    sgemm(true, false, p.out, 1, p.rows, 1.f, dy, dy_row_stride, ones.data(), 1, 0.f, g.dbias, 1);
  }
}

}  // namespace attnkit::kernels
