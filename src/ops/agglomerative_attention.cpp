// Op boundary of agglomerative attention: validation, then the backend that
// agglomerative_attention_dispatch names: for float32 the kernels of
// kernels/agglomerative_attention.h behind an autograd::Function; other dtypes the
// composite (which is how tests run it in float64). Registers its schemas
// (agglomerative_attention and the kernel ops) at its bottom.
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "ops/checks.h"
#include "kernels/agglomerative_attention.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/dispatch_util.h"
#include "ops/kernel_op.h"
#include "ops/schema.h"
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

// The kernels as ops of their own (ops/kernel_op.h), with CPU and Meta
// kernels, called through the dispatcher: attnkit::_agglomerative_forward
// (`save`: also the class averages and denominators the backward reads, else
// empty (0) tensors) and _agglomerative_backward. Their CPU kernels check
// their arguments as the op does (Python can call them directly).

using AgglomerativeOutputs = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;  // out, avg, den
using AgglomerativeGradients = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
using AgglomerativeForwardSignature = AgglomerativeOutputs(const torch::Tensor&, const torch::Tensor&,
                                                           const torch::Tensor&, bool, double, bool);
using AgglomerativeBackwardSignature = AgglomerativeGradients(const torch::Tensor&, const torch::Tensor&,
                                                              const torch::Tensor&, const torch::Tensor&,
                                                              const torch::Tensor&, const torch::Tensor&, bool, double);

/// agglomerative_attention's checks.
void check_agglomerative(const char* op, const torch::Tensor& cq, const torch::Tensor& cr, const torch::Tensor& v,
                         double clip) {
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
  detail::check_finite_in(op, "clip", clip, cq.scalar_type());
  TORCH_CHECK(clip > 0, op, ": option 'clip' must be > 0, got ", clip);
  // Where the clip is active the output's slope towards cr is v / clip, which
  // the backward sums over the queries: a clip near the dtype's smallest
  // normal number (float32's 1.2e-38) made those gradients overflow to inf or
  // NaN from ordinary inputs, and a smaller one rounds to 0 or a subnormal (an
  // empty prefix's average 0 / 0). The square root of the smallest normal
  // number (2^-63 for float32 and bfloat16, 2^-511 for float64) keeps 1 / clip
  // 2^64 below the largest float (docs/MATH.md, "Agglomerative attention").
  const auto type = cq.scalar_type();
  const double smallest = std::sqrt(detail::dtype_min_normal(type));
  TORCH_CHECK(clip >= smallest, op, ": option 'clip' must be at least ", smallest, " for ",
              detail::dtype_name(type), " inputs (the square root of the smallest normal number: below it the "
              "gradients overflow), got ", clip);
}

void check_agglomerative_kernel(const char* op, const torch::Tensor& cq, const torch::Tensor& cr,
                                const torch::Tensor& v, double clip) {
  check_agglomerative(op, cq, cr, v, clip);
  TORCH_CHECK(cq.scalar_type() == torch::kFloat, op, ": the kernel takes float32, got ",
              detail::dtype_name(cq.scalar_type()));
}

/// out laid out like v (empty_output_like); with `save`, the class average
/// each query read and its unclipped denominator (one row per query when
/// causal, one per class when full), so the backward never recomputes a scan.
AgglomerativeOutputs agglomerative_outputs(const torch::Tensor& cq, const torch::Tensor& v, bool causal, bool save) {
  const int64_t N = cq.size(0), H = cq.size(1), M = v.size(3);
  const int64_t rows = kernels::agglomerative_saved_rows(causal, cq.size(2));
  return {empty_output_like(v, cq.size(2)),
          save ? torch::empty({N, H, rows, M}, v.options()) : torch::empty({0}, v.options()),
          save ? torch::empty({N, H, rows}, v.options()) : torch::empty({0}, v.options())};
}

