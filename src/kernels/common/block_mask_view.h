// The kernels' view of a block mask (include/attnkit/block_mask.h, the
// type's documentation): which (query block, key block) of a head is empty,
// full or partial, and a partial block's bits, as pointers and sizes.
// Torch-free.
//
// A kernel over a block mask visits only the non-empty blocks, applies nothing
// inside full ones and hides the pairs whose bit is clear in partial ones (a
// score of -inf, as the other masks). Scanning a row or column of kinds costs
// one byte per block, far below a block's work, so the kernels need no list of
// the non-empty blocks beside the kinds.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "base/isa_namespace.h"
#include "kernels/common/simd.h"

// The view is part of the kernels' parameters (shared by every level); the
// functions below are compiled per level.
namespace attnkit::kernels {

/// The values of BlockKind (include/attnkit/block_mask.h).
constexpr uint8_t kEmptyBlock = 0, kFullBlock = 1, kPartialBlock = 2;

struct BlockMaskView {
  const uint8_t* kinds = nullptr;          // (batch, heads, q_blocks, kv_blocks) contiguous; nullptr: no mask
  const int32_t* partial_index = nullptr;  // kinds' shape: a partial block's index into bits
  const uint8_t* bits = nullptr;           // (partials, q_block, row_bytes()): bit j % 8 of byte j / 8
                                           // of row i set when the block's query i sees its key j
  int64_t batch = 1, heads = 1;            // 1 broadcasts over the problem's N or H
  int64_t q_block = 128, kv_block = 128;
  int64_t q_blocks = 0, kv_blocks = 0;

  bool active() const { return kinds != nullptr; }
  int64_t row_bytes() const { return (kv_block + 7) / 8; }

  /// Block (qb, kb)'s entry of (n, h): its offset into kinds and partial_index.
  int64_t entry(int64_t n, int64_t h, int64_t qb, int64_t kb) const {
    const int64_t nb = batch == 1 ? 0 : n, hb = heads == 1 ? 0 : h;
    return ((nb * heads + hb) * q_blocks + qb) * kv_blocks + kb;
  }
  uint8_t kind(int64_t n, int64_t h, int64_t qb, int64_t kb) const { return kinds[entry(n, h, qb, kb)]; }
  /// Row r of partial block (qb, kb) of (n, h): row_bytes() bytes.
  const uint8_t* bit_row(int64_t n, int64_t h, int64_t qb, int64_t kb, int64_t r) const {
    return bits + (static_cast<int64_t>(partial_index[entry(n, h, qb, kb)]) * q_block + r) * row_bytes();
  }
};

}  // namespace attnkit::kernels

ATTNKIT_KERNELS_BEGIN

/// x[c] = -inf for c < n where bit (first + c) of `bits` is clear (bit t is
/// bit t % 8 of byte t / 8); the others stay.
inline void hide_by_bits(float* x, int64_t n, const uint8_t* bits, int64_t first) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  int64_t c = 0;
  if (first % 8 == 0) {  // whole bytes: 8 keys at a time
    const uint8_t* byte = bits + first / 8;
    for (; c + 8 <= n; c += 8, ++byte) {
      if (*byte == 0xFF) continue;
#ifdef __AVX512F__
      _mm256_mask_storeu_ps(x + c, static_cast<__mmask8>(~*byte), _mm256_set1_ps(-kInf));
#elif ATTNKIT_AVX2
      const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      const __m256i kept = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(*byte), select), select);
      _mm256_storeu_ps(x + c, _mm256_blendv_ps(_mm256_set1_ps(-kInf), _mm256_loadu_ps(x + c),
                                               _mm256_castsi256_ps(kept)));
#else
      for (int b = 0; b < 8; ++b)
        if (!(*byte >> b & 1)) x[c + b] = -kInf;
#endif
    }
  }
  for (; c < n; ++c) {
    const int64_t t = first + c;
    if (!(bits[t / 8] >> (t % 8) & 1)) x[c] = -kInf;
  }
}

/// Sets to -inf the scores of the pairs `mask` hides in the tile of queries
/// [i0, i0 + rows) x keys [j0, j0 + cols) of head (n, h), s[r * lds + c]:
/// the whole part of the tile in empty blocks, the clear bits of partial
/// ones. Any tile: it may cross blocks.
inline void hide_masked(const BlockMaskView& mask, int64_t n, int64_t h, int64_t i0, int64_t rows, int64_t j0,
                        int64_t cols, float* s, int64_t lds) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t qb = i0 / mask.q_block; qb * mask.q_block < i0 + rows; ++qb) {
    const int64_t r_begin = std::max(i0, qb * mask.q_block), r_end = std::min(i0 + rows, (qb + 1) * mask.q_block);
    for (int64_t kb = j0 / mask.kv_block; kb * mask.kv_block < j0 + cols; ++kb) {
      const int64_t c_begin = std::max(j0, kb * mask.kv_block), c_end = std::min(j0 + cols, (kb + 1) * mask.kv_block);
      const uint8_t kind = mask.kind(n, h, qb, kb);
      if (kind == kFullBlock) continue;
      for (int64_t i = r_begin; i < r_end; ++i) {
        float* row = s + (i - i0) * lds + (c_begin - j0);
        if (kind == kEmptyBlock)
          std::fill(row, row + (c_end - c_begin), -kInf);
        else
          hide_by_bits(row, c_end - c_begin, mask.bit_row(n, h, qb, kb, i - qb * mask.q_block),
                       c_begin - kb * mask.kv_block);
      }
    }
  }
}

ATTNKIT_KERNELS_END
