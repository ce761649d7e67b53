// Long on purpose: one file holds each ISA level's building blocks and the
// kernels made of them, so that the levels stay the same computation.
//
// The band kernels of sparse attention (sparse_band.h). Each level with them
// provides the same building blocks (the queries transposed, the scores key by
// key, the softmax down the keys, the products), first at AVX-512, then their
// AVX2 twins, which hold the block's 32 rows in four 8-lane vectors instead of
// two 16-lane ones and take fewer keys and output rows per step (16 vector
// registers instead of 32); the kernels at the end are made of them. The
// twins are written out rather than generated from one template because the
// AVX-512 blocks were tuned and verified on AVX-512 hardware, which the
// machines that wrote the AVX2 ones lacked (qemu-user cannot run AVX-512
// either); merging them is for a session that can run both. Nothing is
// compiled at the baseline level.
#include "kernels/sparse_band.h"

#include <algorithm>
#include <limits>

#include "kernels/common/parallel.h"
#include "kernels/common/vec.h"

ATTNKIT_KERNELS_BEGIN
namespace band {
namespace {

[[maybe_unused]] constexpr float kInf = std::numeric_limits<float>::infinity();

/// What the products of the band kernels sum over (weigh, below): the keys
/// (P v, dS k) or the block's rows (P^T dout, dS^T q).
enum class Sum { keys, rows };

}  // namespace

#ifdef __AVX512F__
namespace {

// The scores are computed transposed, one key per row: st[c][r] = scale
// k_c . q_r with the block's 32 rows in two 16-lane vectors. The softmax then
// runs down the keys with the rows in the lanes, and since a row's entries
// are one run of keys [first_r, last_r), key c's mask is two compares.

/// qt[e][r] = q_r[e] for the rows r < rows from q (row stride ld), 0 for
/// rows <= r < 32.
void transpose_rows(const float* q, int64_t ld, int64_t rows, int64_t E, float* qt) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i idx0 = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(ld)));
  const __m512i idx1 = _mm512_add_epi32(idx0, _mm512_set1_epi32(static_cast<int>(16 * ld)));
  const __mmask16 k0 = vec::tail_mask(std::min<int64_t>(rows, 16));
  const __mmask16 k1 = rows > 16 ? vec::tail_mask(rows - 16) : __mmask16{0};
  for (int64_t e = 0; e < E; ++e) {
    _mm512_store_ps(qt + e * kRows,
                    _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k0, idx0, q + e, 4));
    _mm512_store_ps(qt + e * kRows + 16,
                    _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k1, idx1, q + e, 4));
  }
}

