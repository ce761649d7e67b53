// Op boundaries of linear attention and its packed form: validation, then the
// backend that <op>_dispatch names: float32 through the kernels of
// src/kernels/linear_attention (as autograd Functions, so C++ and Python
// callers get the kernels' backward), other dtypes through the composite.
// Registers its ops' schemas (linear_attention, varlen_linear_attention, and
// the kernel ops) at its bottom. gated_linear_attention is
// ops/gated_linear_attention.cpp's; the kernel ops' shared checks are in
// ops/linear_attention.h.
#include "kernels/linear_attention.h"

#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/checks.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/dispatch_util.h"
#include "ops/head_features.h"
#include "ops/kernel_op.h"
#include "ops/linear_attention.h"
#include "ops/schema.h"
#include "ops/varlen.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using detail::check_float32_kernel;
using detail::check_float32_shape;


kernels::FeatureMapKind kernel_feature_map(FeatureMap map) {
  return map == FeatureMap::elu ? kernels::FeatureMapKind::elu : kernels::FeatureMapKind::identity;
}

/// Kernel parameters over q, k, v, out and den (undefined unless normalize).
kernels::LinearAttentionBackwardParams linear_params(const torch::Tensor& q, const torch::Tensor& k,
                                                     const torch::Tensor& v, torch::Tensor& out,
                                                     torch::Tensor& den,
                                                     const LinearAttentionFuncOptions& o) {
  kernels::LinearAttentionBackwardParams p;
  detail::bind_qkv(p, q, k, v, out);
  // Grouped-query heads: the kernel reads each key/value head for its group.
  p.kv_group = detail::kv_group(q, k);
  p.den = den.defined() ? den.data_ptr<float>() : nullptr;
  p.feature_map = kernel_feature_map(o.feature_map());
  p.normalize = o.normalize();
  p.causal = o.causal();
  p.eps = static_cast<float>(o.eps());
  p.rotary_dim = o.rotary_dim();
  p.rotary_base = o.rotary_base();
  return p;
}

/// The options as saved_data, read back by options_from.
void save_options(AutogradContext* ctx, const LinearAttentionFuncOptions& o) {
  ctx->saved_data["elu"] = o.feature_map() == FeatureMap::elu;
  ctx->saved_data["normalize"] = o.normalize();
  ctx->saved_data["causal"] = o.causal();
  ctx->saved_data["eps"] = o.eps();
  ctx->saved_data["rotary_dim"] = o.rotary_dim();
  ctx->saved_data["rotary_base"] = o.rotary_base();
}

LinearAttentionFuncOptions options_from(const AutogradContext* ctx) {
  const auto& d = ctx->saved_data;
  return LinearAttentionFuncOptions()
      .feature_map(d.at("elu").toBool() ? FeatureMap::elu : FeatureMap::identity)
      .normalize(d.at("normalize").toBool())
      .causal(d.at("causal").toBool())
      .eps(d.at("eps").toDouble())
      .rotary_dim(d.at("rotary_dim").toInt())
      .rotary_base(d.at("rotary_base").toDouble());
}

// ---------------------------------------------------------------------------
// The kernels as ops of their own (ops/kernel_op.h), with CPU and Meta
// kernels, called by the autograd Functions below through the dispatcher:
// attnkit::_linear_attention_forward / _backward, their packed forms
// _varlen_linear_attention_forward / _backward (the offsets are tensor
// arguments, read in the CPU kernels). Their CPU kernels check their
// arguments as the ops do (Python can call them directly); den is an empty
// (0) tensor without normalize.
// ---------------------------------------------------------------------------

using LinearOutputs = std::tuple<torch::Tensor, torch::Tensor>;  // out, den
using QkvGradients = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
using LinearAttentionForwardSignature = LinearOutputs(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                      c10::string_view, bool, bool, double, int64_t, double);
using LinearAttentionBackwardSignature = QkvGradients(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                      const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                      c10::string_view, bool, bool, double, int64_t, double);
using VarlenLinearForwardSignature = LinearOutputs(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                   const torch::Tensor&, const torch::Tensor&, c10::string_view, bool,
                                                   bool, double, int64_t, double);
