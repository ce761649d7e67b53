// Long on purpose: the forward and the backward share the edge-list walkers,
// the work items, the dense and band block paths and their scratch, which no
// other file uses (the band kernels themselves are in sparse_band.cpp).
#include "kernels/sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "base/memory.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/strided.h"
#include "kernels/common/vec.h"
#include "kernels/sparse_band.h"

ATTNKIT_KERNELS_BEGIN

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Work items: kBlockRows consecutive queries (the forward; the backward's
// parts are runs of these blocks) or kBlockKeys consecutive keys (the sums of
// the parts' key gradients). A dense tile spans kTile keys: at E = M = 64 the
// exact kernel's measurements (see softmax_attention.cpp) put sgemm near its
// best from 128 x 256 blocks; a banded block of b rows covers 2w + b columns
// for 2w + 1 edges per row (local pattern of span w), so smaller blocks waste
// less. At w = 64, 32-row blocks do 1.24x the edges' work instead of 1.49x
// with 64, and ran the band slightly faster relative to exact attention, with
// random patterns unchanged: the smaller GEMMs gave back most of what the
// smaller tiles saved (docs/PERFORMANCE.md, "Why the kernels' constants").
// The band kernels below hold 32 rows in two vectors.
constexpr int64_t kBlockRows = 32;
constexpr int64_t kBlockKeys = 32;
constexpr int64_t kTile = 256;

/// Compressed rows: the entries of line r are idx[offsets[r] : offsets[r + 1]],
/// strictly increasing.
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

/// The columns [begin, end) of a tile row that hold its entries: every entry
/// lies inside, and the first and last columns are entries (begin == end: no
/// entry).
struct Run {
  int64_t begin, end;
};

/// For the tile columns c < cols (keys j0 + c) of a row whose entries are
/// idx[b, e) (sorted): returns their Run and sets s[c] = -inf inside it where
/// j0 + c is no entry. Columns outside the run are left as they are: callers
/// skip them (a band's rows are one run each, so only their columns are
/// exponentiated).
Run mask_holes(const int64_t* idx, int64_t b, int64_t e, int64_t j0, int64_t cols, float* s) {
  const int64_t* it = std::lower_bound(idx + b, idx + e, j0);
  const int64_t* stop = std::lower_bound(it, idx + e, j0 + cols);
  if (it == stop) return {0, 0};
  const Run run{it[0] - j0, stop[-1] - j0 + 1};
  if (stop - it == run.end - run.begin) return run;  // consecutive entries: no hole
  int64_t pos = run.begin;
  for (; it != stop; ++it) {
    const int64_t c = *it - j0;
    std::fill(s + pos, s + c, -kInf);
    pos = c + 1;
  }
  return run;
}

/// x[c] = 0 for c < cols outside the run.
void zero_outside(float* x, const Run& run, int64_t cols) {
  std::fill(x, x + run.begin, 0.f);
  std::fill(x + run.end, x + cols, 0.f);
}

/// The rows one query head reads of an operand: its own head of q, out and
/// dout (group 1), head kv_head(h) = h / group of k and v (grouped-query
/// heads: k and v have H / group heads).
struct OperandRows {
  const HeadRows& x;
  int64_t group = 1;
  const float* row(int64_t n, int64_t h, int64_t r) const { return x.row(n, h / group, r); }
  int64_t ld() const { return x.ld(); }
};

/// ALiBi: s[r * lds + c] -= slope_h |i0 + r + S - L - (j0 + c)| for the rows
/// [i0, i0 + rows) and keys [j0, j0 + cols) of head h (query i at key
/// position i + S - L); nothing without slopes.
void sub_alibi(const SparseAttentionParams& p, int64_t h, int64_t i0, int64_t rows, int64_t j0,
               int64_t cols, float* s, int64_t lds) {
  if (!p.alibi_slopes) return;
  const float slope = p.alibi_slopes[h];
  const int64_t first = i0 + p.S - p.L - j0;  // row i0's distance to key j0
  for (int64_t r = 0; r < rows; ++r) vec::sub_distance(s + r * lds, cols, static_cast<float>(first + r), slope);
}

/// ALiBi on one row's gathered scores: x[t] -= slope_h |i + S - L - cols[t]|.
void sub_alibi_edges(const SparseAttentionParams& p, int64_t h, int64_t i, const int64_t* cols,
                     int64_t count, float* x) {
  if (!p.alibi_slopes) return;
  const float slope = p.alibi_slopes[h];
  const int64_t at = i + p.S - p.L;
  for (int64_t t = 0; t < count; ++t) x[t] -= slope * std::fabs(static_cast<float>(at - cols[t]));
}

#if ATTNKIT_BAND_KERNELS
/// The band kernels' Block for rows [i0, i0 + rows) over the keys of `shape`,
/// with head h's ALiBi slope (0: none) and row i0's distance to the first key.
band::Block band_block(const SparseAttentionParams& p, int64_t h, int64_t i0, int64_t rows,
                       const BlockShape& shape, const int32_t* first, const int32_t* last) {
  return {rows, shape.hi - shape.lo, first, last, p.alibi_slopes ? p.alibi_slopes[h] : 0.f,
          i0 + p.S - p.L - shape.lo};
}
#endif

/// The per-edge paths gather key/value (or query/output-gradient) rows from
/// anywhere in the sequence, which the hardware prefetchers cannot guess: each
/// loop asks for the rows of the edge kPrefetchAhead edges ahead, so that many
/// gathers are in flight while the current edge is computed.
constexpr int64_t kPrefetchAhead = 8;

/// Requests the cache lines of a row of `count` floats (for reading).
inline void prefetch_row(const float* row, int64_t count) {
  for (int64_t c = 0; c < count; c += 16) __builtin_prefetch(row + c, 0, 3);
}

/// A band's next block of rows reads the keys of this one shifted by
/// kBlockRows: asks for its rows of `rows` (queries, output gradients) and for
/// the rows of `keys` (keys, values) past this block's range [lo, hi), so
/// that they arrive while this block computes. Where the heads' keys and
/// values outgrow the caches (L = 16384), this made the forward of a span-64
/// band measurably faster (docs/PERFORMANCE.md, "Why the kernels' constants").
struct Rows {
  const OperandRows* x;
  int64_t width;  // floats per row
};

void prefetch_next_block(const SparseAttentionParams& p, std::initializer_list<Rows> rows,
                         std::initializer_list<Rows> keys, int64_t n, int64_t h, int64_t i0,
                         const BlockShape& shape) {
  const int64_t next = std::min(p.L, i0 + 2 * kBlockRows);
  for (const Rows& r : rows)
    for (int64_t i = i0 + kBlockRows; i < next; ++i) prefetch_row(r.x->row(n, h, i), r.width);
  const int64_t ahead = std::min(p.S, shape.hi + kBlockRows);
  for (const Rows& r : keys)
    for (int64_t j = shape.hi; j < ahead; ++j) prefetch_row(r.x->row(n, h, j), r.width);
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
  float *qt;       // the block's queries transposed on the band path: E x 32

  ForwardScratch(const SparseAttentionParams& p, Slicer& slicer)
      : s(slicer.take(kBlockRows * kTile)),
        u(slicer.take(kBlockRows * p.M)),
        m(slicer.take(kBlockRows)),
        l(slicer.take(kBlockRows)),
        row(slicer.take(p.S)),
        qt(slicer.take(p.E * band::kRows)) {}
};

struct Inputs {
  OperandRows q, k, v;
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
    sub_alibi(p, h, i0, rows, j0, cols, w.s, kTile);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = w.s + r * kTile;
      const Run run = mask_holes(g.idx, g.begin(i0 + r), g.end(i0 + r), j0, cols, sr);
      zero_outside(sr, run, cols);
      if (run.begin == run.end) continue;  // no edge in this tile: P = 0, m and l stay
      // Online softmax over the run: P = exp(s - m_new), l = l exp(m - m_new)
      // + rowsum(P), u rescaled by the same factor. max() keeps a NaN of
      // either operand.
      float* x = sr + run.begin;
      const int64_t count = run.end - run.begin;
      const float m_new = std::max(vec::max(x, count), w.m[r]);
      if (m_new == -kInf) {  // only -inf scores so far: P = 0, not NaN
        std::fill(x, x + count, 0.f);
        continue;
      }
      const float alpha = vec::exp(w.m[r] - m_new);
      w.l[r] = w.l[r] * alpha + vec::exp_shift_sum(x, count, m_new);
      if (alpha != 1.f) vec::scale(w.u + r * M, M, alpha);
      w.m[r] = m_new;
    }
    sgemm(false, false, rows, M, cols, 1.f, w.s, kTile, in.v.row(n, h, j0), in.v.ld(), 1.f, w.u,
          M);
  }
  for (int64_t r = 0; r < rows; ++r) write_row(p, n, h, i0 + r, w.u + r * M, w.m[r], w.l[r]);
}

