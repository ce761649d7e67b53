#include "kernels/softmax_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/gemm.h"
#include "kernels/memory.h"
#include "kernels/parallel.h"
#include "kernels/threading.h"
#include "kernels/vec.h"

namespace attnkit::kernels {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Block sizes, queries x keys. Measured single-threaded at N = 1, H = 8,
// L = S = 4096, E = M = 64: best of 6 runs in thread CPU time, on the 2-core
// AVX-512 Xeon dev VM while other builds shared it (the 1024^3 sgemm peak read
// 120-155 GFLOP/s there, so differences under ~10% are noise):
//   forward  128x256 0.31 s, 128x128 0.32, 64x256 0.33, 128x512 0.33,
//            256x256 0.29, 256x128 0.40
//   backward 128x256 0.68 s, 128x128 0.68, 64x128 0.72, 256x256 0.74,
//            256x128 0.75, 64x64 0.78
// 128 x 256 is within the noise of the best in both passes. Smaller blocks
// pay oneDNN's per-call overhead (dispatch, packing) more often; larger ones
// gain nothing more and grow the score block (128 KiB here), which with the
// key and value panels must stay in L2. In a hot loop sgemm runs these block
// shapes at 130-145 GFLOP/s and a hand-written 12 x 32 register-tiled AVX-512
// kernel at 149: too close to justify a second code path.
constexpr int64_t kForwardBlockQ = 128;
constexpr int64_t kForwardBlockK = 256;
// A forward work item is a span of up to kForwardGroup query blocks that share
// every key and value block while it is in L2. At L = S = 16384 (keys and
// values of a head: 8 MiB, more than L2) spans of 4 blocks ran the forward in
// 5.9-6.3 s against 6.6-7.6 s for single blocks; at 4096 both are equal.
constexpr int64_t kForwardGroup = 4;
constexpr int64_t kBackwardBlockQ = 128;
constexpr int64_t kBackwardBlockK = 256;

/// A row-major matrix as sgemm takes it: element (r, c) at data[r * ld + c].
struct Rows {
  const float* data;
  int64_t ld;
};

/// Rows [r0, r0 + rows) of a (., cols) matrix with the given strides, as Rows:
/// the input itself when sgemm can read it in place (contiguous columns, row
/// stride >= cols), else a copy into `pack` (rows * cols floats).
Rows rows_of(const float* base, int64_t row_stride, int64_t col_stride, int64_t r0,
             int64_t rows, int64_t cols, float* pack) {
  const float* first = base + r0 * row_stride;
  if ((col_stride == 1 || cols == 1) && row_stride >= cols) return {first, row_stride};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) pack[r * cols + c] = first[r * row_stride + c * col_stride];
  return {pack, cols};
}

/// Whether rows_of copies for a matrix with these strides (then it needs `pack`).
bool needs_pack(int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols) {
  return rows > 0 && !((col_stride == 1 || cols == 1) && row_stride >= cols);
}

/// Query i of batch n sees exactly the keys [0, visible(i)) before the bias: both
/// key_lengths and the causal limit cut a prefix. Nondecreasing in i.
class Visibility {
 public:
  Visibility(const SoftmaxAttentionParams& p, int64_t n)
      : limit_(p.key_lengths ? std::clamp<int64_t>(p.key_lengths[n], 0, p.S) : p.S),
        offset_(p.S - p.L),
        causal_(p.causal) {}
  int64_t operator()(int64_t i) const {
    return causal_ ? std::clamp<int64_t>(i + 1 + offset_, 0, limit_) : limit_;
  }

 private:
  int64_t limit_, offset_;
  bool causal_;
};

/// Adds bias[n, h, i0 + r, j0 + c] to s[r * lds + c] for r < rows, c < cols.
void add_bias(const SoftmaxAttentionParams& p, int64_t n, int64_t h, int64_t i0, int64_t rows,
              int64_t j0, int64_t cols, float* s, int64_t lds) {
  const int64_t* st = p.bias_stride;
  const float* b = p.bias + n * st[0] + h * st[1] + i0 * st[2] + j0 * st[3];
  for (int64_t r = 0; r < rows; ++r, b += st[2]) {
    float* sr = s + r * lds;
    if (st[3] == 1) {
      vec::add(sr, b, cols);
    } else {
      for (int64_t c = 0; c < cols; ++c) sr[c] += b[c * st[3]];
    }
  }
}

/// Sets the scores of keys a row may not see to -inf in the block of rows
/// [i0, i0 + rows) x keys [j0, j0 + cols), s[r * lds + c].
void mask_block(const Visibility& visible, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                float* s, int64_t lds) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t from = std::clamp<int64_t>(visible(i0 + r) - j0, 0, cols);
    std::fill(s + r * lds + from, s + r * lds + cols, -kInf);
  }
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

