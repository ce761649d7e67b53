#include "kernels/linear_attention.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "kernels/gemm.h"
#include "kernels/memory.h"
#include "kernels/parallel.h"
#include "kernels/threading.h"
#include "kernels/vec.h"

namespace attnkit::kernels {

namespace {


// ---------------------------------------------------------------------------
// Matrices, scratch and threads
// ---------------------------------------------------------------------------

/// A strided matrix: element (r, c) at data[r * rs + c * cs].
struct Strided {
  const float* data;
  int64_t rs, cs;
  const float* row(int64_t r) const { return data + r * rs; }
};

/// Matrix (n, h) of a strided 4-d tensor.
Strided head_of(const float* base, const int64_t* st, int64_t n, int64_t h) {
  return {base + n * st[0] + h * st[1], st[2], st[3]};
}

/// Output matrix (n, h) of a 4-d tensor with unit last stride.
float* out_head(float* base, const int64_t* st, int64_t n, int64_t h) {
  return base + n * st[0] + h * st[1];
}

/// A row-major matrix as sgemm takes it: element (r, c) at data[r * ld + c].
struct Rows {
  const float* data;
  int64_t ld;
  const float* row(int64_t r) const { return data + r * ld; }
};

/// Whether sgemm can read a rows x cols block of m in place.
bool readable_in_place(const Strided& m, int64_t cols) {
  return (m.cs == 1 || cols == 1) && m.rs >= cols;
}

/// Rows [r0, r0 + rows) of m (cols wide): m itself when sgemm can read it, else
/// a copy into `pack` (rows * cols floats).
Rows rows_of(const Strided& m, int64_t r0, int64_t rows, int64_t cols, float* pack) {
  const float* first = m.row(r0);
  if (readable_in_place(m, cols)) return {first, m.rs};
  for (int64_t r = 0; r < rows; ++r) {
    if (m.cs == 1) {
      std::memcpy(pack + r * cols, first + r * m.rs, cols * sizeof(float));
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) pack[r * cols + c] = first[r * m.rs + c * m.cs];
  }
  return {pack, cols};
}

void zero_rows(float* x, int64_t ld, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::fill(x + r * ld, x + r * ld + cols, 0.f);
}

/// y[i] += a * x[i].
void axpy(float* y, const float* x, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

/// Runs head(nh, scratch) for nh in [0, heads) on num_threads() OpenMP threads,
/// each thread with its own scratch (make_scratch(slicer)) carved out of one
/// counted buffer.
template <typename MakeScratch, typename Head>
void parallel_heads(int64_t heads, MakeScratch make_scratch, Head head) {
  Slicer sizer(nullptr);
  make_scratch(sizer);
  parallel_with_scratch(sizer.used(), [&](float* base) {
    Slicer slicer(base);
    const auto w = make_scratch(slicer);
#pragma omp for schedule(dynamic, 1)
    for (int64_t nh = 0; nh < heads; ++nh) head(nh, w);
  });
}

// ---------------------------------------------------------------------------
// Feature maps
// ---------------------------------------------------------------------------

/// x[i] = elu(x[i]) + 1 = (x > 0 ? x + 1 : exp(x)), in place.
void elu_plus_one(float* x, int64_t n) {
  constexpr int64_t kBlock = 64;
  float e[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min(kBlock, n - i0);
    std::copy(x + i0, x + i0 + len, e);
    vec::exp_shift(e, len, 0.f);
    for (int64_t i = 0; i < len; ++i) x[i0 + i] = x[i0 + i] > 0.f ? x[i0 + i] + 1.f : e[i];
  }
}

/// phi(rows [r0, r0 + rows) of x) as Rows: x itself for the identity when
/// sgemm can read it in place, else computed into `pack` (rows x cols).
Rows feature_rows(FeatureMapKind map, const Strided& x, int64_t r0, int64_t rows, int64_t cols,
                  float* pack) {
  if (map == FeatureMapKind::identity) return rows_of(x, r0, rows, cols, pack);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.row(r0 + r);
    float* o = pack + r * cols;
    if (x.cs == 1)
      std::memcpy(o, xr, cols * sizeof(float));
    else
      for (int64_t c = 0; c < cols; ++c) o[c] = xr[c * x.cs];
    elu_plus_one(o, cols);
  }
  return {pack, cols};
}

/// g(r, c) *= phi'(x(r0 + r, c)) for a rows x cols block g (row stride ldg),
/// given phi(x) of the same rows (row stride ldp). For elu + 1 the derivative
/// is 1 for x > 0 and exp(x) = phi(x) otherwise, so no exp is recomputed.
void times_feature_grad(FeatureMapKind map, const Strided& x, int64_t r0, int64_t rows,
                        int64_t cols, const float* phi, int64_t ldp, float* g, int64_t ldg) {
  if (map == FeatureMapKind::identity) return;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.row(r0 + r);
    const float* pr = phi + r * ldp;
    float* gr = g + r * ldg;
    for (int64_t c = 0; c < cols; ++c)
      if (!(xr[c * x.cs] > 0.f)) gr[c] *= pr[c];
  }
}

// ---------------------------------------------------------------------------
// Linear attention: shared pieces of forward and backward
//
// Nothing of size L or S is materialised: features phi(q), phi(k) are computed
// per chunk of queries and per block of keys, right before the GEMM that reads
// them, so they come from cache and scratch stays O(chunk (E + M) + E M).
// ---------------------------------------------------------------------------

/// Keys per block when summed into (or read out of) a state: 64 x 64 x 256
/// GEMMs run near peak, and a block of phi(k) and v stays in L2.
constexpr int64_t kKeyBlock = 256;

/// Query i sees exactly the keys [0, visible(i)); nondecreasing in i, and by at
/// most 1 per query, so a chunk of `rows` queries has fewer than `rows` keys
/// that only some of its queries see.
class Visibility {
 public:
  explicit Visibility(const LinearAttentionParams& p)
      : S_(p.S), offset_(p.S - p.L), causal_(p.causal) {}
  int64_t operator()(int64_t i) const {
    return causal_ ? std::clamp<int64_t>(i + 1 + offset_, 0, S_) : S_;
  }