/// st[c][0:32] = scale * (k_c . q_r) for the NC keys c from k (row stride ldk),
/// q transposed in qt (E x 32).
template <int NC>
void score_keys(const float* k, int64_t ldk, const float* qt, int64_t E, float scale, float* st) {
  __m512 acc[NC][2];  // in registers: every loop over them is unrolled
#pragma GCC unroll 16
  for (int i = 0; i < NC; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t e = 0; e < E; ++e) {
    const __m512 a0 = _mm512_load_ps(qt + e * kRows);
    const __m512 a1 = _mm512_load_ps(qt + e * kRows + 16);
#pragma GCC unroll 16
    for (int i = 0; i < NC; ++i) {
      const __m512 b = _mm512_set1_ps(k[i * ldk + e]);
      acc[i][0] = _mm512_fmadd_ps(b, a0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(b, a1, acc[i][1]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (int i = 0; i < NC; ++i) {
    _mm512_store_ps(st + i * kRows, _mm512_mul_ps(acc[i][0], s));
    _mm512_store_ps(st + i * kRows + 16, _mm512_mul_ps(acc[i][1], s));
  }
}

/// score_keys over `cols` keys, twelve at a time (24 accumulators).
void score_all_keys(const float* k, int64_t ldk, int64_t cols, const float* qt, int64_t E,
                    float scale, float* st) {
  int64_t c = 0;
  for (; c + 12 <= cols; c += 12) score_keys<12>(k + c * ldk, ldk, qt, E, scale, st + c * kRows);
  const float* kc = k + c * ldk;
  float* sc = st + c * kRows;
  switch (cols - c) {
    case 0: break;
    case 1: score_keys<1>(kc, ldk, qt, E, scale, sc); break;
    case 2: score_keys<2>(kc, ldk, qt, E, scale, sc); break;
    case 3: score_keys<3>(kc, ldk, qt, E, scale, sc); break;
    case 4: score_keys<4>(kc, ldk, qt, E, scale, sc); break;
    case 5: score_keys<5>(kc, ldk, qt, E, scale, sc); break;
    case 6: score_keys<6>(kc, ldk, qt, E, scale, sc); break;
    case 7: score_keys<7>(kc, ldk, qt, E, scale, sc); break;
    case 8: score_keys<8>(kc, ldk, qt, E, scale, sc); break;
    case 9: score_keys<9>(kc, ldk, qt, E, scale, sc); break;
    case 10: score_keys<10>(kc, ldk, qt, E, scale, sc); break;
    case 11: score_keys<11>(kc, ldk, qt, E, scale, sc); break;
  }
}

/// Weighted sums of rows of x, the products of the band kernels. The weights
/// w are a band block's transposed tile (one key per row of 32 floats, the
/// block's rows in the lanes), summed either over the keys (Sum::keys: P v,
/// dS k; output row i is block row i) or over the block's rows (Sum::rows:
/// P^T dout, dS^T q; output row i is key i):
///   out[i][0 : 16 NV] (+)= alpha sum_{t < count} weight(i, t) x_t,
/// weight(i, t) = w[t][i] or w[i][t], x_t the row t of x (row stride ldx) from
/// its current column, the last vector masked by tail.

template <Sum kSum, int NR, int NV>
void weigh(const float* w, int64_t count, const float* x, int64_t ldx, __mmask16 tail,
           float alpha, bool accumulate, float* out, int64_t ldo) {
  // Every loop over the accumulators is unrolled, so that they stay in
  // registers (a loop left rolled makes GCC keep them on the stack).
  __m512 acc[NR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; ++t) {
    __m512 xt[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      xt[j] = j + 1 < NV ? _mm512_loadu_ps(x + t * ldx + 16 * j)
                         : _mm512_maskz_loadu_ps(tail, x + t * ldx + 16 * j);
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      const __m512 weight =
          _mm512_set1_ps(kSum == Sum::keys ? w[t * kRows + i] : w[i * kRows + t]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(weight, xt[j], acc[i][j]);
    }
  }
  const __m512 a = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 k = j + 1 < NV ? __mmask16{0xFFFF} : tail;
      float* o = out + i * ldo + 16 * j;
      const __m512 sum = accumulate ? _mm512_fmadd_ps(acc[i][j], a, _mm512_maskz_loadu_ps(k, o))
                                    : _mm512_mul_ps(acc[i][j], a);
      _mm512_mask_storeu_ps(o, k, sum);
    }
}

template <Sum kSum, int NR>
void weigh_nv(int nv, const float* w, int64_t count, const float* x, int64_t ldx, __mmask16 tail,
              float alpha, bool accumulate, float* out, int64_t ldo) {
  switch (nv) {
    case 1: return weigh<kSum, NR, 1>(w, count, x, ldx, tail, alpha, accumulate, out, ldo);
    case 2: return weigh<kSum, NR, 2>(w, count, x, ldx, tail, alpha, accumulate, out, ldo);
    case 3: return weigh<kSum, NR, 3>(w, count, x, ldx, tail, alpha, accumulate, out, ldo);
    default: return weigh<kSum, NR, 4>(w, count, x, ldx, tail, alpha, accumulate, out, ldo);
  }
}

/// How many output rows weigh_all takes next when `left` remain: six (24
/// accumulators of 64 columns), but 7 or 8 left go as four and the rest, since
/// a step of one or two rows has too few accumulators to hide the FMAs'
/// latency (docs/PERFORMANCE.md, "Why the kernels' constants").
constexpr int64_t weigh_step(int64_t left) { return left > 8 ? 6 : left > 6 ? 4 : left; }

/// weigh over all `rows` output rows (row stride ldo) and all `width` columns
/// of x: up to six rows (weigh_step) by up to 64 columns at a time.
template <Sum kSum>
void weigh_all(const float* w, int64_t rows, int64_t count, const float* x, int64_t ldx,
               int64_t width, float alpha, bool accumulate, float* out, int64_t ldo) {
  for (int64_t c0 = 0; c0 < width; c0 += 64) {
    const int64_t cols = std::min<int64_t>(64, width - c0);
    const int nv = static_cast<int>(ceil_div(cols, 16));
    const __mmask16 tail = vec::tail_mask(cols - 16 * (nv - 1));
    for (int64_t i = 0, step = 0; i < rows; i += step) {
      step = weigh_step(rows - i);
      // Output row i's weights: lane i of each key's row, or key i's row.
      const float* wi = w + (kSum == Sum::keys ? i : i * kRows);
      float* o = out + i * ldo + c0;
      const float* xc = x + c0;
      switch (step) {
        case 1: weigh_nv<kSum, 1>(nv, wi, count, xc, ldx, tail, alpha, accumulate, o, ldo); break;
        case 2: weigh_nv<kSum, 2>(nv, wi, count, xc, ldx, tail, alpha, accumulate, o, ldo); break;
        case 3: weigh_nv<kSum, 3>(nv, wi, count, xc, ldx, tail, alpha, accumulate, o, ldo); break;
        case 4: weigh_nv<kSum, 4>(nv, wi, count, xc, ldx, tail, alpha, accumulate, o, ldo); break;
        case 5: weigh_nv<kSum, 5>(nv, wi, count, xc, ldx, tail, alpha, accumulate, o, ldo); break;
        default: weigh_nv<kSum, 6>(nv, wi, count, xc, ldx, tail, alpha, accumulate, o, ldo); break;
      }
    }
  }
}

/// Key c's mask over the 32 rows of a band block: the rows whose run holds c.
/// When every row's run is all the keys (`whole`: a tile of the exact kernel
/// that no mask cuts), that is the block's rows for every key, taken without
/// the compares (of_key<true>).
struct BandMask {
  __m512i first0, first1, last0, last1;
  __mmask16 rows0, rows1;
  bool whole = true;

  explicit BandMask(const Block& b)
      : first0(_mm512_loadu_si512(b.first)),
        first1(_mm512_loadu_si512(b.first + 16)),
        last0(_mm512_loadu_si512(b.last)),
        last1(_mm512_loadu_si512(b.last + 16)),
        rows0(vec::tail_mask(std::min<int64_t>(b.rows, 16))),
        rows1(b.rows > 16 ? vec::tail_mask(b.rows - 16) : __mmask16{0}) {
    for (int64_t r = 0; r < b.rows; ++r) whole = whole && b.first[r] == 0 && b.last[r] == b.keys;
  }

  template <bool kWhole>
  void of_key(int64_t c, __mmask16& k0, __mmask16& k1) const {
    if constexpr (kWhole) {
      k0 = rows0, k1 = rows1;
    } else {
      const __m512i cc = _mm512_set1_epi32(static_cast<int>(c));
      k0 = _mm512_cmple_epi32_mask(first0, cc) & _mm512_cmplt_epi32_mask(cc, last0);
      k1 = _mm512_cmple_epi32_mask(first1, cc) & _mm512_cmplt_epi32_mask(cc, last1);
    }
  }
};

/// x, or 0 in the lanes where x is -inf (a row without edges, or whose scores
/// are all -inf, shifts its scores by 0: exp(-inf) = 0 rather than NaN).
inline __m512 finite_shift(__m512 x) {
  return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-kInf), _CMP_EQ_OQ),
                            _mm512_setzero_ps());
}

template <bool kWhole>
void softmax_keys(const Block& b, const BandMask& mask, float* st, float* m, float* l) {
  __m512 m0 = _mm512_set1_ps(-kInf), m1 = m0;
  for (int64_t c = 0; c < b.keys; ++c) {
    __mmask16 k0, k1;
    mask.of_key<kWhole>(c, k0, k1);
    // max() returns its second operand when either is NaN: a NaN score
    // replaces m here, and makes its own weight (so l and the row) NaN below.
    m0 = _mm512_mask_max_ps(m0, k0, m0, _mm512_load_ps(st + c * kRows));
    m1 = _mm512_mask_max_ps(m1, k1, m1, _mm512_load_ps(st + c * kRows + 16));
  }
  const __m512 shift0 = finite_shift(m0), shift1 = finite_shift(m1);
  __m512 l0 = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
  for (int64_t c = 0; c < b.keys; ++c) {
    __mmask16 k0, k1;
    mask.of_key<kWhole>(c, k0, k1);
    float* sc = st + c * kRows;
    const __m512 p0 = _mm512_maskz_mov_ps(k0, vec::softmax_exp16(_mm512_load_ps(sc), shift0));
    const __m512 p1 = _mm512_maskz_mov_ps(k1, vec::softmax_exp16(_mm512_load_ps(sc + 16), shift1));
    _mm512_store_ps(sc, p0);
    _mm512_store_ps(sc + 16, p1);
    l0 = _mm512_add_ps(l0, p0);
    l1 = _mm512_add_ps(l1, p1);
  }
  _mm512_storeu_ps(m, m0);
  _mm512_storeu_ps(m + 16, m1);
  _mm512_storeu_ps(l, l0);
  _mm512_storeu_ps(l + 16, l1);
}

/// The forward's softmax of a block's scores st (keys x 32), down the keys
/// with the rows in lanes: the masked maximum m, then P (0 off the runs) in
/// place of the scores and its sums l. A row without keys keeps m = -inf
/// and l = 0.
void softmax_keys(const Block& b, float* st, float* m, float* l) {
  const BandMask mask(b);
  if (mask.whole) return softmax_keys<true>(b, mask, st, m, l);
  softmax_keys<false>(b, mask, st, m, l);
}

template <bool kWhole>
void softmax_grad_keys(const Block& b, const BandMask& mask, const float* lse, const float* d, float* pt,
                       float* dst) {
  const __m512 shift0 = finite_shift(_mm512_load_ps(lse));
  const __m512 shift1 = finite_shift(_mm512_load_ps(lse + 16));
  const __m512 d0 = _mm512_load_ps(d), d1 = _mm512_load_ps(d + 16);
  for (int64_t c = 0; c < b.keys; ++c) {
    __mmask16 k0, k1;
    mask.of_key<kWhole>(c, k0, k1);
    float* pc = pt + c * kRows;
    float* dc = dst + c * kRows;
    const __m512 p0 = _mm512_maskz_mov_ps(k0, vec::softmax_exp16(_mm512_load_ps(pc), shift0));
    const __m512 p1 = _mm512_maskz_mov_ps(k1, vec::softmax_exp16(_mm512_load_ps(pc + 16), shift1));
    _mm512_store_ps(pc, p0);
    _mm512_store_ps(pc + 16, p1);
    _mm512_store_ps(dc, _mm512_maskz_mul_ps(k0, p0, _mm512_sub_ps(_mm512_load_ps(dc), d0)));
    _mm512_store_ps(dc + 16, _mm512_maskz_mul_ps(k1, p1, _mm512_sub_ps(_mm512_load_ps(dc + 16), d1)));
  }
}

/// The backward's P = exp(s - lse) in place of the scores pt and
/// dS = P (dP - d) in place of dP (dst), both 0 off the runs; lse and d
/// hold 32 entries (the padding rows' 0).
void softmax_grad_keys(const Block& b, const float* lse, const float* d, float* pt, float* dst) {
  const BandMask mask(b);
  if (mask.whole) return softmax_grad_keys<true>(b, mask, lse, d, pt, dst);
  softmax_grad_keys<false>(b, mask, lse, d, pt, dst);
}

}  // namespace

