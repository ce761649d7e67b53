#include "torch_sdpa.h"

#include <torch/version.h>

#include <stdexcept>

namespace attnkit::cli {

bool torch_has_sdpa() { return TORCH_VERSION_MAJOR >= 2; }

torch::Tensor torch_sdpa(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         bool causal) {
#if TORCH_VERSION_MAJOR >= 2
  const int64_t L = q.size(-2), S = k.size(-2);
  const bool gqa = q.dim() == 4 && k.size(1) != q.size(1);
  if (!causal || L == S)
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, causal,
                                            /*scale=*/c10::nullopt, gqa);
  // True = attend: key j is visible from query i when j <= i + S - L.
  const auto mask = torch::ones({L, S}, torch::kBool).tril(S - L);
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, /*is_causal=*/false, c10::nullopt, gqa);
#else
  (void)q, (void)k, (void)v, (void)causal;
  throw std::logic_error("torch_sdpa: libtorch " TORCH_VERSION " has no public scaled_dot_product_attention");
#endif
}

}  // namespace attnkit::cli
