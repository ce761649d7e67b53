// Dense (fully connected) layer, forward and backward, over pointers and row
// strides. Torch-free. See docs/MATH.md, Dense layers.
//
//   y = x W^T + b          x (rows, in), W (out, in), b (out), y (rows, out)
//   dx = dy W,  dW = dy^T x,  db = sum over rows of dy
//
// float32: every product is one call of kernels::sgemm (oneDNN), which threads
// itself over num_threads(); the bias and its gradient are vectorised loops.
// bfloat16: every product is one call of kernels::gemm_bf16 (oneDNN's matmul
// on AMX / AVX512_BF16, or float32 conversion where the CPU has neither, see
// kernels::bf16_gemm_path), accumulated in float32 and rounded once to bf16;
// the bias is added in float32 before that rounding, and db is summed in
// float32 and rounded once. Results do not depend on the thread count beyond
// the rounding of oneDNN's blocking.
#pragma once

#include <cstdint>

#include "kernels/gemm_bf16.h"

namespace attnkit::kernels {

/// Row-major matrices with unit column stride and the given row strides (in
/// elements), so a (rows, in) view of a larger tensor costs no copy. The
/// weight may also be stored transposed, (in, out) row-major (the `.t()` view
/// of a parameter kept as x W, as the agglomerative layer keeps its own).
/// T is float or bf16; x, weight, bias, y and the gradients share it.
template <typename T>
struct LinearParamsT {
  const T* x = nullptr;           // (rows, in)
  int64_t x_row_stride = 0;
  const T* weight = nullptr;      // (out, in); (in, out) when weight_transposed
  int64_t weight_row_stride = 0;  // of the layout as stored
  bool weight_transposed = false;
  const T* bias = nullptr;        // (out) contiguous; nullptr: no bias
  int64_t rows = 0, in = 0, out = 0;
};
using LinearParams = LinearParamsT<float>;
using LinearParamsBf16 = LinearParamsT<bf16>;

/// Writes y (rows, out) with row stride y_row_stride.
void linear_forward(const LinearParams& p, float* y, int64_t y_row_stride);
void linear_forward(const LinearParamsBf16& p, bf16* y, int64_t y_row_stride);

/// Reads dy (rows, out) with row stride dy_row_stride and writes, for each
/// non-null destination, dx (rows, in), dweight and dbias (out), all
/// contiguous and fully overwritten; dweight in the weight's stored layout,
/// (out, in) or (in, out) when weight_transposed. Gradients nobody asked for
/// cost nothing.
template <typename T>
struct LinearGradientsT {
  T* dx = nullptr;
  T* dweight = nullptr;
  T* dbias = nullptr;
};
using LinearGradients = LinearGradientsT<float>;
using LinearGradientsBf16 = LinearGradientsT<bf16>;
void linear_backward(const LinearParams& p, const float* dy, int64_t dy_row_stride,
                     const LinearGradients& grads);
void linear_backward(const LinearParamsBf16& p, const bf16* dy, int64_t dy_row_stride,
                     const LinearGradientsBf16& grads);

}  // namespace attnkit::kernels