#elif ATTNKIT_AVX2
namespace {

// As above, with the block's 32 rows in four 8-lane vectors. With 16
// registers a step holds fewer accumulators: three keys of scores (12), three
// output rows of up to 32 columns in the products (12).
constexpr int kRowVectors = kRows / 8;

/// xt[e][r] = x_r[e] for the rows r < rows of x (row stride ld) and the
/// columns e < width, 0 for rows <= r < 32.
void transpose_rows(const float* x, int64_t ld, int64_t rows, int64_t width, float* xt) {
  if (rows < kRows) std::fill(xt, xt + width * kRows, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ld;
    for (int64_t e = 0; e < width; ++e) xt[e * kRows + r] = xr[e];
  }
}

/// st[c][0:32] = scale * (k_c . q_r) for the NC keys c from k (row stride ldk),
/// q transposed in qt (E x 32).
template <int NC>
void score_keys(const float* k, int64_t ldk, const float* qt, int64_t E, float scale, float* st) {
  __m256 acc[NC][kRowVectors];  // in registers: every loop over them is unrolled
#pragma GCC unroll 4
  for (int i = 0; i < NC; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kRowVectors; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t e = 0; e < E; ++e) {
    const float* a = qt + e * kRows;
#pragma GCC unroll 4
    for (int i = 0; i < NC; ++i) {
      const __m256 b = _mm256_broadcast_ss(k + i * ldk + e);
#pragma GCC unroll 4
      for (int j = 0; j < kRowVectors; ++j)
        acc[i][j] = _mm256_fmadd_ps(b, _mm256_load_ps(a + 8 * j), acc[i][j]);
    }
  }
  const __m256 s = _mm256_set1_ps(scale);
#pragma GCC unroll 4
  for (int i = 0; i < NC; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kRowVectors; ++j)
      _mm256_store_ps(st + i * kRows + 8 * j, _mm256_mul_ps(acc[i][j], s));
}

/// score_keys over `cols` keys, three at a time.
void score_all_keys(const float* k, int64_t ldk, int64_t cols, const float* qt, int64_t E,
                    float scale, float* st) {
  int64_t c = 0;
  for (; c + 3 <= cols; c += 3) score_keys<3>(k + c * ldk, ldk, qt, E, scale, st + c * kRows);
  const float* kc = k + c * ldk;
  float* sc = st + c * kRows;
  switch (cols - c) {
    case 0: break;
    case 1: score_keys<1>(kc, ldk, qt, E, scale, sc); break;
    case 2: score_keys<2>(kc, ldk, qt, E, scale, sc); break;
  }
}

/// The products of the band kernels, as at AVX-512 (see there), with vectors
/// of 8 columns. With kTail, `tail` masks the last one (maskload / maskstore
/// lanes); without, every vector is whole: the mask would take the sixteenth
/// register, and the spill GCC then makes puts a store and a reload into
/// every step's chain of FMAs (docs/PERFORMANCE.md, "Why the kernels'
/// constants", has the measurement).
template <Sum kSum, int NR, int NV, bool kTail>
void weigh(const float* w, int64_t count, const float* x, int64_t ldx, __m256i tail, float alpha,
           bool accumulate, float* out, int64_t ldo) {
  const auto load = [&](const float* from, int j) {
    return kTail && j + 1 == NV ? _mm256_maskload_ps(from, tail) : _mm256_loadu_ps(from);
  };
  __m256 acc[NR][NV];
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps();
  // The NR weights stay in registers and x's vectors are loaded one at a
  // time: 3 + 12 + 1 registers at NR = 3, NV = 4.
  for (int64_t t = 0; t < count; ++t) {
    __m256 weight[NR];
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i)
      weight[i] = _mm256_broadcast_ss(kSum == Sum::keys ? w + t * kRows + i : w + i * kRows + t);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __m256 xj = load(x + t * ldx + 8 * j, j);
#pragma GCC unroll 4
      for (int i = 0; i < NR; ++i) acc[i][j] = _mm256_fmadd_ps(weight[i], xj, acc[i][j]);
    }
  }
  const __m256 a = _mm256_set1_ps(alpha);
