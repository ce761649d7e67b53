#include "reference/masking.h"

#include <limits>

namespace attnkit::detail {

torch::Tensor visibility(int64_t N, int64_t L, int64_t S, bool causal,
                         const torch::Tensor& key_lengths) {
  auto i = torch::arange(L, torch::kLong).view({1, 1, L, 1});
  auto j = torch::arange(S, torch::kLong).view({1, 1, 1, S});
  auto visible = torch::ones({1, 1, L, S}, torch::kBool);
  if (causal) visible = visible & (j <= i + (S - L));
  if (key_lengths.defined()) visible = visible & (j < key_lengths.view({N, 1, 1, 1}));
  return visible.expand({N, 1, L, S});
}

torch::Tensor masked_softmax(const torch::Tensor& scores, const torch::Tensor& visible) {
  const double inf = std::numeric_limits<double>::infinity();
  auto shown = visible & (scores > -inf);
  auto row_has_key = shown.any(-1, /*keepdim=*/true);
  // Hidden entries get -inf, empty rows 0, so the softmax never sees an all -inf
  // row; multiplying by row_has_key then zeroes those rows and their gradient.
  auto safe = scores.masked_fill(shown.logical_not(), -inf)
                  .masked_fill(row_has_key.logical_not(), 0);
  return torch::softmax(safe, -1) * row_has_key;
}

torch::Tensor repeat_kv_heads(const torch::Tensor& k, int64_t H) {
  const int64_t group = k.size(1) == 0 ? 1 : H / k.size(1);
  return group > 1 ? k.repeat_interleave(group, 1) : k;
}

torch::Tensor alibi_penalty(const torch::Tensor& slopes, int64_t L, int64_t S,
                            const torch::TensorOptions& options) {
  const auto query_at = torch::arange(L, options).add(static_cast<double>(S - L)).view({L, 1});
  const auto distance = (query_at - torch::arange(S, options).view({1, S})).abs();
  return -slopes.to(options.dtype()).view({-1, 1, 1}) * distance;
}

}  // namespace attnkit::detail
