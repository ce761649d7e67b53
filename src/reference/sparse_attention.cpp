// Reference sparse attention over CSR edge lists (docs/MATH.md, "Sparse
// attention"): the edge list becomes a dense mask and the attention a masked
// softmax.
#include "reference/reference.h"

namespace attnkit::reference {

torch::Tensor edge_mask(const EdgeList& edges, int64_t H, int64_t L, int64_t S) {
  const int64_t lists = edges.per_head() ? H : 1;
  auto mask = torch::zeros({lists, L, S}, torch::kBool);
  auto offsets = edges.offsets.contiguous().view({lists, L + 1});
  auto off = offsets.accessor<int64_t, 2>();
  auto col = edges.columns.contiguous();
  auto c = col.accessor<int64_t, 1>();
  auto m = mask.accessor<bool, 3>();
  for (int64_t h = 0; h < lists; ++h)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t e = off[h][i]; e < off[h][i + 1]; ++e) m[h][i][c[e]] = true;
  return mask;
}

torch::Tensor sparse_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const EdgeList& edges,
                               const SparseAttentionFuncOptions& o, torch::Tensor* weights) {
  const int64_t H = q.size(1), L = q.size(2), S = k.size(2), E = q.size(3);
  const double scale = o.scale() ? *o.scale() : 1.0 / std::sqrt(static_cast<double>(E));
  // Grouped-query heads: query head h reads key and value head h / (H / Hkv).
  const auto keys = detail::repeat_kv_heads(k, H), values = detail::repeat_kv_heads(v, H);
  auto scores = torch::matmul(q, keys.transpose(-2, -1)) * scale;
  if (o.alibi_slopes().defined()) scores = scores + detail::alibi_penalty(o.alibi_slopes(), L, S, q.options());
  auto a = masked_softmax(scores, edge_mask(edges, H, L, S).unsqueeze(0));
  if (weights) *weights = a;
  return torch::matmul(a, values);
}

}  // namespace attnkit::reference
