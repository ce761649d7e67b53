// attnkit functional API: every attention mechanism of the library as a
// differentiable function on torch::Tensor.
//
// Layout convention (that of torch's scaled_dot_product_attention):
//   queries q (N, H, L, E), keys k (N, H, S, E), values v (N, H, S, M),
//   output (N, H, L, M).
// Masks: `causal` lets query i see key j iff j <= i + (S - L) (bottom-right
// aligned); `key_lengths` (int64, shape (N)) hides keys j >= key_lengths[n].
// A query that sees no key outputs zeros and receives zero gradients.
//
// Each function is also registered as torch.ops.attnkit.<name> with the same
// semantics; see docs/API.md for shapes, errors and complexity, and
// docs/MATH.md for every mechanism's equations, gradients and edge cases.
#pragma once

#include <attnkit/block_mask.h>
#include <attnkit/dispatch.h>
#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace attnkit {

// ----------------------------------------------------------------------------
// Exact softmax attention:  out = softmax(scale * q k^T + bias + mask) v.
// Grouped-query heads: k and v may have Hkv heads, a divisor of q's H; query
// head h then reads key and value head h / (H / Hkv), with no copy of k or v
// (multi-query: Hkv = 1).
// ----------------------------------------------------------------------------
struct SoftmaxAttentionFuncOptions {
  /// Multiplies q k^T. Unset means 1 / sqrt(E).
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// Query i sees key j iff j <= i + (S - L).
  TORCH_ARG(bool, causal) = false;
  /// int64 (N): keys j >= key_lengths[n] are invisible. Undefined = all visible.
  TORCH_ARG(torch::Tensor, key_lengths) = {};
  /// Additive score bias broadcastable to (N, H, L, S); -inf entries hide keys.
  TORCH_ARG(torch::Tensor, bias) = {};
  /// ALiBi (Press et al., 2022): floating (H), one slope per query head; the
  /// scores get -slope_h |i + S - L - j|, a penalty linear in the distance,
  /// computed inside the kernel (no L x S tensor). Query i sits at position
  /// i + S - L of the keys, the causal mask's bottom-right alignment, so one
  /// query over a decoding cache is at its end. Constants: no gradient.
  /// alibi_slopes(H) gives the paper's geometric slopes. Undefined: none.
  TORCH_ARG(torch::Tensor, alibi_slopes) = {};
  /// Rotary positions (RoPE, Su et al., 2021), applied inside the kernel as
  /// q and k are loaded: the first rotary_dim entries (even, <= E) of query i
  /// are rotated to position i + S - L and those of key j to position j (the
  /// causal mask's alignment), in the pairs (c, c + rotary_dim / 2) of
  /// rotary_embedding below. 0: none. Scores then depend on i - j alone.
  TORCH_ARG(int64_t, rotary_dim) = 0;
  /// RoPE's angles: position t times rotary_base^(-2c / rotary_dim).
  TORCH_ARG(double, rotary_base) = 10000.0;
  /// A local window (sliding-window attention): query i sees only the keys
  /// within window - 1 of its position i + S - L, before it when causal
  /// (window keys: itself and window - 1 earlier ones), on both sides
  /// otherwise (2 window - 1 keys). The kernel skips the tiles outside the
  /// band: O(L window) work. 0: no window.
  TORCH_ARG(int64_t, window) = 0;
  /// Attention dropout (the transformer's dropout on the attention weights):
  /// each weight P_ij is kept with probability 1 - dropout_p and scaled by
  /// 1 / (1 - dropout_p), or zeroed, inside the kernel:
  ///   out = ((P o Z) / (1 - dropout_p)) v,  Z_ij in {0, 1}.
  /// Z is a function of (dropout_seed, batch, head, query, key) alone
  /// (attention_dropout_mask below draws the same one): the backward
  /// regenerates it, nothing of size L x S is stored, and the result is
  /// bitwise the same for any thread count. The weights' normaliser counts
  /// every visible key (dropout comes after the softmax). In [0, 1); the
  /// probability is rounded to a multiple of 2^-16. Applied whenever it is
  /// positive, like torch's scaled_dot_product_attention: modules pass it
  /// only in training. 0: none (the kernel is then the one without dropout).
  TORCH_ARG(double, dropout_p) = 0.0;
  /// The mask's seed. Unset: drawn from torch's default CPU generator at the
  /// call (torch::manual_seed makes runs repeat); the backward reuses it.
  TORCH_ARG(c10::optional<int64_t>, dropout_seed) = c10::nullopt;
  /// A block mask (attnkit/block_mask.h) over the (L, S) grid, of batch N
  /// or 1 and heads H (query heads) or 1: it hides the pairs it does not
  /// make visible, on top of every mask above. The kernel visits only its
  /// non-empty blocks and applies nothing inside full ones, so its cost
  /// follows BlockMask::visited_fraction(). Unset: none.
  TORCH_ARG(c10::optional<BlockMask>, block_mask) = c10::nullopt;
  /// Attention sinks (as gpt-oss): floating (H), one logit per query head
  /// that joins every row's softmax without a value,
  ///   out_i = sum_j exp(s_ij - lse_i) v_j,  lse_i = log(sum_j exp(s_ij) + exp(sink_h)),
  /// so that a row can give little weight to every key. Learnable: it gets a
  /// gradient when it requires one. A row with no visible key gives 0, and
  /// lse_i = sink_h. Undefined: none.
  TORCH_ARG(torch::Tensor, sinks) = {};
  /// Soft-capping of the scores (Gemma 2): > 0 turns s = scale q k^T into
  /// softcap tanh(s / softcap), before the bias, ALiBi and the masks (the
  /// order of docs/MATH.md, "Masks and visibility"). Finite, >= 0; 0: none.
  TORCH_ARG(double, softcap) = 0.0;
};
/// ALiBi's slopes for `heads` heads: 2^(-8 h / heads), h = 1..heads, when
/// heads is a power of two; otherwise the paper's rule (those of the largest
/// power of two below, then every other slope of twice that). float32 (heads).
torch::Tensor alibi_slopes(int64_t heads);

