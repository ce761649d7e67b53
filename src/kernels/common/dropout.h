// Attention dropout's keep mask, drawn by a counter-based generator: whether
// weight (n, h, i, j) is kept is a pure function of the seed and those four
// indices, so a kernel draws any tile of the mask in any order, the backward
// draws the forward's mask again, and nothing of size L x S is stored
// (docs/MATH.md, "Attention dropout", defines the draw; this file is the
// definition the kernels, the mask op and the float64 reference share).
//
// The draw. A 64-bit key per query row, chained through splitmix64's
// finaliser (a bijection of 64-bit words):
//   row = f(f(f(f(seed) + (n + 1) G) + (h + 1) G) + (i + 1) G),  G = 0x9E3779B97F4A7C15,
// then a 32-bit word per pair of keys from two rounds of a 32-bit integer hash
// g (Wellons' "lowbias32", also a bijection), keyed by the row's two halves:
//   word(u) = g(hi(row) ^ g(lo(row) ^ u)),
// each word giving two keys their 16-bit draws: key j takes word
// u = 16 floor(j / 32) + j mod 16, its low half when j mod 32 < 16 and its
// high half otherwise (so 16 consecutive words serve 32 consecutive keys,
// one vector of hashes). A key is kept iff its draw >= t = min(round(p 2^16),
// 2^16 - 1) (ties rounded up): kept with probability exactly 1 - t 2^-16 (p is
// rounded to a multiple of 2^-16, as FlashAttention rounds it to 2^-8). Within a row the inner g is a
// bijection of u, so no two words of a row share an input; two rows share
// their whole mask only if their 64-bit keys collide (probability 2^-64 per
// pair).
//
// Why not Philox (PyTorch's and FlashAttention's generator): docs/MATH.md,
// "Attention dropout". The statistics tests (tests/ops/attention_dropout_test.cpp)
// check keep rates and independence across keys, queries, heads, batches and
// seeds, and the bits against values computed apart from this file.
//
// keep_bits draws a row's mask for a run of keys into bits (bit c % 16 of
// word c / 16 for key j0 + c); scale_kept applies it: x = kept ? x s : 0. Both
// give the same bits and floats at every ISA level.
#pragma once

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>

#include "kernels/common/isa.h"
#include "kernels/common/simd.h"

ATTNKIT_KERNELS_BEGIN

/// splitmix64's finaliser: a bijection of 64-bit words with full avalanche.
constexpr uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Wellons' lowbias32: a bijection of 32-bit words, two multiplies.
constexpr uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  return x ^ (x >> 16);
}

#ifdef __AVX512F__
inline __m512i mix32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
#elif ATTNKIT_AVX2
inline __m256i mix32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
#endif

/// The mask of one call: its seed, rate and the batch index of its n = 0.
class AttentionDropout {
 public:
  /// The most keys one keep_bits call takes (the widest key tile).
  static constexpr int64_t kMaxKeys = 1024;

  AttentionDropout() = default;
  /// p in [0, 1); batch_offset: the batch index of the call's n = 0 (a
  /// packed batch's sequence b is batch b).
  AttentionDropout(double p, uint64_t seed, int64_t batch_offset)
      : threshold_(threshold(p)),
        scale_(static_cast<float>(1.0 / keep_rate(p))),
        seed_(mix64(seed)),
        batch_offset_(batch_offset) {}

  /// round(p 2^16) (ties up, whatever the rounding mode), at most 2^16 - 1:
  /// a key is dropped iff its draw < this.
  static uint32_t threshold(double p) {
    return static_cast<uint32_t>(std::min(std::floor(p * 0x1p16 + 0.5), 0x1p16 - 1));
  }
  /// The probability a key is kept, 1 - threshold(p) 2^-16.
  static double keep_rate(double p) { return 1.0 - threshold(p) * 0x1p-16; }

  bool active() const { return threshold_ > 0; }
  /// 1 / keep_rate(p), rounded to float: what a kept weight is multiplied by.
  float scale() const { return scale_; }

