// Op boundary of clustered and improved-clustered attention.
#include "ops/checks.h"
#include "reference/reference.h"

namespace attnkit {

torch::Tensor clustered_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const ClusteredAttentionOptions& options) {
  constexpr const char* op = "clustered_attention";
  detail::check_qkv(op, q, k, v);
  const int64_t L = q.size(2), S = k.size(2);
  TORCH_CHECK(options.clusters() >= 1, op, ": option 'clusters' must be >= 1, got ",
              options.clusters());
  TORCH_CHECK(options.clusters() <= std::max<int64_t>(L, 1), op, ": option 'clusters' (",
              options.clusters(), ") must not exceed the number of queries L = ", L);
  TORCH_CHECK(options.bits() >= 1 && options.bits() <= 63, op,
              ": option 'bits' must be in [1, 63], got ", options.bits());
  TORCH_CHECK(options.iterations() >= 0, op, ": option 'iterations' must be >= 0, got ",
              options.iterations());
  TORCH_CHECK(options.topk() >= 0, op, ": option 'topk' must be >= 0, got ", options.topk());
  TORCH_CHECK(options.topk() <= S, op, ": option 'topk' (", options.topk(),
              ") must not exceed the number of keys S = ", S);
  detail::check_scale(op, options.scale());
  detail::check_lengths(op, "key_lengths", options.key_lengths(), q.size(0), S);
  detail::check_lengths(op, "query_lengths", options.query_lengths(), q.size(0), L);
  return reference::clustered_attention(q, k, v, options);
}

}  // namespace attnkit