/// Rotary positions (RoPE, Su et al., 2021) as an op of their own: x (N, H,
/// T, E) with row t rotated to position offset + t. The first dim entries
/// (even, 2 <= dim <= E) turn in the pairs (c, c + dim / 2), c < dim / 2,
/// by the angle position * base^(-2c / dim):
///   y_c = x_c cos - x_(c + dim/2) sin,  y_(c + dim/2) = x_(c + dim/2) cos + x_c sin
/// (GPT-NeoX's and LLaMA's "rotate half" pairing); entries from dim on are
/// copied. Differentiable: the gradient is the inverse rotation. float32 by a
/// kernel whose angles are bitwise those softmax_attention(rotary_dim=) uses,
/// so rotating keys once here (a decoding cache) and rotating them inside
/// the kernel give the same floats.
struct RotaryEmbeddingFuncOptions {
  /* implicit */ RotaryEmbeddingFuncOptions(int64_t dim) : dim_(dim) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(double, base) = 10000.0;
  /// Position of row 0 (any sign).
  TORCH_ARG(int64_t, offset) = 0;
};
torch::Tensor rotary_embedding(const torch::Tensor& x, const RotaryEmbeddingFuncOptions& options);
/// The keep mask Z of attention dropout (SoftmaxAttentionFuncOptions::
/// dropout_p) for N batches, H heads, L queries and S keys: bool (N, H, L, S),
/// true where a weight is kept. Entry (n, h, i, j) is the one the kernel
/// draws for batch n, head h, query i, key j with this seed (docs/MATH.md,
/// "Attention dropout"): for tests, and for reading off which weights a call
/// dropped. Costs N H L S bytes.
torch::Tensor attention_dropout_mask(int64_t N, int64_t H, int64_t L, int64_t S, double dropout_p, int64_t seed);
torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v,
                                const SoftmaxAttentionFuncOptions& options = {});
