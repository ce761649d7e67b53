#include "kernels/clustered_attention.h"


#include <algorithm>
#include <cmath>
#include <limits>

#include "base/memory.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/strided.h"
#include "kernels/common/vec.h"
#include "kernels/common/visibility.h"

ATTNKIT_KERNELS_BEGIN

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// Centroid rows per panel (at most). A panel reads all of K and V once, so one
// panel for the usual C <= 128 reads them once per head: four panels of 25
// rows read them four times, which once K and V no longer fit in cache made
// forward+backward slower (docs/PERFORMANCE.md, "Why the kernels' constants").
constexpr int64_t kClusterBlock = 128;
constexpr int64_t kKeyBlock = 256;     // keys per panel in the backward
constexpr int64_t kMemberBlock = 128;  // member queries per sparse product

/// [0, n) cut into ceil(n / max_block) nearly equal blocks (n = 300 and
/// max_block = 128 give three blocks of 100 rather than 128, 128, 44).
class Blocks {
 public:
  Blocks(int64_t n, int64_t max_block)
      : n_(n), count_(ceil_div(n, max_block)), size_(count_ ? ceil_div(n, count_) : 0) {}
  int64_t count() const { return count_; }
  int64_t size() const { return size_; }
  int64_t begin(int64_t b) const { return std::min(n_, b * size_); }
  int64_t end(int64_t b) const { return std::min(n_, (b + 1) * size_); }

 private:
  int64_t n_, count_, size_;
};

/// Visible keys [0, valid) of batch n.
int64_t visible_keys(const ClusteredAttentionParams& p, int64_t n) {
  return key_limit(p.key_lengths, n, p.S);
}

/// Per head: the queries of each cluster (in increasing position) and the
/// centroids, the means of their members' queries (0 for empty clusters).
class Clustering {
 public:
  explicit Clustering(const ClusteredAttentionParams& p)
      : C_(p.C), L_(p.L), E_(p.E),
        offsets_(static_cast<std::size_t>(p.N * p.H * (p.C + 1))),
        index_(static_cast<std::size_t>(p.N * p.H * p.L)),
        centroids_(static_cast<std::size_t>(p.N * p.H * p.C * p.E)) {}

  /// Fills head nh = n * H + h. Called once per head, from any thread.
  void build(const ClusteredAttentionParams& p, int64_t nh) {
    const int64_t* labels = p.labels + nh * L_;
    int64_t* off = offsets_.data() + nh * (C_ + 1);
    int64_t* index = index_.data() + nh * L_;
    // Counting sort of the member queries by label.
    std::fill(off, off + C_ + 1, int64_t{0});
    for (int64_t i = 0; i < L_; ++i)
      if (labels[i] >= 0) ++off[labels[i] + 1];
    for (int64_t c = 0; c < C_; ++c) off[c + 1] += off[c];
    for (int64_t i = 0; i < L_; ++i)
      if (labels[i] >= 0) index[off[labels[i]]++] = i;  // off[c] ends at the start of c + 1
    for (int64_t c = C_; c > 0; --c) off[c] = off[c - 1];
    off[0] = 0;

    const float* q = head_of(p.q, p.q_stride, nh / p.H, nh % p.H);
    float* qc = centroids_.data() + nh * C_ * E_;
    std::fill(qc, qc + C_ * E_, 0.f);
    for (int64_t c = 0; c < C_; ++c) {
      float* row = qc + c * E_;
      for (int64_t m = off[c]; m < off[c + 1]; ++m) {
        const float* qi = q + index[m] * p.q_stride[2];
        if (p.q_stride[3] == 1) {
          vec::add(row, qi, E_);
        } else {
          for (int64_t e = 0; e < E_; ++e) row[e] += qi[e * p.q_stride[3]];
        }
      }
      if (off[c + 1] > off[c]) vec::scale(row, E_, 1.f / static_cast<float>(off[c + 1] - off[c]));
    }
  }

