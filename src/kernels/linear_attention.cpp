#include "kernels/linear_attention.h"

#include <algorithm>
#include <cstring>

#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/rotary.h"
#include "kernels/common/strided.h"
#include "kernels/common/vec.h"
#include "kernels/common/visibility.h"

ATTNKIT_KERNELS_BEGIN

namespace {

// ---------------------------------------------------------------------------
// Feature maps
// ---------------------------------------------------------------------------

/// out[i] = elu(x[i]) + 1 = (x > 0 ? x + 1 : exp(x)) for i < n, x read with
/// stride xs, in one pass: the feature map is computed as it is packed for the
/// GEMM that reads it, instead of a copy and then the map in place (the copies
/// took as long as the exps; docs/PERFORMANCE.md, "Why the kernels' constants").
void elu_plus_one(const float* x, int64_t xs, int64_t n, float* out) {
  int64_t i = 0;
#ifdef __AVX512F__
  if (xs == 1) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i < n; i += 16) {
      const __mmask16 lanes = vec::tail_mask(std::min<int64_t>(16, n - i));
      const __m512 v = _mm512_maskz_loadu_ps(lanes, x + i);
      const __mmask16 positive = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ);
      // exp on every lane keeps NaN (not > 0) as NaN, as the scalar form does.
      const __m512 f = _mm512_mask_add_ps(vec::exp16(v), positive, v, one);
      _mm512_mask_storeu_ps(out + i, lanes, f);
    }
    return;
  }
#elif ATTNKIT_AVX2
  if (xs == 1) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i < n; i += 8) {
      const __m256i lanes = vec::tail_mask8(std::min<int64_t>(8, n - i));
      const __m256 v = _mm256_maskload_ps(x + i, lanes);
      const __m256 positive = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GT_OQ);
      // exp on every lane keeps NaN (not > 0) as NaN, as the scalar form does.
      const __m256 f = _mm256_blendv_ps(vec::exp8(v), _mm256_add_ps(v, one), positive);
      _mm256_maskstore_ps(out + i, lanes, f);
    }
    return;
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i * xs];
    out[i] = v > 0.f ? v + 1.f : vec::exp(v);
  }
}