 private:
  int64_t S_, offset_;
  bool causal_;
};

/// Queries per chunk. Non-causal queries all see every key, so nothing is
/// masked and a chunk is just a block that keeps its features in cache.
int64_t chunk_of(const LinearAttentionParams& p) {
  return p.causal ? std::max<int64_t>(p.chunk, 1) : kKeyBlock;
}

/// Chunk [i0, i0 + rows): its queries all see keys [0, all_see) and some of
/// them see [all_see, any_see) (the masked block, narrower than rows).
struct QueryChunk {
  int64_t i0, rows, all_see, any_see;
  int64_t width() const { return any_see - all_see; }
};

QueryChunk query_chunk(const Visibility& visible, int64_t i0, int64_t chunk, int64_t L) {
  const int64_t rows = std::min(chunk, L - i0);
  return {i0, rows, visible(i0), visible(i0 + rows - 1)};
}

/// Zeroes the entries of the chunk's masked block (rows x width, row stride
/// width) whose key its query does not see.
void mask_block(const Visibility& visible, const QueryChunk& c, float* block) {
  const int64_t width = c.width();
  for (int64_t r = 0; r < c.rows; ++r) {
    const int64_t seen = std::clamp<int64_t>(visible(c.i0 + r) - c.all_see, 0, width);
    std::fill(block + r * width + seen, block + (r + 1) * width, 0.f);
  }
}

struct LinearScratch {
  float *fq, *fk;    // phi of a chunk of queries (chunk x E), of a block of keys (block x E)
  float* v;          // a block of v, packed when its strides need it: block x M
  float* dout;       // backward: a chunk of dout, packed when its strides need it
  float *du, *dden;  // backward with normaliser: dU (chunk x M) and dden (chunk) of a chunk
  float *state, *z;  // running S (E x M) and z (E); backward pass 2: R and r
  float* block;      // the masked block of a causal chunk: chunk x chunk

  LinearScratch(const LinearAttentionParams& p, bool backward, Slicer& s) {
    const int64_t C = std::min(chunk_of(p), std::max<int64_t>(p.L, 1));
    const int64_t K = std::max(kKeyBlock, C);  // key blocks and masked blocks (< C keys)
    const bool normalize_backward = backward && p.normalize;
    fq = s.take(C * p.E);
    fk = s.take(K * p.E);
    v = s.take(K * p.M);
    dout = s.take(backward ? C * p.M : 0);
    du = s.take(normalize_backward ? C * p.M : 0);
    dden = s.take(normalize_backward ? C : 0);
    state = s.take(p.E * p.M);
    z = s.take(p.E);
    block = s.take(p.causal ? C * C : 0);
  }
};

/// The inputs of head (n, h).
struct Head {
  Strided q, k, v;
};

Head head_inputs(const LinearAttentionParams& p, int64_t n, int64_t h) {
  return {head_of(p.q, p.q_stride, n, h), head_of(p.k, p.k_stride, n, h),
          head_of(p.v, p.v_stride, n, h)};
}

/// phi(k) and v of keys [j0, j0 + rows), rows <= the scratch's block size.
struct KeyRows {
  Rows fk, v;
};

KeyRows key_rows(const LinearAttentionParams& p, const Head& x, int64_t j0, int64_t rows,
                 const LinearScratch& w) {
  return {feature_rows(p.feature_map, x.k, j0, rows, p.E, w.fk), rows_of(x.v, j0, rows, p.M, w.v)};
}

/// Adds keys [from, to) to the running state: S += phi(K)^T V, z += sum phi(k).
void absorb_keys(const LinearAttentionParams& p, const Head& x, int64_t from, int64_t to,
                 const LinearScratch& w) {
  for (int64_t j0 = from; j0 < to; j0 += kKeyBlock) {
    const int64_t rows = std::min(kKeyBlock, to - j0);
    const KeyRows kr = key_rows(p, x, j0, rows, w);
    sgemm(true, false, p.E, p.M, rows, 1.f, kr.fk.data, kr.fk.ld, kr.v.data, kr.v.ld, 1.f, w.state,
          p.M);
    if (p.normalize)
      for (int64_t s = 0; s < rows; ++s) vec::add(w.z, kr.fk.row(s), p.E);
  }
}

/// block = masked phi(Q_chunk) phi(K_block)^T: rows x width.
void masked_scores(const LinearAttentionParams& p, const Visibility& visible, const QueryChunk& c,
                   const Rows& fq, const KeyRows& kb, float* block) {
  sgemm(false, true, c.rows, c.width(), p.E, 1.f, fq.data, fq.ld, kb.fk.data, kb.fk.ld, 0.f, block,
        c.width());
  mask_block(visible, c, block);
}

/// block = masked (dU_chunk V_block^T + dden): rows x width. Its entry (r, c)
/// is d loss / d (phi(q_r) . phi(k_c)) for a visible pair.
void masked_score_grads(const LinearAttentionParams& p, const Visibility& visible,
                        const QueryChunk& c, const Rows& du, const float* dden, const KeyRows& kb,
                        float* block) {
  const int64_t width = c.width();
  sgemm(false, true, c.rows, width, p.M, 1.f, du.data, du.ld, kb.v.data, kb.v.ld, 0.f, block,
        width);
  if (p.normalize)
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t j = 0; j < width; ++j) block[r * width + j] += dden[r];
  mask_block(visible, c, block);
}

// ---------------------------------------------------------------------------
// Linear attention forward
// ---------------------------------------------------------------------------