#if ATTNKIT_BAND_KERNELS
// ---------------------------------------------------------------------------
// Band blocks in registers (sparse_band.h), at avx2 and above
// ---------------------------------------------------------------------------
//
// A band's block of 32 rows covers 2w + 32 keys (160 at span w = 64), and its
// rows' entries are one run of keys each. Blocks whose rows have gaps inside
// the tile, or whose keys span more than one tile, take forward_dense.

static_assert(kBlockRows <= band::kRows, "a block's rows must fit the band kernels' lanes");
static_assert(kTile <= band::kMaxKeys, "a tile's keys must fit the band kernels' scratch");

/// The rows of a band block as runs of keys, relative to its first key lo:
/// row r's entries are [first[r], last[r]) (empty for a row without edges and
/// for the padding rows up to 32). False when the block does not qualify for
/// the band kernels: its keys span more than one tile, a row's entries have a
/// gap, or a gathered operand's rows are too far apart for 32-bit offsets.
bool band_runs(const Lines& g, int64_t i0, int64_t rows, const BlockShape& shape,
               std::initializer_list<int64_t> row_strides, int32_t* first, int32_t* last) {
  if (shape.hi - shape.lo > kTile) return false;
  for (const int64_t ld : row_strides)
    if (ld * band::kRows > std::numeric_limits<int32_t>::max()) return false;
  std::fill(first, first + band::kRows, 0);
  std::fill(last, last + band::kRows, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = g.begin(i0 + r), e = g.end(i0 + r);
    if (b == e) continue;
    if (g.idx[e - 1] - g.idx[b] != e - b - 1) return false;
    first[r] = static_cast<int32_t>(g.idx[b] - shape.lo);
    last[r] = static_cast<int32_t>(g.idx[e - 1] + 1 - shape.lo);
  }
  return true;
}

