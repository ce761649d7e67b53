#include "kernels/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/strided.h"
#include "kernels/common/vec.h"
#include "kernels/memory.h"

namespace attnkit::kernels {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Work items: kBlockRows consecutive queries (forward, dq pass) or kBlockKeys
// consecutive keys (dk, dv pass). A dense tile spans kTile keys (row passes) or
// kTile queries (key pass): at E = M = 64 the exact kernel's measurements (see
// softmax_attention.cpp) put sgemm near its best from 128 x 256 blocks; a
// banded block of b rows covers 2w + b columns for 2w + 1 edges per row (local
// pattern of span w), so smaller blocks waste less. At w = 64, 32-row blocks
// (1.24x the edges' work instead of 1.49x with 64) ran the band 1.01-1.11x
// faster relative to exact attention in the same process (2026-11-23, L = 4096
// and 16384, one thread), with random patterns unchanged: the smaller GEMMs
// give back most of what the smaller tiles save.
constexpr int64_t kBlockRows = 32;
constexpr int64_t kBlockKeys = 32;
constexpr int64_t kTile = 256;

/// Compressed rows (or, transposed, compressed columns): the entries of line r
/// are idx[offsets[r] : offsets[r + 1]], strictly increasing.
struct Lines {
  const int64_t* offsets;
  const int64_t* idx;
  int64_t begin(int64_t r) const { return offsets[r]; }
  int64_t end(int64_t r) const { return offsets[r + 1]; }
};

/// The rows of head h's list.
Lines rows_of_head(const SparseAttentionParams& p, int64_t h) {
  return {p.offsets + (p.lists == 1 ? 0 : h) * (p.L + 1), p.columns};
}

/// Lines [r0, r0 + count) of g: the union [lo, hi) of their entries' range and
/// their number of entries.
struct BlockShape {
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0, entries = 0;
};

BlockShape block_shape(const Lines& g, int64_t r0, int64_t count) {
  BlockShape s;
  for (int64_t r = r0; r < r0 + count; ++r) {
    const int64_t b = g.begin(r), e = g.end(r);
    if (b == e) continue;
    s.entries += e - b;
    s.lo = std::min(s.lo, g.idx[b]);
    s.hi = std::max(s.hi, g.idx[e - 1] + 1);
  }
  return s;
}

/// Dense tiles when the entries fill at least half of the block's rectangle
/// (count lines x [lo, hi)): then the tiles do at most twice the edges' work at
/// sgemm speed, which beats one edge at a time.
bool dense(const BlockShape& s, int64_t count) {
  return s.entries > 0 && 2 * s.entries >= count * (s.hi - s.lo);
}

/// s[c] = -inf for c < cols unless j0 + c is an entry of idx[b, e) (sorted).
void mask_outside(const int64_t* idx, int64_t b, int64_t e, int64_t j0, int64_t cols, float* s) {
  const int64_t* it = std::lower_bound(idx + b, idx + e, j0);
  const int64_t* stop = std::lower_bound(it, idx + e, j0 + cols);
  if (it != stop && stop[-1] - it[0] == stop - it - 1) {  // one run of consecutive entries
    std::fill(s, s + (it[0] - j0), -kInf);
    std::fill(s + (stop[-1] - j0 + 1), s + cols, -kInf);
    return;
  }
  int64_t pos = 0;
  for (; it != stop; ++it) {
    const int64_t c = *it - j0;
    std::fill(s + pos, s + c, -kInf);
    pos = c + 1;
  }
  std::fill(s + pos, s + cols, -kInf);
}

/// The per-edge paths gather key/value (or query/output-gradient) rows from
/// anywhere in the sequence, which the hardware prefetchers cannot guess: each
/// loop asks for the rows of the edge kPrefetchAhead edges ahead, so that many
/// gathers are in flight while the current edge is computed.
constexpr int64_t kPrefetchAhead = 8;

/// Requests the cache lines of a row of `count` floats (for reading).
inline void prefetch_row(const float* row, int64_t count) {
  for (int64_t c = 0; c < count; c += 16) __builtin_prefetch(row + c, 0, 3);
}

/// out[t] = a . row(t) for t < count, `n` floats each (the rows gathered
/// through an edge list), four at a time (vec::dot4), asking for the rows
/// kPrefetchAhead edges ahead; touch(t) runs before edge t is computed (to
/// prefetch what the caller reads next for that edge).
template <class Row, class Touch>
void gather_dots(const float* a, int64_t count, const Row& row, int64_t n, float* out, const Touch& touch) {
  for (int64_t t = 0; t < std::min(count, kPrefetchAhead); ++t) prefetch_row(row(t), n);
  int64_t t = 0;
  for (; t + 4 <= count; t += 4) {
    for (int64_t u = t + kPrefetchAhead; u < std::min(count, t + kPrefetchAhead + 4); ++u) prefetch_row(row(u), n);
    for (int64_t u = t; u < t + 4; ++u) touch(u);
    const float* b[4] = {row(t), row(t + 1), row(t + 2), row(t + 3)};
    vec::dot4(a, b, n, out + t);
  }
  for (; t < count; ++t) {
    touch(t);
    out[t] = vec::dot(a, row(t), n);
  }
}

constexpr auto kNothing = [](int64_t) {};

/// Row i of head (n, h) of a strided (N, H, R, X) output.
float* row_ptr(float* base, const int64_t* stride, int64_t n, int64_t h, int64_t i) {
  return base + n * stride[0] + h * stride[1] + i * stride[2];
}

/// Work item t of N H ceil(R / block) items: (n, h, first line, lines).
struct Item {
  int64_t n, h, r0, count;
};

Item item_of(int64_t t, int64_t H, int64_t R, int64_t block) {
  const int64_t blocks = ceil_div(R, block);
  const int64_t nh = t / blocks, r0 = (t % blocks) * block;
  return {nh / H, nh % H, r0, std::min(block, R - r0)};
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

struct ForwardScratch {
  float *s;        // scores, then probabilities: kBlockRows x kTile
  float *u, *m, *l;  // online softmax: unnormalised output (rows x M), max, sum
  float *row;      // one row's scores on the edge-at-a-time path: up to S

  ForwardScratch(const SparseAttentionParams& p, Slicer& slicer)
      : s(slicer.take(kBlockRows * kTile)),
        u(slicer.take(kBlockRows * p.M)),
        m(slicer.take(kBlockRows)),
        l(slicer.take(kBlockRows)),
        row(slicer.take(p.S)) {}
};

struct Inputs {
  const HeadRows &q, &k, &v;
};

/// out_i = u / l and lse_i = m + log l; l == 0 means no edge: out 0, lse -inf
/// (l >= 1 otherwise: the row's largest term contributes exp(0)).
void write_row(const SparseAttentionParams& p, int64_t n, int64_t h, int64_t i, const float* u,
               float m, float l) {
  put_row(u, p.M, row_ptr(p.out, p.out_stride, n, h, i), p.out_stride[3], l == 0.f ? 0.f : 1.f / l);
  p.lse[(n * p.H + h) * p.L + i] = l == 0.f ? -kInf : m + std::log(l);
}

/// Rows [i0, i0 + rows) as dense tiles over the keys [lo, hi), FlashAttention
/// style: scores of kTile keys, the keys outside each row's list masked, online
/// softmax, then the product with those keys' values.
void forward_dense(const SparseAttentionParams& p, const Inputs& in, const Lines& g, int64_t n,
                   int64_t h, int64_t i0, int64_t rows, const BlockShape& shape,
                   const ForwardScratch& w) {
  const int64_t E = p.E, M = p.M;
  std::fill(w.u, w.u + rows * M, 0.f);
  std::fill(w.m, w.m + rows, -kInf);
  std::fill(w.l, w.l + rows, 0.f);
  for (int64_t j0 = shape.lo; j0 < shape.hi; j0 += kTile) {
    const int64_t cols = std::min(kTile, shape.hi - j0);
    sgemm(false, true, rows, cols, E, p.scale, in.q.row(n, h, i0), in.q.ld(), in.k.row(n, h, j0),
          in.k.ld(), 0.f, w.s, kTile);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = w.s + r * kTile;
      mask_outside(g.idx, g.begin(i0 + r), g.end(i0 + r), j0, cols, sr);
      // Online softmax: P = exp(s - m_new), l = l exp(m - m_new) + rowsum(P),
      // u rescaled by the same factor. max() keeps a NaN of either operand.
      const float m_new = std::max(vec::max(sr, cols), w.m[r]);
      if (m_new == -kInf) {  // no edge of this row so far: P = 0, not NaN
        std::fill(sr, sr + cols, 0.f);
        continue;
      }
      const float alpha = vec::exp(w.m[r] - m_new);
      w.l[r] = w.l[r] * alpha + vec::exp_shift_sum(sr, cols, m_new);
      if (alpha != 1.f) vec::scale(w.u + r * M, M, alpha);
      w.m[r] = m_new;
    }
    sgemm(false, false, rows, M, cols, 1.f, w.s, kTile, in.v.row(n, h, j0), in.v.ld(), 1.f, w.u,
          M);
  }
  for (int64_t r = 0; r < rows; ++r) write_row(p, n, h, i0 + r, w.u + r * M, w.m[r], w.l[r]);
}

/// Row i one edge at a time: its scores, their softmax, then the weighted sum
/// of its values (each key and value a contiguous row).
void forward_row(const SparseAttentionParams& p, const Inputs& in, const Lines& g, int64_t n,
                 int64_t h, int64_t i, const ForwardScratch& w) {
  const int64_t b = g.begin(i), count = g.end(i) - b;
  const int64_t* cols = g.idx + b;
  std::fill(w.u, w.u + p.M, 0.f);
  if (count == 0) return write_row(p, n, h, i, w.u, -kInf, 0.f);
  const auto key = [&](int64_t t) { return in.k.row(n, h, cols[t]); };
  const auto value = [&](int64_t t) { return in.v.row(n, h, cols[t]); };
  // The values are asked for with their keys, for the weighted sum below.
  gather_dots(in.q.row(n, h, i), count, key, p.E, w.row, [&](int64_t t) { prefetch_row(value(t), p.M); });
  vec::scale(w.row, count, p.scale);
  const float m = vec::max(w.row, count);
  const float l = vec::exp_shift_sum(w.row, count, m);
  for (int64_t t = 0; t < count; ++t) vec::axpy(w.u, w.row[t], value(t), p.M);
  write_row(p, n, h, i, w.u, m, l);
}

// ---------------------------------------------------------------------------
// Backward, pass 1: D and dq per row
// ---------------------------------------------------------------------------

struct RowGradScratch {
  float *s, *ds;  // P and dP, then dS: kBlockRows x kTile each
  float *dq;      // kBlockRows x E
  float *p_row, *ds_row;  // one row's P and dP, then dS, on the edge-at-a-time path: up to S each

