// Long on purpose: each helper's AVX-512, AVX2 and scalar forms stand together,
// so that the levels stay one function.
//
// Vectorised helpers shared by the kernels: exp, max, sum, dot, scale, add,
// axpy, ALiBi's distance penalty over contiguous float arrays. Each ISA level's translation units get
// their own build (isa.h): 16 lanes at avx512 and above, 8 lanes at avx2 (the
// same exp, bit for bit), a portable scalar loop at baseline. Every function
// handles any length (masked tails), and none needs aligned pointers.
#pragma once

#include <cmath>
#include <climits>
#include <cstdint>
#include <limits>

#include "kernels/common/isa.h"
#include "kernels/common/simd.h"

ATTNKIT_KERNELS_BEGIN
namespace vec {

// exp2_16 / exp2_8's polynomial for 2^r on [-1/2, 1/2], highest degree
// first, evaluated by Horner's rule: a fit for relative error (Lawson's
// iteration over 4,000 Chebyshev nodes, then rounded to float; 1.9e-9
// before rounding).
constexpr float kExp2Poly[] = {1.5345812426e-04f, 1.3399930904e-03f, 9.6184890717e-03f, 5.5503286421e-02f,
                               2.4022646248e-01f, 6.9314718246e-01f, 1.f};
constexpr float kLog2e = 1.44269504088896341f;

#ifdef __AVX512F__

/// exp of 16 floats. Cephes' expf scheme: x = n ln2 + r with n = round(x / ln2),
/// |r| <= ln2 / 2 (ln2 split in two so that r is nearly exact), exp(r) by a
/// degree-6 polynomial, then 2^n applied by vscalefps. Accuracy, measured
/// against double exp over every float in [-87, 0]: max relative error 1.2e-7
/// (1.26 ulp); the same over 1e7 random x in [-87, 88.7] (the test checks
/// 2 ulp). Results below exp(-87) = 1.6e-38 flush to 0, so exp(-inf) == 0
/// exactly: producing a subnormal or an underflow costs x86 a microcode assist
/// (many times the cost of a normal element: docs/PERFORMANCE.md, "Why the
/// kernels' constants"), which masked scores would
/// hit on every causal diagonal block, and softmax weights that small are far
/// below float resolution next to the row's largest weight of 1. Above 88.7
/// the result is +inf. NaN propagates.
inline __m512 exp16(__m512 x) {
  // x >= -87 or NaN; the flushed lanes skip vscalefps, which avoids the assist.
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ);
  // max/min return their second operand when either is NaN: keep x second.
  x = _mm512_max_ps(_mm512_set1_ps(-88.f), x);
  x = _mm512_min_ps(_mm512_set1_ps(88.8f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

/// 2^x of 16 floats: x = n + r with n = round(x) and r = x - n, which is exact
/// and |r| <= 1/2, 2^r by a degree-6 polynomial (fitted for relative error;
/// 0.93 ulp at most over [-1/2, 1/2], evaluated in float32), then 2^n applied
/// by vscalefps. No argument reduction by a split ln 2 as exp16 needs: 10
/// operations against its 15, which is what the softmax's exponentials
/// (softmax_exp16) are made of. Results below 2^-125 flush to 0, for exp16's
/// reason, so 2^-inf == 0 exactly; 2^x for x >= 128 is +inf; NaN propagates.
inline __m512 exp2_16(__m512 x) {
  // x >= -125 or NaN; the flushed lanes skip vscalefps, which avoids the assist.
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
  // +inf would leave r = inf - inf; min returns x when x is NaN.
  x = _mm512_min_ps(_mm512_set1_ps(128.f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

/// A softmax's weights exp(x - shift) for x <= shift (shift the row's largest
/// score, or its log-sum-exp), as 2^((x - shift) log2(e)). The difference is
/// taken first, so the weights near the maximum, the ones that matter, are
/// accurate to 2 ulp; far below it the rounding of (x - shift) log2(e) costs
/// up to |x - shift| ulp of relative error, which is never more than 2^-24 of
/// the row's largest weight, 1 (tests/kernels: SoftmaxKernelExp). -inf gives
/// 0 (a masked score), as does anything below exp(-86.6).
inline __m512 softmax_exp16(__m512 x, __m512 shift) {
  return exp2_16(_mm512_mul_ps(_mm512_sub_ps(x, shift), _mm512_set1_ps(kLog2e)));
}

/// Lanes [0, n) of a 16-lane block, for loads and stores of the tail.
inline __mmask16 tail_mask(int64_t n) {
  return static_cast<__mmask16>((1u << n) - 1u);
}

#elif ATTNKIT_AVX2

/// exp of 8 floats: exp16's scheme, constants and operations, so the results
/// are bitwise the same (the tests check both against double exp). AVX2 has
/// no vscalefps: 2^n is built in the exponent bits, as 2^(n - 1) * 2 when
/// n = 128 (x near 88.7, where exp overflows to +inf as it should).
inline __m256 exp8(__m256 x) {
  // x >= -87 or NaN: the lanes that are not flushed to 0.
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_NLT_UQ);
  // max/min return their second operand when either is NaN: keep x second.
  x = _mm256_max_ps(_mm256_set1_ps(-88.f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.8f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // n is in [-127, 128] (x was clamped to [-88, 88.8]); on the lanes kept it
  // is >= -126, a normal power of two. NaN lanes give garbage n but p is NaN.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i top = _mm256_cmpgt_epi32(ni, _mm256_set1_epi32(127));  // n = 128
  const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(ni, top), _mm256_set1_epi32(127));
  __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
  e = _mm256_blendv_ps(e, _mm256_add_ps(e, e), _mm256_castsi256_ps(top));
  return _mm256_and_ps(e, normal);
}

/// 2^x of 8 floats: exp2_16's scheme, constants and operations, so the
/// results are bitwise the same. Without vscalefps, 2^n is built in the
/// exponent bits as in exp8; x is first clamped to [-126, 128], so that the
/// flushed lanes' products stay normal (no assist) and n = 128 is 2^127 * 2.
inline __m256 exp2_8(__m256 x) {
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-125.f), _CMP_NLT_UQ);
  // max/min return their second operand when either is NaN: keep x second.
  x = _mm256_max_ps(_mm256_set1_ps(-126.f), x);
  x = _mm256_min_ps(_mm256_set1_ps(128.f), x);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExp2Poly[i]));
  // n is in [-126, 128]: a normal power of two but for 128. NaN lanes give
  // garbage n but p is NaN.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i top = _mm256_cmpgt_epi32(ni, _mm256_set1_epi32(127));  // n = 128
  const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(ni, top), _mm256_set1_epi32(127));
  __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
  e = _mm256_blendv_ps(e, _mm256_add_ps(e, e), _mm256_castsi256_ps(top));
  return _mm256_and_ps(e, normal);
}

/// softmax_exp16 of 8 floats (the same operations, bitwise the same results).
inline __m256 softmax_exp8(__m256 x, __m256 shift) {
  return exp2_8(_mm256_mul_ps(_mm256_sub_ps(x, shift), _mm256_set1_ps(kLog2e)));
}

/// Lanes [0, n) of an 8-lane block (n <= 8), as maskload/maskstore take them.
inline __m256i tail_mask8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/// The sum of the 8 lanes.
inline float reduce_add8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/// The largest of the 8 lanes (no NaN among them).
inline float reduce_max8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

#endif  // __AVX512F__ / ATTNKIT_AVX2

/// exp of one float: exp16 / exp8 where they exist (so scalar and vector
/// results agree), else std::exp with the same flush to 0 below exp(-87).
inline float exp(float x) {
#ifdef __AVX512F__
  return _mm512_cvtss_f32(exp16(_mm512_set1_ps(x)));
#elif ATTNKIT_AVX2
  return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x)));
