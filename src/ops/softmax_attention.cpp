// Op boundary of exact softmax attention: validation, then the implementation.
#include "ops/checks.h"
#include "reference/reference.h"

namespace attnkit {

namespace {
void check_bias(const char* op, const torch::Tensor& bias, const torch::Tensor& q, int64_t S) {
  if (!bias.defined()) return;
  TORCH_CHECK(bias.device().is_cpu() && bias.is_floating_point(), op,
              ": argument 'bias' must be a floating CPU tensor, got ", bias.scalar_type(),
              " on ", bias.device());
  detail::check_same_dtype(op, "bias", bias, q);
  const int64_t target[4] = {q.size(0), q.size(1), q.size(2), S};
  TORCH_CHECK(bias.dim() <= 4, op, ": argument 'bias' must broadcast to (N, H, L, S) = (",
              target[0], ", ", target[1], ", ", target[2], ", ", target[3], "), got shape ",
              detail::shape_str(bias));
  for (int64_t d = 0; d < bias.dim(); ++d) {
    const int64_t size = bias.size(bias.dim() - 1 - d), want = target[3 - d];
    TORCH_CHECK(size == 1 || size == want, op,
                ": argument 'bias' must broadcast to (N, H, L, S) = (", target[0], ", ",
                target[1], ", ", target[2], ", ", target[3], "), got shape ",
                detail::shape_str(bias));
  }
}
}  // namespace

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const SoftmaxAttentionOptions& options) {
  constexpr const char* op = "softmax_attention";
  detail::check_qkv(op, q, k, v);
  detail::check_scale(op, options.scale());
  detail::check_lengths(op, "key_lengths", options.key_lengths(), q.size(0), k.size(2));
  check_bias(op, options.bias(), q, k.size(2));
  return reference::softmax_attention(q, k, v, options);
}

}  // namespace attnkit
