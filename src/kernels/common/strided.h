// Strided matrices and the readers that turn them into what sgemm takes.
//
// Kernels receive every tensor as a pointer plus one stride (in elements) per
// dimension, so views cost no copy. sgemm reads a row-major matrix with unit
// column stride; these helpers hand it the input in place when the strides
// allow, and a packed copy otherwise, and write results back through strides.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "base/memory.h"
#include "kernels/common/isa.h"
#include "kernels/common/vec.h"

ATTNKIT_KERNELS_BEGIN

/// Element (n, h, 0, 0) of a strided (N, H, ., .) tensor (or (n, h, 0) of a
/// 3-d one): the first stride is batch, the second head.
template <typename T>
T* head_of(T* base, const int64_t* stride, int64_t n, int64_t h) {
  return base + n * stride[0] + h * stride[1];
}

/// A strided matrix: element (r, c) at data[r * rs + c * cs].
struct Strided {
  const float* data;
  int64_t rs, cs;
  const float* row(int64_t r) const { return data + r * rs; }
};

/// Matrix (n, h) of a strided (N, H, R, X) tensor.
inline Strided head_matrix(const float* base, const int64_t* stride, int64_t n, int64_t h) {
  return {head_of(base, stride, n, h), stride[2], stride[3]};
}

/// A row-major matrix as sgemm takes it: element (r, c) at data[r * ld + c].
struct Rows {
  const float* data;
  int64_t ld;
  const float* row(int64_t r) const { return data + r * ld; }
};

/// Whether sgemm can read a (., cols) block with these strides in place:
/// contiguous columns (or only one) and rows that do not overlap.
inline bool readable_in_place(int64_t row_stride, int64_t col_stride, int64_t cols) {
  return (col_stride == 1 || cols == 1) && row_stride >= cols;
}

/// Whether rows_of copies a rows x cols block of m (then it needs rows * cols
/// floats of `pack`).
inline bool needs_pack(const Strided& m, int64_t rows, int64_t cols) {
  return rows > 0 && !readable_in_place(m.rs, m.cs, cols);
}

/// Whether whole rows lie one after another (row stride cols, unit column
/// stride): then any block of them is one contiguous run of memory.
inline bool rows_adjacent(const Strided& m, int64_t rows, int64_t cols) {
  return (m.cs == 1 || cols == 1) && (rows <= 1 || m.rs == cols);
}

/// Whether compact_rows_of copies a rows x cols block of m.
inline bool needs_compact(const Strided& m, int64_t rows, int64_t cols) {
  return rows > 0 && !rows_adjacent(m, rows, cols);
}

