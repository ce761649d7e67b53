// bfloat16 block products on AMX tiles, and the operand layouts they read.
// Torch-free. Used by the bf16 attention kernels, whose block products are
// small (tens to hundreds of rows) and many: a library call per block would
// cost more than the product itself does on the tiles (docs/PERFORMANCE.md,
// "Why the kernels' constants"), so the kernels call these directly.
//
// One product, C (m x n, float32) = or += A (m x k) B (k x n):
//   A  bf16, row-major with row stride lda (elements), as stored; rows of 64
//      bytes (32 values) are loaded into tiles, so k is a multiple of 32 and
//      the padding columns of A are zero wherever the padding rows of B are not.
//   B  bf16 in the "pair panel" layout of AMX's TDPBF16PS: the n columns in
//      panels of 16, panel g at B + g * panel_stride; in a panel, row p holds
//      the 16 columns' values at k = 2p and 2p + 1 interleaved:
//        B[g * panel_stride + p * 32 + 2 c + t] = B(2p + t, 16 g + c).
//      A product over rows [k0, k0 + k) of B starts at B + k0 * 16.
//   C  float32 row-major with row stride ldc.
// m, n and k are multiples of 32 (callers pad their operands with zeros).
//
// Every tile is 16 rows x 64 bytes, so one configuration serves every
// product; a thread loads it once per work item (TileScope).
#pragma once

#include <cstdint>

#include "base/bf16.h"
#include "kernels/common/isa.h"

ATTNKIT_KERNELS_BEGIN
namespace amx {

// Compiled only at the amx level (isa.h): whoever calls these runs there, so
// the CPU has AMX-BF16 and Linux has granted this process the tile state.

/// Configures the calling thread's tiles on construction and releases them
/// on destruction. Products run only inside one.
class TileScope {
 public:
  TileScope();
  ~TileScope();
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

/// x rounded up to a multiple of 32: the padded extent of every operand dimension.
inline int64_t pad32(int64_t x) { return (x + 31) / 32 * 32; }

/// C = A B (accumulate false) or C += A B (accumulate true); see above.
void gemm(int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda, const bf16* b,
          int64_t panel_stride, float* c, int64_t ldc, bool accumulate);

/// A source matrix X (rows x cols): element (r, c) at x[r * row_stride + c * col_stride].
struct Source {
  const bf16* x;
  int64_t row_stride, col_stride;
};

/// dst (rows_pad x cols_pad, row-major, row stride cols_pad) = X, zero-padded.
void pack_rows(Source x, int64_t rows, int64_t cols, int64_t rows_pad, int64_t cols_pad, bf16* dst);

/// dst (cols_pad x rows_pad, row-major) = X^T, zero-padded.
void pack_rows_transposed(Source x, int64_t rows, int64_t cols, int64_t rows_pad, int64_t cols_pad,
                          bf16* dst);

/// B = X^T in pair panels (X is n x k: B's columns are X's rows; for the keys
/// of S = Q K^T): n_pad / 16 panels of stride k_pad * 16, zero-padded.
void pack_panels_transposed(Source x, int64_t n, int64_t k, int64_t n_pad, int64_t k_pad, bf16* dst);

/// B = X in pair panels (X is k x n; for the values of O = P V): n_pad / 16
/// panels of stride k_pad * 16, zero-padded.
void pack_panels(Source x, int64_t k, int64_t n, int64_t k_pad, int64_t n_pad, bf16* dst);

}  // namespace amx
ATTNKIT_KERNELS_END