  const int64_t* members(int64_t nh, int64_t c) const {
    return index_.data() + nh * L_ + offsets_[nh * (C_ + 1) + c];
  }
  int64_t count(int64_t nh, int64_t c) const {
    return offsets_[nh * (C_ + 1) + c + 1] - offsets_[nh * (C_ + 1) + c];
  }
  const float* centroids(int64_t nh) const { return centroids_.data() + nh * C_ * E_; }

 private:
  int64_t C_, L_, E_;
  Buffer<int64_t> offsets_, index_;
  Buffer<float> centroids_;
};

/// The slots s of a sorted top list top[0, kv) whose keys lie in [j0, j1).
struct TopRange {
  int64_t begin, end;
};
TopRange top_in(const int64_t* top, int64_t kv, int64_t j0, int64_t j1) {
  return {std::lower_bound(top, top + kv, j0) - top, std::lower_bound(top, top + kv, j1) - top};
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

/// Centroid rows [c0, c0 + rows) of head (n, h): Ac (in `panel`), lse, the top
/// keys and mass (improved), and the background Vc or Vb.
void centroid_rows_forward(const ClusteredAttentionParams& p, const Clustering& cl,
                           const HeadRows& k, const HeadRows& v, int64_t nh, int64_t c0,
                           int64_t rows, float* panel) {
  const int64_t n = nh / p.H, h = nh % p.H, valid = visible_keys(p, n);
  const int64_t ldp = round_up16(p.S), kk = p.topk;
  sgemm(false, true, rows, valid, p.E, p.scale, cl.centroids(nh) + c0 * p.E, p.E, k.row(n, p.kv_head(h), 0),
        k.ld(), 0.f, panel, ldp);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = nh * p.C + c0 + r;
    float* a = panel + r * ldp;
    if (kk > 0) select_top_keys(a, valid, p.S, kk, p.top + c * kk);
    if (valid == 0) {  // no visible key: Ac = 0, no NaN
      p.centroid_lse[c] = -kInf;
      if (kk > 0) p.mass[c] = 0.f;
      continue;
    }
    const float max = vec::max(a, valid);
    const float sum = vec::exp_shift_sum(a, valid, max);
    p.centroid_lse[c] = max + std::log(sum);
    vec::scale(a, valid, 1.f / sum);
    if (kk > 0) {
      // The mass of the top keys, which then leave Ac: the rest is the background.
      const int64_t* top = p.top + c * kk;
      float mass = 0.f;
      for (int64_t s = 0; s < kk && top[s] < valid; ++s) {
        mass += a[top[s]];
        a[top[s]] = 0.f;
      }
      p.mass[c] = mass;
    }
  }
  sgemm(false, false, rows, p.M, valid, 1.f, panel, ldp, v.row(n, p.kv_head(h), 0), v.ld(), 0.f,
        p.background + (nh * p.C + c0) * p.M, p.M);
}

