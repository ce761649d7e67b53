#include "kernels/softmax_attention_bf16.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/memory.h"
#include "kernels/common/amx.h"
#include "kernels/common/parallel.h"
#include "kernels/common/simd.h"
#include "kernels/common/strided.h"
#include "kernels/common/vec.h"
#include "kernels/common/visibility.h"

ATTNKIT_KERNELS_BEGIN

namespace {

using amx::pad32;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Block sizes, queries x keys. On the tiles a block product costs a few
// hundred cycles and the softmax's exponentials dominate (one per score,
// against 2 E multiply-adds that the tiles do 1024 at a time), so the blocks
// only need to be large enough to amortise the calls and small enough that
// a block's scores (64 KiB) stay in L1/L2 between the product and the softmax.
constexpr int64_t kForwardBlockQ = 64;
constexpr int64_t kForwardBlockK = 256;
constexpr int64_t kBackwardBlockQ = 128;
constexpr int64_t kBackwardBlockK = 128;

/// n bf16 values of a thread's float scratch.
bf16* take_bf16(Slicer& slicer, int64_t n) { return reinterpret_cast<bf16*>(slicer.take((n + 1) / 2)); }

/// Matrix (n, h) of a strided (N, H, rows, cols) bf16 tensor.
amx::Source head_source(const bf16* base, const int64_t* stride, int64_t n, int64_t h) {
  return {head_of(base, stride, n, h), stride[2], stride[3]};
}

/// The source x advanced by r0 rows.
amx::Source from_row(amx::Source x, int64_t r0) { return {x.x + r0 * x.row_stride, x.row_stride, x.col_stride}; }

Visibility visibility_of(const SoftmaxAttentionBf16Params& p, int64_t n) {
  return Visibility(p.L, p.S, p.causal, key_limit(p.key_lengths, n, p.S));
}

void zero(bf16* x, int64_t n) { std::fill_n(x, n, bf16{}); }

/// out[c] = bf16(exp(scale s[c] - shift)) for c < n (one rounding before the
/// exp: a fused multiply-subtract); returns the float32 sum of the
/// exponentials (before rounding).
float exp_to_bf16(const float* s, int64_t n, float scale, float shift, bf16* out) {
#ifdef __AVX512BF16__
  const __m512 sc = _mm512_set1_ps(scale), sh = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 e = vec::exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + c), sc, sh));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (c < n) {
    const __mmask16 k = vec::tail_mask(n - c);
    const __m512 e = vec::exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + c), sc, sh));
    sum = _mm512_mask_add_ps(sum, k, sum, e);
    _mm256_mask_storeu_epi16(out + c, k, (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(sum);
#else
  float sum = 0.f;
  for (int64_t c = 0; c < n; ++c) {
    const float e = vec::exp(std::fma(s[c], scale, -shift));
    sum += e;
    out[c] = to_bf16(e);
  }
  return sum;
#endif
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

/// Every head's keys (B of S = Q K^T: S32 columns in panels over E32) and
/// values (B of O = P V: M32 columns in panels over S32), packed once.
struct ForwardPacks {
  int64_t E32, M32, S32;
  Buffer<bf16> data;

  explicit ForwardPacks(const SoftmaxAttentionBf16Params& p)
      : E32(pad32(p.E)), M32(pad32(p.M)), S32(pad32(p.S)),
        data(static_cast<size_t>(p.N * p.H * S32 * (E32 + M32))) {
    parallel_for(p.N * p.H, 0, [&](int64_t t, float*) {
      const int64_t n = t / p.H, h = t % p.H;
      // Keys past the padding limit are seen by no query: left zero, so that
      // whatever they hold never meets a probability of 0 in a product.
      const int64_t limit = key_limit(p.key_lengths, n, p.S);
      amx::pack_panels_transposed(head_source(p.k, p.k_stride, n, h), limit, p.E, S32, E32, keys(n, h, p.H));
      amx::pack_panels(head_source(p.v, p.v_stride, n, h), limit, p.M, S32, M32, values(n, h, p.H));
    });
  }
  bf16* keys(int64_t n, int64_t h, int64_t H) { return data.data() + (n * H + h) * S32 * (E32 + M32); }
  bf16* values(int64_t n, int64_t h, int64_t H) { return keys(n, h, H) + S32 * E32; }
};

struct ForwardScratch {
  bf16 *q, *p;   // the block's queries (BQ x E32), probabilities (BQ x BK)
  float *s, *o;  // scores (BQ x BK), unnormalised output (BQ x M32)
  float *m, *l;  // running max and sum (BQ)

  ForwardScratch(Slicer& slicer, int64_t E32, int64_t M32)
      : q(take_bf16(slicer, kForwardBlockQ * E32)),
        p(take_bf16(slicer, kForwardBlockQ * kForwardBlockK)),
        s(slicer.take(kForwardBlockQ * kForwardBlockK)),
        o(slicer.take(kForwardBlockQ * M32)),
        m(slicer.take(kForwardBlockQ)),
        l(slicer.take(kForwardBlockQ)) {}
};

/// Queries [i0, i0 + rows) of head (n, h) over every key they see, in key
/// blocks, with the online softmax of FlashAttention-2; writes out and lse.
void forward_block(const SoftmaxAttentionBf16Params& p, ForwardPacks& packs, int64_t n, int64_t h,
                   int64_t i0, const ForwardScratch& w) {
  const int64_t BQ = kForwardBlockQ, BK = kForwardBlockK;
  const int64_t E32 = packs.E32, M32 = packs.M32, S32 = packs.S32;
  const int64_t rows = std::min(BQ, p.L - i0), rows32 = pad32(rows);
  const Visibility visible = visibility_of(p, n);
  std::fill(w.o, w.o + rows32 * M32, 0.f);
  std::fill(w.m, w.m + rows, -kInf);
  std::fill(w.l, w.l + rows, 0.f);

  const int64_t span_end = visible(i0 + rows - 1);  // the last row sees the most keys
  if (span_end > 0) {
    const bf16* keys = packs.keys(n, h, p.H);
    const bf16* values = packs.values(n, h, p.H);
    amx::pack_rows(from_row(head_source(p.q, p.q_stride, n, h), i0), rows, p.E, rows32, E32, w.q);
    zero(w.p, rows32 * BK);  // rows past `rows` stay zero
    for (int64_t j0 = 0; j0 < span_end; j0 += BK) {
      const int64_t cols = std::min(BK, span_end - j0), cols32 = pad32(cols);
      amx::gemm(rows32, cols32, E32, w.q, E32, keys + j0 * E32, E32 * 16, w.s, BK, false);
      for (int64_t r = 0; r < rows; ++r) {
        float* s = w.s + r * BK;
        bf16* pr = w.p + r * BK;
        const int64_t seen = std::clamp<int64_t>(visible(i0 + r) - j0, 0, cols);
        // The scaled scores' max: for scale > 0 it is the raw max times scale
        // (rounding is monotonic), so the scores are read twice, not three
        // times; else they are scaled first.
        float factor = p.scale;
        if (factor <= 0.f) {
          vec::scale(s, seen, factor);
          factor = 1.f;
        }
        // max(block max, m) keeps a NaN of either: the row then stays NaN.
        const float m_new = std::max(vec::max(s, seen) * factor, w.m[r]);
        if (m_new == -kInf) {  // nothing visible to this row yet: P = 0, not NaN
          zero(pr, cols32);
          continue;
        }
        const float alpha = vec::exp(w.m[r] - m_new);  // 0 on the row's first visible block
        w.l[r] = w.l[r] * alpha + exp_to_bf16(s, seen, factor, m_new, pr);
        zero(pr + seen, cols32 - seen);
        if (alpha != 1.f) vec::scale(w.o + r * M32, p.M, alpha);
        w.m[r] = m_new;
      }
      amx::gemm(rows32, M32, cols32, w.p, BK, values + j0 * 16, S32 * 16, w.o, M32, true);
    }
  }

  // out = u / l, lse = m + log l; l == 0: no visible key (out 0, lse -inf).
  const int64_t* os = p.out_stride;
  for (int64_t r = 0; r < rows; ++r) {
    const float l = w.l[r], inv = l == 0.f ? 0.f : 1.f / l;
    bf16* out = p.out + n * os[0] + h * os[1] + (i0 + r) * os[2];
    const float* o = w.o + r * M32;
    for (int64_t c = 0; c < p.M; ++c) out[c * os[3]] = to_bf16(o[c] * inv);
    p.lse[(n * p.H + h) * p.L + i0 + r] = l == 0.f ? -kInf : w.m[r] + std::log(l);
  }
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------
//
// Transposed, so that no block is ever transposed: for key block j and query
// block i,
//   S^T  = K_j Q_i^T                  P^T = exp(scale S^T - lse_i)
//   dP^T = V_j dO_i^T                 dS^T = P^T (dP^T - D_i)
//   dV_j += P^T dO_i                  dK_j += dS^T Q_i    (times scale at the end)
//   dQ_i^T += K_j^T dS_i^T            (times scale at the end)
// with D_i = rowsum(dO_i * O_i). The rows of every A operand (K, V, K^T,
// P^T, dS^T) are rows of a packed copy or of a block just computed, and the
// B operands are panels packed once per head; only dS^T is repacked into
// panels (by pairs of keys) for the dQ product.

/// Every head's operands in the layouts the tiles read, packed once.
struct BackwardPacks {
  int64_t E32, M32, S32, L32, per_head;
  Buffer<bf16> data;
  Buffer<float> d;  // D = rowsum(dO * O), L32 per head

  explicit BackwardPacks(const SoftmaxAttentionBf16BackwardParams& p)
      : E32(pad32(p.E)), M32(pad32(p.M)), S32(pad32(p.S)), L32(pad32(p.L)),
        per_head(S32 * (2 * E32 + M32) + 2 * L32 * (E32 + M32)),
        data(static_cast<size_t>(p.N * p.H * per_head)),
        d(static_cast<size_t>(p.N * p.H * L32)) {
    parallel_for(p.N * p.H, 0, [&](int64_t t, float*) {
      const int64_t n = t / p.H, h = t % p.H;
      const amx::Source q = head_source(p.q, p.q_stride, n, h), k = head_source(p.k, p.k_stride, n, h),
                        v = head_source(p.v, p.v_stride, n, h),
                        dout = head_source(p.dout, p.dout_stride, n, h);
      const int64_t L = p.L, S = p.S;
      amx::pack_rows(k, S, p.E, S32, E32, k_rows(t));
      amx::pack_rows_transposed(k, S, p.E, S32, E32, k_cols(t));
      amx::pack_rows(v, S, p.M, S32, M32, v_rows(t));
      amx::pack_panels_transposed(q, L, p.E, L32, E32, q_t(t));
      amx::pack_panels(q, L, p.E, L32, E32, q_n(t));
      amx::pack_panels_transposed(dout, L, p.M, L32, M32, o_t(t));
      amx::pack_panels(dout, L, p.M, L32, M32, o_n(t));
      const int64_t* os = p.out_stride;
      const bf16* out = p.out + n * os[0] + h * os[1];
      float* dh = d.data() + t * L32;
      for (int64_t i = 0; i < L; ++i) {
        float acc = 0.f;
        for (int64_t c = 0; c < p.M; ++c)
          acc += to_float(dout.x[i * dout.row_stride + c * dout.col_stride]) *
                 to_float(out[i * os[2] + c * os[3]]);
        dh[i] = acc;
      }
      std::fill(dh + L, dh + L32, 0.f);
    });
  }
  // Per head t = n H + h:
  bf16* k_rows(int64_t t) { return data.data() + t * per_head; }  // S32 x E32, A of S^T
  bf16* k_cols(int64_t t) { return k_rows(t) + S32 * E32; }        // E32 x S32, A of dQ^T
  bf16* v_rows(int64_t t) { return k_cols(t) + S32 * E32; }        // S32 x M32, A of dP^T
  bf16* q_t(int64_t t) { return v_rows(t) + S32 * M32; }           // B of S^T (panels of queries)
  bf16* q_n(int64_t t) { return q_t(t) + L32 * E32; }              // B of dK (panels over E)
  bf16* o_t(int64_t t) { return q_n(t) + L32 * E32; }              // B of dP^T
  bf16* o_n(int64_t t) { return o_t(t) + L32 * M32; }              // B of dV
  const float* d_of(int64_t t) const { return d.data() + t * L32; }
};

struct BackwardScratch {
  float *s, *dp;       // S^T and dP^T blocks (BK x BQ)
  bf16 *pt, *dst;      // P^T and dS^T rounded (BK x BQ)
  bf16* ds_panels;     // dS^T as the B operand of dQ^T (panels of queries over keys)
  float *dk, *dv;      // the key block's accumulators (BK x E32, BK x M32)
  float* dqt;          // dQ^T (E32 x L32) when a head is one item; else null

  BackwardScratch(Slicer& slicer, int64_t E32, int64_t M32, int64_t L32, bool own_dq)
      : s(slicer.take(kBackwardBlockK * kBackwardBlockQ)),
        dp(slicer.take(kBackwardBlockK * kBackwardBlockQ)),
        pt(take_bf16(slicer, kBackwardBlockK * kBackwardBlockQ)),
        dst(take_bf16(slicer, kBackwardBlockK * kBackwardBlockQ)),
        ds_panels(take_bf16(slicer, kBackwardBlockK * kBackwardBlockQ)),
        dk(slicer.take(kBackwardBlockK * E32)),
        dv(slicer.take(kBackwardBlockK * M32)),
        dqt(own_dq ? slicer.take(E32 * L32) : nullptr) {}
};

/// Row r (key j0 + r) of P^T and dS^T over the queries [i0, i0 + cols), of
/// which [i0 + first, i0 + seen_to) see the key: elsewhere both are 0, up to
/// cols32.
void probabilities_row(const float* s, const float* dp, const float* lse, const float* d,
                       float scale, int64_t first, int64_t seen_to, int64_t cols32, bf16* pt,
                       bf16* dst) {
  zero(pt, first);
  zero(dst, first);
  int64_t c = first;
#ifdef __AVX512BF16__
  const __m512 sc = _mm512_set1_ps(scale);
  for (; c < seen_to; c += 16) {
    const __mmask16 k = vec::tail_mask(std::min<int64_t>(16, seen_to - c));
    const __m512 x = _mm512_maskz_loadu_ps(k, s + c);
    const __m512 prob = _mm512_maskz_mov_ps(
        k, vec::exp16(_mm512_fmsub_ps(x, sc, _mm512_maskz_loadu_ps(k, lse + c))));
    const __m512 ds = _mm512_mul_ps(
        prob, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dp + c), _mm512_maskz_loadu_ps(k, d + c)));
    _mm256_mask_storeu_epi16(pt + c, k, (__m256i)_mm512_cvtneps_pbh(prob));
    _mm256_mask_storeu_epi16(dst + c, k, (__m256i)_mm512_cvtneps_pbh(ds));
  }
  c = std::max(c, seen_to);
#else
  for (; c < seen_to; ++c) {
    const float prob = vec::exp(s[c] * scale - lse[c]);
    pt[c] = to_bf16(prob);
    dst[c] = to_bf16(prob * (dp[c] - d[c]));
  }
#endif
  zero(pt + seen_to, cols32 - seen_to);
  zero(dst + seen_to, cols32 - seen_to);
}

/// The keys [j_begin, j_end) of head t = (n, h): writes their dk and dv, and
/// adds their terms of dQ^T (unscaled) into dqt (E32 x L32).
void backward_keys(const SoftmaxAttentionBf16BackwardParams& p, BackwardPacks& packs, int64_t n,
                   int64_t h, int64_t j_begin, int64_t j_end, const BackwardScratch& w, float* dqt) {
  const int64_t BQ = kBackwardBlockQ, BK = kBackwardBlockK;
  const int64_t E32 = packs.E32, M32 = packs.M32, S32 = packs.S32, L32 = packs.L32;
  const int64_t t = n * p.H + h;
  const Visibility visible = visibility_of(p, n);
  const int64_t limit = key_limit(p.key_lengths, n, p.S);
  const float* lse = p.lse + t * p.L;
  const float* d = packs.d_of(t);
  const int64_t *dks = p.dk_stride, *dvs = p.dv_stride;
  bf16* dk = p.dk + n * dks[0] + h * dks[1];
  bf16* dv = p.dv + n * dvs[0] + h * dvs[1];

  for (int64_t j0 = j_begin; j0 < j_end; j0 += BK) {
    const int64_t keys = std::min(BK, j_end - j0), keys32 = pad32(keys);
    std::fill(w.dk, w.dk + keys32 * E32, 0.f);
    std::fill(w.dv, w.dv + keys32 * M32, 0.f);
    const int64_t first_query = visible.first_query(j0, p.L);  // of the block's first key
    for (int64_t i0 = first_query / BQ * BQ; i0 < p.L && j0 < limit; i0 += BQ) {
      const int64_t cols = std::min(BQ, p.L - i0), cols32 = pad32(cols);
      amx::gemm(keys32, cols32, E32, packs.k_rows(t) + j0 * E32, E32, packs.q_t(t) + i0 * E32,
                E32 * 16, w.s, BQ, false);
      amx::gemm(keys32, cols32, M32, packs.v_rows(t) + j0 * M32, M32, packs.o_t(t) + i0 * M32,
                M32 * 16, w.dp, BQ, false);
      for (int64_t r = 0; r < keys32; ++r) {
        // Key j0 + r is seen by the queries from its first one on (none past
        // the padding limit, nor for the rows that pad the block).
        const int64_t first = r < keys ? std::clamp<int64_t>(visible.first_query(j0 + r, p.L) - i0, 0, cols) : cols;
        probabilities_row(w.s + r * BQ, w.dp + r * BQ, lse + i0, d + i0, p.scale, first, cols,
                          cols32, w.pt + r * BQ, w.dst + r * BQ);
      }
      amx::gemm(keys32, M32, cols32, w.pt, BQ, packs.o_n(t) + i0 * 16, L32 * 16, w.dv, M32, true);
      amx::gemm(keys32, E32, cols32, w.dst, BQ, packs.q_n(t) + i0 * 16, L32 * 16, w.dk, E32, true);
      amx::pack_panels(amx::Source{w.dst, BQ, 1}, keys32, cols32, keys32, cols32, w.ds_panels);
      amx::gemm(E32, cols32, keys32, packs.k_cols(t) + j0, S32, w.ds_panels, keys32 * 16, dqt + i0,
                L32, true);
    }
    for (int64_t r = 0; r < keys; ++r) {
      const float* gk = w.dk + r * E32;
      const float* gv = w.dv + r * M32;
      bf16* dkr = dk + (j0 + r) * dks[2];
      bf16* dvr = dv + (j0 + r) * dvs[2];
      for (int64_t c = 0; c < p.E; ++c) dkr[c * dks[3]] = to_bf16(gk[c] * p.scale);
      for (int64_t c = 0; c < p.M; ++c) dvr[c * dvs[3]] = to_bf16(gv[c]);
    }
  }
}

/// dq of head (n, h), queries [i0, i0 + rows), from the parts' dQ^T buffers
/// (each E32 x L32, `stride` apart) summed in part order.
void write_dq(const SoftmaxAttentionBf16BackwardParams& p, int64_t n, int64_t h, int64_t i0,
              int64_t rows, const float* dqt, int64_t parts, int64_t stride, int64_t L32) {
  const int64_t* qs = p.dq_stride;
  bf16* dq = p.dq + n * qs[0] + h * qs[1];
  for (int64_t i = i0; i < i0 + rows; ++i) {
    bf16* row = dq + i * qs[2];
    for (int64_t c = 0; c < p.E; ++c) {
      float acc = dqt[c * L32 + i];
      for (int64_t part = 1; part < parts; ++part) acc += dqt[part * stride + c * L32 + i];
      row[c * qs[3]] = to_bf16(acc * p.scale);
    }
  }
}

}  // namespace