void linear_forward_head(const LinearAttentionParams& p, int64_t n, int64_t h,
                         const LinearScratch& w) {
  const int64_t E = p.E, M = p.M, chunk = chunk_of(p);
  const Visibility visible(p);
  const Head x = head_inputs(p, n, h);
  float* out = out_head(p.out, p.out_stride, n, h);
  const int64_t ldo = p.out_stride[2];
  float* den = p.normalize ? p.den + (n * p.H + h) * p.L : nullptr;

  std::fill(w.state, w.state + E * M, 0.f);
  std::fill(w.z, w.z + E, 0.f);
  int64_t absorbed = 0;
  for (int64_t i0 = 0; i0 < p.L; i0 += chunk) {
    const QueryChunk c = query_chunk(visible, i0, chunk, p.L);
    absorb_keys(p, x, absorbed, c.all_see, w);
    absorbed = c.all_see;
    const Rows fq = feature_rows(p.feature_map, x.q, i0, c.rows, E, w.fq);
    float* o = out + i0 * ldo;
    sgemm(false, false, c.rows, M, E, 1.f, fq.data, fq.ld, w.state, M, 0.f, o, ldo);
    if (c.width() > 0) {
      const KeyRows kb = key_rows(p, x, c.all_see, c.width(), w);
      masked_scores(p, visible, c, fq, kb, w.block);
      sgemm(false, false, c.rows, M, c.width(), 1.f, w.block, c.width(), kb.v.data, kb.v.ld, 1.f, o,
            ldo);
    }
    if (!p.normalize) continue;
    for (int64_t r = 0; r < c.rows; ++r) {
      float d = vec::dot(fq.row(r), w.z, E) + p.eps;
      for (int64_t j = 0; j < c.width(); ++j) d += w.block[r * c.width() + j];
      den[i0 + r] = d;
      // A query that sees no key has a zero numerator: out = 0 even for eps = 0.
      vec::scale(o + r * ldo, M, visible(i0 + r) > 0 ? 1.f / d : 0.f);
    }
  }
}

// ---------------------------------------------------------------------------
// Linear attention backward
//
// With o_l = u_l / den_l: dU_l = g_l / den_l and dden_l = -(g_l . o_l) / den_l,
// and everything is the unnormalised attention with values [v, 1] and output
// gradients [dU, dden] (SPECS 5):
//   dphi(q_l) = S_l dU_l + z_l dden_l          pass 1, forwards (S_l, z_l prefixes)
//   dphi(k_s) = R_s v_s + r_s,  dv_s = R_s^T phi(k_s)   pass 2, backwards
// with R_s = sum_{l sees s} phi(q_l) dU_l^T and r_s = sum_{l sees s} phi(q_l) dden_l.
// Both passes recompute the chunk's features and dU, dden instead of storing them.
// ---------------------------------------------------------------------------

/// dU and dden of the chunk's queries (normalize: into scratch, dden in w.dden),
/// or its rows of dout as dU.
Rows output_grads(const LinearAttentionBackwardParams& p, int64_t n, int64_t h,
                  const Visibility& visible, const QueryChunk& c, const LinearScratch& w) {
  const Rows g = rows_of(head_of(p.dout, p.dout_stride, n, h), c.i0, c.rows, p.M, w.dout);
  if (!p.normalize) return g;
  const float* out = out_head(p.out, p.out_stride, n, h) + c.i0 * p.out_stride[2];
  const float* den = p.den + (n * p.H + h) * p.L + c.i0;
  for (int64_t r = 0; r < c.rows; ++r) {
    const float inv = visible(c.i0 + r) > 0 ? 1.f / den[r] : 0.f;
    float* du = w.du + r * p.M;
    std::memcpy(du, g.row(r), p.M * sizeof(float));
    vec::scale(du, p.M, inv);
    w.dden[r] = -vec::dot(g.row(r), out + r * p.out_stride[2], p.M) * inv;
  }
  return {w.du, p.M};
}

/// Pass 1: dq, chunk by chunk, rebuilding the prefix state S, z.
void query_grads(const LinearAttentionBackwardParams& p, int64_t n, int64_t h,
                 const Visibility& visible, const Head& x, const LinearScratch& w) {
  const int64_t E = p.E, M = p.M, chunk = chunk_of(p);
  float* dq = out_head(p.dq, p.dq_stride, n, h);
  const int64_t ldq = p.dq_stride[2];
  std::fill(w.state, w.state + E * M, 0.f);
  std::fill(w.z, w.z + E, 0.f);
  int64_t absorbed = 0;
  for (int64_t i0 = 0; i0 < p.L; i0 += chunk) {
    const QueryChunk c = query_chunk(visible, i0, chunk, p.L);
    absorb_keys(p, x, absorbed, c.all_see, w);
    absorbed = c.all_see;
    const Rows du = output_grads(p, n, h, visible, c, w);
    float* dqc = dq + i0 * ldq;
    sgemm(false, true, c.rows, E, M, 1.f, du.data, du.ld, w.state, M, 0.f, dqc, ldq);
    if (p.normalize)
      for (int64_t r = 0; r < c.rows; ++r) axpy(dqc + r * ldq, w.z, w.dden[r], E);
    if (c.width() > 0) {
      const KeyRows kb = key_rows(p, x, c.all_see, c.width(), w);
      masked_score_grads(p, visible, c, du, w.dden, kb, w.block);
      sgemm(false, false, c.rows, E, c.width(), 1.f, w.block, c.width(), kb.fk.data, kb.fk.ld, 1.f,
            dqc, ldq);
    }
    if (p.feature_map != FeatureMapKind::identity) {
      const Rows fq = feature_rows(p.feature_map, x.q, i0, c.rows, E, w.fq);
      times_feature_grad(p.feature_map, x.q, i0, c.rows, E, fq.data, fq.ld, dqc, ldq);
    }
  }
}