/// softmax_attention and each row's log-sum-exp lse (N, H, L), float32 (the
/// kernels' row statistic; float64 inputs give float64), both
/// differentiable: lse_i = log sum_j exp(s_ij) over the visible keys (and the
/// sink), -inf for a row that sees nothing (without sinks). With
/// merge_attention, attention over disjoint key sets combines exactly.
std::tuple<torch::Tensor, torch::Tensor> softmax_attention_with_lse(const torch::Tensor& q, const torch::Tensor& k,
                                                                    const torch::Tensor& v,
                                                                    const SoftmaxAttentionFuncOptions& options = {});
/// Attention over the union of disjoint key sets from attention over each:
/// outputs[t] (N, H, L, M) and lses[t] (N, H, L) as softmax_attention_with_lse
/// gives them; out = sum_t w_t outputs[t] with w_t = exp(lses[t] - lse) and
/// lse = log sum_t exp(lses[t]) (a row no part sees stays 0, lse -inf).
/// Differentiable in every output and lse. Returns (out, lse).
std::tuple<torch::Tensor, torch::Tensor> merge_attention(const std::vector<torch::Tensor>& outputs,
                                                         const std::vector<torch::Tensor>& lses);
/// Which backend softmax_attention runs for these arguments (validated as by
/// the op): the float32 kernel when q, k and v are float32 (with or without a
/// bias, which may require grad); for bfloat16 the kernel too, its reason
/// naming how: "bf16 on AMX tiles" (bf16 products with float32 accumulation
/// and softmax, bf16 outputs), or the float32 kernel on converted inputs with
/// the outputs rounded to bf16 (with a bias, ALiBi slopes, rotary positions, a window, dropout or grouped heads,
/// or where AMX is unavailable or ATTNKIT_BF16_GEMM=float32); else (float64, float16) the composite, with
/// the reason.
Dispatch softmax_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v,
                                    const SoftmaxAttentionFuncOptions& options = {});

// ----------------------------------------------------------------------------
// torch 2's scaled_dot_product_attention, for torch 1.13 users: the function
// documented for torch 2.5 (torch.nn.functional.scaled_dot_product_attention),
// computed by softmax_attention above. docs/API.md, "scaled_dot_product_attention".
//
//   query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hv, S, Ev)
//   -> (..., Hq, L, Ev); any rank >= 2, the batch dimensions broadcast.
// Where it differs from our own ops: `is_causal` is top-left aligned (query i
// sees key j iff j <= i), which equals our `causal` only when L == S; a
// boolean mask marks the keys that take part (True), a floating one is added
// to the scores. Our rule for a row with nothing visible holds: zeros and
// zero gradients (torch's math backend gives NaN there).
// ----------------------------------------------------------------------------
struct ScaledDotProductAttentionFuncOptions {
  /// Boolean (True: takes part) or floating (added; the query's dtype),
  /// broadcastable to (..., Hq, L, S). Undefined: none.
  TORCH_ARG(torch::Tensor, attn_mask) = {};
  /// Attention dropout in [0, 1], inside the exact kernel
  /// (SoftmaxAttentionFuncOptions::dropout_p; 1 zeroes the output), its seed
  /// drawn from torch's default CPU generator. Applied whenever positive,
  /// as torch's: pass 0.0 when not training.
  TORCH_ARG(double, dropout_p) = 0.0;
  /// Query i sees key j iff j <= i (top-left aligned); not with attn_mask.
  TORCH_ARG(bool, is_causal) = false;
  /// Multiplies q k^T. Unset means 1 / sqrt(E).
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// Query head h reads key head h / (Hq / Hk) and value head h / (Hq / Hv)
  /// (grouped-query attention); Hk and Hv must divide Hq.
  TORCH_ARG(bool, enable_gqa) = false;
};
torch::Tensor scaled_dot_product_attention(const torch::Tensor& query, const torch::Tensor& key,
                                           const torch::Tensor& value,
                                           const ScaledDotProductAttentionFuncOptions& options = {});