using VarlenLinearBackwardSignature = QkvGradients(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                   const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                   const torch::Tensor&, const torch::Tensor&, c10::string_view, bool,
                                                   bool, double, int64_t, double);

LinearAttentionFuncOptions linear_options(c10::string_view feature_map, bool normalize, bool causal, double eps,
                                          int64_t rotary_dim, double rotary_base) {
  return LinearAttentionFuncOptions()
      .feature_map(feature_map_from_string(std::string(feature_map)))
      .normalize(normalize)
      .causal(causal)
      .eps(eps)
      .rotary_dim(rotary_dim)
      .rotary_base(rotary_base);
}

/// The options' checks of linear_attention and varlen_linear_attention
/// (q's last dimension is E in both layouts).
void check_linear_options(const char* op, const torch::Tensor& q, const LinearAttentionFuncOptions& o) {
  detail::check_finite_in(op, "eps", o.eps(), q.scalar_type());
  TORCH_CHECK(o.eps() >= 0, op, ": option 'eps' must be >= 0, got ", o.eps());
  detail::check_rotary(op, "rotary_dim", o.rotary_dim(), "rotary_base", o.rotary_base(), q.size(q.dim() - 1));
}

/// linear_attention's checks on a kernel op's (N, H, L, E) arguments, and float32.
void check_linear_kernel_arguments(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const LinearAttentionFuncOptions& o) {
  detail::check_qkv(op, q, k, v, /*grouped_heads=*/true);
  check_linear_options(op, q, o);
  check_float32_kernel(op, q);
}

/// grad_out and out of a kernel's backward: float32 in the forward's output shape.
void check_outputs(const char* op, const torch::Tensor& grad_out, const torch::Tensor& out, torch::IntArrayRef shape) {
  check_float32_shape(op, "grad_out", grad_out, shape);
  check_float32_shape(op, "out", out, shape);
}

/// den of a kernel's backward: (rows) contiguous float32 with normalize,
/// else anything (unread).
void check_den(const char* op, const torch::Tensor& den, bool normalize, int64_t rows) {
  if (!normalize) return;
  TORCH_CHECK(den.scalar_type() == torch::kFloat && den.numel() == rows && den.is_contiguous(), op,
              ": argument 'den' must be contiguous float32 with ", rows, " entries (normalize), got ",
              detail::dtype_name(den.scalar_type()), " ", detail::shape_str(den));
}

/// The den a kernel reads and writes: `den` itself with normalize, else none.
torch::Tensor used_den(const torch::Tensor& den, bool normalize) { return normalize ? den : torch::Tensor(); }

LinearOutputs linear_outputs(const torch::Tensor& q, const torch::Tensor& v, bool normalize) {
  return {torch::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options()),
          normalize ? torch::empty({q.size(0), q.size(1), q.size(2)}, q.options()) : torch::empty({0}, q.options())};
}

LinearOutputs linear_attention_forward_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           c10::string_view feature_map, bool normalize, bool causal, double eps,
                                           int64_t rotary_dim, double rotary_base) {
  constexpr const char* op = "_linear_attention_forward";
  const auto o = linear_options(feature_map, normalize, causal, eps, rotary_dim, rotary_base);
  check_linear_kernel_arguments(op, q, k, v, o);
  auto [out, den] = linear_outputs(q, v, normalize);
  auto kernel_den = used_den(den, normalize);
  kernels::linear_attention_forward(linear_params(q, k, v, out, kernel_den, o));
  return {out, den};
}

LinearOutputs linear_attention_forward_meta(const torch::Tensor& q, const torch::Tensor&, const torch::Tensor& v,
                                            c10::string_view, bool normalize, bool, double, int64_t, double) {
  return linear_outputs(q, v, normalize);
}

