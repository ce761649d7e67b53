// Reference implementations: composite libtorch code, dtype-generic, written to
// be read next to docs/MATH.md (its sections are named below). Tests run them in
// float64 as the oracle for the fast kernels; benchmarks and the approximation
// tool use them too. The ops call them as their composite backend, for the
// inputs their kernels do not take (see each op's <op>_dispatch); modules and
// models never call them directly.
//
// Inputs are assumed valid (the ops validate); shapes follow include/attnkit/ops.h.
#pragma once

#include <attnkit/ops.h>

#include "reference/masking.h"
#include <torch/types.h>

namespace attnkit::reference {

using detail::masked_softmax;
using detail::visibility;

/// "Exact softmax attention". Also the attention matrix when `weights` is
/// non-null (after dropout, as torch's multi-head attention returns it).
/// With dropout o.dropout_seed() must be set; batch n draws the mask of batch
/// n + dropout_batch_offset (a packed batch's sequences). `lse`, when
/// non-null, gets each row's log-sum-exp (N, H, L) over its visible keys and
/// the sink (-inf for a row that sees nothing, with a zero gradient there).
torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const SoftmaxAttentionFuncOptions& o,
                                torch::Tensor* weights = nullptr, int64_t dropout_batch_offset = 0,
                                torch::Tensor* lse = nullptr);

/// "Attention dropout": the keep mask Z, bool (N, H, L, S), entry by entry
/// from the scalar definition of the draw (kernels/common/dropout.h), batch n
/// drawn as n + batch_offset.
torch::Tensor attention_dropout_keep(int64_t N, int64_t H, int64_t L, int64_t S, double p, int64_t seed,
                                     int64_t batch_offset = 0);

/// "Rotary positions": x (N, H, T, E) with row t rotated to position
/// o.offset() + t, the angles computed in x's dtype from their definition.
torch::Tensor rotary_embedding(const torch::Tensor& x, const RotaryEmbeddingFuncOptions& o);

/// torch 2.5's documented scaled_dot_product_attention (its "equivalent to"
/// code, step by step), with our rule for rows with nothing visible (zeros).
torch::Tensor scaled_dot_product_attention(const torch::Tensor& query, const torch::Tensor& key,
                                           const torch::Tensor& value,
                                           const ScaledDotProductAttentionFuncOptions& o);

/// "Linear attention": quadratic masked form when causal (obviously correct, O(L S)).
torch::Tensor linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const LinearAttentionFuncOptions& o);

/// "Gated linear attention": the recurrence step by step, C_t kept only for the current t.
torch::Tensor gated_linear_attention(const torch::Tensor& f, const torch::Tensor& q,
                                     const torch::Tensor& alpha, const torch::Tensor& beta,
                                     const GatedLinearAttentionFuncOptions& o);

/// "Agglomerative attention" on class weights: cq (N,H,L), cr (N,H,S), v (N,H,S,M).
torch::Tensor agglomerative_attention(const torch::Tensor& cq, const torch::Tensor& cr,
                                      const torch::Tensor& v, const AgglomerativeAttentionFuncOptions& o);

// --- "Clustered attention" and its improved form, in separate steps --------------

/// Planes (B, E+1) of i.i.d. N(0,1) values drawn from `seed`, float64. The same
/// seed gives the same planes everywhere (see base/random.h).
torch::Tensor hash_planes(int64_t bits, int64_t E, int64_t seed, bool hash_bias);

/// Sign bits of q (N,H,L,E) against planes (B,E+1): bool (N,H,L,B), bit b set
/// iff sum_e q_e P[b,e] > P[b,E]. Computed in q's dtype.
torch::Tensor hash_bits(const torch::Tensor& q, const torch::Tensor& planes);

/// Packs bool (..., B) bits little-endian into int64 (...) (plane 0 = bit 0).
torch::Tensor pack_bits(const torch::Tensor& bits);

/// Hamming K-means over packed hashes (N,H,L) int64. Returns labels (N,H,L)
/// int64 with -1 for padded queries (i >= query_lengths[n]).
torch::Tensor hamming_kmeans(const torch::Tensor& hashes, int64_t clusters, int64_t bits,
                             int64_t iterations, int64_t seed,
                             const torch::Tensor& query_lengths);

/// Clustered (topk = 0) or improved-clustered attention given the labels.
/// When `weights` is non-null it receives the dense (N,H,L,S) attention rows
/// that the output is the product of (At for improved, Ac broadcast for plain).
torch::Tensor clustered_attention_given_labels(const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v,
                                               const torch::Tensor& labels,
                                               int64_t clusters, int64_t topk, double scale,
                                               const torch::Tensor& key_lengths,
                                               torch::Tensor* weights = nullptr);

/// All steps: planes, hashes, K-means, attention.
torch::Tensor clustered_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const ClusteredAttentionFuncOptions& o,
                                  torch::Tensor* weights = nullptr);

// --- "Sparse attention" -----------------------------------------------------------

/// Dense boolean visibility (1 or H, L, S) of an edge list.
torch::Tensor edge_mask(const EdgeList& edges, int64_t H, int64_t L, int64_t S);

torch::Tensor sparse_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const EdgeList& edges,
                               const SparseAttentionFuncOptions& o,
                               torch::Tensor* weights = nullptr);

}  // namespace attnkit::reference