// ----------------------------------------------------------------------------
// Linear attention (the cheap-linear-attention paper and its feature-map
// generalisation; docs/MATH.md, "Linear attention"):
//   out_l = phi(q_l)^T S / (phi(q_l) . z + eps)   (the division when normalize)
//   S = sum_s phi(k_s) v_s^T,  z = sum_s phi(k_s)  (over visible s when causal).
// feature_map = identity, normalize = false, k = v = H is the paper's C q.
// Grouped-query heads: k and v may have Hkv heads, a divisor of q's H; query
// head h then reads key and value head h / (H / Hkv), whose state S, z the
// kernel builds once for the group (multi-query: Hkv = 1).
// ----------------------------------------------------------------------------
enum class FeatureMap { identity, elu };  // elu means elu(x) + 1

struct LinearAttentionFuncOptions {
  TORCH_ARG(FeatureMap, feature_map) = FeatureMap::identity;
  TORCH_ARG(bool, normalize) = false;
  TORCH_ARG(bool, causal) = false;
  TORCH_ARG(double, eps) = 1e-6;
  /// Rotary positions in RoFormer's linear form (Su et al., 2021, section
  /// 3.4.4): the numerator reads phi(q_i) rotated to position i + S - L and
  /// phi(k_j) rotated to position j (the first rotary_dim entries, even,
  /// <= E, in the pairs of rotary_embedding), the normaliser the unrotated
  /// features, so that it stays positive:
  ///   out_i = sum_j (R_i phi(q_i))^T (R_j phi(k_j)) v_j / (phi(q_i) . sum_j phi(k_j) + eps).
  /// Inside the kernel; 0: none.
  TORCH_ARG(int64_t, rotary_dim) = 0;
  /// RoPE's angles: position t times rotary_base^(-2c / rotary_dim).
  TORCH_ARG(double, rotary_base) = 10000.0;
};
torch::Tensor linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v,
                               const LinearAttentionFuncOptions& options = {});
/// The backend linear_attention runs for these arguments (the op calls this):
/// the chunked kernel when q, k and v are float32, and on bfloat16 converted
/// to float32 (the result rounded once; reason "bf16 converted to float32
/// (...)"), else the composite.
/// Assumes arguments the op accepts; it does not validate them.
Dispatch linear_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v,
                                   const LinearAttentionFuncOptions& options = {});

/// Parses "identity" | "elu"; throws naming the accepted values otherwise.
FeatureMap feature_map_from_string(const std::string& name);
std::string to_string(FeatureMap map);

// ----------------------------------------------------------------------------
// Packed variable-length batches (FlashAttention's varlen layout): B sequences
// of different lengths stored one after another, without padding.
//   q (Tq, H, E), k (Tk, Hkv, E), v (Tk, Hkv, M) -> (Tq, H, M)
//   cu_seqlens_q, cu_seqlens_k: int64 (B + 1), 0 = c[0] <= c[1] <= ... <= c[B]
//   = Tq (Tk): sequence b is rows c[b] .. c[b+1] - 1.
// Sequence b's queries attend to its own keys only (the block-diagonal mask of
// the packed batch; nothing outside the blocks is computed), each sequence
// exactly as the op on (1, H, Lb, E) alone: masks, rotary and ALiBi positions
// and windows count from the sequence's start (causal: bottom-right aligned
// per sequence when Lb != Sb); Hkv divides H (grouped-query heads). An empty
// sequence is allowed; a query whose sequence has no key outputs zeros.
// float32 runs the kernels, one call per sequence over views of the packed
// tensors (no padding): float32 results are bitwise those of the op on each
// sequence's (1, H, Lb, E) view.
// bfloat16 takes the float32 kernel on converted inputs; float64 the composite.
// ----------------------------------------------------------------------------
/// Exact attention over a packed batch. The options are softmax_attention's;
/// key_lengths and bias are refused (the offsets give the lengths; a bias has
/// no packed layout). With dropout, sequence b draws the mask of batch entry
/// b (attention_dropout_mask's n = b): the op on sequence b's view alone
/// draws batch 0's, so packed equals one by one at dropout_p = 0.
torch::Tensor varlen_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                               const SoftmaxAttentionFuncOptions& options = {});
/// Linear attention over a packed batch, with linear_attention's options.
torch::Tensor varlen_linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& cu_seqlens_q,
                                      const torch::Tensor& cu_seqlens_k,
                                      const LinearAttentionFuncOptions& options = {});