/// dq, dk, dv contiguous in the shapes of q, k, v (grouped-query heads: the
/// kernel sums each key/value head's gradient over its group).
QkvGradients qkv_gradients(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  auto like = [](const torch::Tensor& x) { return torch::empty_like(x, torch::MemoryFormat::Contiguous); };
  return {like(q), like(k), like(v)};
}

QkvGradients linear_attention_backward_meta(const torch::Tensor&, const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, const torch::Tensor&, const torch::Tensor&,
                                            c10::string_view, bool, bool, double, int64_t, double) {
  return qkv_gradients(q, k, v);
}

QkvGradients linear_attention_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& q,
                                           const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                           const torch::Tensor& den, c10::string_view feature_map, bool normalize,
                                           bool causal, double eps, int64_t rotary_dim, double rotary_base) {
  constexpr const char* op = "_linear_attention_backward";
  const auto o = linear_options(feature_map, normalize, causal, eps, rotary_dim, rotary_base);
  check_linear_kernel_arguments(op, q, k, v, o);
  check_outputs(op, grad_out, out, {q.size(0), q.size(1), q.size(2), v.size(3)});
  check_den(op, den, normalize, q.size(0) * q.size(1) * q.size(2));
  auto out_ = out;
  auto kernel_den = used_den(den, normalize);
  auto p = linear_params(q, k, v, out_, kernel_den, o);
  // Grouped-query heads: dk and dv in k's and v's head count, each summed
  // by the kernel over its group in head order (kernels/linear_attention.h).
  auto [dq, dk, dv] = detail::bind_qkv_grads(p, q, k, v, grad_out);
  kernels::linear_attention_backward(p);
  return {dq, dk, dv};
}

/// Linear attention over a packed batch (varlen_linear_attention): one kernel
/// call per sequence over views of the packed tensors, so each sequence is
/// bitwise the op on it alone. den (when normalize) holds H Tq floats,
/// sequence b's (H, Lb) block at H cu_q[b].
LinearOutputs varlen_linear_outputs(const torch::Tensor& q, const torch::Tensor& v, bool normalize) {
  return {torch::empty({q.size(0), q.size(1), v.size(2)}, q.options()),
          normalize ? torch::empty({q.size(1) * q.size(0)}, q.options()) : torch::empty({0}, q.options())};
}

/// The offsets of a packed kernel op's arguments, checked with the rest.
std::pair<std::vector<int64_t>, std::vector<int64_t>> check_varlen_linear_kernel_arguments(
    const char* op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k, const LinearAttentionFuncOptions& o) {
  auto offsets = detail::check_packed(op, q, k, v, cu_seqlens_q, cu_seqlens_k);
  check_linear_options(op, q, o);
  check_float32_kernel(op, q);
  return offsets;
}

LinearOutputs varlen_linear_forward_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                        c10::string_view feature_map, bool normalize, bool causal, double eps,
                                        int64_t rotary_dim, double rotary_base) {
  const auto o = linear_options(feature_map, normalize, causal, eps, rotary_dim, rotary_base);
  const auto [cu_q, cu_k] =
      check_varlen_linear_kernel_arguments("_varlen_linear_attention_forward", q, k, v, cu_seqlens_q, cu_seqlens_k, o);
  TORCH_INTERNAL_ASSERT(!cu_q.empty(), "a CPU kernel read no offsets");
  auto [out, den] = varlen_linear_outputs(q, v, normalize);
  const auto kernel_den = used_den(den, normalize);
  for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const detail::PackedSequence s(cu_q, cu_k, b);
    auto out_b = s.of(out), den_b = s.row_stats(kernel_den, q.size(1));
    kernels::linear_attention_forward(linear_params(s.of(q), s.keys(k), s.keys(v), out_b, den_b, o));
  }
  return {out, den};
}