/// Rows [i0, i0 + rows) of a band block in registers, or false when the
/// block does not qualify (band_runs).
bool forward_band(const SparseAttentionParams& p, const Inputs& in, const Lines& g, int64_t n,
                  int64_t h, int64_t i0, int64_t rows, const BlockShape& shape,
                  const ForwardScratch& w) {
  alignas(64) int32_t first[band::kRows], last[band::kRows];
  if (!band_runs(g, i0, rows, shape, {in.q.ld()}, first, last)) return false;
  alignas(64) float m[band::kRows], l[band::kRows];
  band::forward(band_block(p, h, i0, rows, shape, first, last), {in.q.row(n, h, i0), in.q.ld()},
                {in.k.row(n, h, shape.lo), in.k.ld()}, {in.v.row(n, h, shape.lo), in.v.ld()}, p.E,
                p.M, p.scale, {w.qt, nullptr, w.s, nullptr}, w.u, m, l);
  for (int64_t r = 0; r < rows; ++r) write_row(p, n, h, i0 + r, w.u + r * p.M, m[r], l[r]);
  return true;
}
#endif  // ATTNKIT_BAND_KERNELS


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
  sub_alibi_edges(p, h, i, cols, count, w.row);
  const float m = vec::max(w.row, count);
  const float l = vec::exp_shift_sum(w.row, count, m);
  for (int64_t t = 0; t < count; ++t) vec::axpy(w.u, w.row[t], value(t), p.M);
  write_row(p, n, h, i, w.u, m, l);
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------
//
// One pass over the rows computes, for each block, P and dS once and derives
// all three gradients from them (as the exact kernel does per tile): dq of the
// block's rows in full, and the block's contributions to dk and dv, which are
// added into a buffer for the keys of the rows' "part". A part is a fixed run of
// row blocks of one (batch, head); its buffer covers the keys its rows attend
// to. A second pass sums, for every key, the parts that cover it (in part
// order) and writes dk and dv. Every buffer row is written by one work item in
// an order fixed by the edge list, and the parts per head depend only on the
// shapes, so the result does not depend on the thread count.