#else
  return x < -87.f ? 0.f : std::exp(x);
#endif
}

/// max_i x[i]; -inf for n == 0, NaN when any x[i] is NaN (as torch's max).
inline float max(const float* x, int64_t n) {
#ifdef __AVX512F__
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 xi = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(xi, xi, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, xi);
  }
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 xi = _mm512_maskz_loadu_ps(k, x + i);
    nan |= _mm512_mask_cmp_ps_mask(k, xi, xi, _CMP_UNORD_Q);
    m = _mm512_mask_max_ps(m, k, m, xi);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(m);
#elif ATTNKIT_AVX2
  const __m256 low = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m = low, nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xi = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(xi, xi, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, xi);
  }
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    const __m256 xi = _mm256_blendv_ps(low, _mm256_maskload_ps(x + i, k), _mm256_castsi256_ps(k));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(xi, xi, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, xi);
  }
  return _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN() : reduce_max8(m);
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return x[i];
    m = x[i] > m ? x[i] : m;
  }
  return m;
#endif
}

/// x[i] = exp(x[i] - shift) in place, a softmax's weights (softmax_exp16:
/// x[i] <= shift); returns the sum of the new values.
inline float exp_shift_sum(float* x, int64_t n, float shift) {
#ifdef __AVX512F__
  const __m512 s = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = softmax_exp16(_mm512_loadu_ps(x + i), s);
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 e = softmax_exp16(_mm512_maskz_loadu_ps(k, x + i), s);
    _mm512_mask_storeu_ps(x + i, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#elif ATTNKIT_AVX2
  const __m256 s = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = softmax_exp8(_mm256_loadu_ps(x + i), s);
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    const __m256 e = softmax_exp8(_mm256_maskload_ps(x + i, k), s);
    _mm256_maskstore_ps(x + i, k, e);
    sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(k)));
  }
  return reduce_add8(sum);
