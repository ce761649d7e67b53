// Reference exact softmax attention (docs/MATH.md, "Exact softmax attention").
#include "reference/reference.h"

#include <limits>

#include "kernels/common/dropout.h"

namespace attnkit::reference {

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const SoftmaxAttentionFuncOptions& o,
                                torch::Tensor* weights, int64_t dropout_batch_offset, torch::Tensor* lse) {
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
  if (o.softcap() > 0) scores = torch::tanh(scores / o.softcap()) * o.softcap();
  if (o.bias().defined()) scores = scores + o.bias();
  if (o.alibi_slopes().defined()) scores = scores + detail::alibi_penalty(o.alibi_slopes(), L, S, q.options());
  auto visible = detail::visibility(N, L, S, o.causal(), o.key_lengths());
  if (o.window() > 0) {
    // |i + S - L - j| < window: the band around the query's position.
    const auto query_at = torch::arange(L, torch::kLong).add(S - L).view({L, 1});
    visible = visible & ((query_at - torch::arange(S, torch::kLong).view({1, S})).abs() < o.window());
  }
  if (o.block_mask()) visible = visible & o.block_mask()->to_dense();
  visible = visible.expand_as(scores);
  constexpr double kInf = std::numeric_limits<double>::infinity();
  // A row with nothing visible takes scores of 0 where the log-sum-exp is
  // formed (finite, so its gradient is 0, not NaN), then -inf.
  torch::Tensor a;
  if (o.sinks().defined()) {
    // The sink: one more column of the softmax, without a value.
    const auto sink = o.sinks().to(scores.scalar_type()).view({1, -1, 1, 1}).expand({N, q.size(1), L, 1});
    const auto all = torch::cat({scores.masked_fill(visible.logical_not(), -kInf), sink}, -1);
    a = torch::softmax(all, -1).narrow(-1, 0, S);
    if (lse) *lse = torch::logsumexp(all, -1);
  } else {
    a = detail::masked_softmax(scores, visible);
    if (lse) {
      const auto seen = visible.any(-1, /*keepdim=*/true);
      const auto hidden = scores.masked_fill(visible.logical_not(), -kInf).masked_fill(seen.logical_not(), 0.0);
      *lse = torch::logsumexp(hidden, -1).masked_fill(seen.squeeze(-1).logical_not(), -kInf);
    }
  }
  // masked_softmax hides NaN scores with the -inf ones; here a NaN score of a
  // visible key makes its row NaN, as torch's softmax (and the kernel) do.
  const auto nan_row = (torch::isnan(scores) & visible).any(-1, /*keepdim=*/true);
  a = a.masked_fill(nan_row, std::numeric_limits<double>::quiet_NaN());
  if (o.dropout_p() > 0) {
    TORCH_CHECK(o.dropout_seed().has_value(), "reference::softmax_attention: dropout needs a seed");
    // Kept weights scaled by the inverse of the rate the draw keeps exactly.
    const double keep = kernels::AttentionDropout::keep_rate(o.dropout_p());
    const auto z = attention_dropout_keep(N, q.size(1), L, S, o.dropout_p(), *o.dropout_seed(), dropout_batch_offset);
    a = a * z.to(a.scalar_type()) / keep;
  }
  if (weights) *weights = a;
  return torch::matmul(a, values);
}

}  // namespace attnkit::reference

namespace attnkit::reference {

torch::Tensor attention_dropout_keep(int64_t N, int64_t H, int64_t L, int64_t S, double p, int64_t seed,
                                     int64_t batch_offset) {
  const kernels::AttentionDropout dropout(p, static_cast<uint64_t>(seed), batch_offset);
  auto z = torch::empty({N, H, L, S}, torch::kBool);
  bool* out = z.data_ptr<bool>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        const uint64_t row = dropout.row(n, h, i);
        for (int64_t j = 0; j < S; ++j) *out++ = dropout.kept(row, j);
      }
  return z;
}

}  // namespace attnkit::reference