/// Outputs of the members of cluster c in head nh (improved form): per block of
/// members, scores against the top keys, softmax scaled by the mass, plus Vb.
void cluster_outputs_improved(const ClusteredAttentionParams& p, const Clustering& cl, int64_t nh,
                              int64_t c, float* w) {
  const int64_t n = nh / p.H, h = nh % p.H, E = p.E, M = p.M, kk = p.topk;
  const int64_t count = cl.count(nh, c);
  if (count == 0) return;
  const int64_t* members = cl.members(nh, c);
  const int64_t kv = std::min(kk, visible_keys(p, n));  // visible top keys: a prefix
  const float* vb = p.background + (nh * p.C + c) * M;
  const float mass = p.mass[nh * p.C + c];
  float* out = head_of(p.out, p.out_stride, n, h);
  float* query_lse = p.query_lse + nh * p.L;
  if (kv == 0) {  // no visible key at all: out = Vb = 0
    for (int64_t m = 0; m < count; ++m) {
      put_row(vb, M, out + members[m] * p.out_stride[2], p.out_stride[3]);
      query_lse[members[m]] = -kInf;
    }
    return;
  }
  float *kt = w, *vt = kt + kk * E, *qm = vt + kk * M, *s = qm + kMemberBlock * E,
        *o = s + kMemberBlock * kk;
  const int64_t* top = p.top + (nh * p.C + c) * kk;
  gather_rows(head_matrix(p.k, p.k_stride, n, p.kv_head(h)), top, kv, E, kt);
  gather_rows(head_matrix(p.v, p.v_stride, n, p.kv_head(h)), top, kv, M, vt);
  const Strided q = head_matrix(p.q, p.q_stride, n, h);
  for (int64_t r0 = 0; r0 < count; r0 += kMemberBlock) {
    const int64_t rows = std::min(kMemberBlock, count - r0);
    gather_rows(q, members + r0, rows, E, qm);
    sgemm(false, true, rows, kv, E, p.scale, qm, E, kt, E, 0.f, s, kv);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * kv;
      const float max = vec::max(sr, kv);
      const float sum = vec::exp_shift_sum(sr, kv, max);
      query_lse[members[r0 + r]] = max + std::log(sum);
      vec::scale(sr, kv, mass / sum);
    }
    sgemm(false, false, rows, M, kv, 1.f, s, kv, vt, M, 0.f, o, M);
    for (int64_t r = 0; r < rows; ++r) {
      vec::add(o + r * M, vb, M);
      put_row(o + r * M, M, out + members[r0 + r] * p.out_stride[2], p.out_stride[3]);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

/// Numbers the backward phases pass to each other, contiguous per head and cluster.
struct BackwardState {
  BackwardState(const ClusteredAttentionParams& p, int64_t heads_per_pass)
      : C(p.C), E(p.E), M(p.M), topk(p.topk),
        g(static_cast<std::size_t>(p.N * p.H * p.C * p.M)),
        dm(static_cast<std::size_t>(p.N * p.H * p.C)),
        d(static_cast<std::size_t>(p.N * p.H * p.C)),
        dkt_(static_cast<std::size_t>(heads_per_pass * p.C * p.topk * p.E)),
        dvt_(static_cast<std::size_t>(heads_per_pass * p.C * p.topk * p.M)) {}

  /// Sparse parts of dK and dV of the top keys of cluster c in head nh, slot by
  /// slot (k' x E and k' x M). Held only for the heads of the current pass
  /// [first_head, first_head + heads_per_pass): C k' (E + M) numbers per head
  /// would otherwise dominate the memory at short lengths.
  float* dkt(int64_t nh, int64_t c) { return dkt_.data() + ((nh - first_head) * C + c) * topk * E; }
  float* dvt(int64_t nh, int64_t c) { return dvt_.data() + ((nh - first_head) * C + c) * topk * M; }

  const int64_t C, E, M, topk;
  int64_t first_head = 0;
  Buffer<float> g;   // (N, H, C, M): sum of dOut over each cluster's members = dVb_c
  Buffer<float> dm;  // (N, H, C): gradient of the mass m_c (0 when plain)
  Buffer<float> d;   // (N, H, C): D_c = sum_l Ac_cl dAc_cl

 private:
  Buffer<float> dkt_, dvt_;
};

/// Sparse part of cluster c in head nh (improved): with P the members' softmax
/// over the top keys and dP = dOut V_T^T,
///   dm_c = sum_i rowsum(P * dP),  dS = m_c P (dP - rowsum(P * dP)),
///   dQ_i += scale dS K_T,  dK_T = scale dS^T Q,  dV_T = m_c P^T dOut.
void cluster_backward_sparse(const ClusteredAttentionBackwardParams& p, const Clustering& cl,
                             BackwardState& st, int64_t nh, int64_t c, float* w) {
  const int64_t n = nh / p.H, h = nh % p.H, E = p.E, M = p.M, kk = p.topk;
  const int64_t count = cl.count(nh, c), kv = std::min(kk, visible_keys(p, n));
  float* dkt = st.dkt(nh, c);
  float* dvt = st.dvt(nh, c);
  std::fill(dkt, dkt + kk * E, 0.f);
  std::fill(dvt, dvt + kk * M, 0.f);
  st.dm[nh * p.C + c] = 0.f;
  if (count == 0 || kv == 0) return;
  const int64_t* members = cl.members(nh, c);
  const int64_t* top = p.top + (nh * p.C + c) * kk;
  const float mass = p.mass[nh * p.C + c];
  const float* query_lse = p.query_lse + nh * p.L;
  float *kt = w, *vt = kt + kk * E, *qm = vt + kk * M, *gm = qm + kMemberBlock * E,
        *prob = gm + kMemberBlock * M, *ds = prob + kMemberBlock * kk, *dqm = ds + kMemberBlock * kk;
  gather_rows(head_matrix(p.k, p.k_stride, n, p.kv_head(h)), top, kv, E, kt);
  gather_rows(head_matrix(p.v, p.v_stride, n, p.kv_head(h)), top, kv, M, vt);
  const Strided q = head_matrix(p.q, p.q_stride, n, h);
  const Strided dout = head_matrix(p.dout, p.dout_stride, n, h);
  float* dq = head_of(p.dq, p.dq_stride, n, h);
  float dm = 0.f;
  for (int64_t r0 = 0; r0 < count; r0 += kMemberBlock) {
    const int64_t rows = std::min(kMemberBlock, count - r0);
    gather_rows(q, members + r0, rows, E, qm);
    gather_rows(dout, members + r0, rows, M, gm);
    sgemm(false, true, rows, kv, E, p.scale, qm, E, kt, E, 0.f, prob, kv);
    for (int64_t r = 0; r < rows; ++r) vec::exp_shift(prob + r * kv, kv, query_lse[members[r0 + r]]);
    sgemm(false, true, rows, kv, M, 1.f, gm, M, vt, M, 0.f, ds, kv);
    for (int64_t r = 0; r < rows; ++r) {
      const float rowdot = vec::dot(prob + r * kv, ds + r * kv, kv);
      dm += rowdot;
      vec::softmax_grad(ds + r * kv, prob + r * kv, kv, rowdot);
    }
    sgemm(false, false, rows, E, kv, p.scale * mass, ds, kv, kt, E, 0.f, dqm, E);
    for (int64_t r = 0; r < rows; ++r)
      add_row(dqm + r * E, 1.f, E, dq + members[r0 + r] * p.dq_stride[2], p.dq_stride[3]);
    sgemm(true, false, kv, E, rows, p.scale * mass, ds, kv, qm, E, 1.f, dkt, E);
    sgemm(true, false, kv, M, rows, mass, prob, kv, gm, M, 1.f, dvt, M);
  }
  st.dm[nh * p.C + c] = dm;
}

/// dAc over keys [j0, j0 + cols) for centroid rows [c0, c0 + rows), in place of
/// dAc = dVb V^T: a top key of c instead gets dm_c (it reaches the output
/// only through the mass).
void mark_top_gradients(const ClusteredAttentionBackwardParams& p, const BackwardState& st,
                        int64_t nh, int64_t c0, int64_t rows, int64_t j0, int64_t cols,
                        int64_t kv, float* da, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = nh * p.C + c0 + r;
    const int64_t* top = p.top + c * p.topk;
    const TopRange in = top_in(top, kv, j0, j0 + cols);
    for (int64_t s = in.begin; s < in.end; ++s) da[r * ld + top[s] - j0] = st.dm[c];
  }
}

/// dQ from the centroid attention, for centroid rows [c0, c0 + rows):
/// dQc = scale dSc K with dSc = Ac * (dAc - D), spread as dQ_i += dQc_c / count_c.
void centroid_rows_backward(const ClusteredAttentionBackwardParams& p, const Clustering& cl,
                            BackwardState& st, const HeadRows& k, const HeadRows& v,
                            int64_t nh, int64_t c0, int64_t rows, float* w) {
  const int64_t n = nh / p.H, h = nh % p.H, E = p.E, M = p.M, valid = visible_keys(p, n);
  const int64_t kv = std::min(p.topk, valid);
  const float* g = st.g.data() + (nh * p.C + c0) * M;
  const float* qc = cl.centroids(nh) + c0 * E;
  const float* lse = p.centroid_lse + nh * p.C + c0;
  for (int64_t r = 0; r < rows; ++r) {  // D_c = dVb_c . Vb_c + m_c dm_c
    const int64_t c = nh * p.C + c0 + r;
    st.d[c] = vec::dot(g + r * M, p.background + c * M, M) + (p.topk > 0 ? p.mass[c] * st.dm[c] : 0.f);
  }
  float *a = w, *da = a + kClusterBlock * kKeyBlock, *dqc = da + kClusterBlock * kKeyBlock;
  std::fill(dqc, dqc + rows * E, 0.f);
  for (int64_t j0 = 0; j0 < valid; j0 += kKeyBlock) {
    const int64_t cols = std::min(kKeyBlock, valid - j0);
    sgemm(false, true, rows, cols, E, p.scale, qc, E, k.row(n, p.kv_head(h), j0), k.ld(), 0.f, a, kKeyBlock);
    for (int64_t r = 0; r < rows; ++r) vec::exp_shift(a + r * kKeyBlock, cols, lse[r]);
    sgemm(false, true, rows, cols, M, 1.f, g, M, v.row(n, p.kv_head(h), j0), v.ld(), 0.f, da, kKeyBlock);
    if (p.topk > 0) mark_top_gradients(p, st, nh, c0, rows, j0, cols, kv, da, kKeyBlock);
    for (int64_t r = 0; r < rows; ++r)
      vec::softmax_grad(da + r * kKeyBlock, a + r * kKeyBlock, cols, st.d[nh * p.C + c0 + r]);
    sgemm(false, false, rows, E, cols, p.scale, da, kKeyBlock, k.row(n, p.kv_head(h), j0), k.ld(), 1.f, dqc, E);
  }
  float* dq = head_of(p.dq, p.dq_stride, n, h);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t count = cl.count(nh, c0 + r);
    const int64_t* members = cl.members(nh, c0 + r);
    for (int64_t m = 0; m < count; ++m)
      add_row(dqc + r * E, 1.f / static_cast<float>(count), E,
              dq + members[m] * p.dq_stride[2], p.dq_stride[3]);
  }
}

