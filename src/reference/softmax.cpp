// Reference exact softmax attention (docs/MATH.md, "Exact softmax attention").
#include "reference/reference.h"

#include <limits>

namespace attnkit::reference {

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const SoftmaxAttentionFuncOptions& o,
                                torch::Tensor* weights) {
  const int64_t N = q.size(0), L = q.size(2), S = k.size(2), E = q.size(3);
  const double scale = o.scale() ? *o.scale() : 1.0 / std::sqrt(static_cast<double>(E));
  // Grouped-query heads: query head h reads key and value head h / (H / Hkv).
  const auto keys = detail::repeat_kv_heads(k, q.size(1)), values = detail::repeat_kv_heads(v, q.size(1));
  // Rotary positions: query i at position i + S - L, key j at j.
  const auto rotate = [&](const torch::Tensor& x, int64_t offset) {
    return o.rotary_dim() == 0 ? x
                               : reference::rotary_embedding(x, RotaryEmbeddingFuncOptions(o.rotary_dim())
                                                         .base(o.rotary_base())
                                                         .offset(offset));
  };
  auto scores = torch::matmul(rotate(q, S - L), rotate(keys, 0).transpose(-2, -1)) * scale;
  if (o.bias().defined()) scores = scores + o.bias();
  if (o.alibi_slopes().defined()) scores = scores + detail::alibi_penalty(o.alibi_slopes(), L, S, q.options());
  auto visible = detail::visibility(N, L, S, o.causal(), o.key_lengths());
  if (o.window() > 0) {
    // |i + S - L - j| < window: the band around the query's position.
    const auto query_at = torch::arange(L, torch::kLong).add(S - L).view({L, 1});
    visible = visible & ((query_at - torch::arange(S, torch::kLong).view({1, S})).abs() < o.window());
  }
  auto a = detail::masked_softmax(scores, visible);
  // masked_softmax hides NaN scores with the -inf ones; here a NaN score of a
  // visible key makes its row NaN, as torch's softmax (and the kernel) do.
  const auto nan_row = (torch::isnan(scores) & visible).any(-1, /*keepdim=*/true);
  a = a.masked_fill(nan_row, std::numeric_limits<double>::quiet_NaN());
  if (weights) *weights = a;
  return torch::matmul(a, values);
}

}  // namespace attnkit::reference