#else
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = exp(x[i] - shift));
  return sum;
#endif
}

/// x[i] = exp(x[i] - shift) in place.
inline void exp_shift(float* x, int64_t n, float shift) { exp_shift_sum(x, n, shift); }

/// sum_i a[i] * b[i].
inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
#elif ATTNKIT_AVX2
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, k), _mm256_maskload_ps(b + i, k), acc);
  }
  return reduce_add8(acc);
#else
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
#endif
}

/// out[r] = sum_i a[i] * b[r][i] for four rows b[0..3]: one pass over a, four
/// independent accumulators, and one shuffle tree for the four horizontal sums
/// (what four dot() calls would each pay for alone). Each sum is accumulated in
/// another order than dot()'s, so results can differ from it in the last bits.
inline void dot4(const float* a, const float* const b[4], int64_t n, float out[4]) {
#ifdef __AVX512F__
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(a + i);
    acc0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b[0] + i), acc0);
    acc1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b[1] + i), acc1);
    acc2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b[2] + i), acc2);
    acc3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(b[3] + i), acc3);
  }
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 x = _mm512_maskz_loadu_ps(k, a + i);
    acc0 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(k, b[0] + i), acc0);
    acc1 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(k, b[1] + i), acc1);
    acc2 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(k, b[2] + i), acc2);
    acc3 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(k, b[3] + i), acc3);
  }
  // Per 128-bit lane: [a0 b0 a1 b1] + [a2 b2 a3 b3] -> (A, B, A, B) partial sums,
  // then the 64-bit pairs of (A, B, ..) and (C, D, ..) -> (A, B, C, D).
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(acc0, acc1), _mm512_unpackhi_ps(acc0, acc1));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(acc2, acc3), _mm512_unpackhi_ps(acc2, acc3));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  // The four 128-bit lanes hold partial (A, B, C, D): add them.
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
#elif ATTNKIT_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i);
    acc0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[0] + i), acc0);
    acc1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[1] + i), acc1);
    acc2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[2] + i), acc2);
    acc3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b[3] + i), acc3);
  }
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    const __m256 x = _mm256_maskload_ps(a + i, k);
    acc0 = _mm256_fmadd_ps(x, _mm256_maskload_ps(b[0] + i, k), acc0);
    acc1 = _mm256_fmadd_ps(x, _mm256_maskload_ps(b[1] + i, k), acc1);
    acc2 = _mm256_fmadd_ps(x, _mm256_maskload_ps(b[2] + i, k), acc2);
    acc3 = _mm256_fmadd_ps(x, _mm256_maskload_ps(b[3] + i, k), acc3);
  }
  // hadd pairs within each 128-bit lane: twice gives, per lane, the partial
  // (A, B, C, D); the two lanes are then added.
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(acc0, acc1), _mm256_hadd_ps(acc2, acc3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  for (int r = 0; r < 4; ++r) out[r] = dot(a, b[r], n);
#endif
}

/// x[i] *= s.
inline void scale(float* x, int64_t n, float s) {
#ifdef __AVX512F__
  const __m512 f = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), f));
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), f));
  }
#elif ATTNKIT_AVX2
  const __m256 f = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), f));
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    _mm256_maskstore_ps(x + i, k, _mm256_mul_ps(_mm256_maskload_ps(x + i, k), f));
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
#endif
}

/// x[i] += y[i].
inline void add(float* x, const float* y, int64_t n) {
#ifdef __AVX512F__
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, k,
                          _mm512_add_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_maskz_loadu_ps(k, y + i)));
  }