/// dK and dV of keys [j0, j0 + cols) in head nh, all clusters at once:
///   dV = Ac'^T dVb (Ac' = Ac without the top keys) + sparse parts,
///   dK = scale dSc^T Qc + sparse parts, sparse parts added in cluster order.
void key_block_backward(const ClusteredAttentionBackwardParams& p, const Clustering& cl,
                        BackwardState& st, const HeadRows& k, const HeadRows& v,
                        int64_t nh, int64_t j0, int64_t cols, float* w) {
  const int64_t n = nh / p.H, h = nh % p.H, E = p.E, M = p.M, C = p.C, kk = p.topk;
  const int64_t valid = visible_keys(p, n), kv = std::min(kk, valid);
  const int64_t seen = std::clamp<int64_t>(valid - j0, 0, cols);  // visible keys of the block
  const int64_t ld = kKeyBlock;
  float *a = w, *da = a + C * ld, *dkb = da + C * ld, *dvb = dkb + kKeyBlock * E;
  std::fill(dkb, dkb + cols * E, 0.f);
  std::fill(dvb, dvb + cols * M, 0.f);
  if (seen > 0) {
    const float* g = st.g.data() + nh * C * M;
    const float* lse = p.centroid_lse + nh * C;
    sgemm(false, true, C, seen, E, p.scale, cl.centroids(nh), E, k.row(n, p.kv_head(h), j0), k.ld(), 0.f, a, ld);
    for (int64_t c = 0; c < C; ++c) vec::exp_shift(a + c * ld, seen, lse[c]);
    sgemm(false, true, C, seen, M, 1.f, g, M, v.row(n, p.kv_head(h), j0), v.ld(), 0.f, da, ld);
    if (kk > 0) mark_top_gradients(p, st, nh, 0, C, j0, seen, kv, da, ld);
    for (int64_t c = 0; c < C; ++c) vec::softmax_grad(da + c * ld, a + c * ld, seen, st.d[nh * C + c]);
    if (kk > 0)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t* top = p.top + (nh * C + c) * kk;
        const TopRange in = top_in(top, kv, j0, j0 + seen);
        for (int64_t s = in.begin; s < in.end; ++s) a[c * ld + top[s] - j0] = 0.f;
      }
    sgemm(true, false, seen, M, C, 1.f, a, ld, g, M, 0.f, dvb, M);
    sgemm(true, false, seen, E, C, p.scale, da, ld, cl.centroids(nh), E, 0.f, dkb, E);
    if (kk > 0)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t* top = p.top + (nh * C + c) * kk;
        const TopRange in = top_in(top, kv, j0, j0 + seen);
        for (int64_t s = in.begin; s < in.end; ++s) {
          vec::add(dkb + (top[s] - j0) * E, st.dkt(nh, c) + s * E, E);
          vec::add(dvb + (top[s] - j0) * M, st.dvt(nh, c) + s * M, M);
        }
      }
  }
  float* dk = head_of(p.dk, p.dk_stride, n, h) + j0 * p.dk_stride[2];
  float* dv = head_of(p.dv, p.dv_stride, n, h) + j0 * p.dv_stride[2];
  for (int64_t r = 0; r < cols; ++r) {
    put_row(dkb + r * E, E, dk + r * p.dk_stride[2], p.dk_stride[3]);
    put_row(dvb + r * M, M, dv + r * p.dv_stride[2], p.dv_stride[3]);
  }
}

}  // namespace