  RowGradScratch(const SparseAttentionParams& p, Slicer& slicer)
      : s(slicer.take(kBlockRows * kTile)),
        ds(slicer.take(kBlockRows * kTile)),
        dq(slicer.take(kBlockRows * p.E)),
        p_row(slicer.take(p.S)),
        ds_row(slicer.take(p.S)) {}
};

struct GradInputs {
  const HeadRows &q, &k, &v, &dout;
  const float* lse;  // (N, H, L)
  float* d;          // (N, H, L): D_i = dout_i . out_i
};

/// dq of rows [i0, i0 + rows) as dense tiles over the keys [lo, hi):
/// dS = P (dP - D) with P = exp(scale q k^T - lse) (0 outside the lists) and
/// dP = dout v^T; dq = scale dS k.
void dq_dense(const SparseAttentionBackwardParams& p, const GradInputs& in, const Lines& g,
              int64_t n, int64_t h, int64_t i0, int64_t rows, const BlockShape& shape,
              const RowGradScratch& w) {
  const int64_t E = p.E, M = p.M;
  const float* lse = in.lse + (n * p.H + h) * p.L + i0;
  const float* d = in.d + (n * p.H + h) * p.L + i0;
  std::fill(w.dq, w.dq + rows * E, 0.f);
  for (int64_t j0 = shape.lo; j0 < shape.hi; j0 += kTile) {
    const int64_t cols = std::min(kTile, shape.hi - j0);
    sgemm(false, true, rows, cols, E, p.scale, in.q.row(n, h, i0), in.q.ld(), in.k.row(n, h, j0),
          in.k.ld(), 0.f, w.s, kTile);
    sgemm(false, true, rows, cols, M, 1.f, in.dout.row(n, h, i0), in.dout.ld(),
          in.v.row(n, h, j0), in.v.ld(), 0.f, w.ds, kTile);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = w.s + r * kTile;
      float* dsr = w.ds + r * kTile;
      if (g.begin(i0 + r) == g.end(i0 + r)) {  // no edge: lse = -inf, P = 0
        std::fill(dsr, dsr + cols, 0.f);
        continue;
      }
      mask_outside(g.idx, g.begin(i0 + r), g.end(i0 + r), j0, cols, sr);
      vec::exp_shift(sr, cols, lse[r]);
      vec::softmax_grad(dsr, sr, cols, d[r]);
    }
    sgemm(false, false, rows, E, cols, 1.f, w.ds, kTile, in.k.row(n, h, j0), in.k.ld(), 1.f, w.dq,
          E);
  }
  for (int64_t r = 0; r < rows; ++r)
    put_row(w.dq + r * E, E, row_ptr(p.dq, p.dq_stride, n, h, i0 + r), p.dq_stride[3], p.scale);
}

