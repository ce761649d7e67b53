// torch's own scaled_dot_product_attention, the `torch` rows of `attnkit
// bench` where libtorch has one: the part of the CLI that depends on torch's
// version (torch 2 has a public SDPA, with a CPU flash kernel; torch 1.13 only
// a private one, so there the rows run the plain composite).
#pragma once

#include <torch/torch.h>

namespace attnkit::cli {

/// True when this libtorch has a public scaled_dot_product_attention (torch 2).
bool torch_has_sdpa();

/// torch.nn.functional.scaled_dot_product_attention(q, k, v) with attnkit's
/// meaning of `causal` (query i sees keys j <= i + S - L, bottom-right): torch's
/// is_causal where that is the same (L == S), an equivalent boolean mask
/// otherwise; enable_gqa when k and v have fewer heads than q. Throws on a
/// libtorch without it (check torch_has_sdpa()).
torch::Tensor torch_sdpa(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         bool causal);

}  // namespace attnkit::cli