void clustered_attention_forward(const ClusteredAttentionParams& p) {
  const int64_t heads = p.N * p.H, C = p.C, E = p.E, M = p.M, kk = p.topk;
  if (heads == 0) return;
  Clustering cl(p);
  const int64_t kv_heads = p.H / p.kv_group;  // k and v have these heads (grouped-query heads)
  const HeadRows k(p.k, p.k_stride, p.N, kv_heads, p.S, E), v(p.v, p.v_stride, p.N, kv_heads, p.S, M);

  // Members and centroids; padded queries output 0.
  parallel_for(heads, 0, [&](int64_t nh, float*) {
    cl.build(p, nh);
    float* out = head_of(p.out, p.out_stride, nh / p.H, nh % p.H);
    for (int64_t i = 0; i < p.L; ++i)
      if (p.labels[nh * p.L + i] < 0) zero_row(M, out + i * p.out_stride[2], p.out_stride[3]);
  });

  // Centroid attention, panels of centroid rows over all keys.
  const Blocks panels(C, kClusterBlock);
  parallel_for(heads * panels.count(), panels.size() * round_up16(p.S), [&](int64_t t, float* w) {
    const int64_t nh = t / panels.count(), b = t % panels.count();
    const int64_t c0 = panels.begin(b), rows = panels.end(b) - c0;
    if (rows > 0) centroid_rows_forward(p, cl, k, v, nh, c0, rows, w);
  });

  // Broadcast to the members: Vc (plain), or the sparse top-key product + Vb.
  const int64_t sparse_scratch =
      kk * (E + M) + kMemberBlock * (E + kk + M);
  parallel_for(heads * C, kk > 0 ? sparse_scratch : 0, [&](int64_t t, float* w) {
    const int64_t nh = t / C, c = t % C;
    if (kk > 0) {
      cluster_outputs_improved(p, cl, nh, c, w);
    } else {
      float* out = head_of(p.out, p.out_stride, nh / p.H, nh % p.H);
      const int64_t* members = cl.members(nh, c);
      for (int64_t m = 0; m < cl.count(nh, c); ++m)
        put_row(p.background + (nh * C + c) * M, M, out + members[m] * p.out_stride[2],
                p.out_stride[3]);
    }
  });
}

