// Op boundary of sparse attention over edge lists: validation (the lists are
// checked by check_edge_list, src/edges/checks.cpp), the dispatch between the
// edge-list kernel (float32) and the composite reference (other dtypes), and
// the kernel's autograd. The kernels are ops of their own
// (attnkit::_sparse_attention_forward / _backward, ops/kernel_op.h) with CPU
// and Meta kernels, so that torch.compile and torch.export trace the op.
// Registers its schemas (sparse_attention, the kernel ops, and the factory
// edge_pattern, which names the patterns of src/edges) at its bottom.
#include "kernels/sparse_attention.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "ops/checks.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/head_features.h"
#include "ops/kernel_op.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

constexpr const char* kSparseOp = "sparse_attention";

using detail::OptionalTensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

void check_arguments(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const EdgeList& edges, const SparseAttentionFuncOptions& options) {
  detail::check_qkv(kSparseOp, q, k, v, /*grouped_heads=*/true);
  detail::check_scale(kSparseOp, options.scale(), q.scalar_type());
  detail::check_alibi_slopes(kSparseOp, options.alibi_slopes(), q.size(1));
  check_edge_list(edges, q.size(2), k.size(2), q.size(1), kSparseOp);
}

// The kernel ops' arguments: the edge list as the kernel reads it, offsets
// (lists, L + 1) with lists 1 (one list for all heads) or H, and contiguous
// int64 columns (nnz); the scale; float32 ALiBi slopes (H) or none.
using SparseForwardResult = std::tuple<torch::Tensor, torch::Tensor>;  // out, lse
using SparseGradients = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
using SparseForwardSignature = SparseForwardResult(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                   const torch::Tensor&, const torch::Tensor&, double,
                                                   const OptionalTensor&);
using SparseBackwardSignature = SparseGradients(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                const torch::Tensor&, const torch::Tensor&, double,
                                                const OptionalTensor&);

/// The checks of a kernel op (Python can call one directly): sparse_attention's
/// on float32 inputs, with the edge list in the kernel's (lists, L + 1) form.
void check_kernel_arguments(const char* op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& offsets, const torch::Tensor& columns, double scale,
                            const OptionalTensor& alibi_slopes) {
  detail::check_qkv(op, q, k, v, /*grouped_heads=*/true);
  TORCH_CHECK(q.scalar_type() == torch::kFloat, op, ": the kernel takes float32, got ",
              detail::dtype_name(q.scalar_type()));
  detail::check_scale(op, scale, q.scalar_type());
  const torch::Tensor slopes = alibi_slopes.value_or(torch::Tensor());
  detail::check_alibi_slopes(op, slopes, q.size(1));
  TORCH_CHECK(!slopes.defined() || (slopes.scalar_type() == torch::kFloat && slopes.is_contiguous()), op,
              ": argument 'alibi_slopes' must be contiguous float32 here");
  TORCH_CHECK(offsets.dim() == 2 && (offsets.size(0) == 1 || offsets.size(0) == q.size(1)), op,
              ": argument 'offsets' must have shape (1, L + 1) or (H, L + 1), got ", detail::shape_str(offsets));
  TORCH_CHECK(offsets.is_contiguous() && columns.is_contiguous(), op,
              ": arguments 'offsets' and 'columns' must be contiguous");
  // The per-head form's rules for either count of lists (what the kernel
  // needs: each list's offsets non-decreasing within [0, nnz]); a per-head
  // list of one head (H = 1) need not start at 0, as the op allows.
  check_edge_list(EdgeList{offsets, columns}, q.size(2), k.size(2), offsets.size(0), op);
}

kernels::SparseAttentionParams make_params(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const torch::Tensor& offsets, const torch::Tensor& columns, double scale,
                                           const OptionalTensor& alibi_slopes, const torch::Tensor& out,
                                           const torch::Tensor& lse) {
  kernels::SparseAttentionParams p;
  detail::bind_qkv(p, q, k, v, out);  // the kernel reads strides: views cost no copy
  p.lse = lse.data_ptr<float>();
  p.scale = static_cast<float>(scale);
  p.offsets = offsets.data_ptr<int64_t>();
  p.lists = offsets.size(0);
  p.columns = columns.data_ptr<int64_t>();
  p.kv_group = detail::kv_group(q, k);
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  return p;
}

SparseForwardResult sparse_forward_meta(const torch::Tensor& q, const torch::Tensor&, const torch::Tensor& v,
                                        const torch::Tensor&, const torch::Tensor&, double, const OptionalTensor&) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
  return {torch::empty({N, H, L, M}, q.options()), torch::empty({N, H, L}, q.options())};
}

SparseForwardResult sparse_forward_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const torch::Tensor& offsets, const torch::Tensor& columns, double scale,
                                       const OptionalTensor& alibi_slopes) {
  check_kernel_arguments("_sparse_attention_forward", q, k, v, offsets, columns, scale, alibi_slopes);
  auto result = sparse_forward_meta(q, k, v, offsets, columns, scale, alibi_slopes);
  const auto& [out, lse] = result;
  kernels::sparse_attention_forward(make_params(q, k, v, offsets, columns, scale, alibi_slopes, out, lse));
  return result;
}

SparseGradients sparse_backward_meta(const torch::Tensor&, const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor&, const torch::Tensor&,
                                     const torch::Tensor&, const torch::Tensor&, double, const OptionalTensor&) {
  const auto contiguous = torch::MemoryFormat::Contiguous;
  return {torch::empty_like(q, contiguous), torch::empty_like(k, contiguous), torch::empty_like(v, contiguous)};
}