#elif ATTNKIT_AVX2
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    _mm256_maskstore_ps(x + i, k, _mm256_add_ps(_mm256_maskload_ps(x + i, k), _mm256_maskload_ps(y + i, k)));
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
#endif
}

/// y[i] += a * x[i].
inline void axpy(float* y, float a, const float* x, int64_t n) {
#ifdef __AVX512F__
  const __m512 f = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(f, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, k, _mm512_fmadd_ps(f, _mm512_maskz_loadu_ps(k, x + i),
                                                    _mm512_maskz_loadu_ps(k, y + i)));
  }
#elif ATTNKIT_AVX2
  const __m256 f = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(f, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    _mm256_maskstore_ps(y + i, k,
                        _mm256_fmadd_ps(f, _mm256_maskload_ps(x + i, k), _mm256_maskload_ps(y + i, k)));
  }
#else
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
#endif
}

/// ds[i] = p[i] * (ds[i] - d): the softmax backward dS = P * (dP - D) for one row.
inline void softmax_grad(float* ds, const float* p, int64_t n, float d) {
#ifdef __AVX512F__
  const __m512 dv = _mm512_set1_ps(d);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(ds + i, _mm512_mul_ps(_mm512_loadu_ps(p + i),
                                           _mm512_sub_ps(_mm512_loadu_ps(ds + i), dv)));
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(ds + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + i),
                                                   _mm512_sub_ps(_mm512_maskz_loadu_ps(k, ds + i), dv)));
  }
#elif ATTNKIT_AVX2
  const __m256 dv = _mm256_set1_ps(d);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(ds + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), _mm256_sub_ps(_mm256_loadu_ps(ds + i), dv)));
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    _mm256_maskstore_ps(ds + i, k, _mm256_mul_ps(_mm256_maskload_ps(p + i, k),
                                                 _mm256_sub_ps(_mm256_maskload_ps(ds + i, k), dv)));
  }
#else
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - d);
#endif
}

// A softmax taken down the columns of a tile x (count rows of n columns,
// row stride ld): column i is a query whose visible rows (keys j0 + c) are
// lo[i] <= j0 + c < hi[i]; the others count as -inf. The lanes hold a
// column each, so the maxima and sums stay in registers over the rows.

/// m[i] = max over the visible rows c of x[c][i]; -inf when none is visible.
/// (A NaN may be dropped here: the sums of column_exp_sum carry it.)
inline void column_max(const float* x, int64_t count, int64_t ld, int64_t n, int64_t j0, const int32_t* lo,
                       const int32_t* hi, float* m) {
  const float low = -std::numeric_limits<float>::infinity();
#ifdef __AVX512F__
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? static_cast<__mmask16>(0xffff) : tail_mask(n - i);
    const __m512i l = _mm512_maskz_loadu_epi32(lanes, lo + i), h = _mm512_maskz_loadu_epi32(lanes, hi + i);
    __m512 mi = _mm512_set1_ps(low);
    for (int64_t c = 0; c < count; ++c) {
      const __m512i j = _mm512_set1_epi32(static_cast<int32_t>(j0 + c));
      const __mmask16 seen = lanes & _mm512_cmple_epi32_mask(l, j) & _mm512_cmplt_epi32_mask(j, h);
      mi = _mm512_mask_max_ps(mi, seen, mi, _mm512_maskz_loadu_ps(lanes, x + c * ld + i));
    }
    _mm512_mask_storeu_ps(m + i, lanes, mi);
  }
#elif ATTNKIT_AVX2
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i lanes = n - i >= 8 ? _mm256_set1_epi32(-1) : tail_mask8(n - i);
    const __m256i l = _mm256_maskload_epi32(lo + i, lanes), h = _mm256_maskload_epi32(hi + i, lanes);
    __m256 mi = _mm256_set1_ps(low);
    for (int64_t c = 0; c < count; ++c) {
      const __m256i j = _mm256_set1_epi32(static_cast<int32_t>(j0 + c));
      // lo <= j and j < hi: not (lo > j), and hi > j
      const __m256i seen = _mm256_andnot_si256(_mm256_cmpgt_epi32(l, j), _mm256_cmpgt_epi32(h, j));
      const __m256 xi = _mm256_blendv_ps(_mm256_set1_ps(low), _mm256_maskload_ps(x + c * ld + i, lanes),
                                         _mm256_castsi256_ps(seen));
      mi = _mm256_max_ps(mi, xi);
    }
    _mm256_maskstore_ps(m + i, lanes, mi);
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    float mi = low;
    for (int64_t c = 0; c < count; ++c) {
      const int64_t j = j0 + c;
      if (lo[i] <= j && j < hi[i] && x[c * ld + i] > mi) mi = x[c * ld + i];
    }
    m[i] = mi;
  }
