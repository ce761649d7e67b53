// Op boundary of sparse attention over edge lists: validation (the lists are
// checked by check_edge_list, src/edges/checks.cpp), the dispatch between the
// edge-list kernel (float32) and the composite reference (other dtypes), and
// the kernel's autograd.
#include "kernels/sparse_attention.h"

#include <torch/autograd.h>

#include "base/checks.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/head_features.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

constexpr const char* kSparseOp = "sparse_attention";

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

void check_arguments(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const EdgeList& edges, const SparseAttentionFuncOptions& options) {
  detail::check_qkv(kSparseOp, q, k, v, /*grouped_heads=*/true);
  detail::check_scale(kSparseOp, options.scale(), q.scalar_type());
  detail::check_alibi_slopes(kSparseOp, options.alibi_slopes(), q.size(1));
  check_edge_list(edges, q.size(2), k.size(2), q.size(1), kSparseOp);
}

/// The edge list as the kernel reads it (contiguous int64), the scale and
/// the ALiBi slopes: constants of the autograd graph, passed as one struct
/// (see softmax_attention.cpp: apply records the device of every tensor
/// argument).
struct SparseConstants {
  torch::Tensor offsets;       // (lists, L + 1)
  torch::Tensor columns;       // (nnz)
  double scale;
  torch::Tensor alibi_slopes;  // undefined, or contiguous float32 (H)
};

/// The kernel reads strides, so views of q, k, v and out cost no copy.
kernels::SparseAttentionParams make_params(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, const SparseConstants& c,
                                           const torch::Tensor& out, const torch::Tensor& lse) {
  kernels::SparseAttentionParams p;
  detail::bind_qkv(p, q, k, v, out);
  p.lse = lse.data_ptr<float>();
  p.scale = static_cast<float>(c.scale);
  p.offsets = c.offsets.data_ptr<int64_t>();
  p.lists = c.offsets.size(0);
  p.columns = c.columns.data_ptr<int64_t>();
  p.kv_group = detail::kv_group(q, k);
  p.alibi_slopes = c.alibi_slopes.defined() ? c.alibi_slopes.data_ptr<float>() : nullptr;
  return p;
}

class SparseAttentionFunction : public torch::autograd::Function<SparseAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const SparseConstants& c) {
    const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
    auto out = torch::empty({N, H, L, M}, q.options());
    auto lse = torch::empty({N, H, L}, q.options());
    kernels::sparse_attention_forward(make_params(q, k, v, c, out, lse));
    ctx->save_for_backward({q, k, v, out, lse, c.offsets, c.columns, c.alibi_slopes});
    ctx->saved_data["scale"] = c.scale;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    // Saved with version checks: an in-place change of any of them between
    // forward and backward raises instead of changing the gradients.
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const SparseConstants c{saved[5], saved[6], ctx->saved_data["scale"].toDouble(), saved[7]};
    kernels::SparseAttentionBackwardParams p;
    static_cast<kernels::SparseAttentionParams&>(p) = make_params(q, k, v, c, out, lse);
    // Grouped-query heads: the kernel writes each query head's share of dk
    // and dv (kernels/sparse_attention.h), summed over each group below.
    auto [dq, dk, dv] = detail::bind_qkv_grads(p, q, k, v, grads[0], /*per_query_head=*/p.kv_group > 1);
    kernels::sparse_attention_backward(p);
    if (p.kv_group > 1) {
      dk = detail::sum_over_groups(dk, p.kv_group);
      dv = detail::sum_over_groups(dv, p.kv_group);
    }
    return detail::once_differentiable(kSparseOp, {dq, dk, dv, torch::Tensor()}, {q, k, v, grads[0]});
  }
};

/// The float32 kernel on validated arguments.
torch::Tensor run_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const EdgeList& edges, const SparseAttentionFuncOptions& options) {
  // (lists, L + 1): one list for all heads, or one per head (H may be 0).
  auto offsets = edges.per_head() ? edges.offsets : edges.offsets.unsqueeze(0);
  auto slopes = options.alibi_slopes();
  if (slopes.defined()) slopes = slopes.to(torch::kFloat).contiguous();
  const SparseConstants c{offsets.contiguous(), edges.columns.contiguous(),
                          detail::scale_or_default(options.scale(), q.size(3)), slopes};
  return SparseAttentionFunction::apply(q, k, v, c);
}

}  // namespace

Dispatch sparse_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const EdgeList& edges,
                                   const SparseAttentionFuncOptions& options) {
  check_arguments(q, k, v, edges, options);
  // check_qkv made q, k and v one floating dtype.
  if (q.scalar_type() == torch::kBFloat16)
    return Dispatch::kernel("bf16 converted to float32 (no bf16 kernel for sparse attention)");
  if (q.scalar_type() != torch::kFloat)
    return Dispatch::composite("q, k and v are " + detail::dtype_name(q.scalar_type()) +
                               "; the edge-list kernel is float32 and bfloat16 only (the "
                               "composite builds a dense L x S mask and score matrix per head, "
                               "O(L S) time and memory whatever the number of edges)");
  return Dispatch::kernel();
}

torch::Tensor sparse_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const EdgeList& edges,
                               const SparseAttentionFuncOptions& options) {
  // Validates once (the edge-list check reads every edge).
  if (!sparse_attention_dispatch(q, k, v, edges, options).uses_kernel())
    return reference::sparse_attention(q, k, v, edges, options);
  // bf16: the float32 kernel on converted inputs (not the dense composite),
  // the result rounded once; autograd converts the gradients back.
  if (q.scalar_type() == torch::kBFloat16)
    return run_kernel(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), edges, options)
        .to(torch::kBFloat16);
  return run_kernel(q, k, v, edges, options);
}

}  // namespace attnkit