/// dq of row i one edge at a time: P and dP of all its edges (the gathered keys
/// and values), dS = P (dP - D), then dq = scale sum dS k.
void dq_row(const SparseAttentionBackwardParams& p, const GradInputs& in, const Lines& g,
            int64_t n, int64_t h, int64_t i, const RowGradScratch& w) {
  const int64_t E = p.E, M = p.M;
  const int64_t first = g.begin(i), count = g.end(i) - first;
  const int64_t* cols = g.idx + first;
  std::fill(w.dq, w.dq + E, 0.f);
  if (count > 0) {
    const auto key = [&](int64_t t) { return in.k.row(n, h, cols[t]); };
    const auto value = [&](int64_t t) { return in.v.row(n, h, cols[t]); };
    gather_dots(in.q.row(n, h, i), count, key, E, w.p_row, [&](int64_t t) { prefetch_row(value(t), M); });
    gather_dots(in.dout.row(n, h, i), count, value, M, w.ds_row, kNothing);
    vec::scale(w.p_row, count, p.scale);
    vec::exp_shift(w.p_row, count, in.lse[(n * p.H + h) * p.L + i]);
    vec::softmax_grad(w.ds_row, w.p_row, count, in.d[(n * p.H + h) * p.L + i]);
    for (int64_t t = 0; t < count; ++t) vec::axpy(w.dq, w.ds_row[t], key(t), E);
  }
  put_row(w.dq, E, row_ptr(p.dq, p.dq_stride, n, h, i), p.dq_stride[3], p.scale);
}

