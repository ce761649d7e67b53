// Sparse attention over CSR edge lists (the SAC paper; docs/MATH.md, "Sparse
// attention"): forward and backward over pointers, sizes and strides.
// Torch-free.
//
//   out_i = sum_{j in N(i)} P_ij v_j,  P_ij = exp(scale q_i . k_j - lse_i),
//   lse_i = log sum_{j in N(i)} exp(scale q_i . k_j),
//
// with N(i) the columns of row i of the head's edge list. A row with no edge
// gets out = 0, lse = -inf and zero gradients (as the reference's masked
// softmax). A NaN score makes its row's out and lse NaN.
//
// Cost: time O(nnz (E + M)) per head, plus the dense tiles below; extra memory
// the row statistics lse (N H L, the caller's) and, in the backward pass,
// D_i = dout_i . out_i (N H L floats), the transposed edge list (as many
// entries as the heads' lists hold), per-thread tiles, and copies of q, k, v,
// out, dout when their columns are not contiguous. Nothing of size L x S.
//
// How a block of rows is computed (forward, and the dq pass of the backward):
// the rows of a block of kBlockRows consecutive queries whose edges fill at
// least half of the rectangle rows x [first column, last column] (banded
// patterns: local, segments, causal, full) run as dense tiles: sgemm of the
// block's queries against 256 consecutive keys (contiguous rows of k and v, no
// gather), the columns outside each row's list set to -inf, then the online
// softmax and sgemm with the values. Other blocks go one edge at a time: a dot
// product over E and an axpy over M per edge, over contiguous rows. The dk, dv
// pass does the same per block of keys over the transposed list (the rows of
// each key in increasing order).
//
// Determinism: every output row (of out, lse, dq) and every key (of dk, dv) is
// computed by one work item in an order fixed by the edge list alone, with no
// atomics, so results are bitwise the same for any thread count.
#pragma once

#include <cstdint>

#include "kernels/common/params.h"

namespace attnkit::kernels {

/// q, k, v, out and the sizes come from QkvParams; out may have any strides.
struct SparseAttentionParams : QkvParams {
  float* lse = nullptr;  // (N, H, L) contiguous: written by the forward, read by the backward
  float scale = 1.f;     // multiplies q k^T (usually 1 / sqrt(E))

  /// CSR edge lists, contiguous: offsets (lists, L + 1) and the columns they
  /// index. lists is 1 (every head uses offsets[0]) or H (head h uses
  /// offsets[h]). Row i of a list holds columns[offsets[i] : offsets[i + 1]],
  /// strictly increasing, each in [0, S). (check_edge_list checks all of this.)
  const int64_t* offsets = nullptr;
  const int64_t* columns = nullptr;
  int64_t lists = 1;
};

/// The backward pass reads q, k, v, out, lse (as left by the forward) and the
/// edge lists from the base struct, and writes dq, dk, dv (each fully
/// overwritten; any strides).
struct SparseAttentionBackwardParams : SparseAttentionParams, QkvGrads {};

/// Writes out and lse. Threads: num_threads() over (batch, head, row block).
void sparse_attention_forward(const SparseAttentionParams& p);

/// Writes dq, dk, dv. Two passes: dq (and D) over (batch, head, row block),
/// then dk and dv over (batch, head, key block) through the transposed edge
/// list, built once per call. Threads: num_threads() in each pass.
void sparse_attention_backward(const SparseAttentionBackwardParams& p);

}  // namespace attnkit::kernels