/// Pass 2: dk, dv, chunks backwards with R, r = sums over the later chunks'
/// queries. Chunk c's key group [all_see_c, all_see_{c+1}) (at most a chunk of
/// keys) is seen by all later queries, by some of chunk c's (its masked block,
/// the group's first keys) and by no earlier one.
void key_grads(const LinearAttentionBackwardParams& p, int64_t n, int64_t h,
               const Visibility& visible, const Head& x, const LinearScratch& w) {
  const int64_t E = p.E, M = p.M, chunk = chunk_of(p);
  float* dk = out_head(p.dk, p.dk_stride, n, h);
  float* dv = out_head(p.dv, p.dv_stride, n, h);
  const int64_t ldk = p.dk_stride[2], ldv = p.dv_stride[2];
  float* R = w.state;
  float* r = w.z;
  std::fill(R, R + E * M, 0.f);
  std::fill(r, r + E, 0.f);
  // Keys [j0, j0 + rows) seen by exactly the queries already in R, r.
  const auto from_later = [&](const KeyRows& kr, int64_t j0, int64_t rows) {
    sgemm(false, true, rows, E, M, 1.f, kr.v.data, kr.v.ld, R, M, 0.f, dk + j0 * ldk, ldk);
    if (p.normalize)
      for (int64_t s = j0; s < j0 + rows; ++s) vec::add(dk + s * ldk, r, E);
    sgemm(false, false, rows, M, E, 1.f, kr.fk.data, kr.fk.ld, R, M, 0.f, dv + j0 * ldv, ldv);
  };
  const int64_t chunks = ceil_div(p.L, chunk);
  const int64_t seen_by_last = p.L > 0 ? visible(p.L - 1) : 0;  // later keys: seen by nobody
  for (int64_t ci = chunks - 1; ci >= 0; --ci) {
    const QueryChunk c = query_chunk(visible, ci * chunk, chunk, p.L);
    const int64_t g0 = c.all_see;
    const int64_t group = (ci + 1 < chunks ? visible(c.i0 + chunk) : seen_by_last) - g0;
    const KeyRows kg = key_rows(p, x, g0, group, w);
    from_later(kg, g0, group);
    const Rows fq = feature_rows(p.feature_map, x.q, c.i0, c.rows, E, w.fq);
    const Rows du = output_grads(p, n, h, visible, c, w);
    if (c.width() > 0) {
      const int64_t width = c.width();
      masked_scores(p, visible, c, fq, kg, w.block);
      sgemm(true, false, width, M, c.rows, 1.f, w.block, width, du.data, du.ld, 1.f, dv + g0 * ldv,
            ldv);
      masked_score_grads(p, visible, c, du, w.dden, kg, w.block);
      sgemm(true, false, width, E, c.rows, 1.f, w.block, width, fq.data, fq.ld, 1.f, dk + g0 * ldk,
            ldk);
    }
    sgemm(true, false, E, M, c.rows, 1.f, fq.data, fq.ld, du.data, du.ld, 1.f, R, M);
    if (p.normalize)
      for (int64_t l = 0; l < c.rows; ++l) axpy(r, fq.row(l), w.dden[l], E);
    times_feature_grad(p.feature_map, x.k, g0, group, E, kg.fk.data, kg.fk.ld, dk + g0 * ldk, ldk);
  }
  // Keys seen by every query, a block at a time.
  const int64_t seen_by_all = p.L > 0 ? visible(0) : 0;
  for (int64_t j0 = 0; j0 < seen_by_all; j0 += kKeyBlock) {
    const int64_t rows = std::min(kKeyBlock, seen_by_all - j0);
    const KeyRows kr = key_rows(p, x, j0, rows, w);
    from_later(kr, j0, rows);
    times_feature_grad(p.feature_map, x.k, j0, rows, E, kr.fk.data, kr.fk.ld, dk + j0 * ldk, ldk);
  }
  zero_rows(dk + seen_by_last * ldk, ldk, p.S - seen_by_last, E);
  zero_rows(dv + seen_by_last * ldv, ldv, p.S - seen_by_last, M);
}

void linear_backward_head(const LinearAttentionBackwardParams& p, int64_t n, int64_t h,
                          const LinearScratch& w) {
  const Visibility visible(p);
  const Head x = head_inputs(p, n, h);
  query_grads(p, n, h, visible, x, w);
  key_grads(p, n, h, visible, x, w);
}

// ---------------------------------------------------------------------------
// Gated recurrence: chunks and their decays
// ---------------------------------------------------------------------------

/// Rows per gated chunk (>= 1 even for L = 0, so sizes stay valid).
int64_t gated_chunk(const GatedLinearAttentionParams& p) {
  return std::max<int64_t>(1, std::min(std::max<int64_t>(p.chunk, 1), p.L));
}

struct GatedScratch {
  float *q, *f, *dout;            // chunk rows packed when strided: chunk x E
  float *alpha, *beta;            // the chunk's gates: chunk
  float *decay, *before, *after;  // products of alpha over [c0, t], [c0, t), (t, c1)
  float* D;                       // D[t][s] = prod_{u=s+1}^{t} alpha_u: chunk x chunk
  float *s1, *s2;                 // chunk x chunk products
  float* rowsE;                   // chunk x E
  float* state;                   // C: E x E
  float *adj, *sym;               // backward: adjoint of C and adj + adj^T: E x E
  float* checkpoints;             // causal backward: C at every chunk start
  float* gamma;                   // non-causal backward: prod_{s>t} alpha_s: L
  float *e, *nf;                  // causal backward: e_t and f_t^T A f_t of a chunk