#pragma GCC unroll 4
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      float* o = out + i * ldo + 8 * j;
      const __m256 sum = accumulate ? _mm256_fmadd_ps(acc[i][j], a, load(o, j)) : _mm256_mul_ps(acc[i][j], a);
      if (kTail && j + 1 == NV) {
        _mm256_maskstore_ps(o, tail, sum);
      } else {
        _mm256_storeu_ps(o, sum);
      }
    }
}

template <Sum kSum, int NR, bool kTail>
void weigh_nv(int nv, const float* w, int64_t count, const float* x, int64_t ldx, __m256i tail,
              float alpha, bool accumulate, float* out, int64_t ldo) {
  switch (nv) {
    case 1: return weigh<kSum, NR, 1, kTail>(w, count, x, ldx, tail, alpha, accumulate, out, ldo);
    case 2: return weigh<kSum, NR, 2, kTail>(w, count, x, ldx, tail, alpha, accumulate, out, ldo);
    case 3: return weigh<kSum, NR, 3, kTail>(w, count, x, ldx, tail, alpha, accumulate, out, ldo);
    default: return weigh<kSum, NR, 4, kTail>(w, count, x, ldx, tail, alpha, accumulate, out, ldo);
  }
}

template <Sum kSum, int NR>
void weigh_cols(int64_t cols, const float* w, int64_t count, const float* x, int64_t ldx,
                float alpha, bool accumulate, float* out, int64_t ldo) {
  const int nv = static_cast<int>(ceil_div(cols, 8));
  if (cols % 8 == 0) return weigh_nv<kSum, NR, false>(nv, w, count, x, ldx, _mm256_setzero_si256(), alpha, accumulate, out, ldo);
  const __m256i tail = vec::tail_mask8(cols - 8 * (nv - 1));
  weigh_nv<kSum, NR, true>(nv, w, count, x, ldx, tail, alpha, accumulate, out, ldo);
}

