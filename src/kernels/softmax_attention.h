// Exact softmax attention, tiled FlashAttention-2 style: forward and backward
// (SPECS section 1) over pointers, sizes and strides. Torch-free.
//
//   out = softmax(scale * q k^T + bias) v, row-wise over the visible keys,
//   lse = log sum_j exp(scale * q_i . k_j + bias_ij) over the visible keys.
//
// Query i of batch n sees key j iff j < key_lengths[n] (when given) and, when
// causal, j <= i + S - L (bottom-right aligned); a bias entry of -inf hides a key
// too. A row with no visible key gets out = 0, lse = -inf and zero gradients.
//
// Neither pass allocates anything of size L x S. Scratch per thread: a few
// blocks; the backward pass adds a dQ accumulator of L x E floats, and copies
// of one head of q, k, v, dout when their columns are not contiguous.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

/// Strides are in elements, one per dimension, in the order the shape is given;
/// any strides work (a (N, L, H, E) tensor viewed as (N, H, L, E) costs no copy).
struct SoftmaxAttentionParams {
  const float* q = nullptr;    // (N, H, L, E)
  int64_t q_stride[4] = {};
  const float* k = nullptr;    // (N, H, S, E)
  int64_t k_stride[4] = {};
  const float* v = nullptr;    // (N, H, S, M)
  int64_t v_stride[4] = {};
  float* out = nullptr;        // (N, H, L, M): written by the forward, read by the backward
  int64_t out_stride[4] = {};
  float* lse = nullptr;        // (N, H, L) contiguous: written by the forward, read by the backward

  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0;
  float scale = 1.f;           // multiplies q k^T (usually 1 / sqrt(E))
  bool causal = false;
  const int64_t* key_lengths = nullptr;  // (N), each in [0, S]; nullptr: all keys visible
  const float* bias = nullptr;           // indexed as (N, H, L, S); nullptr: none
  int64_t bias_stride[4] = {};           // 0 broadcasts a dimension: the strides of
                                         // bias.expand({N, H, L, S}) in torch terms
};

/// The backward pass reads q, k, v, out, lse (as left by the forward) and the
/// masks from the base struct, and writes dq, dk, dv (each fully overwritten).
struct SoftmaxAttentionBackwardParams : SoftmaxAttentionParams {
  const float* dout = nullptr;  // (N, H, L, M)
  int64_t dout_stride[4] = {};
  float* dq = nullptr;          // (N, H, L, E)
  int64_t dq_stride[4] = {};
  float* dk = nullptr;          // (N, H, S, E)
  int64_t dk_stride[4] = {};
  float* dv = nullptr;          // (N, H, S, M)
  int64_t dv_stride[4] = {};
};

/// Writes out and lse. Threads: num_threads() over (batch, head, query block).
/// Each query block is computed by one thread in a fixed order, so the result
/// is bitwise the same for any thread count.
void softmax_attention_forward(const SoftmaxAttentionParams& p);

/// Writes dq, dk, dv. Threads: num_threads() over (batch, head), so at most
/// N * H threads work; each head is computed by one thread in a fixed order,
/// so the result is bitwise the same for any thread count.
void softmax_attention_backward(const SoftmaxAttentionBackwardParams& p);

}  // namespace attnkit::kernels
