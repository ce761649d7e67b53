// Op boundary of agglomerative attention.
#include "ops/checks.h"
#include "reference/reference.h"

namespace attnkit {

torch::Tensor agglomerative_attention(const torch::Tensor& cq, const torch::Tensor& cr,
                                      const torch::Tensor& v, const AgglomerativeOptions& options) {
  constexpr const char* op = "agglomerative_attention";
  detail::check_float_tensor(op, "cq", cq, 3);
  detail::check_float_tensor(op, "cr", cr, 3);
  detail::check_float_tensor(op, "v", v, 4);
  detail::check_same_dtype(op, "cr", cr, cq);
  detail::check_same_dtype(op, "v", v, cq);
  detail::check_dim(op, "cr", cr, 0, cq.size(0), "batch size N");
  detail::check_dim(op, "cr", cr, 1, cq.size(1), "class count H");
  detail::check_dim(op, "v", v, 0, cq.size(0), "batch size N");
  detail::check_dim(op, "v", v, 1, cq.size(1), "class count H");
  detail::check_dim(op, "v", v, 2, cr.size(2), "reference length S");
  detail::check_finite(op, "clip", options.clip());
  TORCH_CHECK(options.clip() > 0, op, ": option 'clip' must be > 0, got ", options.clip());
  return reference::agglomerative_attention(cq, cr, v, options);
}

}  // namespace attnkit
