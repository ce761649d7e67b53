// Sparse attention over CSR edge lists (the SAC paper; docs/MATH.md, "Sparse
// attention"): forward and backward over pointers, sizes and strides.
// Torch-free.
//
//   out_i = sum_{j in N(i)} P_ij v_j,  P_ij = exp(s_ij - lse_i),
//   lse_i = log sum_{j in N(i)} exp(s_ij),  s_ij = scale q_i . k_j - alibi_ij,
//   alibi_ij = slope_h |i + S - L - j|  (ALiBi, when slopes are given),
//
// with N(i) the columns of row i of the head's edge list. ALiBi's penalty is
// computed where each score is (per tile, band block or edge), with the
// causal mask's bottom-right alignment (query i at key position i + S - L),
// in the forward and in the backward's recomputation: nothing of size L x S.
// Grouped-query heads (kv_group > 1): k and v have H / kv_group heads, query
// head h reads kv_head(h); dk and dv are still per *query* head, (N, H, S, E)
// and (N, H, S, M), each query head's share, which the caller sums over its
// group in a fixed order (as the exact kernel's). A row with no edge
// gets out = 0, lse = -inf and zero gradients (as the reference's masked
// softmax). A NaN score makes its row's out and lse NaN.
//
// Cost: time O(nnz (E + M)) per head, plus the dense tiles below; extra memory
// the row statistics lse (N H L, the caller's) and, in the backward pass when
// N H < 8, the key gradients of each part (below): per (batch, head) E + M
// floats per key of each part's key range (S (E + M) plus the overlaps of the
// ranges); per-thread tiles; copies of q, k, v, out, dout when their columns
// are not contiguous. Nothing of size L x S.
//
// How a block of rows is computed: the rows of a block of kBlockRows
// consecutive queries whose edges fill at least half of the rectangle rows x
// [first column, last column] (banded patterns: local, segments, causal, full)
// run as dense tiles, over contiguous rows of k and v (no gather). When the
// block's keys fit one 256-key tile and each row's entries are one run of keys
// (a band), AVX-512 register kernels compute the tile (scores transposed, one
// key per row with the block's rows in the lanes, and a two-compare mask per
// key); otherwise sgemm of the block's queries against 256 keys at a time, the
// columns outside each row's list set to -inf, the online softmax and sgemm
// with the values. Other blocks go one edge at a time: a dot product over E and
// an axpy over M per edge, over contiguous rows. The backward pass computes P
// and dS once per tile (or per edge) and derives dq, dk and dv from them, like
// the exact kernel.
//
// Determinism: every output row (of out, lse, dq) is computed by one work item
// in an order fixed by the edge list alone. dk and dv are first summed per
// "part", a run of row blocks of one (batch, head) whose number depends only on
// N and H, into the part's own buffer (or, with one part, straight into dk and
// dv), then the parts covering each key are added in part order: no atomics,
// and results are bitwise the same for any thread count.
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

  const float* alibi_slopes = nullptr;  // (H) ALiBi slopes (any sign); nullptr: none.
                                        // Constants: the backward gives them no gradient
};

/// The backward pass reads q, k, v, out, lse (as left by the forward) and the
/// edge lists from the base struct, and writes dq, dk, dv (each fully
/// overwritten; any strides).
struct SparseAttentionBackwardParams : SparseAttentionParams, QkvGrads {};

/// Writes out and lse. Threads: num_threads() over (batch, head, row block).
void sparse_attention_forward(const SparseAttentionParams& p);

/// Writes dq, dk, dv. Two passes: dq and each part's key gradients over
/// (batch, head, part), enough parts per head for 8 work items when N H < 8;
/// then the parts' sums over (batch, head, key block). Threads: num_threads()
/// in each pass.
void sparse_attention_backward(const SparseAttentionBackwardParams& p);

}  // namespace attnkit::kernels