  GatedScratch(const GatedLinearAttentionParams& p, bool backward, GatedBackwardMethod method,
               Slicer& s) {
    const int64_t C = gated_chunk(p), E = p.E;
    const bool causal_backward = backward && p.causal;
    q = s.take(C * E);
    f = s.take(C * E);
    dout = s.take(backward ? C * E : 0);
    alpha = s.take(C);
    beta = s.take(C);
    decay = s.take(C);
    before = s.take(C);
    after = s.take(C);
    D = s.take(C * C);
    s1 = s.take(C * C);
    s2 = s.take(backward ? C * C : 0);
    rowsE = s.take(C * E);
    state = s.take(E * E);
    adj = s.take(backward ? E * E : 0);
    sym = s.take(backward ? E * E : 0);
    checkpoints = s.take(causal_backward && method == GatedBackwardMethod::checkpoints
                             ? ceil_div(p.L, C) * E * E
                             : 0);
    gamma = s.take(backward && !p.causal ? p.L : 0);
    e = s.take(causal_backward ? C : 0);
    nf = s.take(causal_backward ? C : 0);
  }
};

/// One chunk [c0, c0 + rows) of a gated head, its rows as Rows and its gates
/// and decays loaded into scratch.
struct GatedChunk {
  int64_t c0, rows;
  Rows q, f;
};

/// Loads the chunk's q and f rows, gates and decays. The decays are explicit
/// products, never ratios of prefix products, so a zero alpha is harmless.
GatedChunk load_chunk(const GatedLinearAttentionParams& p, int64_t n, int64_t h, int64_t c0,
                      const GatedScratch& w) {
  const int64_t rows = std::min(gated_chunk(p), p.L - c0);
  const GatedChunk c{c0, rows, rows_of(head_of(p.q, p.q_stride, n, h), c0, rows, p.E, w.q),
                     rows_of(head_of(p.f, p.f_stride, n, h), c0, rows, p.E, w.f)};
  const float* alpha = p.alpha + n * p.alpha_stride[0] + h * p.alpha_stride[1];
  const float* beta = p.beta + n * p.beta_stride[0] + h * p.beta_stride[1];
  for (int64_t t = 0; t < rows; ++t) {
    w.alpha[t] = alpha[(c0 + t) * p.alpha_stride[2]];
    w.beta[t] = beta[(c0 + t) * p.beta_stride[2]];
  }
  float prod = 1.f;
  for (int64_t t = 0; t < rows; ++t) {
    w.before[t] = prod;
    w.decay[t] = prod *= w.alpha[t];
  }
  prod = 1.f;
  for (int64_t t = rows - 1; t >= 0; --t) {
    w.after[t] = prod;
    prod *= w.alpha[t];
  }
  for (int64_t t = 0; t < rows; ++t) {
    float* Dt = w.D + t * rows;
    Dt[t] = 1.f;
    for (int64_t s = t - 1; s >= 0; --s) Dt[s] = Dt[s + 1] * w.alpha[s + 1];
    std::fill(Dt + t + 1, Dt + rows, 0.f);
  }
  return c;
}

/// C <- C_{c1-1} from C = C_{c0-1}: prod(alpha) C + F^T diag(beta_s after_s) F.
void advance_state(const GatedLinearAttentionParams& p, const GatedChunk& c, const GatedScratch& w,
                   float* C) {
  const int64_t E = p.E;
  for (int64_t s = 0; s < c.rows; ++s) {
    const float ws = w.beta[s] * w.after[s];
    const float* fs = c.f.row(s);
    for (int64_t j = 0; j < E; ++j) w.rowsE[s * E + j] = ws * fs[j];
  }
  sgemm(true, false, E, E, c.rows, 1.f, c.f.data, c.f.ld, w.rowsE, E, w.decay[c.rows - 1], C, E);
}

/// C = C_{L-1} of head (n, h).
void final_state(const GatedLinearAttentionParams& p, int64_t n, int64_t h, const GatedScratch& w,
                 float* C) {
  std::fill(C, C + p.E * p.E, 0.f);
  for (int64_t c0 = 0; c0 < p.L; c0 += gated_chunk(p))
    advance_state(p, load_chunk(p, n, h, c0, w), w, C);
}

// ---------------------------------------------------------------------------
// Gated forward
// ---------------------------------------------------------------------------

/// Causal chunk: out_t = decay_t C q_t + sum_{s <= t} D[t][s] beta_s (f_s . q_t) f_s.
void gated_causal_chunk(const GatedLinearAttentionParams& p, const GatedChunk& c,
                        const GatedScratch& w, float* out, int64_t ldo) {
  const int64_t E = p.E, rows = c.rows;
  sgemm(false, true, rows, E, E, 1.f, c.q.data, c.q.ld, w.state, E, 0.f, out, ldo);
  for (int64_t t = 0; t < rows; ++t) vec::scale(out + t * ldo, E, w.decay[t]);
  sgemm(false, true, rows, rows, E, 1.f, c.q.data, c.q.ld, c.f.data, c.f.ld, 0.f, w.s1, rows);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t s = 0; s < rows; ++s) w.s1[t * rows + s] *= w.D[t * rows + s] * w.beta[s];
  sgemm(false, false, rows, E, rows, 1.f, w.s1, rows, c.f.data, c.f.ld, 1.f, out, ldo);
}

void gated_forward_head(const GatedLinearAttentionParams& p, int64_t n, int64_t h,
                        const GatedScratch& w) {
  const int64_t E = p.E, C = gated_chunk(p);
  float* out = out_head(p.out, p.out_stride, n, h);
  const int64_t ldo = p.out_stride[2];
  if (!p.causal) {
    final_state(p, n, h, w, w.state);
    const Strided q = head_of(p.q, p.q_stride, n, h);
    for (int64_t c0 = 0; c0 < p.L; c0 += C) {
      const int64_t rows = std::min(C, p.L - c0);
      const Rows qc = rows_of(q, c0, rows, E, w.q);
      sgemm(false, true, rows, E, E, 1.f, qc.data, qc.ld, w.state, E, 0.f, out + c0 * ldo, ldo);
    }
    return;
  }
  std::fill(w.state, w.state + E * E, 0.f);
  for (int64_t c0 = 0; c0 < p.L; c0 += C) {
    const GatedChunk c = load_chunk(p, n, h, c0, w);
    gated_causal_chunk(p, c, w, out + c0 * ldo, ldo);
    advance_state(p, c, w, w.state);
  }
}