  /// The 64-bit key of query i of head h of batch n.
  uint64_t row(int64_t n, int64_t h, int64_t i) const {
    constexpr uint64_t G = 0x9E3779B97F4A7C15ULL;
    uint64_t key = mix64(seed_ + static_cast<uint64_t>(n + batch_offset_ + 1) * G);
    key = mix64(key + static_cast<uint64_t>(h + 1) * G);
    return mix64(key + static_cast<uint64_t>(i + 1) * G);
  }

  /// Whether key j of the row is kept (the scalar definition).
  bool kept(uint64_t row, int64_t j) const {
    const uint32_t w = word(row, static_cast<uint32_t>(j >> 5 << 4 | (j & 15)));
    return ((j & 16) ? w >> 16 : w & 0xffffu) >= threshold_;
  }

  /// bits[c / 16] bit c % 16 = kept(row, j0 + c) for c < n (n <= kMaxKeys);
  /// bits holds kMaxKeys / 16 words (up to 2 ceil(n / 32) are written), and
  /// the bits past n are unspecified.
  void keep_bits(uint64_t row, int64_t j0, int64_t n, uint16_t* bits) const {
    assert(n <= kMaxKeys);
    // 32 keys per group from the group holding j0 on, 16 bits per half
    // group (halves[2 g + k] bit b: key first + 32 g + 16 k + b); when j0
    // starts a group (every tile but a window's) they are the bits.
    const int64_t first = j0 & ~int64_t{31}, offset = j0 - first;
    if (offset == 0) return draw_groups(row, first, (n + 31) / 32, bits);
    uint16_t halves[2 * (kMaxKeys / 32 + 1) + 1];  // count <= kMaxKeys / 32 + 1, then a zero
    const int64_t count = (offset + n + 31) / 32;
    draw_groups(row, first, count, halves);
    halves[2 * count] = 0;
    for (int64_t c = 0; c < n; c += 16) {
      const int64_t at = offset + c;
      const uint32_t pair = halves[at / 16] | static_cast<uint32_t>(halves[at / 16 + 1]) << 16;
      bits[c / 16] = static_cast<uint16_t>(pair >> (at % 16));
    }
  }

  /// x[c] = kept(row, j0 + c) ? x[c] scale() : 0 for c < n (n <= kMaxKeys).
  void apply(uint64_t row, int64_t j0, float* x, int64_t n) const {
    uint16_t bits[kMaxKeys / 16];
    keep_bits(row, j0, n, bits);
    scale_kept(x, n, bits, scale_);
  }

  /// x[c] = bit c of bits ? x[c] s : 0 for c < n.
  static void scale_kept(float* x, int64_t n, const uint16_t* bits, float s) {
    int64_t c = 0;
#ifdef __AVX512F__
    const __m512 vs = _mm512_set1_ps(s);
    for (; c + 16 <= n; c += 16)
      _mm512_storeu_ps(x + c, _mm512_maskz_mul_ps(bits[c / 16], _mm512_loadu_ps(x + c), vs));
    if (c < n) {
      const auto tail = static_cast<__mmask16>((1u << (n - c)) - 1u);
      _mm512_mask_storeu_ps(x + c, tail,
                            _mm512_maskz_mul_ps(static_cast<__mmask16>(bits[c / 16] & tail),
                                                _mm512_maskz_loadu_ps(tail, x + c), vs));
      return;
    }
#elif ATTNKIT_AVX2
    const __m256 vs = _mm256_set1_ps(s);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (; c + 8 <= n; c += 8) {
      const __m256i b = _mm256_set1_epi32((bits[c / 16] >> (c % 16)) & 0xff);
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bit), lane_bit));
      _mm256_storeu_ps(x + c, _mm256_and_ps(_mm256_mul_ps(_mm256_loadu_ps(x + c), vs), keep));
    }
