// Reference exact softmax attention (docs/MATH.md, "Exact softmax attention").
#include "reference/reference.h"

namespace attnkit::reference {

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const SoftmaxAttentionOptions& o,
                                torch::Tensor* weights) {
  const int64_t N = q.size(0), L = q.size(2), S = k.size(2), E = q.size(3);
  const double scale = o.scale() ? *o.scale() : 1.0 / std::sqrt(static_cast<double>(E));
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (o.bias().defined()) scores = scores + o.bias();
  auto a = detail::masked_softmax(scores, detail::visibility(N, L, S, o.causal(), o.key_lengths()));
  if (weights) *weights = a;
  return torch::matmul(a, v);
}

}  // namespace attnkit::reference