AgglomerativeOutputs agglomerative_forward_cpu(const torch::Tensor& cq, const torch::Tensor& cr, const torch::Tensor& v,
                                               bool causal, double clip, bool save) {
  check_agglomerative_kernel("_agglomerative_forward", cq, cr, v, clip);
  auto outputs = agglomerative_outputs(cq, v, causal, save);
  auto& [out, avg, den] = outputs;
  kernels::AgglomerativeParams p;
  fill_inputs(p, cq, cr, v, causal, clip);
  detail::bind(p.out, p.out_stride, out);
  if (save) {
    p.avg = avg.data_ptr<float>();
    p.den = den.data_ptr<float>();
  }
  kernels::agglomerative_forward(p);
  return outputs;
}

AgglomerativeOutputs agglomerative_forward_meta(const torch::Tensor& cq, const torch::Tensor&, const torch::Tensor& v,
                                                bool causal, double, bool save) {
  return agglomerative_outputs(cq, v, causal, save);
}

/// dcq, dcr, dv laid out like cq, cr, v (empty_like keeps a dense layout).
AgglomerativeGradients agglomerative_gradients(const torch::Tensor& cq, const torch::Tensor& cr,
                                               const torch::Tensor& v) {
  return {torch::empty_like(cq), torch::empty_like(cr), torch::empty_like(v)};
}

AgglomerativeGradients agglomerative_backward_meta(const torch::Tensor&, const torch::Tensor& cq,
                                                   const torch::Tensor& cr, const torch::Tensor& v,
                                                   const torch::Tensor&, const torch::Tensor&, bool, double) {
  return agglomerative_gradients(cq, cr, v);
}

AgglomerativeGradients agglomerative_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& cq,
                                                  const torch::Tensor& cr, const torch::Tensor& v,
                                                  const torch::Tensor& avg, const torch::Tensor& den, bool causal,
                                                  double clip) {
  constexpr const char* op = "_agglomerative_backward";
  check_agglomerative_kernel(op, cq, cr, v, clip);
  const int64_t N = cq.size(0), H = cq.size(1), L = cq.size(2), M = v.size(3);
  const int64_t rows = kernels::agglomerative_saved_rows(causal, L);
  TORCH_CHECK(grad_out.scalar_type() == torch::kFloat && grad_out.sizes() == torch::IntArrayRef({N, H, L, M}), op,
              ": argument 'grad_out' must be float32 of shape (", N, ", ", H, ", ", L, ", ", M, "), got ",
              detail::dtype_name(grad_out.scalar_type()), " ", detail::shape_str(grad_out));
  TORCH_CHECK(
      avg.scalar_type() == torch::kFloat && avg.is_contiguous() && avg.sizes() == torch::IntArrayRef({N, H, rows, M}) &&
          den.scalar_type() == torch::kFloat && den.is_contiguous() && den.sizes() == torch::IntArrayRef({N, H, rows}),
      op, ": arguments 'avg' and 'den' must be the forward's (contiguous float32 of shapes (", N, ", ", H, ", ", rows,
      ", ", M, ") and (", N, ", ", H, ", ", rows, ")), got ", detail::shape_str(avg), " and ", detail::shape_str(den));
  auto grads = agglomerative_gradients(cq, cr, v);
  auto& [dcq, dcr, dv] = grads;
  kernels::AgglomerativeBackwardParams p;
  fill_inputs(p, cq, cr, v, causal, clip);
  p.avg = avg.data_ptr<float>();
  p.den = den.data_ptr<float>();
  detail::bind(p.dout, p.dout_stride, grad_out);
  detail::bind(p.dcq, p.dcq_stride, dcq);
  detail::bind(p.dcr, p.dcr_stride, dcr);
  detail::bind(p.dv, p.dv_stride, dv);
  kernels::agglomerative_backward(p);
  return grads;
}