SparseGradients sparse_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                    const torch::Tensor& offsets, const torch::Tensor& columns, double scale,
                                    const OptionalTensor& alibi_slopes) {
  constexpr const char* op = "_sparse_attention_backward";
  check_kernel_arguments(op, q, k, v, offsets, columns, scale, alibi_slopes);
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
  const std::vector<int64_t> out_shape{N, H, L, M};
  TORCH_CHECK(grad_out.scalar_type() == torch::kFloat && grad_out.sizes() == torch::IntArrayRef(out_shape) &&
                  out.sizes() == torch::IntArrayRef(out_shape) && out.scalar_type() == torch::kFloat,
              op, ": arguments 'grad_out' and 'out' must be float32 of shape (", N, ", ", H, ", ", L, ", ", M,
              "), got ", detail::shape_str(grad_out), " and ", detail::shape_str(out));
  TORCH_CHECK(lse.scalar_type() == torch::kFloat && lse.is_contiguous() && lse.sizes() == torch::IntArrayRef({N, H, L}),
              op, ": argument 'lse' must be the forward's (contiguous float32 of shape (", N, ", ", H, ", ", L,
              ")), got ", detail::shape_str(lse));
  kernels::SparseAttentionBackwardParams p;
  static_cast<kernels::SparseAttentionParams&>(p) =
      make_params(q, k, v, offsets, columns, scale, alibi_slopes, out, lse);
  // Grouped-query heads: the kernel writes each query head's share of dk and
  // dv (kernels/sparse_attention.h), summed over each group below.
  auto [dq, dk, dv] = detail::bind_qkv_grads(p, q, k, v, grad_out, /*per_query_head=*/p.kv_group > 1);
  kernels::sparse_attention_backward(p);
  if (p.kv_group > 1) {
    dk = detail::sum_over_groups(dk, p.kv_group);
    dv = detail::sum_over_groups(dv, p.kv_group);
  }
  return {dq, dk, dv};
}

/// The edge list, the scale and the ALiBi slopes: constants of the autograd
/// graph, passed as one struct (see softmax_attention.cpp: apply records the
/// device of every tensor argument).
struct SparseConstants {
  torch::Tensor offsets;  // (lists, L + 1)
  torch::Tensor columns;  // (nnz)
  double scale;
  torch::Tensor alibi_slopes;  // undefined, or contiguous float32 (H)
};

class SparseAttentionFunction : public torch::autograd::Function<SparseAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const SparseConstants& c) {
    static const auto op = detail::kernel_op<SparseForwardSignature>("attnkit::_sparse_attention_forward");
    auto [out, lse] = op.call(q, k, v, c.offsets, c.columns, c.scale, detail::as_optional(c.alibi_slopes));
    ctx->save_for_backward({q, k, v, out, lse, c.offsets, c.columns, c.alibi_slopes});
    ctx->saved_data["scale"] = c.scale;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = detail::kernel_op<SparseBackwardSignature>("attnkit::_sparse_attention_backward");
    // Saved with version checks: an in-place change of any of them between
    // forward and backward raises instead of changing the gradients.
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    auto [dq, dk, dv] = op.call(grads[0], q, k, v, out, lse, saved[5], saved[6], ctx->saved_data["scale"].toDouble(),
                                detail::as_optional(saved[7]));
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

namespace {

torch::Tensor sparse_attention_op(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& offsets,
                                  const torch::Tensor& columns, c10::optional<double> scale,
                                  const c10::optional<torch::Tensor>& alibi_slopes) {
  return sparse_attention(q, k, v, EdgeList{offsets, columns},
                          SparseAttentionFuncOptions().scale(scale).alibi_slopes(alibi_slopes.value_or(torch::Tensor())));
}

std::tuple<torch::Tensor, torch::Tensor> edge_pattern_op(c10::string_view name, int64_t n,
                                                         int64_t param) {
  auto e = edges::by_name(std::string(name), n, param);
  return {e.offsets, e.columns};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def("sparse_attention(Tensor q, Tensor k, Tensor v, Tensor offsets, Tensor columns, *, "
        "float? scale=None, Tensor? alibi_slopes=None) -> Tensor",
        &sparse_attention_op);
  m.def("edge_pattern(str name, int n, int param=0) -> (Tensor offsets, Tensor columns)");
  m.def(
      "_sparse_attention_forward(Tensor q, Tensor k, Tensor v, Tensor offsets, Tensor columns, float scale, "
      "Tensor? alibi_slopes) -> (Tensor out, Tensor lse)");
  m.def(
      "_sparse_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor offsets, Tensor columns, float scale, Tensor? alibi_slopes) -> (Tensor dq, Tensor dk, Tensor dv)");
}

// edge_pattern is a factory: CompositeExplicitAutograd, as
// attention_dropout_mask is (ops/softmax_attention.cpp says why), with a fake
// implementation in python/attnkit/_compile.py.
TORCH_LIBRARY_IMPL(attnkit, CompositeExplicitAutograd, m) {
  m.impl("edge_pattern", &edge_pattern_op);
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("_sparse_attention_forward", &sparse_forward_cpu);
  m.impl("_sparse_attention_backward", &sparse_backward_cpu);
}

TORCH_LIBRARY_IMPL(attnkit, Meta, m) {
  m.impl("_sparse_attention_forward", &sparse_forward_meta);
  m.impl("_sparse_attention_backward", &sparse_backward_meta);
}

}  // namespace attnkit
