// Exact softmax attention, tiled FlashAttention-2 style: forward and backward
// over pointers, sizes and strides (see docs/MATH.md, Exact softmax attention).
// Torch-free.
//
//   out = softmax(scale * q k^T + bias - alibi) v, row-wise over the visible keys,
//   lse = log sum_j exp(scale * q_i . k_j + bias_ij - alibi_ij) over the visible keys,
//   alibi_ij = slope_h |i + S - L - j|  (ALiBi, when slopes are given: a
//   distance penalty computed in the tile, with the bottom-right alignment of
//   the causal mask, so one query over a cache sits at the cache's end).
// With rotary positions q_i and k_j stand rotated (kernels/common/rotary.h)
// to the positions i + S - L and j, the same alignment: each block of q and k
// is rotated as it is loaded, and the backward rotates dq and dk back.
//
// Query i of batch n sees key j iff j < key_lengths[n] (when given) and, when
// causal, j <= i + S - L (bottom-right aligned; see docs/MATH.md, Masks and
// visibility), and, with a window W, j > i + S - L - W (and j < i + S - L + W
// when not causal); a bias entry of -inf hides a key too. A window's tiles
// outside the band are skipped: the cost is O(L (W + block)), not O(L S). A
// block mask hides more pairs: the passes visit only its non-empty blocks
// (each tile inside one block), take nothing from it inside full blocks and
// hide the clear bits of partial ones, so the cost follows the non-empty
// blocks; it takes the sgemm or lane tiles (not a window's band tiles), and
// no key split or grouped decoding rows. A row with no visible key
// gets out = 0, lse = -inf and zero gradients. A NaN score of a visible key
// (from q, k or the bias) makes its row's out and lse NaN, as torch's softmax.
//
// With attention dropout the weights P_ij that multiply v are P_ij Z_ij /
// (1 - p), Z the keep mask of kernels/common/dropout.h, drawn per tile after
// the exponentials (the row sums count every visible key) and drawn again by
// the backward: dV = (P o Z)^T dO / (1 - p), dP = (dO V^T) o Z / (1 - p),
// dS = P o (dP - D) with D_i = dO_i . out_i as without dropout.
//
// Neither pass allocates anything of size L x S. Scratch per thread: a few
// blocks; the backward pass adds a dQ accumulator of L x E floats, and copies
// of one head of q, k, v, dout unless its rows lie one after another (of q
// and k always, with rotary positions): the backward reads each many times. Rotary positions add one table of
// max(L, S) x rotary_dim floats per call, shared by the threads. A
// forward that splits the keys (see softmax_attention_forward) adds the
// accumulators of its key chunks, under 128 x 128 x (M + 2) floats.
#pragma once

#include <cstdint>

#include "kernels/common/block_mask_view.h"
#include "kernels/common/params.h"
#include "kernels/common/score_program.h"

namespace attnkit::kernels {

/// q, k, v, out and the sizes come from QkvParams; out may have any strides.
/// Grouped-query heads (kv_group > 1): k and v have H / kv_group heads; in
/// the backward, dk and dv are still per *query* head, (N, H, S, E) and
/// (N, H, S, M): each query head's share, which the caller sums over its group
/// (so that every entry keeps one writer and a fixed order).
struct SoftmaxAttentionParams : QkvParams {
  float* lse = nullptr;        // (N, H, L) contiguous: written by the forward, read by the backward