// ---------------------------------------------------------------------------
// Gated backward. With G_t = dL/dC_t through every later use of C_t:
//   dq_t = C_t^T dout_t,  df_t = beta_t (G_t + G_t^T) f_t,
//   dbeta_t = f_t^T G_t f_t,  dalpha_t = <G_t, C_{t-1}>,
//   G_t = [causal] dout_t q_t^T + alpha_{t+1} G_{t+1}.
// ---------------------------------------------------------------------------

/// sym = a + a^T (E x E).
void symmetrize(const float* a, int64_t E, float* sym) {
  for (int64_t i = 0; i < E; ++i)
    for (int64_t j = 0; j < E; ++j) sym[i * E + j] = a[i * E + j] + a[j * E + i];
}

/// Non-causal: G_t = gamma_t G with G = sum_t dout_t q_t^T and gamma_t = prod_{s>t}
/// alpha_s, so no state but C_{L-1} is needed: <G, C_{t-1}> obeys the scalar
/// recurrence h_t = alpha_t h_{t-1} + beta_t f_t^T G f_t.
void gated_noncausal_backward(const GatedLinearAttentionBackwardParams& p, int64_t n, int64_t h,
                              const GatedScratch& w) {
  const int64_t E = p.E, C = gated_chunk(p);
  final_state(p, n, h, w, w.state);
  const Strided q = head_of(p.q, p.q_stride, n, h), f = head_of(p.f, p.f_stride, n, h);
  const Strided dout = head_of(p.dout, p.dout_stride, n, h);
  float* dq = out_head(p.dq, p.dq_stride, n, h);
  float* df = out_head(p.df, p.df_stride, n, h);
  const int64_t ldq = p.dq_stride[2], ldf = p.df_stride[2];

  std::fill(w.adj, w.adj + E * E, 0.f);  // G
  for (int64_t c0 = 0; c0 < p.L; c0 += C) {
    const int64_t rows = std::min(C, p.L - c0);
    const Rows g = rows_of(dout, c0, rows, E, w.dout), qc = rows_of(q, c0, rows, E, w.q);
    sgemm(true, false, E, E, rows, 1.f, g.data, g.ld, qc.data, qc.ld, 1.f, w.adj, E);
    sgemm(false, false, rows, E, E, 1.f, g.data, g.ld, w.state, E, 0.f, dq + c0 * ldq, ldq);
  }
  symmetrize(w.adj, E, w.sym);

  const float* alpha = p.alpha + n * p.alpha_stride[0] + h * p.alpha_stride[1];
  const float* beta = p.beta + n * p.beta_stride[0] + h * p.beta_stride[1];
  const auto alpha_at = [&](int64_t t) { return alpha[t * p.alpha_stride[2]]; };
  const auto beta_at = [&](int64_t t) { return beta[t * p.beta_stride[2]]; };
  float prod = 1.f;
  for (int64_t t = p.L - 1; t >= 0; --t) {
    w.gamma[t] = prod;
    prod *= alpha_at(t);
  }
  float* dalpha = p.dalpha ? p.dalpha + (n * p.H + h) * p.L : nullptr;
  float* dbeta = p.dbeta ? p.dbeta + (n * p.H + h) * p.L : nullptr;
  double hsum = 0.0;  // h_{t-1} = <G, C_{t-1}>
  for (int64_t c0 = 0; c0 < p.L; c0 += C) {
    const int64_t rows = std::min(C, p.L - c0);
    const Rows fc = rows_of(f, c0, rows, E, w.f);
    float* y = df + c0 * ldf;  // (G + G^T) f_t, scaled in place into df_t
    sgemm(false, false, rows, E, E, 1.f, fc.data, fc.ld, w.sym, E, 0.f, y, ldf);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = c0 + r;
      const float d = 0.5f * vec::dot(y + r * ldf, fc.row(r), E);  // f_t^T G f_t
      vec::scale(y + r * ldf, E, beta_at(t) * w.gamma[t]);
      if (dbeta) dbeta[t] = w.gamma[t] * d;
      if (dalpha) dalpha[t] = static_cast<float>(w.gamma[t] * hsum);
      hsum = alpha_at(t) * hsum + double(beta_at(t)) * d;
    }
  }
}

/// dalpha of a causal chunk: <G_t, C_{t-1}> with C_{t-1} = before_t Cp +
/// sum_{s<t} D[t-1][s] beta_s f_s f_s^T and G_t = sum_{r>=t} D[r][t] dout_r q_r^T
/// + after_t A, expanded into four O(chunk^2) sums:
///   before_t after_t <A, Cp> + after_t sum_{s<t} D[t-1][s] beta_s f_s^T A f_s
///   + before_t sum_{r>=t} D[r][t] e_r + sum_{r>=t} D[r][t] Y_r(t),
/// with e_r = dout_r^T Cp q_r, Y_r(t) = sum_{s<t} D[t-1][s] beta_s (dout_r.f_s)(q_r.f_s)
/// run as the recurrence Y_r(t+1) = alpha_t Y_r(t) + beta_t M[r][t] (no division).
/// qf = Q F^T and gf = dO F^T unmasked (M = qf o gf); nf_s = f_s^T A f_s;
/// adj_cp = <A, Cp>.
void gated_chunk_dalpha(const GatedChunk& c, const GatedScratch& w, const float* qf,
                        const float* gf, float adj_cp, float* dalpha) {
  const int64_t rows = c.rows;
  for (int64_t t = 0; t < rows; ++t) dalpha[t] = w.before[t] * w.after[t] * adj_cp;
  float z = 0.f;
  for (int64_t t = 0; t < rows; ++t) {
    dalpha[t] += w.after[t] * z;
    z = w.alpha[t] * z + w.beta[t] * w.nf[t];
  }
  for (int64_t t = 0; t < rows; ++t) {
    float sum = 0.f;
    for (int64_t r = t; r < rows; ++r) sum += w.D[r * rows + t] * w.e[r];
    dalpha[t] += w.before[t] * sum;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float y = 0.f;
    for (int64_t t = 0; t <= r; ++t) {
      dalpha[t] += w.D[r * rows + t] * y;
      y = w.alpha[t] * y + w.beta[t] * qf[r * rows + t] * gf[r * rows + t];
    }
  }
}