/// weigh over all `rows` output rows (row stride ldo) and all `width` columns
/// of x: three rows by up to 32 columns at a time.
template <Sum kSum>
void weigh_all(const float* w, int64_t rows, int64_t count, const float* x, int64_t ldx,
               int64_t width, float alpha, bool accumulate, float* out, int64_t ldo) {
  for (int64_t c0 = 0; c0 < width; c0 += 32) {
    const int64_t cols = std::min<int64_t>(32, width - c0);
    for (int64_t i = 0; i < rows; i += 3) {
      const float* wi = w + (kSum == Sum::keys ? i : i * kRows);
      float* o = out + i * ldo + c0;
      const float* xc = x + c0;
      switch (std::min<int64_t>(3, rows - i)) {
        case 1: weigh_cols<kSum, 1>(cols, wi, count, xc, ldx, alpha, accumulate, o, ldo); break;
        case 2: weigh_cols<kSum, 2>(cols, wi, count, xc, ldx, alpha, accumulate, o, ldo); break;
        default: weigh_cols<kSum, 3>(cols, wi, count, xc, ldx, alpha, accumulate, o, ldo); break;
      }
    }
  }
}

/// The keys of the 8 rows of one vector (rows 8 j to 8 j + 7 of a block):
/// every row's run lies in [lo, hi), and [all_lo, all_hi) in every row's run
/// (lo <= all_lo <= all_hi <= hi). The softmax visits only [lo, hi) of a
/// vector, and masks only the keys outside [all_lo, all_hi): at span 64 a
/// vector's rows share 122 of their 136 keys, and the band's block is 160
/// keys wide.
class LaneKeys {
 public:
  LaneKeys(const int32_t* first, const int32_t* last, int j)
      : first_(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + 8 * j))),
        last_(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(last + 8 * j))) {
    int64_t lo = kMaxKeys, hi = 0, all_lo = 0, all_hi = kMaxKeys;
    for (int r = 8 * j; r < 8 * j + 8; ++r) {
      if (first[r] == last[r]) {  // a row without keys shares none
        all_lo = kMaxKeys;
        continue;
      }
      lo = std::min<int64_t>(lo, first[r]);
      hi = std::max<int64_t>(hi, last[r]);
      all_lo = std::max<int64_t>(all_lo, first[r]);
      all_hi = std::min<int64_t>(all_hi, last[r]);
    }
    lo_ = std::min(lo, hi);
    hi_ = hi;
    all_lo_ = std::clamp(all_lo, lo_, hi_);
    all_hi_ = std::clamp(all_hi, all_lo_, hi_);
  }

  int64_t lo() const { return lo_; }
  int64_t hi() const { return hi_; }

  /// Calls f(c, mask) for every key c of [lo, hi) in increasing order; mask
  /// has all ones in the lanes of the rows whose run holds c, zeros
  /// elsewhere, and is all ones without a compare inside [all_lo, all_hi).
  template <class F>
  void for_each(const F& f) const {
    int64_t c = lo_;
    for (; c < all_lo_; ++c) f(c, of_key(c));
    const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (; c < all_hi_; ++c) f(c, all);
    for (; c < hi_; ++c) f(c, of_key(c));
  }

 private:
  __m256 of_key(int64_t c) const {  // first <= c and c < last
    const __m256i cc = _mm256_set1_epi32(static_cast<int>(c));
    return _mm256_castsi256_ps(
        _mm256_andnot_si256(_mm256_cmpgt_epi32(first_, cc), _mm256_cmpgt_epi32(last_, cc)));
  }

  __m256i first_, last_;
  int64_t lo_, hi_, all_lo_, all_hi_;
};