// ----------------------------------------------------------------------------
// Gated linear attention (docs/MATH.md, "Gated linear attention"): the recurrence
//   C_t = alpha_t C_{t-1} + beta_t f_t f_t^T,   C_0 = 0,
// read out by q:  causal: out_t = C_t q_t;  otherwise out_t = C_L q_t.
// f (N, H, L, E), q (N, H, L, E), alpha and beta (N, H, L) -> (N, H, L, E).
// The cheap-linear-attention paper's gated form is alpha = beta = 1,
// f_t = sigmoid(W h_t + b) * h_t (nn::GatedLinearAttention builds it).
// ----------------------------------------------------------------------------
struct GatedLinearAttentionFuncOptions {
  TORCH_ARG(bool, causal) = false;
};
torch::Tensor gated_linear_attention(const torch::Tensor& f, const torch::Tensor& q,
                                     const torch::Tensor& alpha, const torch::Tensor& beta,
                                     const GatedLinearAttentionFuncOptions& options = {});
/// The backend gated_linear_attention runs (the op calls this): the chunked
/// kernel when f, q, alpha and beta are float32, else the composite.
Dispatch gated_linear_attention_dispatch(const torch::Tensor& f, const torch::Tensor& q,
                                         const torch::Tensor& alpha, const torch::Tensor& beta,
                                         const GatedLinearAttentionFuncOptions& options = {});

// ----------------------------------------------------------------------------
// Agglomerative attention (docs/MATH.md, "Agglomerative attention"), one head
// per class:
//   a_h = sum_t cr_th v_t / max(sum_t cr_th, clip),  out_ih = cq_ih * a_h
// causal: the sums run over t <= i + (S - L).
// cq (N, H, L), cr (N, H, S), v (N, H, S, M) -> (N, H, L, M).
// The clip's gradient is zero where it is active (sum < clip).
// ----------------------------------------------------------------------------
struct AgglomerativeAttentionFuncOptions {
  TORCH_ARG(bool, causal) = false;
  TORCH_ARG(double, clip) = 1e-3;
};
torch::Tensor agglomerative_attention(const torch::Tensor& cq, const torch::Tensor& cr,
                                      const torch::Tensor& v,
                                      const AgglomerativeAttentionFuncOptions& options = {});
/// The backend agglomerative_attention runs (the op calls this): the
/// blocked-scan kernel when cq, cr and v are float32, else the composite.
Dispatch agglomerative_attention_dispatch(const torch::Tensor& cq, const torch::Tensor& cr,
                                          const torch::Tensor& v,
                                          const AgglomerativeAttentionFuncOptions& options = {});

// ----------------------------------------------------------------------------
// Clustered (topk = 0) and improved-clustered (topk > 0) attention (the
// clustered-attention paper).
// Queries are hashed with `bits` random hyperplanes drawn from `seed`, grouped
// by Hamming K-means into `clusters` groups, and each group attends through its
// centroid. See docs/MATH.md, "Clustered attention" and "Improved clustered
// attention", and docs/API.md for the exact rules. Grouped-query heads as in
// exact attention: k and v may have Hkv heads, a divisor of q's H (queries are
// clustered per query head; each head's clusters attend over its group's keys).
// ----------------------------------------------------------------------------
struct ClusteredAttentionFuncOptions {
  /// The most K-means iterations a call may ask for.
  static constexpr int64_t kMaxIterations = 1000;
  TORCH_ARG(int64_t, clusters) = 100;
  TORCH_ARG(int64_t, bits) = 63;
  TORCH_ARG(int64_t, iterations) = 10;
  /// 0: plain clustered attention. > 0: improved clustered with this many keys.
  TORCH_ARG(int64_t, topk) = 0;
  /// Use the threshold column of the planes (false: hyperplanes through 0).
  TORCH_ARG(bool, hash_bias) = true;
  TORCH_ARG(int64_t, seed) = 0;
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  TORCH_ARG(torch::Tensor, key_lengths) = {};
  /// int64 (N): queries i >= query_lengths[n] are padding; they output zeros.
  TORCH_ARG(torch::Tensor, query_lengths) = {};
};
torch::Tensor clustered_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v,
                                  const ClusteredAttentionFuncOptions& options = {});