/// Parts per (batch, head): enough work items for kMinSplitItems threads
/// when N H is small, one when it is not (each extra part costs a buffer over
/// its keys and a term in the sum of pass 2).
int64_t parts_per_head(const SparseAttentionParams& p) {
  const int64_t heads = p.N * p.H, blocks = ceil_div(p.L, kBlockRows);
  if (heads == 0 || blocks == 0) return 1;
  return std::max<int64_t>(1, std::min(ceil_div(kMinSplitItems, heads), blocks));
}

/// The row blocks [b0, b1) of part `part` of `parts`.
std::pair<int64_t, int64_t> part_blocks(int64_t blocks, int64_t parts, int64_t part) {
  return {part * blocks / parts, (part + 1) * blocks / parts};
}

/// The key range [lo, hi) of every (list, part) and where each (n, h, part)'s
/// rows start in the dk/dv buffers (rows of E and of M floats).
struct PartLayout {
  int64_t parts = 1;
  std::vector<int64_t> lo, hi;  // per (list, part)
  std::vector<int64_t> start;   // per (n, h, part), plus the total at the end

  explicit PartLayout(const SparseAttentionParams& p) : parts(parts_per_head(p)) {
    const int64_t blocks = ceil_div(p.L, kBlockRows);
    lo.assign(p.lists * parts, 0);
    hi.assign(p.lists * parts, 0);
    for (int64_t g = 0; g < p.lists; ++g) {
      const Lines lines{p.offsets + g * (p.L + 1), p.columns};
      for (int64_t part = 0; part < parts; ++part) {
        const auto [b0, b1] = part_blocks(blocks, parts, part);
        const int64_t r0 = b0 * kBlockRows, r1 = std::min(p.L, b1 * kBlockRows);
        const BlockShape s = block_shape(lines, r0, r1 - r0);
        if (s.entries == 0) continue;  // no keys: an empty range
        lo[g * parts + part] = s.lo;
        hi[g * parts + part] = s.hi;
      }
    }
    start.assign(p.N * p.H * parts + 1, 0);
    for (int64_t t = 0; t < p.N * p.H * parts; ++t) {
      const int64_t h = (t / parts) % p.H, part = t % parts;
      const int64_t g = (p.lists == 1 ? 0 : h) * parts + part;
      start[t + 1] = start[t] + (hi[g] - lo[g]);
    }
  }

  int64_t key_lo(const SparseAttentionParams& p, int64_t h, int64_t part) const {
    return lo[(p.lists == 1 ? 0 : h) * parts + part];
  }
  int64_t key_hi(const SparseAttentionParams& p, int64_t h, int64_t part) const {
    return hi[(p.lists == 1 ? 0 : h) * parts + part];
  }
};

struct GradInputs {
  OperandRows q, k, v, dout;
  const float* lse;  // (N, H, L)
};