/// x, or 0 in the lanes where x is -inf (see the AVX-512 finite_shift).
inline __m256 finite_shift(__m256 x) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-kInf), _CMP_EQ_OQ), x);
}

/// Zeros in vector j of the keys [begin, end) of a keys x 32 tile.
void zero_keys(float* tile, int j, int64_t begin, int64_t end) {
  for (int64_t c = begin; c < end; ++c) _mm256_store_ps(tile + c * kRows + 8 * j, _mm256_setzero_ps());
}

/// softmax_keys as at AVX-512, one vector of 8 rows at a time over its own
/// keys (LaneKeys).
void softmax_keys(const Block& b, float* st, float* m, float* l) {
  for (int j = 0; j < kRowVectors; ++j) {
    const LaneKeys keys(b.first, b.last, j);
    float* sj = st + 8 * j;
    __m256 mj = _mm256_set1_ps(-kInf);
    // max() returns its second operand when either is NaN, as at AVX-512.
    keys.for_each([&](int64_t c, __m256 mask) {
      mj = _mm256_blendv_ps(mj, _mm256_max_ps(mj, _mm256_load_ps(sj + c * kRows)), mask);
    });
    const __m256 shift = finite_shift(mj);
    __m256 lj = _mm256_setzero_ps();
    zero_keys(st, j, 0, keys.lo());
    keys.for_each([&](int64_t c, __m256 mask) {
      const __m256 p = _mm256_and_ps(mask, vec::softmax_exp8(_mm256_load_ps(sj + c * kRows), shift));
      _mm256_store_ps(sj + c * kRows, p);
      lj = _mm256_add_ps(lj, p);
    });
    zero_keys(st, j, keys.hi(), b.keys);
    _mm256_storeu_ps(m + 8 * j, mj);
    _mm256_storeu_ps(l + 8 * j, lj);
  }
}

