// Reference of torch 2's scaled_dot_product_attention: the code torch 2.5's
// documentation gives as its equivalent, written out step by step in
// libtorch. One change, our rule for a row whose keys are all hidden: zeros
// (the documented code's softmax gives NaN there). Dropout is not part of it:
// the op refuses dropout_p > 0.
#include "reference/reference.h"

#include <cmath>
#include <limits>

namespace attnkit::reference {

torch::Tensor scaled_dot_product_attention(const torch::Tensor& query, const torch::Tensor& key,
                                           const torch::Tensor& value,
                                           const ScaledDotProductAttentionFuncOptions& o) {
  const int64_t L = query.size(-2), S = key.size(-2);
  const double inf = std::numeric_limits<double>::infinity();
  const double scale = o.scale() ? *o.scale() : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
  auto attn_bias = torch::zeros({L, S}, query.options());
  if (o.is_causal()) {
    const auto keep = torch::ones({L, S}, query.options().dtype(torch::kBool)).tril(0);
    attn_bias = attn_bias.masked_fill(keep.logical_not(), -inf);
  }
  if (o.attn_mask().defined()) {
    if (o.attn_mask().scalar_type() == torch::kBool)
      attn_bias = attn_bias.masked_fill(o.attn_mask().logical_not(), -inf);
    else
      attn_bias = o.attn_mask() + attn_bias;
  }
  auto k = key, v = value;
  if (o.enable_gqa()) {
    k = k.repeat_interleave(query.size(-3) / key.size(-3), -3);
    v = v.repeat_interleave(query.size(-3) / value.size(-3), -3);
  }
  const auto scores = torch::matmul(query, k.transpose(-2, -1)) * scale + attn_bias;
  // softmax over the last dimension; a row of -inf only gives zeros.
  const auto weights = detail::masked_softmax(scores, scores > -inf);
  return torch::matmul(weights, v);
}

}  // namespace attnkit::reference