/// Where one part adds its key gradients (dk already scaled): rows of E and M
/// floats for the keys from lo, ld_k and ld_v floats apart. Either the part's
/// buffer or, with one part per head and unit column strides, dk and dv.
struct KeyGrads {
  int64_t lo;
  float *dk, *dv;
  int64_t ld_k, ld_v;
  float* dk_row(int64_t j) const { return dk + (j - lo) * ld_k; }
  float* dv_row(int64_t j) const { return dv + (j - lo) * ld_v; }
};

struct GradScratch {
  float *p, *ds;           // P and dP, then dS: kBlockRows x kTile each
  float *dq;               // kBlockRows x E
  float *d;                // D_i = dout_i . out_i of the block's rows
  float *p_row, *ds_row;   // one row's P and dP, then dS, on the edge-at-a-time path: up to S each
  float *qt, *dot;         // the block's q and dout transposed on the band path: E x 32, M x 32

  GradScratch(const SparseAttentionParams& params, Slicer& slicer)
      : p(slicer.take(kBlockRows * kTile)),
        ds(slicer.take(kBlockRows * kTile)),
        dq(slicer.take(kBlockRows * params.E)),
        d(slicer.take(kBlockRows)),
        p_row(slicer.take(params.S)),
        ds_row(slicer.take(params.S)),
        qt(slicer.take(params.E * band::kRows)),
        dot(slicer.take(params.M * band::kRows)) {}
};

/// Rows [i0, i0 + rows) as dense tiles over the keys [lo, hi): per tile
/// P = exp(scale q k^T - lse) (0 outside the lists), dP = dout v^T and
/// dS = P (dP - D), then dv += P^T dout, dk += scale dS^T q and
/// dq += dS k: five products per tile.
void grad_dense(const SparseAttentionBackwardParams& p, const GradInputs& in, const Lines& g,
                int64_t n, int64_t h, int64_t i0, int64_t rows, const BlockShape& shape,
                const KeyGrads& out, const GradScratch& w) {
  const int64_t E = p.E, M = p.M;
  const float* lse = in.lse + (n * p.H + h) * p.L + i0;
  const float* q = in.q.row(n, h, i0);
  const float* dout = in.dout.row(n, h, i0);
  std::fill(w.dq, w.dq + rows * E, 0.f);
  for (int64_t j0 = shape.lo; j0 < shape.hi; j0 += kTile) {
    const int64_t cols = std::min(kTile, shape.hi - j0);
    sgemm(false, true, rows, cols, E, p.scale, q, in.q.ld(), in.k.row(n, h, j0), in.k.ld(), 0.f,
          w.p, kTile);
    sub_alibi(p, h, i0, rows, j0, cols, w.p, kTile);
    sgemm(false, true, rows, cols, M, 1.f, dout, in.dout.ld(), in.v.row(n, h, j0), in.v.ld(), 0.f,
          w.ds, kTile);
    for (int64_t r = 0; r < rows; ++r) {
      float* pr = w.p + r * kTile;
      float* dsr = w.ds + r * kTile;
      if (g.begin(i0 + r) == g.end(i0 + r)) {  // no edge: lse = -inf, P = dS = 0
        std::fill(pr, pr + cols, 0.f);
        std::fill(dsr, dsr + cols, 0.f);
        continue;
      }
      const Run run = mask_holes(g.idx, g.begin(i0 + r), g.end(i0 + r), j0, cols, pr);
      zero_outside(pr, run, cols);
      zero_outside(dsr, run, cols);
      vec::exp_shift(pr + run.begin, run.end - run.begin, lse[r]);
      vec::softmax_grad(dsr + run.begin, pr + run.begin, run.end - run.begin, w.d[r]);
    }
    sgemm(true, false, cols, M, rows, 1.f, w.p, kTile, dout, in.dout.ld(), 1.f, out.dv_row(j0),
          out.ld_v);
    sgemm(true, false, cols, E, rows, p.scale, w.ds, kTile, q, in.q.ld(), 1.f, out.dk_row(j0),
          out.ld_k);
    sgemm(false, false, rows, E, cols, 1.f, w.ds, kTile, in.k.row(n, h, j0), in.k.ld(), 1.f,
          w.dq, E);
  }
  for (int64_t r = 0; r < rows; ++r)
    put_row(w.dq + r * E, E, row_ptr(p.dq, p.dq_stride, n, h, i0 + r), p.dq_stride[3], p.scale);
}

