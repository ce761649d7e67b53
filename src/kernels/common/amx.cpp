#include "kernels/common/amx.h"

#include <algorithm>
#include <cstring>

#include "kernels/common/simd.h"

// GCC spells the AMX macros __AMX_TILE__ / __AMX_BF16__, clang __AMXTILE__ / __AMXBF16__.
#if !((defined(__AMX_TILE__) || defined(__AMXTILE__)) && \
      (defined(__AMX_BF16__) || defined(__AMXBF16__)) && defined(__AVX512BF16__))
#error "amx.cpp is compiled at the amx level only (CMakeLists.txt)"
#endif

ATTNKIT_KERNELS_BEGIN
namespace amx {

namespace {

/// The LDTILECFG operand (palette 1): every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

/// The 32-bit word at `from`: two bf16 values, any alignment.
inline uint32_t word_at(const bf16* from) {
  uint32_t w;
  std::memcpy(&w, from, sizeof w);
  return w;
}

}  // namespace


TileScope::TileScope() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

TileScope::~TileScope() { _tile_release(); }

void gemm(int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda, const bf16* b,
          int64_t panel_stride, float* c, int64_t ldc, bool accumulate) {
  // Tiles 0-3: a 32 x 32 block of C; 4, 5: 16-row strips of A; 6, 7: two panels of B.
  const int64_t a_bytes = lda * 2, c_bytes = ldc * 4;
  for (int64_t i = 0; i < m; i += 32) {
    const bf16* a0 = a + i * lda;
    const bf16* a1 = a0 + 16 * lda;
    for (int64_t j = 0; j < n; j += 32) {
      float* c0 = c + i * ldc + j;
      float* c1 = c0 + 16 * ldc;
      if (accumulate) {
        _tile_loadd(0, c0, c_bytes);
        _tile_loadd(1, c0 + 16, c_bytes);
        _tile_loadd(2, c1, c_bytes);
        _tile_loadd(3, c1 + 16, c_bytes);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      const bf16* b0 = b + (j / 16) * panel_stride;
      const bf16* b1 = b0 + panel_stride;
      for (int64_t kk = 0; kk < k; kk += 32) {
        _tile_loadd(4, a0 + kk, a_bytes);
        _tile_loadd(5, a1 + kk, a_bytes);
        _tile_loadd(6, b0 + kk * 16, 64);
        _tile_loadd(7, b1 + kk * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c0, c_bytes);
      _tile_stored(1, c0 + 16, c_bytes);
      _tile_stored(2, c1, c_bytes);
      _tile_stored(3, c1 + 16, c_bytes);
    }
  }
}


// The packs fill and copy with std::fill_n and std::copy_n, not memset and
// memcpy: an empty operand (no keys, E = 0) has a null buffer or data
// pointer, and the C functions are undefined on null even for zero bytes.

void pack_rows(Source x, int64_t rows, int64_t cols, int64_t rows_pad, int64_t cols_pad, bf16* dst) {
  for (int64_t r = 0; r < rows_pad; ++r) {
    bf16* d = dst + r * cols_pad;
    int64_t c = 0;
    if (r < rows) {
      const bf16* s = x.x + r * x.row_stride;
      if (x.col_stride == 1) {
        std::copy_n(s, cols, d);
        c = cols;
      } else {
        for (; c < cols; ++c) d[c] = s[c * x.col_stride];
      }
    }
    std::fill_n(d + c, cols_pad - c, bf16{});
  }
}

void pack_rows_transposed(Source x, int64_t rows, int64_t cols, int64_t rows_pad, int64_t cols_pad,
                          bf16* dst) {
  // dst(c, r) = X(r, c): swap the roles of X's strides.
  pack_rows(Source{x.x, x.col_stride, x.row_stride}, cols, rows, cols_pad, rows_pad, dst);
}

void pack_panels_transposed(Source x, int64_t n, int64_t k, int64_t n_pad, int64_t k_pad, bf16* dst) {
  // B(kk, col) = X(col, kk): in panel g, row p, slot c holds X(16 g + c, 2p + t) for t = 0, 1,
  // that is the 32-bit word p of X's row 16 g + c when X's columns are unit-stride.
  const int64_t panel_stride = k_pad * 16;
  std::fill_n(dst, n_pad / 16 * panel_stride, bf16{});
  for (int64_t col = 0; col < n; ++col) {
    const bf16* s = x.x + col * x.row_stride;
    bf16* d = dst + (col / 16) * panel_stride + (col % 16) * 2;
    if (x.col_stride == 1) {
      int64_t p = 0;
      for (; 2 * p + 1 < k; ++p) {
        const uint32_t w = word_at(s + 2 * p);
        std::memcpy(d + p * 32, &w, sizeof w);
      }
      if (2 * p < k) d[p * 32] = s[2 * p];  // odd k: the last pair's second value stays 0
    } else {
      for (int64_t kk = 0; kk < k; ++kk) d[(kk / 2) * 32 + kk % 2] = s[kk * x.col_stride];
    }
  }
}

void pack_panels(Source x, int64_t k, int64_t n, int64_t k_pad, int64_t n_pad, bf16* dst) {
  // B(kk, col) = X(kk, col): panel g, row p interleaves X's rows 2p and 2p + 1
  // over the columns 16 g .. 16 g + 15.
  const int64_t panel_stride = k_pad * 16;
  std::fill_n(dst, n_pad / 16 * panel_stride, bf16{});
  for (int64_t kk = 0; kk < k; ++kk) {
    const bf16* s = x.x + kk * x.row_stride;
    bf16* d = dst + (kk / 2) * 32 + kk % 2;
    int64_t col = 0;
#ifdef __AVX512BW__
    if (x.col_stride == 1 && kk + 1 < k && kk % 2 == 0) {
      // Both rows of the pair at once: 16 columns of each, interleaved by one permute.
      const bf16* s1 = s + x.row_stride;
      const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                             24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                             16, 0);
      for (; col + 16 <= n; col += 16) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + col));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1 + col));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        _mm512_storeu_si512(d + (col / 16) * panel_stride,
                            _mm512_permutexvar_epi16(order, both));
      }
      for (int64_t c = col; c < n; ++c) {
        bf16* dc = d + (c / 16) * panel_stride + (c % 16) * 2;
        dc[0] = s[c];
        dc[1] = s1[c];
      }
      ++kk;  // the pair's second row is done
      continue;
    }
#endif
    for (; col < n; ++col) d[(col / 16) * panel_stride + (col % 16) * 2] = s[col * x.col_stride];
  }
}

}  // namespace amx
ATTNKIT_KERNELS_END
