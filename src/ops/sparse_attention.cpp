// Op boundary of sparse attention over edge lists (the lists are checked by
// check_edge_list, src/graph/checks.cpp).
#include "ops/checks.h"
#include "reference/reference.h"

namespace attnkit {

torch::Tensor sparse_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const EdgeList& edges,
                               const SparseAttentionFuncOptions& options) {
  constexpr const char* op = "sparse_attention";
  detail::check_qkv(op, q, k, v);
  detail::check_scale(op, options.scale(), q.scalar_type());
  check_edge_list(edges, q.size(2), k.size(2), q.size(1), op);
  // The only backend today; the dispatch is called so that what it reports is what runs.
  TORCH_INTERNAL_ASSERT(!sparse_attention_dispatch(q, k, v, edges, options).uses_kernel());
  return reference::sparse_attention(q, k, v, edges, options);
}

Dispatch sparse_attention_dispatch(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                   const EdgeList&, const SparseAttentionFuncOptions&) {
  return Dispatch::composite(
      "sparse_attention has no kernel yet: the composite builds a dense L x S mask and score "
      "matrix per head, O(L S) time and memory whatever the number of edges");
}

}  // namespace attnkit
