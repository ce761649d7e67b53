// Agglomerative attention (see docs/MATH.md, Agglomerative attention) on class
// weights: forward and backward over pointers, sizes and strides. Torch-free.
//
// One head per class h. With u_t = cr_t v_t and D = max(den, clip):
//   full:   a = sum_t u_t / D(sum_t cr_t),          out_i = cq_i a
//   causal: a_i = sum_{t<=j} u_t / D(sum_{t<=j} cr_t) with j = i + S - L,
//           out_i = cq_i a_i, and out_i = 0 when j < 0 (no visible key).
// The clip has zero gradient where it is active (den < clip).
//
// Time O(N H (L + S) M), no L x S anything. Causal sums are blocked scans: the
// sequence is cut into fixed blocks of rows; a block's sums start from zero and
// are added to the carry of the blocks before it. Threads take (batch element,
// chunk of blocks) tasks and walk their rows in order, all classes of a row
// together (the layer's v and out interleave the classes within each row); a
// chunk that does not start the sequence gets its carry from a first pass over
// the block totals before it. Block totals are always combined in sequence
// order, so every result is bitwise the same for any thread count.
#pragma once

#include <cstdint>

#include "kernels/common/isa.h"

namespace attnkit::kernels {

/// Strides are in elements, one per dimension, in the order the shape is given.
struct AgglomerativeParams {
  const float* cq = nullptr;  // (N, H, L) query class weights
  int64_t cq_stride[3] = {};
  const float* cr = nullptr;  // (N, H, S) reference class weights
  int64_t cr_stride[3] = {};
  const float* v = nullptr;   // (N, H, S, M) projected values
  int64_t v_stride[4] = {};
  float* out = nullptr;       // (N, H, L, M), written by the forward
  int64_t out_stride[4] = {};

  // What the backward reads, written by the forward when non-null: the class
  // averages a the queries read, contiguous (N, H, R, M), and their unclipped
  // denominators, contiguous (N, H, R); R = L when causal (rows with no visible
  // key hold zeros), R = 1 when full (one average serves every query).
  // den decides whether the forward saves: with M = 0, avg holds nothing and
  // may be null (an empty tensor's data), while den must still be written.
  float* avg = nullptr;
  float* den = nullptr;

  int64_t N = 0, H = 0, L = 0, S = 0, M = 0;
  bool causal = false;
  float clip = 1e-3f;  // > 0
};

/// The backward reads cq, cr, v, avg and den (as left by the forward) and writes
/// dcq, dcr, dv, each fully overwritten.
struct AgglomerativeBackwardParams : AgglomerativeParams {
  const float* dout = nullptr;  // (N, H, L, M)
  int64_t dout_stride[4] = {};
  float* dcq = nullptr;         // (N, H, L)
  int64_t dcq_stride[3] = {};
  float* dcr = nullptr;         // (N, H, S)
  int64_t dcr_stride[3] = {};
  float* dv = nullptr;          // (N, H, S, M)
  int64_t dv_stride[4] = {};
};

}  // namespace attnkit::kernels

ATTNKIT_KERNELS_BEGIN  // inline code of a header that level TUs include (isa.h)
/// The row count R of the avg and den arrays: L when causal, 1 when full.
inline int64_t agglomerative_saved_rows(bool causal, int64_t L) { return causal ? L : 1; }
ATTNKIT_KERNELS_END

namespace attnkit::kernels {

/// Writes out (and avg, den when given). Threads: num_threads().
void agglomerative_forward(const AgglomerativeParams& p);

/// Writes dcq, dcr, dv. Threads: num_threads().
void agglomerative_backward(const AgglomerativeBackwardParams& p);

}  // namespace attnkit::kernels
