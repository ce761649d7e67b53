// Linear attention (see docs/MATH.md, Linear attention) over pointers, sizes
// and strides, forward and backward, float32. Torch-free.
//
// Feature-map form ("Transformers are RNNs", Katharopoulos et al.; with
// phi = identity it is the plain C q form):
//   out_l = phi(q_l)^T S_l / (phi(q_l) . z_l + eps)   (the division when normalize)
//   S_l = sum_{s visible to l} phi(k_s) v_s^T,  z_l = sum_{s visible to l} phi(k_s)
// Query l sees every key, or when causal the keys s <= l + S - L (bottom-right
// aligned; docs/MATH.md, Masks and visibility); a query that sees no key
// outputs zeros and gets zero gradients.
// Computed in chunks of queries: across chunks a running state (S, z), inside a
// chunk a masked chunk x chunk product; non-causal is the unmasked case. The
// backward pass stores no per-step state: pass 1 rebuilds S for dq, pass 2 runs
// backwards accumulating R = sum phi(q) dU^T for dk, dv.
//
// Conventions of both passes: input strides are in elements, one per
// dimension in the order the shape is given, any values (a (N, L, H, E) tensor
// viewed as (N, H, L, E) costs no copy). Output matrices may have any row
// strides but need a unit last stride, so that GEMMs write them in place.
// Grouped-query heads (QkvParams::kv_group > 1): k and v have H / kv_group
// heads, query head h reads kv head kv_head(h). Work is per key/value head:
// its state S (and z) is built once and read by every query head of its
// group, and its dk, dv are computed once from R summed over the group's
// query heads (in head order) rather than per query head and then added.
//
// Rotary positions (rotary_dim > 0; RoFormer's linear form, Su et al.,
// section 3.4.4): the numerator reads phi(q_i) rotated to position i + S - L
// and phi(k_j) rotated to position j (kernels/common/rotary.h, the exact
// kernel's alignment), the normaliser reads them unrotated:
//   out_i = sum_j (R_i phi(q_i))^T (R_j phi(k_j)) v_j / (phi(q_i) . sum_j phi(k_j) + eps).
//
// Threads: num_threads() over (batch, key/value head); each is computed by one
// thread in a fixed order, so results are bitwise the same for any thread count.
#pragma once

#include <cstdint>

#include "kernels/common/params.h"

namespace attnkit::kernels {

enum class FeatureMapKind { identity, elu };  // elu means elu(x) + 1

/// Queries per chunk of the causal forms. Larger chunks mean larger GEMMs but
/// more masked chunk x chunk work per token; at E = M = 64, 32 beat 64 and 128
/// forward+backward (docs/PERFORMANCE.md, "Why the kernels' constants").
constexpr int64_t kDefaultLinearChunk = 32;

/// q, k, v, out, the sizes and kv_group come from QkvParams; out needs a unit
/// last stride.
struct LinearAttentionParams : QkvParams {
  float* den = nullptr;  // (N, H, L) contiguous, when normalize: phi(q_l) . z_l + eps,
                         // written by the forward, read by the backward
  FeatureMapKind feature_map = FeatureMapKind::identity;
  bool normalize = false;
  bool causal = false;
  float eps = 1e-6f;
  int64_t chunk = kDefaultLinearChunk;  // causal only; >= 1
  int64_t rotary_dim = 0;               // 0, or even in [2, E]: rotated entries of phi(q), phi(k)
  double rotary_base = 10000.0;         // > 0
};

/// Reads q, k, v, out and den as the forward left them; writes dq, dk, dv (each
/// fully overwritten; unit last strides; dk, dv in k's and v's head count).
struct LinearAttentionBackwardParams : LinearAttentionParams, QkvGrads {};

/// Writes out (and den when normalize).
void linear_attention_forward(const LinearAttentionParams& p);
/// Writes dq, dk, dv. Scratch per thread (forward too): O(B (E + M) + E M +
/// chunk^2) with B = max(chunk, 256): features are recomputed per block, no
/// per-token state or feature of the whole sequence is stored. With rotary
/// positions, a table of max(L, S) x rotary_dim angles shared by the threads.
void linear_attention_backward(const LinearAttentionBackwardParams& p);

}  // namespace attnkit::kernels
