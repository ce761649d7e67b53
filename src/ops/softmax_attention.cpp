// Op boundary of exact softmax attention: validation, then the tiled kernel
// (float32) or the composite reference (other dtypes).
#include "kernels/softmax_attention.h"

#include <torch/autograd.h>

#include "ops/binding.h"
#include "ops/checks.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

void check_bias(const char* op, const torch::Tensor& bias, const torch::Tensor& q, int64_t S) {
  if (!bias.defined()) return;
  TORCH_CHECK(bias.device().is_cpu() && bias.is_floating_point(), op,
              ": argument 'bias' must be a floating CPU tensor, got ", bias.scalar_type(),
              " on ", bias.device());
  detail::check_same_dtype(op, "bias", bias, q);
  const int64_t target[4] = {q.size(0), q.size(1), q.size(2), S};
  bool ok = bias.dim() <= 4;
  for (int64_t d = 0; ok && d < bias.dim(); ++d) {
    const int64_t size = bias.size(bias.dim() - 1 - d);
    ok = size == 1 || size == target[3 - d];
  }
  TORCH_CHECK(ok, op, ": argument 'bias' must broadcast to (N, H, L, S) = (", target[0], ", ",
              target[1], ", ", target[2], ", ", target[3], "), got shape ",
              detail::shape_str(bias));
}


/// What the kernel needs besides q, k and v: constants of the autograd graph.
/// (Passed as one struct because Function::apply records the device of every
/// tensor argument, and the bias and key lengths may be undefined.)
struct Constants {
  torch::Tensor bias;         // undefined, or expanded to (N, H, L, S) (stride 0 = broadcast)
  torch::Tensor key_lengths;  // undefined, or contiguous int64 (N)
  double scale;
  bool causal;
};

/// The kernel reads strides, so views of q, k, v, out cost no copy.
kernels::SoftmaxAttentionParams make_params(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, const Constants& c,
                                            const torch::Tensor& out, const torch::Tensor& lse) {
  kernels::SoftmaxAttentionParams p;
  detail::bind(p.q, p.q_stride, q);
  detail::bind(p.k, p.k_stride, k);
  detail::bind(p.v, p.v_stride, v);
  detail::bind(p.out, p.out_stride, out);
  p.lse = lse.data_ptr<float>();
  p.N = q.size(0), p.H = q.size(1), p.L = q.size(2), p.S = k.size(2), p.E = q.size(3), p.M = v.size(3);
  p.scale = static_cast<float>(c.scale);
  p.causal = c.causal;
  p.key_lengths = c.key_lengths.defined() ? c.key_lengths.data_ptr<int64_t>() : nullptr;
  if (c.bias.defined()) detail::bind(p.bias, p.bias_stride, c.bias);
  return p;
}

/// Exact attention by the tiled kernel. The bias is a constant here (the op
/// routes a bias that needs a gradient to the composite path).
class SoftmaxAttentionFunction : public torch::autograd::Function<SoftmaxAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const Constants& c) {
    const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
    auto out = torch::empty({N, H, L, M}, q.options());
    auto lse = torch::empty({N, H, L}, q.options());
    kernels::softmax_attention_forward(make_params(q, k, v, c, out, lse));
    ctx->save_for_backward({q, k, v, out, lse});
    if (c.bias.defined()) ctx->saved_data["bias"] = c.bias;
    if (c.key_lengths.defined()) ctx->saved_data["key_lengths"] = c.key_lengths;
    ctx->saved_data["scale"] = c.scale;
    ctx->saved_data["causal"] = c.causal;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    auto tensor_or_none = [&](const char* key) {
      return ctx->saved_data.count(key) ? ctx->saved_data[key].toTensor() : torch::Tensor();
    };
    const Constants c{tensor_or_none("bias"), tensor_or_none("key_lengths"),
                      ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool()};
    kernels::SoftmaxAttentionBackwardParams p;
    static_cast<kernels::SoftmaxAttentionParams&>(p) = make_params(q, k, v, c, out, lse);
    const auto& dout = grads[0];
    auto dq = torch::empty_like(q, torch::MemoryFormat::Contiguous);
    auto dk = torch::empty_like(k, torch::MemoryFormat::Contiguous);
    auto dv = torch::empty_like(v, torch::MemoryFormat::Contiguous);
    detail::bind(p.dout, p.dout_stride, dout);
    detail::bind(p.dq, p.dq_stride, dq);
    detail::bind(p.dk, p.dk_stride, dk);
    detail::bind(p.dv, p.dv_stride, dv);
    kernels::softmax_attention_backward(p);
    return {dq, dk, dv, torch::Tensor()};
  }
};

bool use_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                const torch::Tensor& bias) {
  const bool f32 = q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
                   v.scalar_type() == torch::kFloat;
  const bool bias_constant = !bias.defined() || !bias.requires_grad();
  return f32 && bias_constant;
}

}  // namespace

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const SoftmaxAttentionOptions& options) {
  constexpr const char* op = "softmax_attention";
  detail::check_qkv(op, q, k, v);
  detail::check_scale(op, options.scale());
  detail::check_lengths(op, "key_lengths", options.key_lengths(), q.size(0), k.size(2));
  check_bias(op, options.bias(), q, k.size(2));
  if (!use_kernel(q, k, v, options.bias())) return reference::softmax_attention(q, k, v, options);

  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  auto bias = options.bias();
  if (bias.defined()) bias = bias.expand({N, H, L, S});  // stride 0 on broadcast dimensions
  auto key_lengths = options.key_lengths();
  if (key_lengths.defined()) key_lengths = key_lengths.contiguous();
  return SoftmaxAttentionFunction::apply(
      q, k, v, Constants{bias, key_lengths, detail::scale_or_default(options.scale(), q.size(3)),
                         options.causal()});
}

}  // namespace attnkit