struct ForwardScratch {
  static constexpr int64_t kSpan = kForwardGroup * kForwardBlockQ;  // most rows per item
  float *q, *k, *v;  // packed copies of blocks when the strides need it
  float *s;          // scores, then probabilities: kForwardBlockQ x kForwardBlockK
  float *o;          // unnormalised output accumulator: kSpan x M
  float *m, *l;      // running max and sum per row: kSpan

  ForwardScratch(const SoftmaxAttentionParams& p, Slicer& slicer)
      : q(slicer.take(kSpan * p.E)),
        k(slicer.take(kForwardBlockK * p.E)),
        v(slicer.take(kForwardBlockK * p.M)),
        s(slicer.take(kForwardBlockQ * kForwardBlockK)),
        o(slicer.take(kSpan * p.M)),
        m(slicer.take(kSpan)),
        l(slicer.take(kSpan)) {}
};

/// Queries [i0, i0 + rows) of head (n, h), rows <= kSpan: out and lse,
/// FlashAttention-2 style, one query block of kForwardBlockQ rows at a time
/// for each key block.
void forward_span(const SoftmaxAttentionParams& p, int64_t n, int64_t h, int64_t i0,
                  int64_t rows, const ForwardScratch& w) {
  const int64_t E = p.E, M = p.M, BQ = kForwardBlockQ, BK = kForwardBlockK;
  const Visibility visible(p, n);
  const float* qh = p.q + n * p.q_stride[0] + h * p.q_stride[1];
  const float* kh = p.k + n * p.k_stride[0] + h * p.k_stride[1];
  const float* vh = p.v + n * p.v_stride[0] + h * p.v_stride[1];
  const Rows q = rows_of(qh, p.q_stride[2], p.q_stride[3], i0, rows, E, w.q);

  std::fill(w.o, w.o + rows * M, 0.f);
  std::fill(w.m, w.m + rows, -kInf);
  std::fill(w.l, w.l + rows, 0.f);
  // Keys at or past a block's key_end are invisible to all its rows (causal:
  // the blocks above the diagonal; padding: past the last valid key): skipped.
  // Keys below its all_see are visible to all its rows: no mask needed there.
  const int64_t span_end = visible(i0 + rows - 1);
  for (int64_t j0 = 0; j0 < span_end; j0 += BK) {
    const int64_t span_cols = std::min(BK, span_end - j0);
    const Rows k = rows_of(kh, p.k_stride[2], p.k_stride[3], j0, span_cols, E, w.k);
    const Rows v = rows_of(vh, p.v_stride[2], p.v_stride[3], j0, span_cols, M, w.v);
    for (int64_t b = 0; b < rows; b += BQ) {
      const int64_t block_rows = std::min(BQ, rows - b);
      const int64_t key_end = visible(i0 + b + block_rows - 1), all_see = visible(i0 + b);
      if (j0 >= key_end) continue;
      const int64_t cols = std::min(BK, key_end - j0);
      float* o = w.o + b * M;
      float* m = w.m + b;
      float* l = w.l + b;
      sgemm(false, true, block_rows, cols, E, p.scale, q.data + b * q.ld, q.ld, k.data, k.ld,
            0.f, w.s, BK);
      if (p.bias) add_bias(p, n, h, i0 + b, block_rows, j0, cols, w.s, BK);
      if (j0 + cols > all_see) mask_block(visible, i0 + b, block_rows, j0, cols, w.s, BK);

      // Online softmax: P = exp(s - m_new), l = l * exp(m - m_new) + rowsum(P),
      // and the accumulator rescaled by the same factor.
      for (int64_t r = 0; r < block_rows; ++r) {
        float* sr = w.s + r * BK;
        const float m_new = std::max(m[r], vec::max(sr, cols));
        if (m_new == -kInf) {  // nothing visible to this row yet: P = 0, not NaN
          std::fill(sr, sr + cols, 0.f);
          continue;
        }
        const float alpha = vec::exp(m[r] - m_new);  // 0 on the row's first visible block
        l[r] = l[r] * alpha + vec::exp_shift_sum(sr, cols, m_new);
        if (alpha != 1.f) vec::scale(o + r * M, M, alpha);
        m[r] = m_new;
      }
      sgemm(false, false, block_rows, M, cols, 1.f, w.s, BK, v.data, v.ld, 1.f, o, M);
    }
  }

  // One normalisation at the end. l >= 1 once any key was visible (the maximal
  // term contributes exp(0)), so l == 0 means a row with no visible key.
  float* lse = p.lse + (n * p.H + h) * p.L + i0;
  const int64_t* os = p.out_stride;
  for (int64_t r = 0; r < rows; ++r) {
    float* out = p.out + n * os[0] + h * os[1] + (i0 + r) * os[2];
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    for (int64_t c = 0; c < M; ++c) out[c * os[3]] = w.o[r * M + c] * inv;
    lse[r] = w.l[r] > 0.f ? w.m[r] + std::log(w.l[r]) : -kInf;
  }
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

struct BackwardScratch {
  float *q, *k, *v, *dout;  // packed copies of the head when the strides need it
  float *d;                 // D_i = rowsum(dO_i * O_i): L
  float *dq;                // dQ accumulator of the head: L x E
  float *dk, *dv;           // dK, dV accumulators of one key block
  float *prob, *ds;         // P and dP, then dS: kBackwardBlockQ x kBackwardBlockK

  BackwardScratch(const SoftmaxAttentionBackwardParams& p, Slicer& slicer)
      : q(slicer.take(needs_pack(p.q_stride[2], p.q_stride[3], p.L, p.E) ? p.L * p.E : 0)),
        k(slicer.take(needs_pack(p.k_stride[2], p.k_stride[3], p.S, p.E) ? p.S * p.E : 0)),
        v(slicer.take(needs_pack(p.v_stride[2], p.v_stride[3], p.S, p.M) ? p.S * p.M : 0)),
        dout(slicer.take(needs_pack(p.dout_stride[2], p.dout_stride[3], p.L, p.M) ? p.L * p.M
                                                                                  : 0)),
        d(slicer.take(p.L)),
        dq(slicer.take(p.L * p.E)),
        dk(slicer.take(kBackwardBlockK * p.E)),
        dv(slicer.take(kBackwardBlockK * p.M)),
        prob(slicer.take(kBackwardBlockQ * kBackwardBlockK)),
        ds(slicer.take(kBackwardBlockQ * kBackwardBlockK)) {}
};

/// Writes the row-major rows x cols matrix src into dst with the given strides.
void store(const float* src, int64_t rows, int64_t cols, float* dst, int64_t row_stride,
           int64_t col_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * row_stride + c * col_stride] = src[r * cols + c];
}

