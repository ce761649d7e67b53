// Masks in composite (libtorch) form, shared by the references and the
// composite modules of the zoo. They live below the ops: reference code
// depends on nothing in src/ops.
#pragma once

#include <torch/types.h>

namespace attnkit::detail {

/// Boolean (N, 1, L, S) visibility of key j to query i under `causal`
/// (j <= i + S - L) and `key_lengths` (j < key_lengths[n]; undefined: all).
torch::Tensor visibility(int64_t N, int64_t L, int64_t S, bool causal,
                         const torch::Tensor& key_lengths);

/// Softmax of `scores` over the last dimension restricted to `visible`
/// (broadcastable bool); -inf scores are invisible too. Rows with nothing
/// visible are all zeros, with zero gradient and no NaN anywhere.
torch::Tensor masked_softmax(const torch::Tensor& scores, const torch::Tensor& visible);

/// Grouped-query heads: k (N, Hkv, S, X) with each head repeated over its
/// group of H / Hkv query heads, (N, H, S, X); k itself when Hkv == H.
torch::Tensor repeat_kv_heads(const torch::Tensor& k, int64_t H);

/// ALiBi's penalty -slope_h |i + S - L - j| (query i at key position
/// i + S - L), (H, L, S) in `options`' dtype, from floating (H) slopes.
torch::Tensor alibi_penalty(const torch::Tensor& slopes, int64_t L, int64_t S,
                            const torch::TensorOptions& options);

}  // namespace attnkit::detail
