// Clustered and improved-clustered attention (see docs/MATH.md, Clustered
// attention and Improved clustered attention) given the cluster labels: forward
// and backward over pointers, sizes and strides. Torch-free.
//
// Per head, with the queries of cluster c (label c) and count_c of them:
//   Qc_c = mean of its queries,  Ac = softmax_visible(scale Qc K^T)   (C x S)
//   plain (topk = 0):  out_i = Vc_c = Ac_c V
//   improved (topk = k' > 0): T_c = the k' keys of highest centroid score
//     (ties to the lower index; padded keys only after every visible one),
//     m_c = sum_{l in T_c} Ac_cl,  Vb_c = sum_{l not in T_c} Ac_cl V_l,
//     out_i = m_c sum_{l in T_c} softmax_{l in T_c, visible}(scale q_i . k_l) V_l + Vb_c.
// Padded queries (label -1) output 0 and get zero gradients. Gradients flow
// through the centroids (dQ_i = dQc_c / count_c), through Ac (into Qc and K)
// and through the mass m_c; labels and top keys are constants.
//
// Nothing of size L x S is ever held: per head the forward keeps O(C (k' + M) + L)
// numbers for the backward, and scratch is a C x block or block x S panel per
// thread. Every work item below is computed by one thread with fixed call
// shapes, and sums across items run in a fixed order, so results are bitwise
// the same for any thread count.
#pragma once

#include <cstdint>

#include "kernels/common/params.h"

namespace attnkit::kernels {

/// Query clustering, the first half of the op: hashes with planes drawn from
/// `seed` (hashing.h), then Hamming K-means (kmeans.h).
struct ClusterParams {
  const float* q = nullptr;  // (N, H, L, E)
  int64_t q_stride[4] = {};
  const int64_t* query_lengths = nullptr;  // (N) or nullptr
  int64_t* labels = nullptr;               // (N, H, L) contiguous, written; -1 = padded
  int64_t N = 0, H = 0, L = 0, E = 0;
  int64_t clusters = 100, bits = 63, iterations = 10, seed = 0;
  bool hash_bias = true;
};
void cluster_queries(const ClusterParams& p);

/// q, k, v, out (written by the forward; any strides) and the sizes come from
/// QkvParams. Grouped-query heads (kv_group > 1): k and v have H / kv_group
/// heads and query head h reads head kv_head(h); queries are clustered per
/// query head as always. The backward then writes dk and dv per query head,
/// (N, H, S, E) and (N, H, S, M): the caller sums each group's heads.
struct ClusteredAttentionParams : QkvParams {
  const int64_t* labels = nullptr;       // (N, H, L) contiguous, in [0, C) or -1 (padded)
  const int64_t* key_lengths = nullptr;  // (N), each in [0, S]; nullptr: all visible

  int64_t C = 0;     // clusters (those without members output nothing)
  int64_t topk = 0;  // k' in [0, S]: 0 plain clustered, > 0 improved clustered
  float scale = 1.f;

  // Written by the forward, read by the backward; contiguous.
  float* centroid_lse = nullptr;  // (N, H, C): log-sum-exp of each centroid's scores
  float* background = nullptr;    // (N, H, C, M): Vb (improved) or Vc (plain)
  // Improved only:
  int64_t* top = nullptr;         // (N, H, C, k') key indices of T_c, increasing
  float* mass = nullptr;          // (N, H, C): m_c
  float* query_lse = nullptr;     // (N, H, L): log-sum-exp over each query's top keys
};

/// The backward reads what the forward wrote and writes dq, dk, dv (fully;
/// any strides).
struct ClusteredAttentionBackwardParams : ClusteredAttentionParams, QkvGrads {};

/// Writes out and the saved state. Threads: num_threads() over (batch, head,
/// cluster block) and (batch, head, cluster).
void clustered_attention_forward(const ClusteredAttentionParams& p);

/// Writes dq, dk, dv. Threads: num_threads() over (batch, head, cluster),
/// (batch, head, cluster block) and (batch, head, key block).
void clustered_attention_backward(const ClusteredAttentionBackwardParams& p);

/// The k' = min(k, S) keys of highest score among scores[0, valid), ties to the
/// lower index, followed when valid < k' by the padded keys valid, valid + 1, ...
/// Writes them to top[0, k') in increasing key order. Scores must not be NaN.
void select_top_keys(const float* scores, int64_t valid, int64_t S, int64_t k, int64_t* top);

}  // namespace attnkit::kernels