/// softmax_grad_keys as at AVX-512, one vector of 8 rows at a time.
void softmax_grad_keys(const Block& b, const float* lse, const float* d, float* pt, float* dst) {
  for (int j = 0; j < kRowVectors; ++j) {
    const LaneKeys keys(b.first, b.last, j);
    const __m256 shift = finite_shift(_mm256_load_ps(lse + 8 * j));
    const __m256 dj = _mm256_load_ps(d + 8 * j);
    float* pj = pt + 8 * j;
    float* dsj = dst + 8 * j;
    zero_keys(pt, j, 0, keys.lo());
    zero_keys(dst, j, 0, keys.lo());
    keys.for_each([&](int64_t c, __m256 mask) {
      const __m256 p = _mm256_and_ps(mask, vec::softmax_exp8(_mm256_load_ps(pj + c * kRows), shift));
      _mm256_store_ps(pj + c * kRows, p);
      _mm256_store_ps(dsj + c * kRows,
                      _mm256_and_ps(mask, _mm256_mul_ps(p, _mm256_sub_ps(_mm256_load_ps(dsj + c * kRows), dj))));
    });
    zero_keys(pt, j, keys.hi(), b.keys);
    zero_keys(dst, j, keys.hi(), b.keys);
  }
}

}  // namespace

#endif  // __AVX512F__ / ATTNKIT_AVX2

#if ATTNKIT_BAND_KERNELS
// The kernels, the same at every level: the queries (and output gradients)
// transposed, the scores key by key, the softmax down the keys, the products.

