// Reference agglomerative attention on class weights (docs/MATH.md,
// "Agglomerative attention").
#include "reference/reference.h"

namespace attnkit::reference {

torch::Tensor agglomerative_attention(const torch::Tensor& cq, const torch::Tensor& cr,
                                      const torch::Tensor& v, const AgglomerativeAttentionFuncOptions& o) {
  const int64_t L = cq.size(2), S = cr.size(2);
  auto weighted = cr.unsqueeze(-1) * v;  // u_t = cr_t v_t, (N,H,S,M)
  // The clip max(den, clip) with zero gradient where active (den < clip).
  auto clipped = [&](const torch::Tensor& den) {
    return torch::where(den < o.clip(), torch::full_like(den, o.clip()), den);
  };
  if (!o.causal()) {
    auto a = weighted.sum(2) / clipped(cr.sum(2)).unsqueeze(-1);  // (N,H,M)
    return cq.unsqueeze(-1) * a.unsqueeze(2);
  }
  // Causal: prefix sums; query i reads prefix index i + S - L (none if < 0).
  if (S == 0) return cq.unsqueeze(-1) * v.sum(2, /*keepdim=*/true);  // zeros (N,H,L,M)
  auto num = weighted.cumsum(2);                       // (N,H,S,M)
  auto den = clipped(cr.cumsum(2)).unsqueeze(-1);      // (N,H,S,1)
  auto a = num / den;
  auto idx = torch::arange(L, torch::kLong) + (S - L);
  auto valid = (idx >= 0).to(v.scalar_type()).view({1, 1, L, 1});
  auto rows = a.index_select(2, idx.clamp_min(0));     // (N,H,L,M)
  return cq.unsqueeze(-1) * rows * valid;
}

}  // namespace attnkit::reference