/// One causal chunk backwards, from Cp = C_{c0-1} and A = w.adj = dL/dC_{c1-1}
/// through the later chunks; leaves in w.adj the same for C_{c0-1}.
void gated_causal_chunk_backward(const GatedLinearAttentionBackwardParams& p, int64_t n, int64_t h,
                                 const GatedChunk& c, const float* Cp, const GatedScratch& w) {
  const int64_t E = p.E, rows = c.rows;
  const Rows g = rows_of(head_of(p.dout, p.dout_stride, n, h), c.c0, rows, E, w.dout);
  float* dq = out_head(p.dq, p.dq_stride, n, h) + c.c0 * p.dq_stride[2];
  float* df = out_head(p.df, p.df_stride, n, h) + c.c0 * p.df_stride[2];
  const int64_t ldq = p.dq_stride[2], ldf = p.df_stride[2];
  float* qf = w.s1;  // (q_t . f_s), later D o that
  float* gf = w.s2;  // (dout_t . f_s), later D o that
  sgemm(false, true, rows, rows, E, 1.f, c.q.data, c.q.ld, c.f.data, c.f.ld, 0.f, qf, rows);
  sgemm(false, true, rows, rows, E, 1.f, g.data, g.ld, c.f.data, c.f.ld, 0.f, gf, rows);

  // dq_t, part 1: decay_t Cp^T dout_t; on the way e_t = dout_t^T Cp q_t.
  sgemm(false, false, rows, E, E, 1.f, g.data, g.ld, Cp, E, 0.f, dq, ldq);
  for (int64_t t = 0; t < rows; ++t) {
    w.e[t] = vec::dot(dq + t * ldq, c.q.row(t), E);
    vec::scale(dq + t * ldq, E, w.decay[t]);
  }
  // (A + A^T) f_s into rowsE, and nf_s = f_s^T A f_s.
  symmetrize(w.adj, E, w.sym);
  sgemm(false, false, rows, E, E, 1.f, c.f.data, c.f.ld, w.sym, E, 0.f, w.rowsE, E);
  for (int64_t s = 0; s < rows; ++s) w.nf[s] = 0.5f * vec::dot(w.rowsE + s * E, c.f.row(s), E);

  if (p.dalpha)
    gated_chunk_dalpha(c, w, qf, gf, vec::dot(w.adj, Cp, E * E),
                       p.dalpha + (n * p.H + h) * p.L + c.c0);
  if (p.dbeta) {  // f_s^T G_s f_s
    float* dbeta = p.dbeta + (n * p.H + h) * p.L + c.c0;
    for (int64_t s = 0; s < rows; ++s) {
      float sum = w.after[s] * w.nf[s];
      for (int64_t t = s; t < rows; ++t)
        sum += w.D[t * rows + s] * qf[t * rows + s] * gf[t * rows + s];
      dbeta[s] = sum;
    }
  }
  for (int64_t i = 0; i < rows * rows; ++i) {  // D is zero above the diagonal: the mask
    qf[i] *= w.D[i];
    gf[i] *= w.D[i];
  }

  // df_s = beta_s (sum_t D[t][s] ((q_t . f_s) dout_t + (dout_t . f_s) q_t)
  //                + after_s (A + A^T) f_s).
  for (int64_t s = 0; s < rows; ++s)
    for (int64_t j = 0; j < E; ++j) df[s * ldf + j] = w.after[s] * w.rowsE[s * E + j];
  sgemm(true, false, rows, E, rows, 1.f, qf, rows, g.data, g.ld, 1.f, df, ldf);
  sgemm(true, false, rows, E, rows, 1.f, gf, rows, c.q.data, c.q.ld, 1.f, df, ldf);
  for (int64_t s = 0; s < rows; ++s) vec::scale(df + s * ldf, E, w.beta[s]);

  // dq_t, part 2: sum_{s<=t} D[t][s] beta_s (dout_t . f_s) f_s.
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t s = 0; s < rows; ++s) gf[t * rows + s] *= w.beta[s];
  sgemm(false, false, rows, E, rows, 1.f, gf, rows, c.f.data, c.f.ld, 1.f, dq, ldq);

  // A <- dL/dC_{c0-1} = prod(alpha) A + sum_t decay_t dout_t q_t^T.
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < E; ++j) w.rowsE[t * E + j] = w.decay[t] * c.q.row(t)[j];
  sgemm(true, false, E, E, rows, 1.f, g.data, g.ld, w.rowsE, E, w.decay[rows - 1], w.adj, E);
}