#endif
}

/// x[c][i] = exp(x[c][i] - shift[i]) for the visible rows, 0 for the others,
/// and sum[i] = the column's sum of them.
inline void column_exp_sum(float* x, int64_t count, int64_t ld, int64_t n, int64_t j0, const int32_t* lo,
                           const int32_t* hi, const float* shift, float* sum) {
#ifdef __AVX512F__
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? static_cast<__mmask16>(0xffff) : tail_mask(n - i);
    const __m512i l = _mm512_maskz_loadu_epi32(lanes, lo + i), h = _mm512_maskz_loadu_epi32(lanes, hi + i);
    const __m512 s = _mm512_maskz_loadu_ps(lanes, shift + i);
    __m512 total = _mm512_setzero_ps();
    for (int64_t c = 0; c < count; ++c) {
      const __m512i j = _mm512_set1_epi32(static_cast<int32_t>(j0 + c));
      const __mmask16 seen = _mm512_cmple_epi32_mask(l, j) & _mm512_cmplt_epi32_mask(j, h);
      float* xc = x + c * ld + i;
      const __m512 e = _mm512_maskz_mov_ps(seen, softmax_exp16(_mm512_maskz_loadu_ps(lanes, xc), s));
      _mm512_mask_storeu_ps(xc, lanes, e);
      total = _mm512_add_ps(total, e);
    }
    _mm512_mask_storeu_ps(sum + i, lanes, total);
  }
#elif ATTNKIT_AVX2
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i lanes = n - i >= 8 ? _mm256_set1_epi32(-1) : tail_mask8(n - i);
    const __m256i l = _mm256_maskload_epi32(lo + i, lanes), h = _mm256_maskload_epi32(hi + i, lanes);
    const __m256 s = _mm256_maskload_ps(shift + i, lanes);
    __m256 total = _mm256_setzero_ps();
    for (int64_t c = 0; c < count; ++c) {
      const __m256i j = _mm256_set1_epi32(static_cast<int32_t>(j0 + c));
      const __m256i seen = _mm256_andnot_si256(_mm256_cmpgt_epi32(l, j), _mm256_cmpgt_epi32(h, j));
      float* xc = x + c * ld + i;
      const __m256 e = _mm256_and_ps(softmax_exp8(_mm256_maskload_ps(xc, lanes), s), _mm256_castsi256_ps(seen));
      _mm256_maskstore_ps(xc, lanes, e);
      total = _mm256_add_ps(total, e);
    }
    _mm256_maskstore_ps(sum + i, lanes, total);
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    float total = 0.f;
    for (int64_t c = 0; c < count; ++c) {
      const int64_t j = j0 + c;
      float& xc = x[c * ld + i];
      xc = lo[i] <= j && j < hi[i] ? exp(xc - shift[i]) : 0.f;
      total += xc;
    }
    sum[i] = total;
  }
#endif
}

/// x[c] -= slope * |from - c|: ALiBi's linear distance penalty along a row of
/// scores whose first key is `from` positions before the query (from may be
/// negative: keys after the query). Exact for |from - c| < 2^24.
inline void sub_distance(float* x, int64_t n, float from, float slope) {
#ifdef __AVX512F__
  const __m512 f = _mm512_set1_ps(from), s = _mm512_set1_ps(slope);
  const __m512 sixteen = _mm512_set1_ps(16.f);
  __m512 c = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16, c = _mm512_add_ps(c, sixteen))
    _mm512_storeu_ps(x + i, _mm512_fnmadd_ps(s, _mm512_abs_ps(_mm512_sub_ps(f, c)), _mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, k, _mm512_fnmadd_ps(s, _mm512_abs_ps(_mm512_sub_ps(f, c)),
                                                     _mm512_maskz_loadu_ps(k, x + i)));
  }
#elif ATTNKIT_AVX2
  const __m256 f = _mm256_set1_ps(from), s = _mm256_set1_ps(slope), eight = _mm256_set1_ps(8.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 c = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8, c = _mm256_add_ps(c, eight))
    _mm256_storeu_ps(x + i, _mm256_fnmadd_ps(s, _mm256_andnot_ps(sign, _mm256_sub_ps(f, c)), _mm256_loadu_ps(x + i)));
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    _mm256_maskstore_ps(x + i, k, _mm256_fnmadd_ps(s, _mm256_andnot_ps(sign, _mm256_sub_ps(f, c)),
                                                   _mm256_maskload_ps(x + i, k)));
  }
