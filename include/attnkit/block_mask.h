// Block masks: which queries see which keys, stored by blocks of q_block
// queries x kv_block keys, as torch 2's FlexAttention stores them, so that a
// kernel visits only the blocks with something visible and applies no mask
// inside blocks where everything is.
//
// Each (batch, head, query block, key block) is empty (nothing visible),
// full (everything visible) or partial; a partial block keeps its bits, one
// per (query, key) pair. Memory: one byte and one int32 per block plus
// q_block * ceil(kv_block / 8) bytes per partial block (BlockMask::bytes()),
// never an L x S tensor: a causal mask at L = S = 16384 with blocks of 128
// holds 16384 blocks and 128 partial ones (2 KiB each), 336 KiB in all.
//
//   auto mask = attnkit::create_block_mask(attnkit::masks::documents(offsets, /*causal=*/true),
//                                          /*batch=*/1, /*heads=*/1, L, L);
//
// A mask function says whether query q of batch b and head h sees key kv;
// create_block_mask evaluates it once per pair, a chunk of query blocks at a
// time, and keeps the result in blocks. Batch or heads of 1 broadcast: the
// same mask for every batch entry or head.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace attnkit {

/// What a (query block, key block) holds.
enum class BlockKind : uint8_t { empty = 0, full = 1, partial = 2 };

/// True when query `q` of batch entry `b` and head `h` sees key `kv`.
using MaskFunction = std::function<bool(int64_t b, int64_t h, int64_t q, int64_t kv)>;

struct BlockMask {
  /// The grid the mask covers: L queries, S keys.
  int64_t q_len = 0, kv_len = 0;
  /// Block sizes (positive). The last block of a row or column may be cut
  /// short by L or S; its bits beyond them are 0.
  int64_t q_block = 128, kv_block = 128;
  /// uint8 (B, H, ceil(L / q_block), ceil(S / kv_block)): a BlockKind per
  /// block. B and H are the batch and head counts, or 1 to broadcast.
  torch::Tensor kinds;
  /// int32, kinds' shape: a partial block's index into `bits`, -1 elsewhere.
  torch::Tensor partial_index;
  /// uint8 (P, q_block, ceil(kv_block / 8)), P the partial blocks: query i of
  /// the block sees key j iff bit j % 8 of byte j / 8 of row i is set.
  torch::Tensor bits;

  int64_t batch() const { return kinds.size(0); }
  int64_t heads() const { return kinds.size(1); }
  int64_t q_blocks() const { return kinds.size(2); }
  int64_t kv_blocks() const { return kinds.size(3); }
  int64_t num_partial() const { return bits.size(0); }
  /// The bytes the mask holds: kinds, partial_index and bits.
  int64_t bytes() const;
  /// The share of (query, key) pairs of the L x S grid (per batch entry and
  /// head, averaged) in non-empty blocks: what a kernel over the mask visits.
  double visited_fraction() const;
  /// Whether query q of (b, h) sees key kv (b, h < batch(), heads(), or any
  /// value when that size is 1). One lookup: for tests and small uses.
  bool sees(int64_t b, int64_t h, int64_t q, int64_t kv) const;
  /// The mask as a bool (B, H, L, S) tensor, true where visible: O(L S).
  torch::Tensor to_dense() const;
};

/// Evaluates `mask` on every (b, h, q, kv) of the (batch, heads, L, S) grid,
/// a chunk of query blocks at a time (never an L x S tensor), in parallel
/// over query blocks: `mask` must be safe to call from several threads.
/// batch or heads of 1: one mask shared by every batch entry or head.
BlockMask create_block_mask(const MaskFunction& mask, int64_t batch, int64_t heads, int64_t L, int64_t S,
                            int64_t q_block = 128, int64_t kv_block = 128);

/// The block form of a bool tensor (B, H, R, S) of R query rows starting at a
/// multiple of q_block (rows past R are invisible): kinds, partial_index (the
/// partial blocks numbered from `first_partial` in (b, h, query block, key
/// block) order) and bits. create_block_mask and attnkit.create_block_mask
/// (Python, which evaluates its mask_mod over tensors) call it per chunk.
struct MaskBlocks {
  torch::Tensor kinds, partial_index, bits;
};
MaskBlocks mask_blocks(const torch::Tensor& rows, int64_t q_block, int64_t kv_block, int64_t first_partial = 0);

/// The pairs both masks (`block_mask_and`) or either mask (`block_mask_or`)
/// make visible. The masks must cover the same grid with the same blocks;
/// batch and heads broadcast (1 against n). A block whose bits come out all
/// set or all clear becomes full or empty.
BlockMask block_mask_and(const BlockMask& a, const BlockMask& b);
BlockMask block_mask_or(const BlockMask& a, const BlockMask& b);

/// Refuses (c10::Error naming `op` and what is wrong) a mask that is not
/// well formed or does not fit a (batch, heads, L, S) problem: dtypes,
/// shapes, kinds, partial indices in range (-1 exactly on blocks that are
/// not partial; blocks may share bits), no bit set outside the grid, batch
/// and heads 1 or equal to the problem's.
void check_block_mask(const char* op, const BlockMask& mask, int64_t batch, int64_t heads, int64_t L, int64_t S);

/// Named mask functions for the common patterns, with the library's
/// alignment: query i of L sits at key position i + S - L (the causal mask's
/// bottom-right alignment; with L = S, torch's `q_idx >= kv_idx`).
namespace masks {
/// kv <= q + S - L.
MaskFunction causal(int64_t L, int64_t S);
/// A local window as SoftmaxAttentionFuncOptions::window: the keys within
/// window - 1 of position q + S - L, before it when causal, on both sides
/// otherwise. window >= 1.
MaskFunction sliding_window(int64_t L, int64_t S, int64_t window, bool causal);
/// Packed documents over one sequence of L = S tokens: `offsets` (int64,
/// increasing from 0 to L, as varlen_attention's cu_seqlens) start each
/// document; a query sees the keys of its own document (causal: up to itself).
MaskFunction documents(const torch::Tensor& offsets, bool causal);
/// Prefix-LM: every query sees the first `prefix` keys, and the keys up to
/// its own position (kv < prefix or kv <= q + S - L).
MaskFunction prefix_lm(int64_t L, int64_t S, int64_t prefix);
/// A window plus `globals` global tokens (Longformer, BigBird): the keys of
/// sliding_window, every key below `globals`, and, when not causal, every key
/// for the global queries (q + S - L < globals). Causal: nothing past the
/// query's position.
MaskFunction global_window(int64_t L, int64_t S, int64_t globals, int64_t window, bool causal);
/// Dilated: the keys at a multiple of `dilation` from the query's position,
/// (q + S - L - kv) % dilation == 0, only before it when causal.
MaskFunction dilated(int64_t L, int64_t S, int64_t dilation, bool causal);
/// Pairs both functions (`all_of`) or either (`any_of`) make visible.
MaskFunction all_of(std::vector<MaskFunction> functions);
MaskFunction any_of(std::vector<MaskFunction> functions);
}  // namespace masks

}  // namespace attnkit