/// The backend clustered_attention runs (the op calls this): the hashing,
/// K-means and attention kernels when q, k and v are float32, else the composite.
Dispatch clustered_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v,
                                      const ClusteredAttentionFuncOptions& options = {});

// ----------------------------------------------------------------------------
// Sparse attention over neighbour lists (the SAC paper; docs/MATH.md, "Sparse
// attention"):
//   out_i = sum_{j in N(i)} softmax_{j in N(i)}(scale q_i . k_j - alibi_ij) v_j.
// Grouped-query heads as for softmax_attention: k and v may have Hkv heads, a
// divisor of q's H; query head h reads key and value head h / (H / Hkv), with
// no copy. Edge lists are per query head (or shared).
// ----------------------------------------------------------------------------
/// Compressed sparse rows of a bipartite graph from L queries to S keys.
/// Shared by all heads: offsets int64 (L+1), columns int64 (nnz).
/// One list per head: offsets int64 (H, L+1) indexing one flat columns (nnz);
/// the edges of query i in head h are columns[offsets[h][i] : offsets[h][i+1]].
/// Each head's offsets are non-decreasing within [0, nnz]; heads may share or
/// skip ranges of columns (a shared list must start at 0 and end at nnz).
/// Columns within a row are strictly increasing and lie in [0, S).
struct EdgeList {
  torch::Tensor offsets;
  torch::Tensor columns;

  bool per_head() const { return offsets.defined() && offsets.dim() == 2; }
  int64_t num_queries() const { return offsets.size(-1) - 1; }
  int64_t num_edges() const { return columns.numel(); }
};

struct SparseAttentionFuncOptions {
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// ALiBi, as SoftmaxAttentionFuncOptions::alibi_slopes: floating (H), one
  /// slope per query head; each edge's score gets -slope_h |i + S - L - j|
  /// (query i at key position i + S - L), computed inside the kernel, so one
  /// query over a decoding cache sits at its end. Constants: no gradient.
  /// Undefined: none.
  TORCH_ARG(torch::Tensor, alibi_slopes) = {};
};
/// float32 runs the edge-list kernel (src/kernels/sparse_attention.h): time
/// O(nnz (E + M)) per head, with banded blocks of rows (local, segments,
/// causal) as dense tiles; memory O(N H L) row statistics plus, in the backward
/// pass when N H < 8, O(S (E + M)) key-gradient buffers per head; nothing of
/// size L x S; results bitwise the same for any thread count. Strided q, k, v
/// are read in place (copied once when their columns are not contiguous). Gradients for q, k and v (first
/// order only). A row with no edge outputs zeros and gets zero gradients.
/// bfloat16 runs the float32 kernel on converted inputs, the result rounded
/// once. float64 runs the composite, which builds a dense L x S mask and score
/// matrix per head (O(L S) time and memory) and is differentiable twice.
torch::Tensor sparse_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const EdgeList& edges,
                               const SparseAttentionFuncOptions& options = {});
/// The backend sparse_attention runs (the op calls this): the edge-list kernel
/// when q, k and v are float32 or bfloat16 (converted: the reason says so),
/// else the composite; the reason says why.
Dispatch sparse_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const EdgeList& edges,
                                   const SparseAttentionFuncOptions& options = {});