// ---------------------------------------------------------------------------
// Backward, pass 2: dk and dv per key through the transposed lists
// ---------------------------------------------------------------------------

/// The transposed lists (compressed columns): for list g, the rows that hold
/// key j are rows[offsets[g (S + 1) + j] : offsets[g (S + 1) + j + 1]], in
/// increasing order. Built in one sweep per list (a counting sort by key).
struct Transposed {
  Buffer<int64_t> offsets, rows;

  explicit Transposed(const SparseAttentionParams& p)
      : offsets(static_cast<std::size_t>(p.lists * (p.S + 1))) {
    const int64_t L = p.L, S = p.S;
    int64_t total = 0;
    for (int64_t g = 0; g < p.lists; ++g) {
      const int64_t* off = p.offsets + g * (L + 1);
      int64_t* t = offsets.data() + g * (S + 1);
      std::fill(t, t + S + 1, 0);
      for (int64_t e = off[0]; e < off[L]; ++e) ++t[p.columns[e] + 1];
      t[0] = total;
      for (int64_t j = 0; j < S; ++j) t[j + 1] += t[j];
      total = t[S];
    }
    rows = Buffer<int64_t>(static_cast<std::size_t>(total));
    Buffer<int64_t> next(static_cast<std::size_t>(S));
    for (int64_t g = 0; g < p.lists; ++g) {
      const int64_t* off = p.offsets + g * (L + 1);
      const int64_t* t = offsets.data() + g * (S + 1);
      std::copy(t, t + S, next.data());
      for (int64_t i = 0; i < L; ++i)
        for (int64_t e = off[i]; e < off[i + 1]; ++e) rows[next[p.columns[e]]++] = i;
    }
  }

  Lines of_head(const SparseAttentionParams& p, int64_t h) const {
    return {offsets.data() + (p.lists == 1 ? 0 : h) * (p.S + 1), rows.data()};
  }
};

struct KeyGradScratch {
  float *p, *ds;         // P^T and dP^T, then dS^T: kBlockKeys x kTile each
  float *dk, *dv;        // kBlockKeys x E, kBlockKeys x M
  float *neg_lse, *neg_d;  // kTile each
  float *p_col, *ds_col;   // one key's P and dP, then dS, on the edge-at-a-time path: up to L each

  KeyGradScratch(const SparseAttentionParams& params, Slicer& slicer)
      : p(slicer.take(kBlockKeys * kTile)),
        ds(slicer.take(kBlockKeys * kTile)),
        dk(slicer.take(kBlockKeys * params.E)),
        dv(slicer.take(kBlockKeys * params.M)),
        neg_lse(slicer.take(kTile)),
        neg_d(slicer.take(kTile)),
        p_col(slicer.take(params.L)),
        ds_col(slicer.take(params.L)) {}
};

