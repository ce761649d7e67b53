// Exact softmax attention on bfloat16 inputs, on AMX tiles: forward and
// backward. Torch-free. The same function and masks as softmax_attention.h
// (see docs/MATH.md, Exact softmax attention), without a bias:
//
//   out = softmax(scale * q k^T) v over the visible keys, lse as there.
//
// Precision: every product takes bf16 operands and accumulates in float32
// (TDPBF16PS). Scores, the softmax, its statistics (lse, float32) and the
// running output stay float32; the probabilities P and, in the backward, dS
// are rounded to bf16 once, as the operands of the products that follow.
// out, dq, dk, dv are rounded to bf16 once, from float32 accumulators.
//
// Layout: each pass first copies every head's operands into the layouts the
// tiles read (amx.h), padded to multiples of 32 rows and columns: the forward
// N H S (E + M) bf16 values, the backward N H (S (2E + M) + 2 L (E + M))
// values and L floats. Work items then run in parallel, each in a fixed order,
// so results are bitwise the same for any thread count. Nothing of size L x S
// is allocated.
//
// Built at the amx level only (isa.h); below it the op layer runs the float32
// kernel on converted inputs (and for a bias).
#pragma once

#include <cstdint>

#include "kernels/gemm_bf16.h"

namespace attnkit::kernels {

struct SoftmaxAttentionBf16Params {
  const bf16* q = nullptr;  // (N, H, L, E), any strides
  int64_t q_stride[4] = {};
  const bf16* k = nullptr;  // (N, H, S, E)
  int64_t k_stride[4] = {};
  const bf16* v = nullptr;  // (N, H, S, M)
  int64_t v_stride[4] = {};
  bf16* out = nullptr;      // (N, H, L, M), any strides
  int64_t out_stride[4] = {};
  float* lse = nullptr;     // (N, H, L) contiguous: written by the forward, read by the backward
  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0;

  float scale = 1.f;
  bool causal = false;
  const int64_t* key_lengths = nullptr;  // (N), each in [0, S]; nullptr: all keys visible
};

struct SoftmaxAttentionBf16BackwardParams : SoftmaxAttentionBf16Params {
  const bf16* dout = nullptr;  // (N, H, L, M)
  int64_t dout_stride[4] = {};
  bf16* dq = nullptr;          // (N, H, L, E), fully overwritten
  int64_t dq_stride[4] = {};
  bf16* dk = nullptr;          // (N, H, S, E)
  int64_t dk_stride[4] = {};
  bf16* dv = nullptr;          // (N, H, S, M)
  int64_t dv_stride[4] = {};
};

/// True when this process runs at the amx level (isa::current()), so the
/// kernels below exist; calling them otherwise throws std::logic_error.
bool softmax_attention_bf16_available();

/// Writes out and lse. Threads: num_threads() over (batch, head, block of 64
/// queries).
void softmax_attention_forward_bf16(const SoftmaxAttentionBf16Params& p);

/// Writes dq, dk, dv. Threads: num_threads() over (batch, head, part of the
/// keys): one part per head when N H >= 8, else up to 8 items in all, as the
/// float32 backward; each part adds its terms of dq into a buffer of its own
/// (E x L floats), and the buffers are summed in part order.
void softmax_attention_backward_bf16(const SoftmaxAttentionBf16BackwardParams& p);

}  // namespace attnkit::kernels
