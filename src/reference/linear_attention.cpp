// Reference linear and gated linear attention (docs/MATH.md, "Linear attention"
// and "Gated linear attention").
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

torch::Tensor gated_linear_attention(const torch::Tensor& f, const torch::Tensor& q,
                                     const torch::Tensor& alpha, const torch::Tensor& beta,
                                     const GatedLinearAttentionFuncOptions& o) {
  const int64_t N = f.size(0), H = f.size(1), L = f.size(2), E = f.size(3);
  if (L == 0) {
    // No step: C = 0 and an empty output. C is written as the (empty) sum over
    // t of alpha_t beta_t f_t f_t^T rather than a fresh zeros tensor, so that
    // the output is still connected to every input in the autograd graph, as
    // the kernel's output is: without it, an output of inputs that require
    // grad had no grad_fn (and autograd.grad(..., allow_unused=True) silently
    // returned no gradients at all).
    const auto C = torch::einsum("nht,nht,nhte,nhtf->nhef", {alpha, beta, f, f});
    return torch::matmul(q, C.transpose(-2, -1));
  }
  auto C = torch::zeros({N, H, E, E}, f.options());
  std::vector<torch::Tensor> outs;
  outs.reserve(o.causal() ? L : 0);
  for (int64_t t = 0; t < L; ++t) {
    auto ft = f.select(2, t);                                   // (N,H,E)
    auto at = alpha.select(2, t).view({N, H, 1, 1});
    auto bt = beta.select(2, t).view({N, H, 1, 1});
    C = at * C + bt * ft.unsqueeze(-1) * ft.unsqueeze(-2);      // C_t
    if (o.causal()) outs.push_back(torch::matmul(C, q.select(2, t).unsqueeze(-1)).squeeze(-1));
  }
  if (o.causal()) return torch::stack(outs, 2);
  return torch::matmul(q, C.transpose(-2, -1));                 // out_t = C_L q_t
}

}  // namespace attnkit::reference