/// dk, dv of keys [j0, j0 + keys) as dense tiles over the queries [lo, hi):
/// dv = P^T dout, dk = scale dS^T q, P^T and dS^T recomputed per tile.
void dkv_dense(const SparseAttentionBackwardParams& p, const GradInputs& in, const Lines& t,
               int64_t n, int64_t h, int64_t j0, int64_t keys, const BlockShape& shape,
               const KeyGradScratch& w) {
  const int64_t E = p.E, M = p.M;
  const float* lse = in.lse + (n * p.H + h) * p.L;
  const float* d = in.d + (n * p.H + h) * p.L;
  std::fill(w.dk, w.dk + keys * E, 0.f);
  std::fill(w.dv, w.dv + keys * M, 0.f);
  for (int64_t i0 = shape.lo; i0 < shape.hi; i0 += kTile) {
    const int64_t rows = std::min(kTile, shape.hi - i0);
    sgemm(false, true, keys, rows, E, p.scale, in.k.row(n, h, j0), in.k.ld(), in.q.row(n, h, i0),
          in.q.ld(), 0.f, w.p, kTile);
    sgemm(false, true, keys, rows, M, 1.f, in.v.row(n, h, j0), in.v.ld(), in.dout.row(n, h, i0),
          in.dout.ld(), 0.f, w.ds, kTile);
    // A row without edges (lse = -inf) holds no key, so all its entries are
    // masked: shift them by 0 rather than +inf (which would make -inf + inf).
    for (int64_t r = 0; r < rows; ++r) {
      w.neg_lse[r] = lse[i0 + r] == -kInf ? 0.f : -lse[i0 + r];
      w.neg_d[r] = -d[i0 + r];
    }
    for (int64_t c = 0; c < keys; ++c) {
      float* pc = w.p + c * kTile;
      float* dsc = w.ds + c * kTile;
      mask_outside(t.idx, t.begin(j0 + c), t.end(j0 + c), i0, rows, pc);
      vec::add(pc, w.neg_lse, rows);
      vec::exp_shift(pc, rows, 0.f);
      vec::add(dsc, w.neg_d, rows);
      for (int64_t r = 0; r < rows; ++r) dsc[r] *= pc[r];
    }
    sgemm(false, false, keys, M, rows, 1.f, w.p, kTile, in.dout.row(n, h, i0), in.dout.ld(), 1.f,
          w.dv, M);
    sgemm(false, false, keys, E, rows, 1.f, w.ds, kTile, in.q.row(n, h, i0), in.q.ld(), 1.f, w.dk,
          E);
  }
  for (int64_t c = 0; c < keys; ++c) {
    put_row(w.dk + c * E, E, row_ptr(p.dk, p.dk_stride, n, h, j0 + c), p.dk_stride[3], p.scale);
    put_row(w.dv + c * M, M, row_ptr(p.dv, p.dv_stride, n, h, j0 + c), p.dv_stride[3]);
  }
}

/// dk, dv of key j one incoming edge at a time, in increasing row order: P and
/// dP of all its edges (the gathered queries and output gradients), dS, then
/// dv = sum P dout and dk = scale sum dS q.
void dkv_key(const SparseAttentionBackwardParams& p, const GradInputs& in, const Lines& t,
             int64_t n, int64_t h, int64_t j, const KeyGradScratch& w) {
  const int64_t E = p.E, M = p.M;
  const float* lse = in.lse + (n * p.H + h) * p.L;
  const float* d = in.d + (n * p.H + h) * p.L;
  const int64_t first = t.begin(j), count = t.end(j) - first;
  const int64_t* rows = t.idx + first;
  std::fill(w.dk, w.dk + E, 0.f);
  std::fill(w.dv, w.dv + M, 0.f);
  if (count > 0) {
    const auto query = [&](int64_t u) { return in.q.row(n, h, rows[u]); };
    const auto grad = [&](int64_t u) { return in.dout.row(n, h, rows[u]); };
    gather_dots(in.k.row(n, h, j), count, query, E, w.p_col, [&](int64_t u) { prefetch_row(grad(u), M); });
    gather_dots(in.v.row(n, h, j), count, grad, M, w.ds_col, kNothing);
    // A row that holds key j has an edge, so its lse is finite.
    for (int64_t u = 0; u < count; ++u) w.p_col[u] = p.scale * w.p_col[u] - lse[rows[u]];
    vec::exp_shift(w.p_col, count, 0.f);
    for (int64_t u = 0; u < count; ++u) w.ds_col[u] = w.p_col[u] * (w.ds_col[u] - d[rows[u]]);
    for (int64_t u = 0; u < count; ++u) {
      vec::axpy(w.dv, w.p_col[u], grad(u), M);
      vec::axpy(w.dk, w.ds_col[u], query(u), E);
    }
  }
  put_row(w.dk, E, row_ptr(p.dk, p.dk_stride, n, h, j), p.dk_stride[3], p.scale);
  put_row(w.dv, M, row_ptr(p.dv, p.dv_stride, n, h, j), p.dv_stride[3]);
}

}  // namespace

