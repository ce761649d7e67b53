// Op boundary of agglomerative attention: validation, then the backend that
// agglomerative_attention_dispatch names: for float32 the kernels of
// kernels/agglomerative.h behind an autograd::Function; other dtypes the
// composite (which is how tests run it in float64).
#include <torch/autograd.h>

#include <limits>

#include "base/checks.h"
#include "kernels/agglomerative.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/dispatch_util.h"
#include "reference/reference.h"

namespace attnkit {

namespace {


/// An (N, H, L, M) output laid out like v: when v's classes are interleaved
/// within each row ((N, S, H, M) storage, as a view of x P is), so are the
/// output's, which makes concatenating the classes a free view.
torch::Tensor empty_output_like(const torch::Tensor& v, int64_t L) {
  const int64_t N = v.size(0), H = v.size(1), M = v.size(3);
  if (v.stride(1) < v.stride(2)) return torch::empty({N, L, H, M}, v.options()).transpose(1, 2);
  return torch::empty({N, H, L, M}, v.options());
}

/// Fills the inputs, sizes and options shared by the forward and backward params.
void fill_inputs(kernels::AgglomerativeParams& p, const torch::Tensor& cq, const torch::Tensor& cr,
                 const torch::Tensor& v, bool causal, double clip) {
  detail::bind(p.cq, p.cq_stride, cq);
  detail::bind(p.cr, p.cr_stride, cr);
  detail::bind(p.v, p.v_stride, v);
  p.N = cq.size(0);
  p.H = cq.size(1);
  p.L = cq.size(2);
  p.S = cr.size(2);
  p.M = v.size(3);
  p.causal = causal;
  p.clip = static_cast<float>(clip);
}

/// Params of a forward into a new output laid out like v (see empty_output_like).
kernels::AgglomerativeParams forward_params(const torch::Tensor& cq, const torch::Tensor& cr,
                                            const torch::Tensor& v, bool causal, double clip,
                                            torch::Tensor* out) {
  *out = empty_output_like(v, cq.size(2));
  kernels::AgglomerativeParams p;
  fill_inputs(p, cq, cr, v, causal, clip);
  detail::bind(p.out, p.out_stride, *out);
  return p;
}

/// The float32 forward without autograd: nothing is saved.
torch::Tensor forward_only(const torch::Tensor& cq, const torch::Tensor& cr, const torch::Tensor& v,
                           bool causal, double clip) {
  torch::Tensor out;
  kernels::agglomerative_forward(forward_params(cq, cr, v, causal, clip, &out));
  return out;
}

/// The float32 op under autograd. The forward saves the class average each
/// query read and its unclipped denominator (one row per query when causal,
/// one per class when full), so the backward never recomputes a scan.
class AgglomerativeFunction : public torch::autograd::Function<AgglomerativeFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& cq,
                               const torch::Tensor& cr, const torch::Tensor& v, bool causal,
                               double clip) {
    const int64_t N = cq.size(0), H = cq.size(1), M = v.size(3);
    const int64_t rows = kernels::agglomerative_saved_rows(causal, cq.size(2));
    auto avg = torch::empty({N, H, rows, M}, v.options());
    auto den = torch::empty({N, H, rows}, v.options());
    torch::Tensor out;
    auto p = forward_params(cq, cr, v, causal, clip, &out);
    p.avg = avg.data_ptr<float>();
    p.den = den.data_ptr<float>();
    kernels::agglomerative_forward(p);
    ctx->save_for_backward({cq, cr, v, avg, den});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["clip"] = clip;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &cq = saved[0], &cr = saved[1], &v = saved[2], &avg = saved[3], &den = saved[4];
    const torch::Tensor& dout = grads[0];
    auto dcq = torch::empty_like(cq), dcr = torch::empty_like(cr), dv = torch::empty_like(v);
    kernels::AgglomerativeBackwardParams p;
    fill_inputs(p, cq, cr, v, ctx->saved_data["causal"].toBool(), ctx->saved_data["clip"].toDouble());
    p.avg = avg.data_ptr<float>();
    p.den = den.data_ptr<float>();
    detail::bind(p.dout, p.dout_stride, dout);
    detail::bind(p.dcq, p.dcq_stride, dcq);
    detail::bind(p.dcr, p.dcr_stride, dcr);
    detail::bind(p.dv, p.dv_stride, dv);
    kernels::agglomerative_backward(p);
    return detail::once_differentiable("agglomerative_attention",
                                       {dcq, dcr, dv, torch::Tensor(), torch::Tensor()},
                                       {cq, cr, v, dout});
  }
};

}  // namespace

torch::Tensor agglomerative_attention(const torch::Tensor& cq, const torch::Tensor& cr,
                                      const torch::Tensor& v, const AgglomerativeAttentionFuncOptions& options) {
  constexpr const char* op = "agglomerative_attention";
  detail::check_float_tensor(op, "cq", cq, 3);
  detail::check_float_tensor(op, "cr", cr, 3);
  detail::check_float_tensor(op, "v", v, 4);
  detail::check_same_dtype(op, "cr", cr, "cq", cq);
  detail::check_same_dtype(op, "v", v, "cq", cq);
  detail::check_dim(op, "cr", cr, 0, cq.size(0), "batch size N");
  detail::check_dim(op, "cr", cr, 1, cq.size(1), "class count H");
  detail::check_dim(op, "v", v, 0, cq.size(0), "batch size N");
  detail::check_dim(op, "v", v, 1, cq.size(1), "class count H");
  detail::check_dim(op, "v", v, 2, cr.size(2), "reference length S");
  detail::check_finite_in(op, "clip", options.clip(), cq.scalar_type());
  TORCH_CHECK(options.clip() > 0, op, ": option 'clip' must be > 0, got ", options.clip());
  // Below the dtype's smallest normal number clip rounds to 0 or a subnormal,
  // and the average of an empty prefix becomes 0 / 0 (float32 and bfloat16
  // share that bound; float64's is far below any useful clip).
  const auto type = cq.scalar_type();
  TORCH_CHECK(options.clip() >= detail::dtype_min_normal(type), op, ": option 'clip' must be at least ",
              detail::dtype_min_normal(type), " for ", detail::dtype_name(type), " inputs, got ",
              options.clip());
  if (!agglomerative_attention_dispatch(cq, cr, v, options).uses_kernel())
    return reference::agglomerative_attention(cq, cr, v, options);
  const bool needs_grad = torch::GradMode::is_enabled() &&
                          (cq.requires_grad() || cr.requires_grad() || v.requires_grad());
  if (!needs_grad) return forward_only(cq, cr, v, options.causal(), options.clip());
  return AgglomerativeFunction::apply(cq, cr, v, options.causal(), options.clip());
}

Dispatch agglomerative_attention_dispatch(const torch::Tensor& cq, const torch::Tensor& cr,
                                          const torch::Tensor& v, const AgglomerativeAttentionFuncOptions&) {
  return detail::float32_kernel_or_composite({{"cq", &cq}, {"cr", &cr}, {"v", &v}});
}

}  // namespace attnkit