/// phi(rows [r0, r0 + rows) of x) as Rows: x itself for the identity when
/// sgemm can read it in place, else computed into `pack` (rows x cols).
Rows feature_rows(FeatureMapKind map, const Strided& x, int64_t r0, int64_t rows, int64_t cols,
                  float* pack) {
  if (map == FeatureMapKind::identity) return rows_of(x, r0, rows, cols, pack);
  for (int64_t r = 0; r < rows; ++r) elu_plus_one(x.row(r0 + r), x.cs, cols, pack + r * cols);
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
    if (x.cs == 1)  // branch-free, so that the compiler vectorises it
      for (int64_t c = 0; c < cols; ++c) gr[c] *= xr[c] > 0.f ? 1.f : pr[c];
    else
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

/// Keys per block (and queries per chunk) without causal masking, where
/// nothing is masked and a block only bounds the scratch: larger blocks make
/// larger GEMMs (E x M x block for the state, block x M x E for the output).
constexpr int64_t kNonCausalBlock = 1024;

/// Keys per block of p: kKeyBlock when causal, else kNonCausalBlock.
int64_t key_block_of(const LinearAttentionParams& p) {
  return p.causal ? kKeyBlock : kNonCausalBlock;
}

/// Query i sees exactly the keys [0, visible(i)); nondecreasing in i, and by at
/// most 1 per query, so a chunk of `rows` queries has fewer than `rows` keys
/// that only some of its queries see.
Visibility visibility_of(const LinearAttentionParams& p) { return Visibility(p.L, p.S, p.causal); }

/// Queries per chunk. Non-causal queries all see every key, so nothing is
/// masked and a chunk is just a block that keeps its features in cache.
int64_t chunk_of(const LinearAttentionParams& p) {
  return p.causal ? std::max<int64_t>(p.chunk, 1) : kNonCausalBlock;
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

/// The features of rows of q or k as the products read them: phi(x) for the
/// normaliser (den) and, for the numerator (num), phi(x) rotated to each row's
/// position with rotary positions, else the same rows.
struct FeatureRows {
  Rows num, den;
};

/// Computes features and, with rotary positions, turns them: query i to
/// position i + S - L, key j to position j (the causal mask's alignment, as
/// the exact kernel's; decoding needs no offset). One per call, read-only,
/// shared by the threads: its table covers positions [min(0, S - L), S).
class FeatureReader {
 public:
  explicit FeatureReader(const LinearAttentionParams& p)
      : p_(p), rotary_(RotaryTable::for_attention(p.rotary_dim, p.rotary_base, p.L, p.S)) {}

  bool rotates() const { return rotary_.active(); }

  /// Rows [i0, i0 + rows) of queries x: phi into `pack` (when not readable in
  /// place), rotated into `turned`.
  FeatureRows queries(const Strided& x, int64_t i0, int64_t rows, float* pack, float* turned) const {
    return features(x, i0, rows, query_position(i0), pack, turned);
  }
  FeatureRows keys(const Strided& x, int64_t j0, int64_t rows, float* pack, float* turned) const {
    return features(x, j0, rows, j0, pack, turned);
  }

  /// Gradients of rotated query (key) features, rows [i0, i0 + rows) at g
  /// (row stride ld), rotated back in place: those of the unrotated ones.
  void unrotate_queries(float* g, int64_t ld, int64_t i0, int64_t rows) const {
    if (rotates()) rotary_.unrotate_rows(g, rows, ld, p_.E, query_position(i0));
  }
  void unrotate_keys(float* g, int64_t ld, int64_t j0, int64_t rows) const {
    if (rotates()) rotary_.unrotate_rows(g, rows, ld, p_.E, j0);
  }

 private:
  int64_t query_position(int64_t i) const { return i + p_.S - p_.L; }

  FeatureRows features(const Strided& x, int64_t r0, int64_t rows, int64_t position0, float* pack,
                       float* turned) const {
    const Rows f = feature_rows(p_.feature_map, x, r0, rows, p_.E, pack);
    if (!rotates()) return {f, f};
    return {rotary_.rotated_rows(Strided{f.data, f.ld, 1}, 0, rows, p_.E, position0, turned), f};
  }

  const LinearAttentionParams& p_;
  RotaryTable rotary_;
};

struct LinearScratch {
  float *fq, *fq_turned;  // phi of a chunk of queries (chunk x E), and rotated (rotary)
  float *fk, *fk_turned;  // phi of a block of keys (block x E), and rotated (rotary)
  float* v;               // a block of v, packed when its strides need it: block x M
  float* dout;            // backward: a chunk of dout, packed when its strides need it
  float *du, *dden;       // backward with normaliser: dU (chunk x M) and dden (chunk) of a chunk
  float *state, *z;       // running S (E x M) and z (E); backward pass 2: R and r
  float* block;           // the masked block of a causal chunk: chunk x chunk
  float* dk_den;          // backward, rotary and normaliser: a key group's normaliser
                          // gradients, added after the numerator's are turned back (chunk x E)

  LinearScratch(const LinearAttentionParams& p, bool backward, Slicer& s) {
    const int64_t C = std::min(chunk_of(p), std::max<int64_t>(p.L, 1));
    // Key blocks (at most S keys) and masked blocks (fewer than C keys).
    const int64_t K = std::max(std::min(key_block_of(p), std::max<int64_t>(p.S, 1)), C);
    const bool normalize_backward = backward && p.normalize;
    const bool rotary = p.rotary_dim > 0;
    fq = s.take(C * p.E);
    fq_turned = s.take(rotary ? C * p.E : 0);
    fk = s.take(K * p.E);
    fk_turned = s.take(rotary ? K * p.E : 0);
    v = s.take(K * p.M);
    dout = s.take(backward ? C * p.M : 0);
    du = s.take(normalize_backward ? C * p.M : 0);
    dden = s.take(normalize_backward ? C : 0);
    state = s.take(p.E * p.M);
    z = s.take(p.E);
    block = s.take(p.causal ? C * C : 0);
    dk_den = s.take(normalize_backward && rotary ? C * p.E : 0);
  }
};

/// A key/value head and the query heads that read it (grouped-query heads:
/// kv_group of them; else one).
struct Group {
  int64_t n, first;  // batch; first query head: first + g for g < p.kv_group
  Strided k, v;
};

Group group_inputs(const LinearAttentionParams& p, int64_t n, int64_t kv_head) {
  return {n, kv_head * p.kv_group, head_matrix(p.k, p.k_stride, n, kv_head),
          head_matrix(p.v, p.v_stride, n, kv_head)};
}

Strided query_head(const LinearAttentionParams& p, int64_t n, int64_t h) {
  return head_matrix(p.q, p.q_stride, n, h);
}

/// Features and v of keys [j0, j0 + rows), rows <= the scratch's block size:
/// fk as the numerator reads them, gk as the normaliser does.
struct KeyRows {
  Rows fk, gk, v;
};

KeyRows key_rows(const LinearAttentionParams& p, const FeatureReader& in, const Group& x, int64_t j0,
                 int64_t rows, const LinearScratch& w) {
  const FeatureRows f = in.keys(x.k, j0, rows, w.fk, w.fk_turned);
  return {f.num, f.den, rows_of(x.v, j0, rows, p.M, w.v)};
}

/// Adds keys [from, to) to the running state: S += phi(K)^T V, z += sum phi(k)
/// (S of the rotated features with rotary positions, z of the unrotated).
void absorb_keys(const LinearAttentionParams& p, const FeatureReader& in, const Group& x, int64_t from,
                 int64_t to, const LinearScratch& w) {
  const int64_t block = key_block_of(p);
  for (int64_t j0 = from; j0 < to; j0 += block) {
    const int64_t rows = std::min(block, to - j0);
    const KeyRows kr = key_rows(p, in, x, j0, rows, w);
    sgemm(true, false, p.E, p.M, rows, 1.f, kr.fk.data, kr.fk.ld, kr.v.data, kr.v.ld, 1.f, w.state,
          p.M);
    if (p.normalize)
      for (int64_t s = 0; s < rows; ++s) vec::add(w.z, kr.gk.row(s), p.E);
  }
}

/// block = masked fq fk^T: rows x width, for query features fq and key
/// features fk of the chunk's masked keys.
void masked_scores(const LinearAttentionParams& p, const Visibility& visible, const QueryChunk& c,
                   const Rows& fq, const Rows& fk, float* block) {
  sgemm(false, true, c.rows, c.width(), p.E, 1.f, fq.data, fq.ld, fk.data, fk.ld, 0.f, block,
        c.width());
  mask_block(visible, c, block);
}

/// block = masked (dU_chunk V_block^T + dden), dden left out when null (no
/// normaliser, or one whose scores are not these: rotary positions): rows
/// x width. Its entry (r, c) is d loss / d (phi(q_r) . phi(k_c)) for a visible
/// pair (of the numerator's features alone without dden).
void masked_score_grads(const LinearAttentionParams& p, const Visibility& visible,
                        const QueryChunk& c, const Rows& du, const float* dden, const Rows& v,
                        float* block) {
  const int64_t width = c.width();
  sgemm(false, true, c.rows, width, p.M, 1.f, du.data, du.ld, v.data, v.ld, 0.f, block, width);
  if (dden)
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t j = 0; j < width; ++j) block[r * width + j] += dden[r];
  mask_block(visible, c, block);
}

/// block = masked dden (each row r: dden[r]): the gradients of the normaliser's
/// scores phi(q_r) . phi(k_c), when they are not the numerator's (rotary).
void masked_normaliser_grads(const Visibility& visible, const QueryChunk& c, const float* dden,
                             float* block) {
  const int64_t width = c.width();
  for (int64_t r = 0; r < c.rows; ++r) std::fill(block + r * width, block + (r + 1) * width, dden[r]);
  mask_block(visible, c, block);
}

/// Runs body(chunk, masked keys) for the query chunks in order, with w.state,
/// w.z holding S, z summed over the keys every query of the chunk sees (its
/// all_see prefix), and the features of the keys only some of them see.
template <typename Body>
void prefix_sweep(const LinearAttentionParams& p, const FeatureReader& in, const Visibility& visible,
                  const Group& x, const LinearScratch& w, Body body) {
  std::fill(w.state, w.state + p.E * p.M, 0.f);
  std::fill(w.z, w.z + p.E, 0.f);
  int64_t absorbed = 0;
  for (int64_t i0 = 0; i0 < p.L; i0 += chunk_of(p)) {
    const QueryChunk c = query_chunk(visible, i0, chunk_of(p), p.L);
    absorb_keys(p, in, x, absorbed, c.all_see, w);
    absorbed = c.all_see;
    body(c, c.width() > 0 ? key_rows(p, in, x, c.all_see, c.width(), w) : KeyRows{});
  }
}

// ---------------------------------------------------------------------------
// Linear attention forward
// ---------------------------------------------------------------------------

/// Query head h's output over chunk c, from the state and the masked keys kb.
void forward_chunk(const LinearAttentionParams& p, const FeatureReader& in, const Visibility& visible,
                   int64_t n, int64_t h, const QueryChunk& c, const KeyRows& kb, const LinearScratch& w) {
  const int64_t E = p.E, M = p.M, i0 = c.i0, width = c.width();
  const FeatureRows fq = in.queries(query_head(p, n, h), i0, c.rows, w.fq, w.fq_turned);
  const int64_t ldo = p.out_stride[2];
  float* o = head_of(p.out, p.out_stride, n, h) + i0 * ldo;
  sgemm(false, false, c.rows, M, E, 1.f, fq.num.data, fq.num.ld, w.state, M, 0.f, o, ldo);
  if (width > 0) {
    masked_scores(p, visible, c, fq.num, kb.fk, w.block);
    sgemm(false, false, c.rows, M, width, 1.f, w.block, width, kb.v.data, kb.v.ld, 1.f, o, ldo);
  }
  if (!p.normalize) return;
  // The normaliser's scores are the numerator's unless those are rotated.
  if (width > 0 && in.rotates()) masked_scores(p, visible, c, fq.den, kb.gk, w.block);
  float* den = p.den + (n * p.H + h) * p.L;
  for (int64_t r = 0; r < c.rows; ++r) {
    float d = vec::dot(fq.den.row(r), w.z, E) + p.eps;
    for (int64_t j = 0; j < width; ++j) d += w.block[r * width + j];
    den[i0 + r] = d;
    // A query that sees no key has a zero numerator: out = 0 even for eps = 0.
    vec::scale(o + r * ldo, M, visible(i0 + r) > 0 ? 1.f / d : 0.f);
  }
}

void linear_forward_group(const LinearAttentionParams& p, const FeatureReader& in, const Group& x,
                          const LinearScratch& w) {
  const Visibility visible = visibility_of(p);
  prefix_sweep(p, in, visible, x, w, [&](const QueryChunk& c, const KeyRows& kb) {
    for (int64_t h = x.first; h < x.first + p.kv_group; ++h) forward_chunk(p, in, visible, x.n, h, c, kb, w);
  });
}

// ---------------------------------------------------------------------------
// Linear attention backward
//
// With o_l = u_l / den_l: dU_l = g_l / den_l and dden_l = -(g_l . o_l) / den_l,
// and everything is the unnormalised attention with values [v, 1] and output
// gradients [dU, dden] (docs/MATH.md, Linear attention):
//   dphi(q_l) = S_l dU_l + z_l dden_l          pass 1, forwards (S_l, z_l prefixes)
//   dphi(k_s) = R_s v_s + r_s,  dv_s = R_s^T phi(k_s)   pass 2, backwards
// with R_s = sum_{l sees s} phi(q_l) dU_l^T and r_s = sum_{l sees s} phi(q_l) dden_l
// (summed over the group's query heads too with grouped heads).
// With rotary positions S, R and the numerator's terms are of the rotated
// features: their gradients are turned back before the normaliser's (z, r,
// of the unrotated features) are added.
// Both passes recompute the chunk's features and dU, dden instead of storing them.
// ---------------------------------------------------------------------------

/// dU and dden of the chunk's queries of head (n, h) (normalize: into
/// scratch, dden in w.dden), or its rows of dout as dU.
Rows output_grads(const LinearAttentionBackwardParams& p, int64_t n, int64_t h,
                  const Visibility& visible, const QueryChunk& c, const LinearScratch& w) {
  const Rows g = rows_of(head_matrix(p.dout, p.dout_stride, n, h), c.i0, c.rows, p.M, w.dout);
  if (!p.normalize) return g;
  const float* out = head_of(p.out, p.out_stride, n, h) + c.i0 * p.out_stride[2];
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

/// Pass 1 for query head h over chunk c: its rows of dq, from the prefix
/// state and the masked keys kb.
void query_chunk_grads(const LinearAttentionBackwardParams& p, const FeatureReader& in,
                       const Visibility& visible, int64_t n, int64_t h, const QueryChunk& c,
                       const KeyRows& kb, const LinearScratch& w) {
  const int64_t E = p.E, M = p.M, i0 = c.i0, width = c.width();
  const int64_t ldq = p.dq_stride[2];
  float* dqc = head_of(p.dq, p.dq_stride, n, h) + i0 * ldq;
  const Rows du = output_grads(p, n, h, visible, c, w);
  sgemm(false, true, c.rows, E, M, 1.f, du.data, du.ld, w.state, M, 0.f, dqc, ldq);
  if (!in.rotates()) {
    if (p.normalize)
      for (int64_t r = 0; r < c.rows; ++r) vec::axpy(dqc + r * ldq, w.dden[r], w.z, E);
    if (width > 0) {
      masked_score_grads(p, visible, c, du, p.normalize ? w.dden : nullptr, kb.v, w.block);
      sgemm(false, false, c.rows, E, width, 1.f, w.block, width, kb.fk.data, kb.fk.ld, 1.f, dqc, ldq);
    }
  } else {
    if (width > 0) {
      masked_score_grads(p, visible, c, du, nullptr, kb.v, w.block);
      sgemm(false, false, c.rows, E, width, 1.f, w.block, width, kb.fk.data, kb.fk.ld, 1.f, dqc, ldq);
    }
    in.unrotate_queries(dqc, ldq, i0, c.rows);
    if (p.normalize) {
      for (int64_t r = 0; r < c.rows; ++r) vec::axpy(dqc + r * ldq, w.dden[r], w.z, E);
      if (width > 0) {
        masked_normaliser_grads(visible, c, w.dden, w.block);
        sgemm(false, false, c.rows, E, width, 1.f, w.block, width, kb.gk.data, kb.gk.ld, 1.f, dqc, ldq);
      }
    }
  }
  if (p.feature_map != FeatureMapKind::identity) {
    const Strided q = query_head(p, n, h);
    const Rows fq = feature_rows(p.feature_map, q, i0, c.rows, E, w.fq);
    times_feature_grad(p.feature_map, q, i0, c.rows, E, fq.data, fq.ld, dqc, ldq);
  }
}

/// Pass 1: dq, chunk by chunk, rebuilding the prefix state S, z once for the group.
void query_grads(const LinearAttentionBackwardParams& p, const FeatureReader& in,
                 const Visibility& visible, const Group& x, const LinearScratch& w) {
  prefix_sweep(p, in, visible, x, w, [&](const QueryChunk& c, const KeyRows& kb) {
    for (int64_t h = x.first; h < x.first + p.kv_group; ++h)
      query_chunk_grads(p, in, visible, x.n, h, c, kb, w);
  });
}

/// Pass 2: dk, dv of the group's key/value head, chunks backwards with R, r =
/// sums over the later chunks' queries of every query head of the group.
/// Chunk c's key group [all_see_c, all_see_{c+1}) (at most a chunk of keys) is
/// seen by all later queries, by some of chunk c's (its masked block, the
/// group's first keys) and by no earlier one.
void key_grads(const LinearAttentionBackwardParams& p, const FeatureReader& in,
               const Visibility& visible, const Group& x, const LinearScratch& w) {
  const int64_t E = p.E, M = p.M, chunk = chunk_of(p);
  const int64_t kv = x.first / p.kv_group;
  float* dk = head_of(p.dk, p.dk_stride, x.n, kv);
  float* dv = head_of(p.dv, p.dv_stride, x.n, kv);
  const int64_t ldk = p.dk_stride[2], ldv = p.dv_stride[2];
  const bool rotates = in.rotates();
  float* R = w.state;
  float* r = w.z;
  std::fill(R, R + E * M, 0.f);
  std::fill(r, r + E, 0.f);
  // Keys [j0, j0 + rows) seen by exactly the queries already in R, r. With
  // rotary positions dk is left in the rotated frame, without r.
  const auto from_later = [&](const KeyRows& kr, int64_t j0, int64_t rows) {
    sgemm(false, true, rows, E, M, 1.f, kr.v.data, kr.v.ld, R, M, 0.f, dk + j0 * ldk, ldk);
    if (p.normalize && !rotates)
      for (int64_t s = j0; s < j0 + rows; ++s) vec::add(dk + s * ldk, r, E);
    sgemm(false, false, rows, M, E, 1.f, kr.fk.data, kr.fk.ld, R, M, 0.f, dv + j0 * ldv, ldv);
  };
  const int64_t chunks = ceil_div(p.L, chunk);
  const int64_t seen_by_last = p.L > 0 ? visible(p.L - 1) : 0;  // later keys: seen by nobody
  for (int64_t ci = chunks - 1; ci >= 0; --ci) {
    const QueryChunk c = query_chunk(visible, ci * chunk, chunk, p.L);
    const int64_t g0 = c.all_see, width = c.width();
    const int64_t group = (ci + 1 < chunks ? visible(c.i0 + chunk) : seen_by_last) - g0;
    const KeyRows kg = key_rows(p, in, x, g0, group, w);
    from_later(kg, g0, group);
    // Rotary: the normaliser's part of the group's dk, r of the later queries
    // and the masked block's, added once the numerator's is turned back.
    if (rotates && p.normalize)
      for (int64_t s = 0; s < group; ++s) std::copy(r, r + E, w.dk_den + s * E);
    for (int64_t h = x.first; h < x.first + p.kv_group; ++h) {
      const FeatureRows fq = in.queries(query_head(p, x.n, h), c.i0, c.rows, w.fq, w.fq_turned);
      const Rows du = output_grads(p, x.n, h, visible, c, w);
      if (width > 0) {
        masked_scores(p, visible, c, fq.num, kg.fk, w.block);
        sgemm(true, false, width, M, c.rows, 1.f, w.block, width, du.data, du.ld, 1.f, dv + g0 * ldv,
              ldv);
        // With rotary positions the normaliser's scores are not these: its dden apart.
        masked_score_grads(p, visible, c, du, p.normalize && !rotates ? w.dden : nullptr, kg.v, w.block);
        sgemm(true, false, width, E, c.rows, 1.f, w.block, width, fq.num.data, fq.num.ld, 1.f,
              dk + g0 * ldk, ldk);
        if (rotates && p.normalize) {
          masked_normaliser_grads(visible, c, w.dden, w.block);
          sgemm(true, false, width, E, c.rows, 1.f, w.block, width, fq.den.data, fq.den.ld, 1.f, w.dk_den,
                E);
        }
      }
      sgemm(true, false, E, M, c.rows, 1.f, fq.num.data, fq.num.ld, du.data, du.ld, 1.f, R, M);
      if (p.normalize)
        for (int64_t l = 0; l < c.rows; ++l) vec::axpy(r, w.dden[l], fq.den.row(l), E);
    }
    in.unrotate_keys(dk + g0 * ldk, ldk, g0, group);
    if (rotates && p.normalize)
      for (int64_t s = 0; s < group; ++s) vec::add(dk + (g0 + s) * ldk, w.dk_den + s * E, E);
    times_feature_grad(p.feature_map, x.k, g0, group, E, kg.gk.data, kg.gk.ld, dk + g0 * ldk, ldk);
  }
  // Keys seen by every query, a block at a time.
  const int64_t seen_by_all = p.L > 0 ? visible(0) : 0;
  for (int64_t j0 = 0; j0 < seen_by_all; j0 += key_block_of(p)) {
    const int64_t rows = std::min(key_block_of(p), seen_by_all - j0);
    const KeyRows kr = key_rows(p, in, x, j0, rows, w);
    from_later(kr, j0, rows);
    in.unrotate_keys(dk + j0 * ldk, ldk, j0, rows);
    if (rotates && p.normalize)
      for (int64_t s = j0; s < j0 + rows; ++s) vec::add(dk + s * ldk, r, E);
    times_feature_grad(p.feature_map, x.k, j0, rows, E, kr.gk.data, kr.gk.ld, dk + j0 * ldk, ldk);
  }
  store_zeros(p.S - seen_by_last, E, dk + seen_by_last * ldk, ldk, 1);
  store_zeros(p.S - seen_by_last, M, dv + seen_by_last * ldv, ldv, 1);
}

void linear_backward_group(const LinearAttentionBackwardParams& p, const FeatureReader& in,
                           const Group& x, const LinearScratch& w) {
  const Visibility visible = visibility_of(p);
  query_grads(p, in, visible, x, w);
  key_grads(p, in, visible, x, w);
}

}  // namespace

// ---------------------------------------------------------------------------
// Entry points: one work item per (batch, key/value head)
// ---------------------------------------------------------------------------

void linear_attention_forward(const LinearAttentionParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return;
  const FeatureReader in(p);
  const int64_t heads = p.H / p.kv_group;
  parallel_for_scratch(
      p.N * heads, [&](Slicer& s) { return LinearScratch(p, /*backward=*/false, s); },
      [&](int64_t item, const LinearScratch& w) {
        linear_forward_group(p, in, group_inputs(p, item / heads, item % heads), w);
      });
}

void linear_attention_backward(const LinearAttentionBackwardParams& p) {
  if (p.N == 0 || p.H == 0) return;
  const FeatureReader in(p);
  const int64_t heads = p.H / p.kv_group;
  parallel_for_scratch(
      p.N * heads, [&](Slicer& s) { return LinearScratch(p, /*backward=*/true, s); },
      [&](int64_t item, const LinearScratch& w) {
        linear_backward_group(p, in, group_inputs(p, item / heads, item % heads), w);
      });
}

ATTNKIT_KERNELS_END