void clustered_attention_backward(const ClusteredAttentionBackwardParams& p) {
  const int64_t heads = p.N * p.H, C = p.C, E = p.E, M = p.M, kk = p.topk;
  if (heads == 0) return;
  Clustering cl(p);
  const int64_t kv_heads = p.H / p.kv_group;  // k and v have these heads (grouped-query heads)
  const HeadRows k(p.k, p.k_stride, p.N, kv_heads, p.S, E), v(p.v, p.v_stride, p.N, kv_heads, p.S, M);
  // The phases after the first run on passes of heads_per_pass heads, which
  // bounds the per-cluster sparse buffers (see BackwardState). Each work item
  // is the same whatever the pass, so the result does not depend on it.
  const int64_t heads_per_pass = std::min<int64_t>(heads, num_threads());
  BackwardState st(p, heads_per_pass);

  // Members, centroids, dVb_c = sum of the members' dOut; dq starts at 0.
  parallel_for(heads, 0, [&](int64_t nh, float*) {
    const int64_t n = nh / p.H, h = nh % p.H;
    cl.build(p, nh);
    float* dq = head_of(p.dq, p.dq_stride, n, h);
    for (int64_t i = 0; i < p.L; ++i) zero_row(E, dq + i * p.dq_stride[2], p.dq_stride[3]);
    const float* dout = head_of(p.dout, p.dout_stride, n, h);
    for (int64_t c = 0; c < C; ++c) {
      float* g = st.g.data() + (nh * C + c) * M;
      std::fill(g, g + M, 0.f);
      const int64_t* members = cl.members(nh, c);
      for (int64_t m = 0; m < cl.count(nh, c); ++m) {
        const float* row = dout + members[m] * p.dout_stride[2];
        for (int64_t x = 0; x < M; ++x) g[x] += row[x * p.dout_stride[3]];
      }
      if (kk == 0) st.dm[nh * C + c] = 0.f;
    }
  });

  const Blocks panels(C, kClusterBlock);
  const int64_t key_blocks = ceil_div(p.S, kKeyBlock);
  for (int64_t first = 0; first < heads; first += heads_per_pass) {
    const int64_t pass = std::min(heads_per_pass, heads - first);
    st.first_head = first;

    // Sparse top-key products (improved): dQ, dm_c and per-cluster dK_T, dV_T.
    if (kk > 0) {
      const int64_t scratch = kk * (E + M) + kMemberBlock * (2 * E + M + 2 * kk);
      parallel_for(pass * C, scratch, [&](int64_t t, float* w) {
        cluster_backward_sparse(p, cl, st, first + t / C, t % C, w);
      });
    }

    // dQ through the centroids, panels of centroid rows.
    parallel_for(pass * panels.count(), 2 * kClusterBlock * kKeyBlock + kClusterBlock * E,
                 [&](int64_t t, float* w) {
                   const int64_t nh = first + t / panels.count(), b = t % panels.count();
                   const int64_t c0 = panels.begin(b), rows = panels.end(b) - c0;
                   if (rows > 0) centroid_rows_backward(p, cl, st, k, v, nh, c0, rows, w);
                 });

    // dK and dV, blocks of keys.
    parallel_for(pass * key_blocks, 2 * C * kKeyBlock + kKeyBlock * (E + M), [&](int64_t t, float* w) {
      const int64_t nh = first + t / key_blocks, j0 = (t % key_blocks) * kKeyBlock;
      key_block_backward(p, cl, st, k, v, nh, j0, std::min(kKeyBlock, p.S - j0), w);
    });
  }
}

ATTNKIT_KERNELS_END
