// Rotary positions (RoPE) as an op of its own: rows of a (N, H, T, E) tensor
// rotated to positions offset + t (kernels/common/rotary.h has the rotation).
// Decoding applies it to each new query and key at its position, so that a
// cache holds rotated keys and exact attention runs without rotating them
// again at every step; modules apply it for mechanisms whose kernels do not
// rotate. Torch-free.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

struct RotaryParams {
  const float* x = nullptr;  // (N, H, T, E), any strides
  int64_t x_stride[4] = {};
  float* y = nullptr;        // (N, H, T, E), contiguous; may not overlap x
  int64_t N = 0, H = 0, T = 0, E = 0;
  int64_t dim = 0;           // rotated entries per row: even, 2 <= dim <= E
  double base = 10000.0;
  int64_t offset = 0;        // row t sits at position offset + t
  bool inverse = false;      // rotate back (by -position): the backward
};

/// Writes y. Threads: num_threads() over (batch, head); elementwise, so the
/// result does not depend on the thread count.
void rotary_embedding(const RotaryParams& p);

}  // namespace attnkit::kernels