AgglomerativeOutputs call_agglomerative_forward(const torch::Tensor& cq, const torch::Tensor& cr,
                                                const torch::Tensor& v, bool causal, double clip, bool save) {
  static const auto op = detail::kernel_op<AgglomerativeForwardSignature>("attnkit::_agglomerative_forward");
  return op.call(cq, cr, v, causal, clip, save);
}

/// The float32 op under autograd (the forward saves what the backward reads).
class AgglomerativeFunction : public torch::autograd::Function<AgglomerativeFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& cq, const torch::Tensor& cr,
                               const torch::Tensor& v, bool causal, double clip) {
    auto [out, avg, den] = call_agglomerative_forward(cq, cr, v, causal, clip, /*save=*/true);
    ctx->save_for_backward({cq, cr, v, avg, den});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["clip"] = clip;
    return out;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    static const auto op = detail::kernel_op<AgglomerativeBackwardSignature>("attnkit::_agglomerative_backward");
    const auto saved = ctx->get_saved_variables();
    const auto &cq = saved[0], &cr = saved[1], &v = saved[2], &avg = saved[3], &den = saved[4];
    auto [dcq, dcr, dv] =
        op.call(grads[0], cq, cr, v, avg, den, ctx->saved_data["causal"].toBool(), ctx->saved_data["clip"].toDouble());
    return detail::once_differentiable("agglomerative_attention", {dcq, dcr, dv, torch::Tensor(), torch::Tensor()},
                                       {cq, cr, v, grads[0]});
  }
};

}  // namespace

torch::Tensor agglomerative_attention(const torch::Tensor& cq, const torch::Tensor& cr,
                                      const torch::Tensor& v, const AgglomerativeAttentionFuncOptions& options) {
  check_agglomerative("agglomerative_attention", cq, cr, v, options.clip());
  if (!agglomerative_attention_dispatch(cq, cr, v, options).uses_kernel())
    return reference::agglomerative_attention(cq, cr, v, options);
  const bool needs_grad = torch::GradMode::is_enabled() &&
                          (cq.requires_grad() || cr.requires_grad() || v.requires_grad());
  if (!needs_grad)  // nothing to save
    return std::get<0>(call_agglomerative_forward(cq, cr, v, options.causal(), options.clip(), /*save=*/false));
  return AgglomerativeFunction::apply(cq, cr, v, options.causal(), options.clip());
}

Dispatch agglomerative_attention_dispatch(const torch::Tensor& cq, const torch::Tensor& cr,
                                          const torch::Tensor& v, const AgglomerativeAttentionFuncOptions&) {
  return detail::float32_kernel_or_composite({{"cq", &cq}, {"cr", &cr}, {"v", &v}});
}

namespace {

torch::Tensor agglomerative_attention_op(const torch::Tensor& cq, const torch::Tensor& cr,
                                         const torch::Tensor& v, bool causal, double clip) {
  return agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().causal(causal).clip(clip));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def(("agglomerative_attention(Tensor cq, Tensor cr, Tensor v, *, bool causal=False, float clip=" +
         detail::schema_float(AgglomerativeAttentionFuncOptions().clip()) + ") -> Tensor")
            .c_str(),
        &agglomerative_attention_op);
  m.def(
      "_agglomerative_forward(Tensor cq, Tensor cr, Tensor v, bool causal, float clip, bool save) "
      "-> (Tensor out, Tensor avg, Tensor den)");
  m.def(
      "_agglomerative_backward(Tensor grad_out, Tensor cq, Tensor cr, Tensor v, Tensor avg, Tensor den, "
      "bool causal, float clip) -> (Tensor dcq, Tensor dcr, Tensor dv)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("_agglomerative_forward", &agglomerative_forward_cpu);
  m.impl("_agglomerative_backward", &agglomerative_backward_cpu);
}

TORCH_LIBRARY_IMPL(attnkit, Meta, m) {
  m.impl("_agglomerative_forward", &agglomerative_forward_meta);
  m.impl("_agglomerative_backward", &agglomerative_backward_meta);
}

}  // namespace attnkit