void softmax_attention_forward_bf16(const SoftmaxAttentionBf16Params& p) {
  // S == 0 (every row: out 0, lse -inf) and E == 0 (every score 0) need no
  // special case: the packs are empty and products over k = 0 write zeros.
  if (p.N * p.H * p.L == 0) return;
  ForwardPacks packs(p);
  const int64_t blocks = ceil_div(p.L, kForwardBlockQ);
  parallel_for_scratch(
      p.N * p.H * blocks, [&](Slicer& s) { return ForwardScratch(s, packs.E32, packs.M32); },
      [&](int64_t item, const ForwardScratch& w) {
        const amx::TileScope tiles;
        const int64_t head = item / blocks;
        forward_block(p, packs, head / p.H, head % p.H, item % blocks * kForwardBlockQ, w);
      });
}

void softmax_attention_backward_bf16(const SoftmaxAttentionBf16BackwardParams& p) {
  if (p.N * p.H == 0 || (p.L == 0 && p.S == 0)) return;
  BackwardPacks packs(p);
  const int64_t heads = p.N * p.H, L32 = packs.L32, E32 = packs.E32;
  // Parts of each head's keys, from the shape alone (see the header).
  const int64_t key_blocks = std::max<int64_t>(ceil_div(p.S, kBackwardBlockK), 1);
  const int64_t parts =
      heads >= kMinSplitItems ? 1 : std::min(ceil_div(kMinSplitItems, heads), key_blocks);
  const int64_t blocks_per_part = ceil_div(key_blocks, parts);
  const int64_t part_stride = E32 * L32;
  Buffer<float> dq_parts(parts > 1 ? static_cast<size_t>(heads * parts * part_stride) : 0);

  parallel_for_scratch(
      heads * parts,
      [&](Slicer& s) { return BackwardScratch(s, E32, packs.M32, L32, parts == 1); },
      [&](int64_t item, const BackwardScratch& w) {
        const amx::TileScope tiles;
        const int64_t head = item / parts, part = item % parts;
        const int64_t n = head / p.H, h = head % p.H;
        float* dqt = parts == 1 ? w.dqt : dq_parts.data() + item * part_stride;
        std::fill(dqt, dqt + part_stride, 0.f);
        const int64_t j_begin = std::min(p.S, part * blocks_per_part * kBackwardBlockK);
        const int64_t j_end = std::min(p.S, j_begin + blocks_per_part * kBackwardBlockK);
        backward_keys(p, packs, n, h, j_begin, j_end, w, dqt);
        if (parts == 1) write_dq(p, n, h, 0, p.L, dqt, 1, part_stride, L32);
      });
  if (parts == 1) return;
  const int64_t q_blocks = ceil_div(p.L, kBackwardBlockQ);
  parallel_for(heads * q_blocks, 0, [&](int64_t item, float*) {
    const int64_t head = item / q_blocks, i0 = item % q_blocks * kBackwardBlockQ;
    write_dq(p, head / p.H, head % p.H, i0, std::min(kBackwardBlockQ, p.L - i0),
             dq_parts.data() + head * parts * part_stride, parts, part_stride, L32);
  });
}

ATTNKIT_KERNELS_END
