// The q, k, v, out block every attention kernel's Params struct starts with
// (as FlashAttention's Qkv_params), and the matching gradient block of the
// backward passes.
//
// Strides are in elements, one per dimension, in the order the shape is given;
// any strides work for inputs (a (N, L, H, E) tensor viewed as (N, H, L, E)
// costs no copy). Each kernel's header states what it needs of output strides.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

struct QkvParams {
  const float* q = nullptr;  // (N, H, L, E) queries
  int64_t q_stride[4] = {};
  const float* k = nullptr;  // (N, H, S, E) keys
  int64_t k_stride[4] = {};
  const float* v = nullptr;  // (N, H, S, M) values
  int64_t v_stride[4] = {};
  float* out = nullptr;      // (N, H, L, M): written by the forward, read by backwards that need it
  int64_t out_stride[4] = {};

  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0;
  /// Grouped-query heads: k and v have H / kv_group heads, and query head h
  /// reads key and value head kv_head(h). A kernel that takes kv_group > 1
  /// says so in its header; the others are only ever given 1.
  int64_t kv_group = 1;
  int64_t kv_head(int64_t h) const { return h / kv_group; }
};

/// What a backward pass adds: the output gradient it reads and the input
/// gradients it writes (each fully overwritten).
struct QkvGrads {
  const float* dout = nullptr;  // (N, H, L, M)
  int64_t dout_stride[4] = {};
  float* dq = nullptr;          // (N, H, L, E)
  int64_t dq_stride[4] = {};
  float* dk = nullptr;          // (N, H, S, E)
  int64_t dk_stride[4] = {};
  float* dv = nullptr;          // (N, H, S, M)
  int64_t dv_stride[4] = {};
};

}  // namespace attnkit::kernels