/// Causal, checkpoints: one forward sweep stores C_{c0-1} for every chunk, then
/// the chunks run backwards from there.
void gated_checkpoint_backward(const GatedLinearAttentionBackwardParams& p, int64_t n, int64_t h,
                               const GatedScratch& w) {
  const int64_t E = p.E, C = gated_chunk(p), chunks = ceil_div(p.L, C);
  std::fill(w.checkpoints, w.checkpoints + E * E, 0.f);
  for (int64_t ci = 0; ci + 1 < chunks; ++ci) {
    float* next = w.checkpoints + (ci + 1) * E * E;
    std::memcpy(next, w.checkpoints + ci * E * E, E * E * sizeof(float));
    advance_state(p, load_chunk(p, n, h, ci * C, w), w, next);
  }
  std::fill(w.adj, w.adj + E * E, 0.f);
  for (int64_t ci = chunks - 1; ci >= 0; --ci)
    gated_causal_chunk_backward(p, n, h, load_chunk(p, n, h, ci * C, w), w.checkpoints + ci * E * E,
                                w);
}

/// Causal, the seed's reverse recomputation: from C_{L-1}, step by step
/// backwards, C_{t-1} = (C_t - beta_t f_t f_t^T) / alpha_t. O(E^2) per step.
void gated_reverse_backward(const GatedLinearAttentionBackwardParams& p, int64_t n, int64_t h,
                            const GatedScratch& w) {
  const int64_t E = p.E;
  float* C = w.state;
  float* G = w.adj;  // alpha_{t+1} G_{t+1}, then G_t
  final_state(p, n, h, w, C);
  std::fill(G, G + E * E, 0.f);
  const Strided q = head_of(p.q, p.q_stride, n, h), f = head_of(p.f, p.f_stride, n, h);
  const Strided dout = head_of(p.dout, p.dout_stride, n, h);
  const float* alpha = p.alpha + n * p.alpha_stride[0] + h * p.alpha_stride[1];
  const float* beta = p.beta + n * p.beta_stride[0] + h * p.beta_stride[1];
  float* dq = out_head(p.dq, p.dq_stride, n, h);
  float* df = out_head(p.df, p.df_stride, n, h);
  float* Gf = w.rowsE;  // G_t f_t
  float* Gtf = w.sym;   // G_t^T f_t
  for (int64_t t = p.L - 1; t >= 0; --t) {
    const float* qt = rows_of(q, t, 1, E, w.q).data;
    const float* ft = rows_of(f, t, 1, E, w.f).data;
    const float* gt = rows_of(dout, t, 1, E, w.dout).data;
    const float at = alpha[t * p.alpha_stride[2]], bt = beta[t * p.beta_stride[2]];
    float* dqt = dq + t * p.dq_stride[2];
    float* dft = df + t * p.df_stride[2];
    std::fill(dqt, dqt + E, 0.f);
    std::fill(Gtf, Gtf + E, 0.f);
    for (int64_t i = 0; i < E; ++i) {
      float* Gi = G + i * E;
      axpy(Gi, qt, gt[i], E);          // G_t = dout_t q_t^T + alpha_{t+1} G_{t+1}
      axpy(dqt, C + i * E, gt[i], E);  // C_t^T dout_t
      Gf[i] = vec::dot(Gi, ft, E);
      axpy(Gtf, Gi, ft[i], E);
    }
    if (p.dbeta) p.dbeta[(n * p.H + h) * p.L + t] = vec::dot(ft, Gf, E);
    for (int64_t j = 0; j < E; ++j) dft[j] = bt * (Gf[j] + Gtf[j]);
    if (t == 0) {  // C_{-1} = 0 is known: no inversion, and dalpha_0 = <G_0, 0>
      if (p.dalpha) p.dalpha[(n * p.H + h) * p.L] = 0.f;
      break;
    }
    for (int64_t i = 0; i < E; ++i)
      for (int64_t j = 0; j < E; ++j) C[i * E + j] = (C[i * E + j] - bt * ft[i] * ft[j]) / at;
    if (p.dalpha) p.dalpha[(n * p.H + h) * p.L + t] = vec::dot(G, C, E * E);
    vec::scale(G, E * E, at);
  }
}

void gated_backward_head(const GatedLinearAttentionBackwardParams& p, int64_t n, int64_t h,
                         const GatedScratch& w) {
  if (!p.causal)
    gated_noncausal_backward(p, n, h, w);
  else if (p.method == GatedBackwardMethod::checkpoints)
    gated_checkpoint_backward(p, n, h, w);
  else
    gated_reverse_backward(p, n, h, w);
}

}  // namespace

// ---------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------

void linear_attention_forward(const LinearAttentionParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return;
  parallel_heads(
      p.N * p.H, [&](Slicer& s) { return LinearScratch(p, /*backward=*/false, s); },
      [&](int64_t nh, const LinearScratch& w) { linear_forward_head(p, nh / p.H, nh % p.H, w); });
}

void linear_attention_backward(const LinearAttentionBackwardParams& p) {
  if (p.N == 0 || p.H == 0) return;
  parallel_heads(
      p.N * p.H, [&](Slicer& s) { return LinearScratch(p, /*backward=*/true, s); },
      [&](int64_t nh, const LinearScratch& w) { linear_backward_head(p, nh / p.H, nh % p.H, w); });
}

void gated_linear_attention_forward(const GatedLinearAttentionParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return;
  parallel_heads(
      p.N * p.H,
      [&](Slicer& s) {
        return GatedScratch(p, /*backward=*/false, GatedBackwardMethod::checkpoints, s);
      },
      [&](int64_t nh, const GatedScratch& w) { gated_forward_head(p, nh / p.H, nh % p.H, w); });
}

void gated_linear_attention_backward(const GatedLinearAttentionBackwardParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return;
  parallel_heads(
      p.N * p.H, [&](Slicer& s) { return GatedScratch(p, /*backward=*/true, p.method, s); },
      [&](int64_t nh, const GatedScratch& w) { gated_backward_head(p, nh / p.H, nh % p.H, w); });
}

}  // namespace attnkit::kernels
