// Rotary positions (RoPE; Su et al., 2021), shared by the kernels that rotate
// rows as they load them (exact attention) and by the rotary op itself.
//
// A row x at position t has its first `dim` entries rotated in pairs
// (x_c, x_{c + dim/2}), c < dim/2, by the angle t theta_c with
// theta_c = base^(-2c / dim):
//   y_c = x_c cos - x_{c + dim/2} sin,  y_{c + dim/2} = x_{c + dim/2} cos + x_c sin;
// entries from dim on pass unchanged. (The "rotate half" pairing of GPT-NeoX
// and LLaMA; FlashAttention's rotary_interleaved = false.) Rotations compose
// and are orthogonal, so a score (R_s q) . (R_t k) = q . R_(t-s) k depends on
// the two positions through their difference alone, and the gradient of a
// rotated row is the inverse rotation (by -t) of the gradient it receives.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "base/memory.h"
#include "kernels/common/isa.h"
#include "kernels/common/strided.h"

ATTNKIT_KERNELS_BEGIN

/// cos and sin of every angle t theta_c for the positions [first, first +
/// count), as floats: count x dim / 2 of each. Built once per call (for
/// count positions, count x dim / 2 entries: under 1% of an attention's work
/// over those positions), then shared read-only by every thread.
class RotaryTable {
 public:
  /// No rotation (dim 0): active() is false.
  RotaryTable() = default;

  /// dim: even, >= 2; base > 0.
  RotaryTable(int64_t dim, double base, int64_t first, int64_t count)
      : half_(dim / 2),
        first_(first),
        cos_(static_cast<std::size_t>(count * half_)),
        sin_(static_cast<std::size_t>(count * half_)) {
    // Each angle from an exact cos/sin at every position that is a multiple
    // of kAnchor and the angle-addition rule in double between them: the
    // error stays near double's rounding (under kAnchor steps of ~1e-16), far
    // below float's, at a fraction of the cost of a sin and cos per entry.
    // The anchors are fixed positions, so an entry is a function of (dim,
    // base, position, c) alone: every table holds the same float for it, and
    // rows rotated by different tables (a kernel's, the rotary op's for a
    // decoding step) agree bitwise.
    constexpr int64_t kAnchor = 16;
    const int64_t end = first + count;
    const int64_t start = (first >= 0 ? first : first - (kAnchor - 1)) / kAnchor * kAnchor;  // floor
    for (int64_t c = 0; c < half_; ++c) {
      const double theta = std::pow(base, -2.0 * static_cast<double>(c) / static_cast<double>(dim));
      const double step_cos = std::cos(theta), step_sin = std::sin(theta);
      double cs = 0, sn = 0;
      for (int64_t t = start; t < end; ++t) {
        if (t % kAnchor == 0) {
          const double angle = static_cast<double>(t) * theta;
          cs = std::cos(angle), sn = std::sin(angle);
        }
        if (t >= first) {
          cos_[(t - first) * half_ + c] = static_cast<float>(cs);
          sin_[(t - first) * half_ + c] = static_cast<float>(sn);
        }
        const double next_cos = cs * step_cos - sn * step_sin;
        sn = sn * step_cos + cs * step_sin;
        cs = next_cos;
      }
    }
  }

  /// The table attention over L queries and S keys reads (dim 0: none):
  /// query i at position i + S - L, key j at j (the causal mask's alignment,
  /// so one query over a decoding cache needs no offset), that is the
  /// positions [min(0, S - L), S).
  static RotaryTable for_attention(int64_t dim, double base, int64_t L, int64_t S) {
    if (dim <= 0) return RotaryTable();
    return RotaryTable(dim, base, std::min<int64_t>(0, S - L), std::max(L, S));
  }

  bool active() const { return half_ > 0; }

  /// dst (cols floats, contiguous) = row x (column stride xs) rotated to
  /// `position`, or back from it when `inverse`. dst may be x when xs == 1.
  void rotate(const float* x, int64_t xs, int64_t cols, int64_t position, bool inverse,
              float* dst) const {
    const float* cs = cos_.data() + (position - first_) * half_;
    const float* sn = sin_.data() + (position - first_) * half_;
    const float sign = inverse ? -1.f : 1.f;
    const int64_t h = half_;
    if (xs == 1 && dst != x) {
      turn(x, x + h, cs, sn, sign, h, dst, dst + h);
      std::copy(x + 2 * h, x + cols, dst + 2 * h);
      return;
    }
    if (xs == 1) {  // in place (a gradient rotated back): each pair read before it is written
      for (int64_t c = 0; c < h; ++c) {
        const float a = x[c], b = x[c + h], s = sign * sn[c];
        dst[c] = a * cs[c] - b * s;
        dst[c + h] = b * cs[c] + a * s;
      }
      return;
    }
    for (int64_t c = 0; c < h; ++c) {
      const float a = x[c * xs], b = x[(c + h) * xs], s = sign * sn[c];
      dst[c] = a * cs[c] - b * s;
      dst[c + h] = b * cs[c] + a * s;
    }
    for (int64_t c = 2 * h; c < cols; ++c) dst[c] = x[c * xs];
  }

  /// Rows [r0, r0 + rows) of m (cols wide), row r rotated to position
  /// position0 + r, into dst (row stride cols): what sgemm then reads.
  Rows rotated_rows(const Strided& m, int64_t r0, int64_t rows, int64_t cols, int64_t position0,
                    float* dst) const {
    for (int64_t r = 0; r < rows; ++r)
      rotate(m.row(r0 + r), m.cs, cols, position0 + r, false, dst + r * cols);
    return {dst, cols};
  }

  /// Rotates rows x (row stride ld, cols wide) back from positions position0 + r,
  /// in place: the gradient of rows that were rotated.
  void unrotate_rows(float* x, int64_t rows, int64_t ld, int64_t cols, int64_t position0) const {
    for (int64_t r = 0; r < rows; ++r) rotate(x + r * ld, 1, cols, position0 + r, true, x + r * ld);
  }

 private:
  /// The pairs (a_c, b_c) turned by (cs_c, sign sn_c) into (ya_c, yb_c), c < n:
  /// separate, non-overlapping arrays, so the loop vectorises.
  static void turn(const float* __restrict a, const float* __restrict b, const float* __restrict cs,
                   const float* __restrict sn, float sign, int64_t n, float* __restrict ya,
                   float* __restrict yb) {
    for (int64_t c = 0; c < n; ++c) {
      const float s = sign * sn[c];
      ya[c] = a[c] * cs[c] - b[c] * s;
      yb[c] = b[c] * cs[c] + a[c] * s;
    }
  }

  int64_t half_ = 0;   // dim / 2: the pairs rotated
  int64_t first_ = 0;  // the table's first position
  Buffer<float> cos_, sin_;
};

ATTNKIT_KERNELS_END