#else
  for (int64_t i = 0; i < n; ++i) x[i] -= slope * std::fabs(from - static_cast<float>(i));
#endif
}

// tanh for soft-capping: an odd Taylor polynomial to x^9 below |x| = 1/4
// (truncation under 1e-8 relative there), 1 - 2 / (exp(2|x|) + 1) above it
// (a few ulp: the subtraction costs at most two bits at |x| = 1/4), the sign
// put back. +-inf give +-1, NaN stays NaN.
#ifdef __AVX512F__
inline __m512 tanh16(__m512 x) {
  const __m512 a = _mm512_abs_ps(x), x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(62.f / 2835.f);
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-17.f / 315.f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.f / 15.f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.f / 3.f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, x2), x, x);
  const __m512 e = exp16(_mm512_add_ps(a, a));
  const __m512 large = _mm512_sub_ps(_mm512_set1_ps(1.f),
                                     _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
  const __m512 signed_large = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(large), _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_LT_OQ), signed_large, small);
}
#elif ATTNKIT_AVX2
inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 a = _mm256_andnot_ps(sign, x), x2 = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(62.f / 2835.f);
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-17.f / 315.f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.f / 15.f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1.f / 3.f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, x2), x, x);
  const __m256 e = exp8(_mm256_add_ps(a, a));
  const __m256 large =
      _mm256_sub_ps(_mm256_set1_ps(1.f), _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, _mm256_set1_ps(1.f))));
  const __m256 signed_large = _mm256_or_ps(large, _mm256_and_ps(x, sign));
  return _mm256_blendv_ps(signed_large, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_LT_OQ));
}
#endif

/// tanh of one float, the vector code's where it exists.
inline float tanh(float x) {
#ifdef __AVX512F__
  return _mm512_cvtss_f32(tanh16(_mm512_set1_ps(x)));
#elif ATTNKIT_AVX2
  return _mm256_cvtss_f32(tanh8(_mm256_set1_ps(x)));
#else
  const float a = std::fabs(x), x2 = x * x;
  if (a < 0.25f) return x + x * x2 * (-1.f / 3.f + x2 * (2.f / 15.f + x2 * (-17.f / 315.f + x2 * (62.f / 2835.f))));
  return std::copysign(1.f - 2.f / (std::exp(2.f * a) + 1.f), x);
#endif
}

/// Soft-capping (Gemma 2): x[i] = cap tanh(x[i] / cap), and when `slope` is
/// given, slope[i] = 1 - tanh^2, the derivative of the new x[i] by the old.
inline void softcap(float* x, int64_t n, float cap, float* slope = nullptr) {
  const float inv = 1.f / cap;
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 c = _mm512_set1_ps(cap), ic = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
  for (; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16{0xFFFF} : tail_mask(n - i);
    const __m512 t = tanh16(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), ic));
    _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(t, c));
    if (slope) _mm512_mask_storeu_ps(slope + i, k, _mm512_fnmadd_ps(t, t, one));
  }
#elif ATTNKIT_AVX2
  const __m256 c = _mm256_set1_ps(cap), ic = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 t = tanh8(_mm256_mul_ps(_mm256_loadu_ps(x + i), ic));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(t, c));
    if (slope) _mm256_storeu_ps(slope + i, _mm256_fnmadd_ps(t, t, one));
  }
#endif
  for (; i < n; ++i) {
    const float t = tanh(x[i] * inv);
    x[i] = cap * t;
    if (slope) slope[i] = 1.f - t * t;
  }
}

}  // namespace vec
ATTNKIT_KERNELS_END

namespace attnkit::kernels {

/// y[i] = exp(x[i]) by the current ISA level's vec::exp_array (vec.cpp,
/// compiled once per level), so tests measure the exp the kernels actually
/// use. Named apart from vec::: a second `vec` outside the level namespace
/// would be read differently by GCC and clang.
void vec_exp_array(const float* x, float* y, int64_t n);
/// y[i] = exp(x[i] - shift) by the current level's vec::exp_shift_sum, the
/// softmax's weights (softmax_exp16 / softmax_exp8); returns their sum.
float vec_softmax_exp_array(const float* x, float* y, int64_t n, float shift);

}  // namespace attnkit::kernels