namespace {

/// ALiBi on a block's transposed scores st (keys x 32): key c's lane r gets
/// -slope |from + r - c| = -slope |(c - from) - r|.
void sub_alibi_keys(const Block& b, float* st) {
  if (b.slope == 0.f) return;
  for (int64_t c = 0; c < b.keys; ++c)
    vec::sub_distance(st + c * kRows, kRows, static_cast<float>(c - b.from), b.slope);
}

/// A block mask's clear bits (Block::bits) on a block's transposed scores st
/// (keys x 32): -inf in the lanes of the rows that do not see key c.
void hide_keys(const Block& b, float* st) {
  if (!b.bits) return;
  for (int64_t g = 0; g * 32 < b.keys; ++g) {
    const uint32_t* words = b.bits + g * kRows;
#ifdef __AVX512F__
    const __m512i w0 = _mm512_load_si512(words), w1 = _mm512_load_si512(words + 16);
    const __m512 hidden = _mm512_set1_ps(-kInf);
    for (int64_t c = 32 * g; c < std::min<int64_t>(b.keys, 32 * g + 32); ++c) {
      const __m512i bit = _mm512_set1_epi32(static_cast<int>(1u << (c % 32)));
      _mm512_mask_store_ps(st + c * kRows, static_cast<__mmask16>(~_mm512_test_epi32_mask(w0, bit)), hidden);
      _mm512_mask_store_ps(st + c * kRows + 16, static_cast<__mmask16>(~_mm512_test_epi32_mask(w1, bit)), hidden);
    }
#else
    const __m256 hidden = _mm256_set1_ps(-kInf);
    for (int64_t c = 32 * g; c < std::min<int64_t>(b.keys, 32 * g + 32); ++c) {
      const __m256i bit = _mm256_set1_epi32(static_cast<int>(1u << (c % 32)));
      for (int j = 0; j < kRows / 8; ++j) {
        const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(words + 8 * j));
        const __m256 kept = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(w, bit), bit));
        float* sc = st + c * kRows + 8 * j;
        _mm256_store_ps(sc, _mm256_blendv_ps(hidden, _mm256_load_ps(sc), kept));
      }
    }
#endif
  }
}

}  // namespace

void transpose_queries(Rows q, int64_t rows, int64_t E, float* qt) { transpose_rows(q.data, q.ld, rows, E, qt); }

void forward_transposed(const Block& b, const float* qt, Rows k, Rows v, int64_t E, int64_t M, float scale,
                        const Scratch& w, float* u, float* m, float* l) {
  score_all_keys(k.data, k.ld, b.keys, qt, E, scale, w.s);  // keys x 32
  if (b.softcap > 0.f) vec::softcap(w.s, b.keys * kRows, b.softcap);
  sub_alibi_keys(b, w.s);
  hide_keys(b, w.s);
  softmax_keys(b, w.s, m, l);
  // u = P v: output rows r, summed over the keys (P^T is w.s: key c's row).
  weigh_all<Sum::keys>(w.s, b.rows, b.keys, v.data, v.ld, M, 1.f, false, u, M);
}

void forward(const Block& b, Rows q, Rows k, Rows v, int64_t E, int64_t M, float scale, const Scratch& w, float* u,
             float* m, float* l) {
  transpose_queries(q, b.rows, E, w.qt);
  forward_transposed(b, w.qt, k, v, E, M, scale, w, u, m, l);
}

void backward(const Block& b, Rows q, Rows k, Rows v, Rows dout, int64_t E, int64_t M,
              float scale, const float* lse, const float* d, const Scratch& w, float* dq,
              float* dk, int64_t ld_k, float* dv, int64_t ld_v) {
  transpose_rows(q.data, q.ld, b.rows, E, w.qt);
  transpose_rows(dout.data, dout.ld, b.rows, M, w.dot);
  float* pt = w.s;    // keys x 32: scores, then P
  float* dst = w.ds;  // keys x 32: dP, then dS
  score_all_keys(k.data, k.ld, b.keys, w.qt, E, scale, pt);
  sub_alibi_keys(b, pt);
  hide_keys(b, pt);
  score_all_keys(v.data, v.ld, b.keys, w.dot, M, 1.f, dst);
  alignas(64) float lse_rows[kRows] = {}, d_rows[kRows] = {};  // padding rows: 0
  std::copy(lse, lse + b.rows, lse_rows);
  std::copy(d, d + b.rows, d_rows);
  softmax_grad_keys(b, lse_rows, d_rows, pt, dst);
  // Key c's rows of dv and dk, summed over the block's rows (P^T and dS^T
  // are pt's and dst's rows); then dq over the keys.
  weigh_all<Sum::rows>(pt, b.keys, b.rows, dout.data, dout.ld, M, 1.f, true, dv, ld_v);
  weigh_all<Sum::rows>(dst, b.keys, b.rows, q.data, q.ld, E, scale, true, dk, ld_k);
  weigh_all<Sum::keys>(dst, b.rows, b.keys, k.data, k.ld, E, scale, false, dq, E);
}
#endif  // ATTNKIT_BAND_KERNELS

}  // namespace band
ATTNKIT_KERNELS_END