#if ATTNKIT_BAND_KERNELS
/// grad_dense for a band block in registers (sparse_band.h), or false when
/// the block does not qualify (band_runs).
bool grad_band(const SparseAttentionBackwardParams& p, const GradInputs& in, const Lines& g,
               int64_t n, int64_t h, int64_t i0, int64_t rows, const BlockShape& shape,
               const KeyGrads& out, const GradScratch& w) {
  alignas(64) int32_t first[band::kRows], last[band::kRows];
  if (!band_runs(g, i0, rows, shape, {in.q.ld(), in.dout.ld()}, first, last)) return false;
  band::backward(band_block(p, h, i0, rows, shape, first, last), {in.q.row(n, h, i0), in.q.ld()},
                 {in.k.row(n, h, shape.lo), in.k.ld()}, {in.v.row(n, h, shape.lo), in.v.ld()},
                 {in.dout.row(n, h, i0), in.dout.ld()}, p.E, p.M, p.scale,
                 in.lse + (n * p.H + h) * p.L + i0, w.d, {w.qt, w.dot, w.p, w.ds}, w.dq,
                 out.dk_row(shape.lo), out.ld_k, out.dv_row(shape.lo), out.ld_v);
  for (int64_t r = 0; r < rows; ++r)
    put_row(w.dq + r * p.E, p.E, row_ptr(p.dq, p.dq_stride, n, h, i0 + r), p.dq_stride[3]);
  return true;
}
#endif  // ATTNKIT_BAND_KERNELS


/// Row i one edge at a time: P and dP of all its edges (the gathered keys and
/// values), dS = P (dP - D); dq_i = scale sum dS k, and each edge's key gets
/// scale dS q_i and P dout_i, in increasing key order.
void grad_row(const SparseAttentionBackwardParams& p, const GradInputs& in, const Lines& g,
              int64_t n, int64_t h, int64_t i, float d, const KeyGrads& out,
              const GradScratch& w) {
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
    sub_alibi_edges(p, h, i, cols, count, w.p_row);
    vec::exp_shift(w.p_row, count, in.lse[(n * p.H + h) * p.L + i]);
    vec::softmax_grad(w.ds_row, w.p_row, count, d);
    const float* q = in.q.row(n, h, i);
    const float* dout = in.dout.row(n, h, i);
    for (int64_t t = 0; t < count; ++t) {
      if (t + kPrefetchAhead < count) {  // the rows written kPrefetchAhead edges on
        const int64_t ahead = cols[t + kPrefetchAhead];
        for (int64_t c = 0; c < E; c += 16) __builtin_prefetch(out.dk_row(ahead) + c, 1, 3);
        for (int64_t c = 0; c < M; c += 16) __builtin_prefetch(out.dv_row(ahead) + c, 1, 3);
      }
      vec::axpy(w.dq, w.ds_row[t], key(t), E);
      vec::axpy(out.dk_row(cols[t]), p.scale * w.ds_row[t], q, E);
      vec::axpy(out.dv_row(cols[t]), w.p_row[t], dout, M);
    }
  }
  put_row(w.dq, E, row_ptr(p.dq, p.dq_stride, n, h, i), p.dq_stride[3], p.scale);
}

/// Pass 2's scratch: one key's sums of dk and dv.
struct KeySums {
  float *dk, *dv;
  KeySums(const SparseAttentionParams& p, Slicer& slicer)
      : dk(slicer.take(p.E)), dv(slicer.take(p.M)) {}
};

