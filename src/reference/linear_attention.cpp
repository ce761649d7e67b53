// Reference linear attention (docs/MATH.md, "Linear attention"); the gated
// recurrence is in gated_linear_attention.cpp.
#include "reference/reference.h"

namespace attnkit::reference {

namespace {
torch::Tensor apply_feature_map(const torch::Tensor& x, FeatureMap map) {
  return map == FeatureMap::elu ? torch::elu(x) + 1 : x;
}
}  // namespace

torch::Tensor linear_attention(const torch::Tensor& q, const torch::Tensor& k_in,
                               const torch::Tensor& v_in, const LinearAttentionFuncOptions& o) {
  const int64_t N = q.size(0), L = q.size(2), S = k_in.size(2);
  // Grouped-query heads: each key/value head repeated over its group.
  const auto k = detail::repeat_kv_heads(k_in, q.size(1));
  const auto v = detail::repeat_kv_heads(v_in, q.size(1));
  auto fq = apply_feature_map(q, o.feature_map());
  auto fk = apply_feature_map(k, o.feature_map());
  // Rotary positions (RoFormer's linear form): the numerator's features are
  // rotated, query i to position i + S - L and key j to j; the normaliser's
  // are not.
  auto rq = fq, rk = fk;
  if (o.rotary_dim() > 0) {
    rq = reference::rotary_embedding(fq, RotaryEmbeddingFuncOptions(o.rotary_dim()).base(o.rotary_base()).offset(S - L));
    rk = reference::rotary_embedding(fk, RotaryEmbeddingFuncOptions(o.rotary_dim()).base(o.rotary_base()));
  }
  // A query that sees no key has a zero numerator and outputs 0 (gradient 0),
  // even with eps = 0 where its normaliser would be 0 / 0: its denominator is
  // replaced by 1.
  if (!o.causal()) {
    auto state = torch::matmul(rk.transpose(-2, -1), v);  // (N,H,E,M)
    auto out = torch::matmul(rq, state);
    if (!o.normalize() || S == 0) return out;
    auto z = fk.sum(-2);                                   // (N,H,E)
    auto den = (fq * z.unsqueeze(-2)).sum(-1, /*keepdim=*/true) + o.eps();
    return out / den;
  }
  // Causal: the explicit lower-triangular (bottom-right aligned) score matrix.
  auto visible = visibility(N, L, S, /*causal=*/true, {}).to(q.scalar_type());  // (N,1,L,S)
  auto scores = torch::matmul(rq, rk.transpose(-2, -1)) * visible;             // (N,H,L,S)
  auto out = torch::matmul(scores, v);
  if (!o.normalize()) return out;
  auto sees_no_key = visible.sum(-1, /*keepdim=*/true) == 0;                    // (N,1,L,1)
  const auto den_scores = o.rotary_dim() > 0 ? torch::matmul(fq, fk.transpose(-2, -1)) * visible : scores;
  auto den = den_scores.sum(-1, /*keepdim=*/true) + o.eps();
  return out / den.masked_fill(sees_no_key, 1.0);
}

}  // namespace attnkit::reference