#endif
    for (; c < n; ++c) x[c] = (bits[c / 16] >> (c % 16)) & 1u ? x[c] * s : 0.f;  // (AVX2's tail)
  }

 private:
  static uint32_t word(uint64_t row, uint32_t u) {
    return mix32(static_cast<uint32_t>(row >> 32) ^ mix32(static_cast<uint32_t>(row) ^ u));
  }

  /// halves[2 g + k] bit b = kept(row, first + 32 g + 16 k + b) for g <
  /// count (first a multiple of 32): words 16 (first / 32 + g) + l, l < 16,
  /// their low halves the keys 16 k + b with k = 0, b = l, their high halves
  /// those with k = 1.
  void draw_groups(uint64_t row, int64_t first, int64_t count, uint16_t* halves) const {
    const auto lo = static_cast<uint32_t>(row), hi = static_cast<uint32_t>(row >> 32);
    const auto u0 = static_cast<uint32_t>(first >> 5 << 4);
#ifdef __AVX512F__
    const __m512i vlo = _mm512_set1_epi32(static_cast<int>(lo)), vhi = _mm512_set1_epi32(static_cast<int>(hi));
    const __m512i t = _mm512_set1_epi32(static_cast<int>(threshold_)), low = _mm512_set1_epi32(0xffff);
    __m512i u = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(u0)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int64_t g = 0; g < count; ++g, u = _mm512_add_epi32(u, _mm512_set1_epi32(16))) {
      const __m512i w = mix32x16(_mm512_xor_si512(vhi, mix32x16(_mm512_xor_si512(vlo, u))));
      halves[2 * g] = _mm512_cmpge_epu32_mask(_mm512_and_si512(w, low), t);
      halves[2 * g + 1] = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(w, 16), t);
    }
#elif ATTNKIT_AVX2
    // Halves are below 2^16: signed compares are exact. Eight words a time.
    const __m256i vlo = _mm256_set1_epi32(static_cast<int>(lo)), vhi = _mm256_set1_epi32(static_cast<int>(hi));
    const __m256i t = _mm256_set1_epi32(static_cast<int>(threshold_)), low = _mm256_set1_epi32(0xffff);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const auto keep_mask8 = [&](__m256i draw) {  // bit l: lane l's draw >= t
      return ~static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(t, draw)))) & 0xffu;
    };
    for (int64_t g = 0; g < count; ++g) {
      uint32_t low_kept = 0, high_kept = 0;
      for (uint32_t part = 0; part < 2; ++part) {
        const __m256i u = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(u0 + 16 * g + 8 * part)), lanes);
        const __m256i w = mix32x8(_mm256_xor_si256(vhi, mix32x8(_mm256_xor_si256(vlo, u))));
        low_kept |= keep_mask8(_mm256_and_si256(w, low)) << (8 * part);
        high_kept |= keep_mask8(_mm256_srli_epi32(w, 16)) << (8 * part);
      }
      halves[2 * g] = static_cast<uint16_t>(low_kept);
      halves[2 * g + 1] = static_cast<uint16_t>(high_kept);
    }
#else
    for (int64_t g = 0; g < count; ++g) {
      uint32_t low_kept = 0, high_kept = 0;
      for (uint32_t l = 0; l < 16; ++l) {
        const uint32_t w = mix32(hi ^ mix32(lo ^ (u0 + static_cast<uint32_t>(16 * g) + l)));
        low_kept |= static_cast<uint32_t>((w & 0xffffu) >= threshold_) << l;
        high_kept |= static_cast<uint32_t>((w >> 16) >= threshold_) << l;
      }
      halves[2 * g] = static_cast<uint16_t>(low_kept);
      halves[2 * g + 1] = static_cast<uint16_t>(high_kept);
    }
#endif
  }

  uint32_t threshold_ = 0;
  float scale_ = 1.f;
  uint64_t seed_ = 0;
  int64_t batch_offset_ = 0;
};

ATTNKIT_KERNELS_END
