// Dense (fully connected) layer, forward and backward, over pointers and row
// strides. Torch-free. See docs/MATH.md, Dense layers.
//
//   y = x W^T + b          x (rows, in), W (out, in), b (out), y (rows, out)
//   dx = dy W,  dW = dy^T x,  db = sum over rows of dy
//
// Every product is one call of kernels::sgemm (oneDNN), which threads itself
// over num_threads(); the bias and its gradient are vectorised loops. Results
// do not depend on the thread count beyond the rounding of oneDNN's blocking.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

/// Row-major matrices with unit column stride and the given row strides (in
/// elements), so a (rows, in) view of a larger tensor costs no copy. The
/// weight may also be stored transposed, (in, out) row-major (the `.t()` view
/// of a parameter kept as x W, as the agglomerative layer keeps its own).
struct LinearParams {
  const float* x = nullptr;       // (rows, in)
  int64_t x_row_stride = 0;
  const float* weight = nullptr;  // (out, in); (in, out) when weight_transposed
  int64_t weight_row_stride = 0;  // of the layout as stored
  bool weight_transposed = false;
  const float* bias = nullptr;    // (out) contiguous; nullptr: no bias
  int64_t rows = 0, in = 0, out = 0;
};

/// Writes y (rows, out) with row stride y_row_stride.
void linear_forward(const LinearParams& p, float* y, int64_t y_row_stride);

/// Reads dy (rows, out) with row stride dy_row_stride and writes, for each
/// non-null destination, dx (rows, in), dweight and dbias (out), all
/// contiguous and fully overwritten; dweight in the weight's stored layout,
/// (out, in) or (in, out) when weight_transposed. Gradients nobody asked for
/// cost nothing.
struct LinearGradients {
  float* dx = nullptr;
  float* dweight = nullptr;
  float* dbias = nullptr;
};
void linear_backward(const LinearParams& p, const float* dy, int64_t dy_row_stride,
                     const LinearGradients& grads);

}  // namespace attnkit::kernels
