// What the attention ops with today's position and head features share
// (softmax_attention, sparse_attention): the check of ALiBi slopes, and
// grouped-query heads' group size and the sum of per-query-head key and
// value gradients over each group.
#pragma once

#include <torch/types.h>

#include <cmath>
#include <cstdint>

#include "ops/checks.h"

namespace attnkit::detail {

/// Optional ALiBi slopes: a floating CPU tensor of shape (H), constant and
/// finite.
inline void check_alibi_slopes(const char* op, const torch::Tensor& slopes, int64_t H) {
  if (!slopes.defined()) return;
  TORCH_CHECK(slopes.device().is_cpu() && slopes.is_floating_point(), op,
              ": argument 'alibi_slopes' must be a floating CPU tensor, got ", slopes.scalar_type(),
              " on ", slopes.device());
  TORCH_CHECK(slopes.dim() == 1 && slopes.size(0) == H, op,
              ": argument 'alibi_slopes' must have shape (H) = (", H, "), one slope per query head, got ",
              shape_str(slopes));
  TORCH_CHECK(!slopes.requires_grad(), op,
              ": argument 'alibi_slopes' requires grad, but ALiBi's slopes are constants here (the "
              "kernel gives them no gradient); detach them, or learn a bias tensor instead");
  // Values where they can be read (has_data); a kernel op checks them again,
  // on float32 slopes by a loop over the H entries (no reduction ops).
  if (H == 0 || !has_data(slopes)) return;
  bool finite = true;
  if (slopes.scalar_type() == torch::kFloat) {
    const auto values = slopes.contiguous();
    const float* slope = values.data_ptr<float>();
    for (int64_t h = 0; h < H; ++h) finite = finite && std::isfinite(slope[h]);
  } else {
    finite = torch::isfinite(slopes).all().item<bool>();
  }
  TORCH_CHECK(finite, op, ": argument 'alibi_slopes' has a non-finite entry");
}

/// Query heads per key/value head (1 without grouped-query heads).
inline int64_t kv_group(const torch::Tensor& q, const torch::Tensor& k) {
  // No query heads (or none of k's): nothing is grouped. H = 0 with Hkv > 0
  // passes check_qkv (Hkv divides 0) and gave a group of 0 heads, which the
  // kernels divide by (a SIGFPE in sparse attention).
  return k.size(1) == 0 || q.size(1) == 0 ? 1 : q.size(1) / k.size(1);
}

/// The gradient of key or value heads that groups of `group` query heads
/// share: `per_query_head` (N, H, S, X) summed over each group, its heads
/// added in increasing order (one fixed order: bitwise the same on any
/// thread count).
inline torch::Tensor sum_over_groups(const torch::Tensor& per_query_head, int64_t group) {
  const auto sizes = per_query_head.sizes();
  const auto grouped = per_query_head.view({sizes[0], sizes[1] / group, group, sizes[2], sizes[3]});
  auto sum = grouped.select(2, 0).clone(torch::MemoryFormat::Contiguous);
  for (int64_t g = 1; g < group; ++g) sum.add_(grouped.select(2, g));
  return sum;
}

}  // namespace attnkit::detail