void sparse_attention_forward(const SparseAttentionParams& p) {
  const HeadRows q(p.q, p.q_stride, p.N, p.H, p.L, p.E);
  const HeadRows k(p.k, p.k_stride, p.N, p.H, p.S, p.E);
  const HeadRows v(p.v, p.v_stride, p.N, p.H, p.S, p.M);
  const Inputs in{q, k, v};
  parallel_for_scratch(
      p.N * p.H * ceil_div(p.L, kBlockRows),
      [&](Slicer& slicer) { return ForwardScratch(p, slicer); },
      [&](int64_t t, const ForwardScratch& w) {
        const Item it = item_of(t, p.H, p.L, kBlockRows);
        const Lines g = rows_of_head(p, it.h);
        const BlockShape shape = block_shape(g, it.r0, it.count);
        if (dense(shape, it.count)) return forward_dense(p, in, g, it.n, it.h, it.r0, it.count, shape, w);
        for (int64_t i = it.r0; i < it.r0 + it.count; ++i) forward_row(p, in, g, it.n, it.h, i, w);
      });
}

void sparse_attention_backward(const SparseAttentionBackwardParams& p) {
  const HeadRows q(p.q, p.q_stride, p.N, p.H, p.L, p.E);
  const HeadRows k(p.k, p.k_stride, p.N, p.H, p.S, p.E);
  const HeadRows v(p.v, p.v_stride, p.N, p.H, p.S, p.M);
  const HeadRows out(p.out, p.out_stride, p.N, p.H, p.L, p.M);
  const HeadRows dout(p.dout, p.dout_stride, p.N, p.H, p.L, p.M);
  Buffer<float> d(static_cast<std::size_t>(p.N * p.H * p.L));
  const GradInputs in{q, k, v, dout, p.lse, d.data()};

  // Pass 1: D_i = dout_i . out_i, then dq, per block of rows.
  parallel_for_scratch(
      p.N * p.H * ceil_div(p.L, kBlockRows),
      [&](Slicer& slicer) { return RowGradScratch(p, slicer); },
      [&](int64_t t, const RowGradScratch& w) {
        const Item it = item_of(t, p.H, p.L, kBlockRows);
        for (int64_t i = it.r0; i < it.r0 + it.count; ++i)
          in.d[(it.n * p.H + it.h) * p.L + i] =
              vec::dot(dout.row(it.n, it.h, i), out.row(it.n, it.h, i), p.M);
        const Lines g = rows_of_head(p, it.h);
        const BlockShape shape = block_shape(g, it.r0, it.count);
        if (dense(shape, it.count)) return dq_dense(p, in, g, it.n, it.h, it.r0, it.count, shape, w);
        for (int64_t i = it.r0; i < it.r0 + it.count; ++i) dq_row(p, in, g, it.n, it.h, i, w);
      });

  // Pass 2: dk and dv per block of keys, over each key's rows.
  const Transposed transposed(p);
  parallel_for_scratch(
      p.N * p.H * ceil_div(p.S, kBlockKeys),
      [&](Slicer& slicer) { return KeyGradScratch(p, slicer); },
      [&](int64_t t, const KeyGradScratch& w) {
        const Item it = item_of(t, p.H, p.S, kBlockKeys);
        const Lines g = transposed.of_head(p, it.h);
        const BlockShape shape = block_shape(g, it.r0, it.count);
        if (dense(shape, it.count)) return dkv_dense(p, in, g, it.n, it.h, it.r0, it.count, shape, w);
        for (int64_t j = it.r0; j < it.r0 + it.count; ++j) dkv_key(p, in, g, it.n, it.h, j, w);
      });
}

}  // namespace attnkit::kernels