/// dk and dv of key j of head (n, h): the rows of the parts whose key range
/// holds j (dk_parts, dv_parts laid out by `layout`), added in part order, or
/// zeros when no row attends to key j.
void sum_parts(const SparseAttentionBackwardParams& p, const PartLayout& layout,
               const float* dk_parts, const float* dv_parts, int64_t n, int64_t h, int64_t j,
               const KeySums& w) {
  const int64_t first = (n * p.H + h) * layout.parts;
  const float *dk = nullptr, *dv = nullptr;  // the sums: one part's rows, or w's
  for (int64_t part = 0; part < layout.parts; ++part) {
    const int64_t lo = layout.key_lo(p, h, part);
    if (j < lo || j >= layout.key_hi(p, h, part)) continue;
    const int64_t row = layout.start[first + part] + (j - lo);
    const float* pk = dk_parts + row * p.E;
    const float* pv = dv_parts + row * p.M;
    if (!dk) {
      dk = pk;
      dv = pv;
      continue;
    }
    if (dk != w.dk) {
      std::copy(dk, dk + p.E, w.dk);
      std::copy(dv, dv + p.M, w.dv);
      dk = w.dk;
      dv = w.dv;
    }
    vec::add(w.dk, pk, p.E);
    vec::add(w.dv, pv, p.M);
  }
  float* dk_out = row_ptr(p.dk, p.dk_stride, n, h, j);
  float* dv_out = row_ptr(p.dv, p.dv_stride, n, h, j);
  if (!dk) {
    zero_row(p.E, dk_out, p.dk_stride[3]);
    zero_row(p.M, dv_out, p.dv_stride[3]);
    return;
  }
  put_row(dk, p.E, dk_out, p.dk_stride[3]);
  put_row(dv, p.M, dv_out, p.dv_stride[3]);
}

}  // namespace

void sparse_attention_forward(const SparseAttentionParams& p) {
  const int64_t Hk = p.H / p.kv_group;
  const HeadRows q_rows(p.q, p.q_stride, p.N, p.H, p.L, p.E);
  const HeadRows k_rows(p.k, p.k_stride, p.N, Hk, p.S, p.E);
  const HeadRows v_rows(p.v, p.v_stride, p.N, Hk, p.S, p.M);
  const OperandRows q{q_rows}, k{k_rows, p.kv_group}, v{v_rows, p.kv_group};
  const Inputs in{q, k, v};
  parallel_for_scratch(
      p.N * p.H * ceil_div(p.L, kBlockRows),
      [&](Slicer& slicer) { return ForwardScratch(p, slicer); },
      [&](int64_t t, const ForwardScratch& w) {
        const Item it = item_of(t, p.H, p.L, kBlockRows);
        const Lines g = rows_of_head(p, it.h);
        const BlockShape shape = block_shape(g, it.r0, it.count);
        if (dense(shape, it.count)) {
          prefetch_next_block(p, {{&q, p.E}}, {{&k, p.E}, {&v, p.M}}, it.n, it.h, it.r0, shape);
#if ATTNKIT_BAND_KERNELS
          if (forward_band(p, in, g, it.n, it.h, it.r0, it.count, shape, w)) return;
#endif
          return forward_dense(p, in, g, it.n, it.h, it.r0, it.count, shape, w);
        }
        for (int64_t i = it.r0; i < it.r0 + it.count; ++i) forward_row(p, in, g, it.n, it.h, i, w);
      });
}