/// Zeroes a rows x cols strided matrix.
void store_zeros(int64_t rows, int64_t cols, float* dst, int64_t row_stride, int64_t col_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * row_stride + c * col_stride] = 0.f;
}

/// dq, dk, dv of head (n, h). Key blocks outer (each owns its dK, dV rows),
/// query blocks inner; dQ accumulates over key blocks in the head's scratch.
void backward_head(const SoftmaxAttentionBackwardParams& p, int64_t n, int64_t h,
                   const BackwardScratch& w) {
  const int64_t L = p.L, S = p.S, E = p.E, M = p.M;
  const int64_t BQ = kBackwardBlockQ, BK = kBackwardBlockK;
  const Visibility visible(p, n);
  const auto head = [n, h](auto* base, const int64_t* st) { return base + n * st[0] + h * st[1]; };
  const Rows q = rows_of(head(p.q, p.q_stride), p.q_stride[2], p.q_stride[3], 0, L, E, w.q);
  const Rows k = rows_of(head(p.k, p.k_stride), p.k_stride[2], p.k_stride[3], 0, S, E, w.k);
  const Rows v = rows_of(head(p.v, p.v_stride), p.v_stride[2], p.v_stride[3], 0, S, M, w.v);
  const Rows dout = rows_of(head(p.dout, p.dout_stride), p.dout_stride[2], p.dout_stride[3],
                            0, L, M, w.dout);
  const float* out = head(p.out, p.out_stride);
  const float* lse = p.lse + (n * p.H + h) * L;
  for (int64_t i = 0; i < L; ++i) {
    const float* oi = out + i * p.out_stride[2];
    const float* gi = dout.data + i * dout.ld;
    if (p.out_stride[3] == 1) {
      w.d[i] = vec::dot(gi, oi, M);
    } else {
      float d = 0.f;
      for (int64_t c = 0; c < M; ++c) d += gi[c] * oi[c * p.out_stride[3]];
      w.d[i] = d;
    }
  }
  std::fill(w.dq, w.dq + L * E, 0.f);

  // Keys at or past key_end are invisible to every query: zero gradients.
  const int64_t key_end = visible(L - 1);
  for (int64_t j0 = 0; j0 < key_end; j0 += BK) {
    const int64_t cols = std::min(BK, key_end - j0);
    const float* kj = k.data + j0 * k.ld;
    const float* vj = v.data + j0 * v.ld;
    std::fill(w.dk, w.dk + cols * E, 0.f);
    std::fill(w.dv, w.dv + cols * M, 0.f);
    // Causal: queries before j0 - (S - L) see none of these keys; start at
    // the query block holding the first one that does.
    const int64_t first = p.causal ? std::clamp<int64_t>(j0 - (S - L), 0, L) : 0;
    for (int64_t i0 = first / BQ * BQ; i0 < L; i0 += BQ) {
      const int64_t rows = std::min(BQ, L - i0);
      const float* qi = q.data + i0 * q.ld;
      const float* gi = dout.data + i0 * dout.ld;
      // P = exp(scale q k^T + bias - lse), recomputed.
      sgemm(false, true, rows, cols, E, p.scale, qi, q.ld, kj, k.ld, 0.f, w.prob, BK);
      if (p.bias) add_bias(p, n, h, i0, rows, j0, cols, w.prob, BK);
      if (j0 + cols > visible(i0)) mask_block(visible, i0, rows, j0, cols, w.prob, BK);
      for (int64_t r = 0; r < rows; ++r) {
        float* pr = w.prob + r * BK;
        if (lse[i0 + r] == -kInf)  // a row with no visible key: P = 0, not NaN
          std::fill(pr, pr + cols, 0.f);
        else
          vec::exp_shift(pr, cols, lse[i0 + r]);
      }
      // dV += P^T dO;  dP = dO V^T;  dS = P * (dP - D);
      // dK += scale dS^T Q;  dQ += scale dS K.
      sgemm(true, false, cols, M, rows, 1.f, w.prob, BK, gi, dout.ld, 1.f, w.dv, M);
      sgemm(false, true, rows, cols, M, 1.f, gi, dout.ld, vj, v.ld, 0.f, w.ds, BK);
      for (int64_t r = 0; r < rows; ++r)
        vec::softmax_grad(w.ds + r * BK, w.prob + r * BK, cols, w.d[i0 + r]);
      sgemm(true, false, cols, E, rows, p.scale, w.ds, BK, qi, q.ld, 1.f, w.dk, E);
      sgemm(false, false, rows, E, cols, p.scale, w.ds, BK, kj, k.ld, 1.f, w.dq + i0 * E, E);
    }
    store(w.dk, cols, E, head(p.dk, p.dk_stride) + j0 * p.dk_stride[2], p.dk_stride[2],
          p.dk_stride[3]);
    store(w.dv, cols, M, head(p.dv, p.dv_stride) + j0 * p.dv_stride[2], p.dv_stride[2],
          p.dv_stride[3]);
  }
  store_zeros(S - key_end, E, head(p.dk, p.dk_stride) + key_end * p.dk_stride[2],
              p.dk_stride[2], p.dk_stride[3]);
  store_zeros(S - key_end, M, head(p.dv, p.dv_stride) + key_end * p.dv_stride[2],
              p.dv_stride[2], p.dv_stride[3]);
  store(w.dq, L, E, head(p.dq, p.dq_stride), p.dq_stride[2], p.dq_stride[3]);
}

}  // namespace