/// Copies a rows x cols block of m starting at row r0 into dst (row-major,
/// row stride cols).
inline void pack_rows(const Strided& m, int64_t r0, int64_t rows, int64_t cols, float* dst) {
  const float* first = m.row(r0);
  for (int64_t r = 0; r < rows; ++r) {
    if (m.cs == 1) {
      std::memcpy(dst + r * cols, first + r * m.rs, cols * sizeof(float));
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = first[r * m.rs + c * m.cs];
  }
}

/// Rows [r0, r0 + rows) of m (cols wide): m itself when sgemm can read it in
/// place, else a copy into `pack` (rows * cols floats).
inline Rows rows_of(const Strided& m, int64_t r0, int64_t rows, int64_t cols, float* pack) {
  if (readable_in_place(m.rs, m.cs, cols)) return {m.row(r0), m.rs};
  pack_rows(m, r0, rows, cols, pack);
  return {pack, cols};
}

/// rows_of for a block that is read many times: a copy into `pack` unless
/// its rows are adjacent. Rows far apart at a power-of-two stride (the heads
/// of an (N, L, H, E) tensor viewed as (N, H, L, E): H E floats apart) fall on
/// few cache sets, and every pass over the block pays for it; the copy is paid
/// once.
inline Rows compact_rows_of(const Strided& m, int64_t r0, int64_t rows, int64_t cols, float* pack) {
  if (rows_adjacent(m, rows, cols)) return {m.row(r0), cols};  // (one row's stride may be anything)
  pack_rows(m, r0, rows, cols, pack);
  return {pack, cols};
}

/// dst[r * cols + c] = m(idx[r], c) for r < count: a gather of rows.
inline void gather_rows(const Strided& m, const int64_t* idx, int64_t count, int64_t cols,
                        float* dst) {
  for (int64_t r = 0; r < count; ++r) pack_rows(m, idx[r], 1, cols, dst + r * cols);
}

/// A whole (N, H, R, X) input as sgemm reads it: each head's rows with unit
/// column stride and a row stride >= X. An input with other strides is copied
/// once (N H R X floats); otherwise nothing is allocated.
class HeadRows {
 public:
  HeadRows(const float* base, const int64_t* stride, int64_t N, int64_t H, int64_t R, int64_t X) {
    if (readable_in_place(stride[2], stride[3], X)) {
      base_ = base;
      std::copy(stride, stride + 3, stride_);
      return;
    }
    copy_ = Buffer<float>(static_cast<std::size_t>(N * H * R * X));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        pack_rows(head_matrix(base, stride, n, h), 0, R, X, copy_.data() + (n * H + h) * R * X);
    base_ = copy_.data();
    stride_[0] = H * R * X, stride_[1] = R * X, stride_[2] = X;
  }
  /// Row r of head (n, h).
  const float* row(int64_t n, int64_t h, int64_t r) const {
    return base_ + n * stride_[0] + h * stride_[1] + r * stride_[2];
  }
  int64_t ld() const { return stride_[2]; }

 private:
  const float* base_ = nullptr;
  int64_t stride_[3] = {};
  Buffer<float> copy_;
};

// Row arithmetic with one strided operand (vec.h has the contiguous forms).

/// y[c] += a * x[c * xs] for c < n, y contiguous.
inline void axpy_strided(float* y, float a, const float* x, int64_t xs, int64_t n) {
  if (xs == 1) return vec::axpy(y, a, x, n);
  for (int64_t c = 0; c < n; ++c) y[c] += a * x[c * xs];
}

/// sum_c x[c * xs] y[c], y contiguous.
inline float dot_strided(const float* x, int64_t xs, const float* y, int64_t n) {
  if (xs == 1) return vec::dot(x, y, n);
  float sum = 0.f;
  for (int64_t c = 0; c < n; ++c) sum += x[c * xs] * y[c];
  return sum;
}

// Writing through strides.

/// dst[c * stride] = factor * src[c] for c < cols.
inline void put_row(const float* src, int64_t cols, float* dst, int64_t stride,
                    float factor = 1.f) {
  if (stride == 1) {  // the common case, as a loop the compiler vectorises
    for (int64_t c = 0; c < cols; ++c) dst[c] = factor * src[c];
    return;
  }
  for (int64_t c = 0; c < cols; ++c) dst[c * stride] = factor * src[c];
}

/// dst[c * stride] += factor * src[c] for c < cols.
inline void add_row(const float* src, float factor, int64_t cols, float* dst, int64_t stride) {
  for (int64_t c = 0; c < cols; ++c) dst[c * stride] += factor * src[c];
}

/// dst[c * stride] = 0 for c < cols.
inline void zero_row(int64_t cols, float* dst, int64_t stride) {
  for (int64_t c = 0; c < cols; ++c) dst[c * stride] = 0.f;
}

/// The row-major rows x cols matrix src written into dst with the given strides.
inline void store(const float* src, int64_t rows, int64_t cols, float* dst, int64_t row_stride,
                  int64_t col_stride) {
  for (int64_t r = 0; r < rows; ++r) put_row(src + r * cols, cols, dst + r * row_stride, col_stride);
}

/// Zeroes a rows x cols strided matrix.
inline void store_zeros(int64_t rows, int64_t cols, float* dst, int64_t row_stride,
                        int64_t col_stride) {
  for (int64_t r = 0; r < rows; ++r) zero_row(cols, dst + r * row_stride, col_stride);
}

ATTNKIT_KERNELS_END
