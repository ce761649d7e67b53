// Linear attention (SPECS section 5) over pointers, sizes and strides, forward
// and backward, float32. Torch-free.
//
// Feature-map form (Katharopoulos et al.; the seed's C q with phi = identity):
//   out_l = phi(q_l)^T S_l / (phi(q_l) . z_l + eps)   (the division when normalize)
//   S_l = sum_{s visible to l} phi(k_s) v_s^T,  z_l = sum_{s visible to l} phi(k_s)
// Query l sees every key, or when causal the keys s <= l + S - L (bottom-right
// aligned); a query that sees no key outputs zeros and gets zero gradients.
// Computed in chunks of queries: across chunks a running state (S, z), inside a
// chunk a masked chunk x chunk product; non-causal is the unmasked case. The
// backward pass stores no per-step state: pass 1 rebuilds S for dq, pass 2 runs
// backwards accumulating R = sum phi(q) dU^T for dk, dv (SPECS section 5).
//
// Gated recurrence (seed section 4):
//   C_t = alpha_t C_{t-1} + beta_t f_t f_t^T,  C_{-1} = 0;
//   causal: out_t = C_t q_t,  otherwise out_t = C_{L-1} q_t.
// Forward in chunks (decays inside a chunk as explicit products, never ratios,
// so alpha = 0 is fine). Backward: non-causal needs no state at all (scalar
// recurrences); causal either re-runs the forward storing C at every chunk start
// (checkpoints, the default) or inverts the recurrence step by step from C_{L-1}
// as the seed proposes, C_{t-1} = (C_t - beta_t f_t f_t^T) / alpha_t, which
// drifts in float32 and fails for alpha_t = 0 (kept to measure exactly that).
//
// Conventions of every kernel here: input strides are in elements, one per
// dimension in the order the shape is given, any values (a (N, L, H, E) tensor
// viewed as (N, H, L, E) costs no copy). Output matrices may have any row
// strides but need a unit last stride, so that GEMMs write them in place.
// Threads: num_threads() over (batch, head); each head is computed by one
// thread in a fixed order, so results are bitwise the same for any thread count.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

enum class FeatureMapKind { identity, elu };  // elu means elu(x) + 1

/// Queries per chunk of the causal forms. Larger chunks mean larger GEMMs but
/// more masked chunk x chunk work per token; at E = M = 64 (H = 8, L = 4096,
/// one thread) 32 beat 64 by ~7% (linear) to ~15% (gated) forward+backward,
/// and 128 by ~40%.
constexpr int64_t kDefaultLinearChunk = 32;

struct LinearAttentionParams {
  const float* q = nullptr;  // (N, H, L, E)
  int64_t q_stride[4] = {};
  const float* k = nullptr;  // (N, H, S, E)
  int64_t k_stride[4] = {};
  const float* v = nullptr;  // (N, H, S, M)
  int64_t v_stride[4] = {};
  float* out = nullptr;  // (N, H, L, M): written by the forward, read by the backward
  int64_t out_stride[4] = {};
  float* den = nullptr;  // (N, H, L) contiguous, when normalize: phi(q_l) . z_l + eps,
                         // written by the forward, read by the backward

  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0;
  FeatureMapKind feature_map = FeatureMapKind::identity;
  bool normalize = false;
  bool causal = false;
  float eps = 1e-6f;
  int64_t chunk = kDefaultLinearChunk;  // causal only; >= 1
};

/// Reads q, k, v, out and den as the forward left them; writes dq, dk, dv (each
/// fully overwritten).
struct LinearAttentionBackwardParams : LinearAttentionParams {
  const float* dout = nullptr;  // (N, H, L, M)
  int64_t dout_stride[4] = {};
  float* dq = nullptr;  // (N, H, L, E)
  int64_t dq_stride[4] = {};
  float* dk = nullptr;  // (N, H, S, E)
  int64_t dk_stride[4] = {};
  float* dv = nullptr;  // (N, H, S, M)
  int64_t dv_stride[4] = {};
};

/// Writes out (and den when normalize).
void linear_attention_forward(const LinearAttentionParams& p);
/// Writes dq, dk, dv. Scratch per thread (forward too): O(B (E + M) + E M +
/// chunk^2) with B = max(chunk, 256): features are recomputed per block, no
/// per-token state or feature of the whole sequence is stored.
void linear_attention_backward(const LinearAttentionBackwardParams& p);

struct GatedLinearAttentionParams {
  const float* f = nullptr;  // (N, H, L, E)
  int64_t f_stride[4] = {};
  const float* q = nullptr;  // (N, H, L, E)
  int64_t q_stride[4] = {};
  const float* alpha = nullptr;  // (N, H, L)
  int64_t alpha_stride[3] = {};
  const float* beta = nullptr;  // (N, H, L)
  int64_t beta_stride[3] = {};
  float* out = nullptr;  // (N, H, L, E)
  int64_t out_stride[4] = {};

  int64_t N = 0, H = 0, L = 0, E = 0;
  bool causal = false;
  int64_t chunk = kDefaultLinearChunk;  // >= 1
};

enum class GatedBackwardMethod {
  checkpoints,       // C stored at every chunk start: O((L / chunk) E^2) scratch per head
  reverse_recompute  // the seed's inversion from C_{L-1}: O(E^2) scratch, drifts (see top)
};

/// Reads f, q, alpha, beta; writes df, dq and, when non-null, dalpha, dbeta.
struct GatedLinearAttentionBackwardParams : GatedLinearAttentionParams {
  const float* dout = nullptr;  // (N, H, L, E)
  int64_t dout_stride[4] = {};
  float* df = nullptr;  // (N, H, L, E)
  int64_t df_stride[4] = {};
  float* dq = nullptr;  // (N, H, L, E)
  int64_t dq_stride[4] = {};
  float* dalpha = nullptr;  // (N, H, L) contiguous, or nullptr when not needed
  float* dbeta = nullptr;   // (N, H, L) contiguous, or nullptr when not needed
  GatedBackwardMethod method = GatedBackwardMethod::checkpoints;  // causal only
};

/// Writes out.
void gated_linear_attention_forward(const GatedLinearAttentionParams& p);
/// Writes df, dq, dalpha, dbeta. The non-causal form needs no stored state, so
/// `method` only matters when causal.
void gated_linear_attention_backward(const GatedLinearAttentionBackwardParams& p);

}  // namespace attnkit::kernels
