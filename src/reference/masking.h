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

}  // namespace attnkit::detail