void softmax_attention_forward(const SoftmaxAttentionParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return;
  // Fewer blocks per span when there would be under 4 spans per thread to
  // balance. How rows are grouped into spans does not change any result.
  const int64_t heads = p.N * p.H, blocks = ceil_div(p.L, kForwardBlockQ);
  int64_t group = kForwardGroup;
  while (group > 1 && heads * ceil_div(blocks, group) < 4 * num_threads()) group /= 2;
  const int64_t span = group * kForwardBlockQ, spans = ceil_div(p.L, span);
  Slicer sizer(nullptr);
  [[maybe_unused]] const ForwardScratch sizing(p, sizer);
  parallel_with_scratch(sizer.used(), [&](float* base) {
    Slicer slicer(base);
    const ForwardScratch w(p, slicer);
    // Consecutive items share a head, so its keys and values stay in cache.
    // Within a head the last spans come first: with causal masking they see
    // the most keys, and the dynamic schedule balances best longest-first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < spans * heads; ++t) {
      const int64_t nh = t / spans, i0 = (spans - 1 - t % spans) * span;
      forward_span(p, nh / p.H, nh % p.H, i0, std::min(span, p.L - i0), w);
    }
  });
}

void softmax_attention_backward(const SoftmaxAttentionBackwardParams& p) {
  if (p.N == 0 || p.H == 0) return;
  Slicer sizer(nullptr);
  [[maybe_unused]] const BackwardScratch sizing(p, sizer);
  parallel_with_scratch(sizer.used(), [&](float* base) {
    Slicer slicer(base);
    const BackwardScratch w(p, slicer);
#pragma omp for schedule(dynamic, 1)
    for (int64_t nh = 0; nh < p.N * p.H; ++nh) backward_head(p, nh / p.H, nh % p.H, w);
  });
}

}  // namespace attnkit::kernels