  float scale = 1.f;           // multiplies q k^T (usually 1 / sqrt(E))
  bool causal = false;
  const int64_t* key_lengths = nullptr;  // (N), each in [0, S]; nullptr: all keys visible
  const float* bias = nullptr;           // indexed as (N, H, L, S); nullptr: none
  int64_t bias_stride[4] = {};           // 0 broadcasts a dimension: the strides of
                                         // bias.expand({N, H, L, S}) in torch terms
  const float* alibi_slopes = nullptr;   // (H) ALiBi slopes (any sign); nullptr: none.
                                         // Constants: the backward gives them no gradient
  int64_t rotary_dim = 0;                // RoPE on the first rotary_dim entries of q and k
                                         // (even, <= E); 0: none
  double rotary_base = 10000.0;          // theta_c = rotary_base^(-2c / rotary_dim)
  int64_t window = 0;                    // > 0: each query sees only keys within window - 1
                                         // of its position i + S - L; 0: none
  // Attention dropout (kernels/common/dropout.h): P_ij kept and scaled, or
  // zeroed, as that file draws it for batch n + dropout_batch_offset.
  double dropout_p = 0.0;                // in [0, 1); 0: no dropout
  uint64_t dropout_seed = 0;
  int64_t dropout_batch_offset = 0;      // the draw's batch index of n = 0
  // A block mask (kernels/common/block_mask_view.h) over the (L, S) grid,
  // indexed by query head; it hides pairs on top of every mask above.
  BlockMaskView block_mask;
  // Attention sinks (gpt-oss): (H) one logit per query head that joins every
  // row's softmax without a value, so that a row may put weight on nothing:
  // lse_i = log(sum_j exp(s_ij) + exp(sink_h)), out_i = sum_j exp(s_ij -
  // lse_i) v_j. A row with no visible key then gives out = 0 and lse = sink_h.
  // nullptr: none.
  const float* sinks = nullptr;
  // Soft-capping (Gemma 2): > 0 makes the scores scale q k^T into
  // softcap tanh(scale q k^T / softcap) before the bias, ALiBi and the masks
  // act; the backward multiplies their gradient by 1 - tanh^2. 0: none.
  float softcap = 0.f;
  // A traced score modifier (kernels/common/score_program.h), run on the
  // scaled (and soft-capped) scores before the bias, ALiBi and the masks:
  // s_ij = mod(s_ij, n, h, i, j). Inactive (size 0): none.
  ScoreProgram score_mod;
};

/// The backward pass reads q, k, v, out, lse (as left by the forward) and the
/// masks from the base struct, and writes dq, dk, dv (each fully overwritten;
/// any strides) and, when dbias is set, dbias.
struct SoftmaxAttentionBackwardParams : SoftmaxAttentionParams, QkvGrads {
  /// The bias gradient dS_ij = P_ij (dP_ij - D_i) (the gradient of the scores
  /// scale q_i . k_j + bias_ij), summed over every dimension d whose
  /// dbias_shape[d] is 1 while the full size is not: the gradient of a bias of
  /// that shape broadcast to (N, H, L, S). Contiguous, fully overwritten.
  /// nullptr: not computed (then dbias_shape is ignored).
  float* dbias = nullptr;
  int64_t dbias_shape[4] = {};  // each 1 or the full size of (N, H, L, S)
  /// The gradient of lse, (N, H, L) contiguous, when the caller's loss reads
  /// lse too (merging attention over key sets): it adds dlse_i P_ij to the
  /// scores' gradient, D_i = dout_i . out_i - dlse_i. nullptr: none.
  const float* dlse = nullptr;
  /// (H), written when sinks are given: d sink_h = -sum_(n, i) P_sink D_i with
  /// P_sink = exp(sink_h - lse_i), summed over n in order. nullptr: not computed.
  float* dsinks = nullptr;
  /// (score_mod.tables_numel), fully overwritten when given: the gradient of
  /// the score modifier's captured tensors (its flat `tables`), each work
  /// item's share summed in item order. nullptr: not computed.
  float* dscore_tables = nullptr;
};

/// Writes out and lse. Threads: num_threads() over (batch, head, query block).
/// Each query block is computed by one thread in a fixed order, so the result
/// is bitwise the same for any thread count.
///
/// Decoding with grouped-query heads (L = 1, kv_group G > 1, and no bias,
/// ALiBi, rotary positions, window or dropout) attends the G query heads of each
/// key/value head as the G rows of one block, so each key/value head's keys
/// are read once per group, not once per query head; equal to the head-by-head
/// result to rounding, and like it bitwise the same for any thread count.
///
/// Without a bias tensor, dropout or a window, with at least 16 queries
/// (not decoding), and where the band kernels exist
/// (avx2 and above: kernels/sparse_band.h), tiles are 32 query rows (the
/// vector lanes) by 256 keys, each computed in L1 and registers: scores,
/// softmax and the product with v, one tile's softmax joined to the next by
/// the log-sum-exp rule. Otherwise query tiles are 128 rows by 256 keys
/// through sgemm; with a window whose band of keys (W, or 2 W - 1 when not
/// causal, plus 63) fits in 1024, 64 rows by the band's width, so that one
/// product covers each block's band.
///
/// Few queries over many keys (decoding: L = 1 over a long cache): when
/// N H ceil(L / BQ) < 64 (BQ the query tile) and S >= 2048, each (batch, head, query block) item
/// also splits its keys into chunks of >= 1024 keys (whole 256-key blocks),
/// so that up to 64 items share the threads even at N = H = L = 1. Each chunk
/// keeps its own row max, sum of exponentials and unnormalised output; a
/// second pass merges the chunks of a row in chunk order with the
/// log-sum-exp rule, and lse is the merged one (what the backward reads).
/// How the keys are chunked depends on the shape alone, never on the thread
/// count, so this path too is bitwise the same for any thread count. Extra
/// memory: the chunks' accumulators, under 128 x 128 x (M + 2) floats.
void softmax_attention_forward(const SoftmaxAttentionParams& p);

/// Into how many chunks softmax_attention_forward splits the keys of each
/// item for p's shape (it reads only N, H, L, S); 1: the keys are not split.
/// For tests and benchmarks, which need to know which path a shape takes.
int64_t softmax_attention_forward_key_chunks(const SoftmaxAttentionParams& p);

/// Writes dq, dk, dv (and dbias). Threads: num_threads() over (batch, head)
/// and, when N H < 8 and there is no bias, over parts of each head's keys
/// (whole key blocks, up to 8 items in all): a part owns its keys' dk and dv
/// and adds its terms of dq into an L x E buffer of its own, and the parts'
/// buffers are summed in part order. The parts depend on the shape alone, and
/// each item runs in a fixed order, so the result is bitwise the same for any
/// thread count.
///
/// dbias: when every head has its own slice of it (dbias_shape[0] == N or
/// N == 1, and dbias_shape[1] == H or H == 1) each head's thread sums its dS
/// tiles into its slice as it goes, at no extra cost. When heads share a slice
/// a second pass recomputes P and dP (two of the five block products) over
/// work items that each own a disjoint part of dbias (a slice, times query
/// blocks unless dbias sums over L, times key blocks unless it sums over S)
/// and add the heads of the slice in increasing (n, h) order. Either way every
/// entry has one writer and a fixed summation order: no atomics, bitwise the
/// same for any thread count. Memory: dbias itself (the caller's), per thread
/// two query x key blocks, L floats and packed blocks of strided inputs, and
/// with parts their dq buffers (parts x L x E floats per head); nothing of
/// size N H L S.
void softmax_attention_backward(const SoftmaxAttentionBackwardParams& p);

}  // namespace attnkit::kernels