LinearOutputs varlen_linear_forward_meta(const torch::Tensor& q, const torch::Tensor&, const torch::Tensor& v,
                                         const torch::Tensor&, const torch::Tensor&, c10::string_view, bool normalize,
                                         bool, double, int64_t, double) {
  return varlen_linear_outputs(q, v, normalize);
}

QkvGradients varlen_linear_backward_meta(const torch::Tensor&, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const torch::Tensor&, const torch::Tensor&,
                                         const torch::Tensor&, const torch::Tensor&, c10::string_view, bool, bool,
                                         double, int64_t, double) {
  return qkv_gradients(q, k, v);
}

QkvGradients varlen_linear_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& den,
                                        const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                        c10::string_view feature_map, bool normalize, bool causal, double eps,
                                        int64_t rotary_dim, double rotary_base) {
  constexpr const char* op = "_varlen_linear_attention_backward";
  const auto o = linear_options(feature_map, normalize, causal, eps, rotary_dim, rotary_base);
  const auto [cu_q, cu_k] = check_varlen_linear_kernel_arguments(op, q, k, v, cu_seqlens_q, cu_seqlens_k, o);
  TORCH_INTERNAL_ASSERT(!cu_q.empty(), "a CPU kernel read no offsets");
  check_outputs(op, grad_out, out, {q.size(0), q.size(1), v.size(2)});
  check_den(op, den, normalize, q.size(0) * q.size(1));
  const auto kernel_den = used_den(den, normalize);
  // Grouped-query heads: dk and dv in k's and v's head count, each summed
  // by the kernel over its group in head order (kernels/linear_attention.h).
  auto [dq, dk, dv] = qkv_gradients(q, k, v);
  for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const detail::PackedSequence s(cu_q, cu_k, b);
    auto out_b = s.of(out), den_b = s.row_stats(kernel_den, q.size(1));
    auto p = linear_params(s.of(q), s.keys(k), s.keys(v), out_b, den_b, o);
    detail::bind(p.dout, p.dout_stride, s.of(grad_out));
    detail::bind(p.dq, p.dq_stride, s.of(dq));
    detail::bind(p.dk, p.dk_stride, s.keys(dk));
    detail::bind(p.dv, p.dv_stride, s.keys(dv));
    kernels::linear_attention_backward(p);
  }
  return {dq, dk, dv};
}

/// The kernel op's arguments (c10::string_view from the options' feature map).
struct LinearOpArguments {
  std::string feature_map;
  bool normalize, causal;
  double eps;
  int64_t rotary_dim;
  double rotary_base;
};

LinearOpArguments op_arguments(const LinearAttentionFuncOptions& o) {
  return {to_string(o.feature_map()), o.normalize(), o.causal(), o.eps(), o.rotary_dim(), o.rotary_base()};
}

class LinearAttentionFunction : public torch::autograd::Function<LinearAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const LinearAttentionFuncOptions& o) {
    static const auto op = detail::kernel_op<LinearAttentionForwardSignature>("attnkit::_linear_attention_forward");
    const auto a = op_arguments(o);
    auto [out, den] = op.call(q, k, v, a.feature_map, a.normalize, a.causal, a.eps, a.rotary_dim, a.rotary_base);
    ctx->save_for_backward({q, k, v, out, den});
    save_options(ctx, o);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = detail::kernel_op<LinearAttentionBackwardSignature>("attnkit::_linear_attention_backward");
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &den = saved[4];
    const auto a = op_arguments(options_from(ctx));
    auto [dq, dk, dv] =
        op.call(grads[0], q, k, v, out, den, a.feature_map, a.normalize, a.causal, a.eps, a.rotary_dim, a.rotary_base);
    return detail::once_differentiable("linear_attention", {dq, dk, dv, torch::Tensor()}, {q, k, v, grads[0]});
  }
};

