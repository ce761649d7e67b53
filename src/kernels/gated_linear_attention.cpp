#include "kernels/gated_linear_attention.h"

#include <algorithm>
#include <cstring>

#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/strided.h"
#include "kernels/common/vec.h"

ATTNKIT_KERNELS_BEGIN

namespace {

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
  const GatedChunk c{c0, rows, rows_of(head_matrix(p.q, p.q_stride, n, h), c0, rows, p.E, w.q),
                     rows_of(head_matrix(p.f, p.f_stride, n, h), c0, rows, p.E, w.f)};
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
  float* out = head_of(p.out, p.out_stride, n, h);
  const int64_t ldo = p.out_stride[2];
  if (!p.causal) {
    final_state(p, n, h, w, w.state);
    const Strided q = head_matrix(p.q, p.q_stride, n, h);
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
  const Strided q = head_matrix(p.q, p.q_stride, n, h), f = head_matrix(p.f, p.f_stride, n, h);
  const Strided dout = head_matrix(p.dout, p.dout_stride, n, h);
  float* dq = head_of(p.dq, p.dq_stride, n, h);
  float* df = head_of(p.df, p.df_stride, n, h);
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
  const Rows g = rows_of(head_matrix(p.dout, p.dout_stride, n, h), c.c0, rows, E, w.dout);
  float* dq = head_of(p.dq, p.dq_stride, n, h) + c.c0 * p.dq_stride[2];
  float* df = head_of(p.df, p.df_stride, n, h) + c.c0 * p.df_stride[2];
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

/// Causal, reverse recomputation (docs/MATH.md, Gated linear attention): from
/// C_{L-1}, step by step backwards, C_{t-1} = (C_t - beta_t f_t f_t^T) / alpha_t. O(E^2) per step.
void gated_reverse_backward(const GatedLinearAttentionBackwardParams& p, int64_t n, int64_t h,
                            const GatedScratch& w) {
  const int64_t E = p.E;
  float* C = w.state;
  float* G = w.adj;  // alpha_{t+1} G_{t+1}, then G_t
  final_state(p, n, h, w, C);
  std::fill(G, G + E * E, 0.f);
  const Strided q = head_matrix(p.q, p.q_stride, n, h), f = head_matrix(p.f, p.f_stride, n, h);
  const Strided dout = head_matrix(p.dout, p.dout_stride, n, h);
  const float* alpha = p.alpha + n * p.alpha_stride[0] + h * p.alpha_stride[1];
  const float* beta = p.beta + n * p.beta_stride[0] + h * p.beta_stride[1];
  float* dq = head_of(p.dq, p.dq_stride, n, h);
  float* df = head_of(p.df, p.df_stride, n, h);
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
      vec::axpy(Gi, gt[i], qt, E);          // G_t = dout_t q_t^T + alpha_{t+1} G_{t+1}
      vec::axpy(dqt, gt[i], C + i * E, E);  // C_t^T dout_t
      Gf[i] = vec::dot(Gi, ft, E);
      vec::axpy(Gtf, ft[i], Gi, E);
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

void gated_linear_attention_forward(const GatedLinearAttentionParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return;
  parallel_for_scratch(
      p.N * p.H,
      [&](Slicer& s) {
        return GatedScratch(p, /*backward=*/false, GatedBackwardMethod::checkpoints, s);
      },
      [&](int64_t nh, const GatedScratch& w) { gated_forward_head(p, nh / p.H, nh % p.H, w); });
}

void gated_linear_attention_backward(const GatedLinearAttentionBackwardParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return;
  parallel_for_scratch(
      p.N * p.H, [&](Slicer& s) { return GatedScratch(p, /*backward=*/true, p.method, s); },
      [&](int64_t nh, const GatedScratch& w) { gated_backward_head(p, nh / p.H, nh % p.H, w); });
}

ATTNKIT_KERNELS_END