void sparse_attention_backward(const SparseAttentionBackwardParams& p) {
  const int64_t Hk = p.H / p.kv_group;
  const HeadRows q_rows(p.q, p.q_stride, p.N, p.H, p.L, p.E);
  const HeadRows k_rows(p.k, p.k_stride, p.N, Hk, p.S, p.E);
  const HeadRows v_rows(p.v, p.v_stride, p.N, Hk, p.S, p.M);
  const HeadRows out_rows(p.out, p.out_stride, p.N, p.H, p.L, p.M);
  const HeadRows dout_rows(p.dout, p.dout_stride, p.N, p.H, p.L, p.M);
  const OperandRows q{q_rows}, k{k_rows, p.kv_group}, v{v_rows, p.kv_group}, out{out_rows},
      dout{dout_rows};
  const GradInputs in{q, k, v, dout, p.lse};
  const PartLayout layout(p);
  const int64_t parts = layout.parts, blocks = ceil_div(p.L, kBlockRows);
  // One part per head adds straight into dk and dv when their rows have unit
  // column stride; otherwise every part adds into its own rows of a buffer.
  const bool direct = parts == 1 && p.dk_stride[3] == 1 && p.dv_stride[3] == 1;
  const int64_t key_rows = direct ? 0 : layout.start.back();
  Buffer<float> dk_parts(static_cast<std::size_t>(key_rows * p.E));
  Buffer<float> dv_parts(static_cast<std::size_t>(key_rows * p.M));

  // Pass 1, per (n, h, part): dq of the part's rows, and its key gradients.
  parallel_for_scratch(
      p.N * p.H * parts, [&](Slicer& slicer) { return GradScratch(p, slicer); },
      [&](int64_t t, const GradScratch& w) {
        const int64_t n = t / (p.H * parts), h = (t / parts) % p.H, part = t % parts;
        KeyGrads grads;
        if (direct) {
          grads = {0, row_ptr(p.dk, p.dk_stride, n, h, 0), row_ptr(p.dv, p.dv_stride, n, h, 0),
                   p.dk_stride[2], p.dv_stride[2]};
          store_zeros(p.S, p.E, grads.dk, grads.ld_k, 1);
          store_zeros(p.S, p.M, grads.dv, grads.ld_v, 1);
        } else {
          const int64_t begin = layout.start[t], end = layout.start[t + 1];
          grads = {layout.key_lo(p, h, part), dk_parts.data() + begin * p.E,
                   dv_parts.data() + begin * p.M, p.E, p.M};
          std::fill(grads.dk, grads.dk + (end - begin) * p.E, 0.f);
          std::fill(grads.dv, grads.dv + (end - begin) * p.M, 0.f);
        }
        const Lines g = rows_of_head(p, h);
        const auto [b0, b1] = part_blocks(blocks, parts, part);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t i0 = b * kBlockRows, rows = std::min(kBlockRows, p.L - i0);
          for (int64_t r = 0; r < rows; ++r)
            w.d[r] = vec::dot(dout.row(n, h, i0 + r), out.row(n, h, i0 + r), p.M);
          const BlockShape shape = block_shape(g, i0, rows);
          if (dense(shape, rows)) {
            prefetch_next_block(p, {{&q, p.E}, {&dout, p.M}, {&out, p.M}},
                                {{&k, p.E}, {&v, p.M}}, n, h, i0, shape);
#if ATTNKIT_BAND_KERNELS
            if (grad_band(p, in, g, n, h, i0, rows, shape, grads, w)) continue;
#endif
            grad_dense(p, in, g, n, h, i0, rows, shape, grads, w);
            continue;
          }
          for (int64_t r = 0; r < rows; ++r) grad_row(p, in, g, n, h, i0 + r, w.d[r], grads, w);
        }
      });

  if (direct) return;
  // Pass 2, per block of keys: the parts that cover each key, summed in part
  // order.
  parallel_for_scratch(
      p.N * p.H * ceil_div(p.S, kBlockKeys), [&](Slicer& slicer) { return KeySums(p, slicer); },
      [&](int64_t t, const KeySums& w) {
        const Item it = item_of(t, p.H, p.S, kBlockKeys);
        for (int64_t j = it.r0; j < it.r0 + it.count; ++j)
          sum_parts(p, layout, dk_parts.data(), dv_parts.data(), it.n, it.h, j, w);
      });
}

ATTNKIT_KERNELS_END