class VarlenLinearFunction : public torch::autograd::Function<VarlenLinearFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& cu_seqlens_q,
                               const torch::Tensor& cu_seqlens_k, const LinearAttentionFuncOptions& o) {
    static const auto op = detail::kernel_op<VarlenLinearForwardSignature>("attnkit::_varlen_linear_attention_forward");
    const auto a = op_arguments(o);
    auto [out, den] = op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, a.feature_map, a.normalize, a.causal, a.eps,
                              a.rotary_dim, a.rotary_base);
    ctx->save_for_backward({q, k, v, out, den, cu_seqlens_q, cu_seqlens_k});
    save_options(ctx, o);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op =
        detail::kernel_op<VarlenLinearBackwardSignature>("attnkit::_varlen_linear_attention_backward");
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &den = saved[4];
    const auto a = op_arguments(options_from(ctx));
    auto [dq, dk, dv] = op.call(grads[0], q, k, v, out, den, saved[5], saved[6], a.feature_map, a.normalize, a.causal,
                                a.eps, a.rotary_dim, a.rotary_base);
    return detail::once_differentiable("varlen_linear_attention",
                                       {dq, dk, dv, torch::Tensor(), torch::Tensor(), torch::Tensor()},
                                       {q, k, v, grads[0]});
  }
};

}  // namespace

FeatureMap feature_map_from_string(const std::string& name) {
  if (name == "identity") return FeatureMap::identity;
  if (name == "elu") return FeatureMap::elu;
  TORCH_CHECK(false, "linear_attention: option 'feature_map' must be 'identity' or 'elu', got '",
              name, "'");
}

std::string to_string(FeatureMap map) { return map == FeatureMap::elu ? "elu" : "identity"; }

torch::Tensor linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const LinearAttentionFuncOptions& options) {
  constexpr const char* op = "linear_attention";
  detail::check_qkv(op, q, k, v, /*grouped_heads=*/true);
  check_linear_options(op, q, options);
  // bfloat16 keeps 8 bits: the normalised form's gradient subtracts nearly
  // equal terms (S v and z out), which in bfloat16 arithmetic lost up to 7%
  // (measured, tests/ops/regressions_test.cpp). So bf16 inputs take the
  // float32 kernel, and the result is rounded once.
  if (q.scalar_type() == torch::kBFloat16)
    return linear_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), options)
        .to(torch::kBFloat16);
  if (!linear_attention_dispatch(q, k, v, options).uses_kernel())
    return reference::linear_attention(q, k, v, options);
  return LinearAttentionFunction::apply(q, k, v, options);
}

torch::Tensor varlen_linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& cu_seqlens_q,
                                      const torch::Tensor& cu_seqlens_k,
                                      const LinearAttentionFuncOptions& options) {
  constexpr const char* op = "varlen_linear_attention";
  auto [cu_q, cu_k] = detail::check_packed(op, q, k, v, cu_seqlens_q, cu_seqlens_k);
  check_linear_options(op, q, options);
  if (q.scalar_type() == torch::kBFloat16)  // the float32 kernel, as linear_attention does
    return varlen_linear_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), cu_seqlens_q,
                                   cu_seqlens_k, options)
        .to(torch::kBFloat16);
  if (q.scalar_type() != torch::kFloat) {  // the composite, sequence by sequence
    TORCH_CHECK(!cu_q.empty(), op, ": ", detail::dtype_name(q.scalar_type()),
                " inputs take the composite, which reads the offsets to cut the batch and so cannot be traced "
                "(torch.compile, torch.export); float32 and bfloat16 can");
    return detail::each_sequence(q, k, v, cu_q, cu_k, [&](const auto& qb, const auto& kb, const auto& vb) {
      return linear_attention(qb, kb, vb, options);
    });
  }
  return VarlenLinearFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, options);
}

Dispatch linear_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const LinearAttentionFuncOptions&) {
  if (q.scalar_type() == torch::kBFloat16)  // k and v too: the op checked they match q
    return Dispatch::kernel("bf16 converted to float32 (no bf16 kernel for linear attention)");
  return detail::float32_kernel_or_composite({{"q", &q}, {"k", &k}, {"v", &v}});
}

