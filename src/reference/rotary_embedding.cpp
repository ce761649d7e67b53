// Reference rotary positions (docs/MATH.md, "Rotary positions").
#include "reference/reference.h"

namespace attnkit::reference {

torch::Tensor rotary_embedding(const torch::Tensor& x, const RotaryEmbeddingFuncOptions& o) {
  const int64_t T = x.size(2), half = o.dim() / 2;
  const auto options = x.options();
  // angle[t, c] = (offset + t) * base^(-2c / dim)
  const auto position = torch::arange(T, options).add(static_cast<double>(o.offset()));
  const auto frequency =
      torch::pow(torch::full({half}, o.base(), options),
                 torch::arange(half, options).mul(-2.0 / static_cast<double>(o.dim())));
  const auto angle = position.view({T, 1}) * frequency.view({1, half});
  const auto cos = angle.cos(), sin = angle.sin();
  const auto a = x.narrow(3, 0, half), b = x.narrow(3, half, half);
  return torch::cat({a * cos - b * sin, b * cos + a * sin, x.narrow(3, o.dim(), x.size(3) - o.dim())}, 3);
}

}  // namespace attnkit::reference
