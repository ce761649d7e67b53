// Gated linear attention (see docs/MATH.md, Gated linear attention) over
// pointers, sizes and strides, forward and backward, float32. Torch-free.
//
// The recurrence:
//   C_t = alpha_t C_{t-1} + beta_t f_t f_t^T,  C_{-1} = 0;
//   causal: out_t = C_t q_t,  otherwise out_t = C_{L-1} q_t.
// Forward in chunks (decays inside a chunk as explicit products, never ratios,
// so alpha = 0 is fine). Backward: non-causal needs no state at all (scalar
// recurrences); causal either re-runs the forward storing C at every chunk start
// (checkpoints, the default) or inverts the recurrence step by step from C_{L-1},
// C_{t-1} = (C_t - beta_t f_t f_t^T) / alpha_t, which drifts in float32 and
// fails for alpha_t = 0 (kept to measure exactly that).
//
// Input strides are in elements, one per dimension in the order the shape is
// given, any values. Output matrices may have any row strides but need a unit
// last stride, so that GEMMs write them in place. Threads: num_threads() over
// (batch, head); each head is computed by one thread in a fixed order, so
// results are bitwise the same for any thread count.
#pragma once

#include <cstdint>

#include "kernels/linear_attention.h"  // kDefaultLinearChunk

namespace attnkit::kernels {

struct GatedLinearAttentionParams {
  const float* f = nullptr;  // (N, H, L, E)
  int64_t f_stride[4] = {};
  const float* q = nullptr;  // (N, H, L, E)
  int64_t q_stride[4] = {};
  const float* alpha = nullptr;  // (N, H, L)
  int64_t alpha_stride[3] = {};
  const float* beta = nullptr;  // (N, H, L)
  int64_t beta_stride[3] = {};
  float* out = nullptr;  // (N, H, L, E)
  int64_t out_stride[4] = {};

  int64_t N = 0, H = 0, L = 0, E = 0;
  bool causal = false;
  int64_t chunk = kDefaultLinearChunk;  // >= 1
};

enum class GatedBackwardMethod {
  checkpoints,       // C stored at every chunk start: O((L / chunk) E^2) scratch per head
  reverse_recompute  // inversion from C_{L-1}: O(E^2) scratch, drifts (see top)
};

/// Reads f, q, alpha, beta; writes df, dq and, when non-null, dalpha, dbeta.
struct GatedLinearAttentionBackwardParams : GatedLinearAttentionParams {
  const float* dout = nullptr;  // (N, H, L, E)
  int64_t dout_stride[4] = {};
  float* df = nullptr;  // (N, H, L, E)
  int64_t df_stride[4] = {};
  float* dq = nullptr;  // (N, H, L, E)
  int64_t dq_stride[4] = {};
  float* dalpha = nullptr;  // (N, H, L) contiguous, or nullptr when not needed
  float* dbeta = nullptr;   // (N, H, L) contiguous, or nullptr when not needed
  GatedBackwardMethod method = GatedBackwardMethod::checkpoints;  // causal only
};

/// Writes out.
void gated_linear_attention_forward(const GatedLinearAttentionParams& p);
/// Writes df, dq, dalpha, dbeta. The non-causal form needs no stored state, so
/// `method` only matters when causal.
void gated_linear_attention_backward(const GatedLinearAttentionBackwardParams& p);

}  // namespace attnkit::kernels