namespace {

torch::Tensor linear_attention_op(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, c10::string_view feature_map,
                                  bool normalize, bool causal, double eps, int64_t rotary_dim,
                                  double rotary_base) {
  return linear_attention(q, k, v, LinearAttentionFuncOptions()
                                       .feature_map(feature_map_from_string(std::string(feature_map)))
                                       .normalize(normalize)
                                       .causal(causal)
                                       .eps(eps)
                                       .rotary_dim(rotary_dim)
                                       .rotary_base(rotary_base));
}

torch::Tensor varlen_linear_attention_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                         c10::string_view feature_map, bool normalize, bool causal, double eps,
                                         int64_t rotary_dim, double rotary_base) {
  return varlen_linear_attention(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                 LinearAttentionFuncOptions()
                                     .feature_map(feature_map_from_string(std::string(feature_map)))
                                     .normalize(normalize)
                                     .causal(causal)
                                     .eps(eps)
                                     .rotary_dim(rotary_dim)
                                     .rotary_base(rotary_base));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  // The schemas' defaults are the *FuncOptions' (ops.h), written once there.
  using detail::schema_bool;
  using detail::schema_float;
  const LinearAttentionFuncOptions lin;
  m.def(("linear_attention(Tensor q, Tensor k, Tensor v, *, str feature_map='" + to_string(lin.feature_map()) +
         "', bool normalize=" + schema_bool(lin.normalize()) + ", bool causal=" + schema_bool(lin.causal()) +
         ", float eps=" + schema_float(lin.eps()) + ", int rotary_dim=" + std::to_string(lin.rotary_dim()) +
         ", float rotary_base=" + schema_float(lin.rotary_base()) + ") -> Tensor")
            .c_str(),
        &linear_attention_op);
  m.def(("varlen_linear_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, *, "
         "str feature_map='" + to_string(lin.feature_map()) + "', bool normalize=" + schema_bool(lin.normalize()) +
         ", bool causal=" + schema_bool(lin.causal()) + ", float eps=" + schema_float(lin.eps()) +
         ", int rotary_dim=" + std::to_string(lin.rotary_dim()) + ", float rotary_base=" +
         schema_float(lin.rotary_base()) + ") -> Tensor")
            .c_str(),
        &varlen_linear_attention_op);
  m.def(
      "_linear_attention_forward(Tensor q, Tensor k, Tensor v, str feature_map, bool normalize, bool causal, "
      "float eps, int rotary_dim, float rotary_base) -> (Tensor out, Tensor den)");
  m.def(
      "_linear_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor den, "
      "str feature_map, bool normalize, bool causal, float eps, int rotary_dim, float rotary_base) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "_varlen_linear_attention_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "str feature_map, bool normalize, bool causal, float eps, int rotary_dim, float rotary_base) "
      "-> (Tensor out, Tensor den)");
  m.def(
      "_varlen_linear_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor den, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, str feature_map, bool normalize, bool causal, float eps, "
      "int rotary_dim, float rotary_base) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("_linear_attention_forward", &linear_attention_forward_cpu);
  m.impl("_linear_attention_backward", &linear_attention_backward_cpu);
  m.impl("_varlen_linear_attention_forward", &varlen_linear_forward_cpu);
  m.impl("_varlen_linear_attention_backward", &varlen_linear_backward_cpu);
}

TORCH_LIBRARY_IMPL(attnkit, Meta, m) {
  m.impl("_linear_attention_forward", &linear_attention_forward_meta);
  m.impl("_linear_attention_backward", &linear_attention_backward_meta);
  m.impl("_varlen_linear_attention_forward", &varlen_linear_forward_meta);
  m.impl("_varlen_linear_attention_backward", &varlen_linear_backward_meta);
}

}  // namespace attnkit