/// Throws a clear error if `edges` is not a valid list for L queries, S keys
/// and H heads (the op calls this; builders' outputs always pass). The
/// values of offsets and columns are checked only when the tensors hold data
/// (a tracer's fake tensors have shapes alone; the kernel checks them then).
void check_edge_list(const EdgeList& edges, int64_t L, int64_t S, int64_t H,
                     const char* op = "sparse_attention");

// Edge-pattern builders: the attention patterns of earlier models as edge lists
// (SAC treats them all as special cases of one sparse kernel). Square patterns
// are over n positions; bp_tree and star add nodes (see each comment).
namespace edges {
/// Every query sees every key.
EdgeList full(int64_t L, int64_t S);
/// Query i sees keys j <= i + (S - L).
EdgeList causal(int64_t L, int64_t S);
/// Query i sees keys with |i - j| <= span (causal: i - span <= j <= i).
EdgeList local(int64_t n, int64_t span, bool causal = false);
/// Transformer-XL style segments of `segment` positions: a query sees its own
/// segment and the previous one (causal: only keys j <= i).
EdgeList segments(int64_t n, int64_t segment, bool causal = false);
/// Binary-partition tree (BP-Transformer) over n tokens: 2n - 1 nodes, tokens
/// are nodes 0..n-1, internal spans n..2n-2 (node n is the root). A token sees
/// itself and the O(log n) spans that tile the rest of the sequence (the
/// siblings of its ancestors); a span node sees its two children.
EdgeList bp_tree(int64_t n);
/// Star transformer: n satellites (0..n-1) and one relay node (n). A satellite
/// sees its neighbours i-1, i, i+1 and the relay; the relay sees every node.
EdgeList star(int64_t n);
/// Sparse-transformer strided pattern (causal): j <= i and (i - j < stride or
/// (i - j) % stride == 0).
EdgeList strided(int64_t n, int64_t stride);
/// Random destinations: node i sees itself and `per_node` keys drawn uniformly
/// from [0, n) (duplicates merged), from a generator seeded with `seed`. A pure
/// function of (n, per_node, seed): the control for a learned structure with
/// as many edges (SAC's alpha), and SAC's structure without a predictor.
EdgeList random(int64_t n, int64_t per_node, uint64_t seed);
/// Builds a pattern by name: "full", "causal", "local", "segments", "bp-tree",
/// "star", "strided", "random"; `param` is the span, segment length, stride or
/// random destinations per node (drawn with seed 0).
EdgeList by_name(const std::string& name, int64_t n, int64_t param);
/// The union of two shared lists over the same L x S grid: row i holds the
/// columns of row i of `a` and of `b`, sorted, each once. Per-head lists are
/// merged head by head (both must then have the same number of heads). The
/// SAC graph model adds predicted edges to a graph's own this way.
EdgeList merge(const EdgeList& a, const EdgeList& b);
/// Hop distances over a square shared list read as a directed graph (an edge
/// i -> j for every column j of row i): int64 (n, n), entry (i, j) the fewest
/// edges on a path from i to j, clipped at `max_distance` (also the value of
/// unreachable pairs); 0 on the diagonal. One breadth-first search per node,
/// each stopped at depth max_distance: O(n (n + nnz)) time at worst, n^2
/// int64 of memory. The distance encoding of SAC's edge predictor on graphs.
torch::Tensor hop_distances(const EdgeList& edges, int64_t max_distance);
}  // namespace edges

// ----------------------------------------------------------------------------
// Dense layer, the semantics of torch::nn::functional::linear:
//   y = x weight^T + bias,  x (..., in), weight (out, in), bias (out) -> (..., out).
// Any number of leading dimensions (at least one dimension in all); float32 runs
// oneDNN's sgemm; bfloat16 runs oneDNN's bf16 matmul (float32 accumulation, bf16
// results; converted to float32 inside where the CPU lacks AVX512_BF16, which
// linear_dispatch's reason names); float64 the composite. Gradients for x,
// weight and bias, in their dtype.
// ----------------------------------------------------------------------------
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias = {});
Dispatch linear_dispatch(const torch::Tensor& x, const torch::Tensor& weight,
                         const torch::Tensor& bias = {});

}  // namespace attnkit
