// Multi-head attention over any mechanism of the registry.
#include <attnkit/nn/multihead.h>

#include "base/checks.h"

namespace attnkit::nn {

MultiheadAttentionImpl::MultiheadAttentionImpl(const MultiheadAttentionOptions& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionImpl::reset() {
  const int64_t d = options.width(), h = options.heads();
  TORCH_CHECK(d > 0 && h > 0 && d % h == 0, "MultiheadAttention: width (", d,
              ") must be a positive multiple of heads (", h, ")");
  auto linear = [&] { return Linear(torch::nn::LinearOptions(d, d).bias(options.bias())); };
  q_proj = register_module("q_proj", linear());
  k_proj = register_module("k_proj", linear());
  v_proj = register_module("v_proj", linear());
  out_proj = register_module("out_proj", linear());
  attention = register_module("attention", make_mechanism(options.attention()));
}

std::shared_ptr<torch::nn::Module> MultiheadAttentionImpl::clone(
    const c10::optional<torch::Device>& device) const {
  auto copy = std::dynamic_pointer_cast<MultiheadAttentionImpl>(
      torch::nn::Cloneable<MultiheadAttentionImpl>::clone(device));
  // Cloneable rebuilt `attention` from options and could not copy its state.
  copy->attention = copy->replace_module("attention", attention->copy(device));
  return copy;
}

void MultiheadAttentionImpl::set_attention(const std::string& spec) {
  attention = replace_module("attention", make_mechanism(spec));
  options.attention(spec);
}

torch::Tensor MultiheadAttentionImpl::forward(const torch::Tensor& query, const torch::Tensor& key,
                                              const torch::Tensor& value,
                                              const torch::Tensor& key_lengths, bool causal) {
  constexpr const char* module = "MultiheadAttention";
  const int64_t d = options.width(), H = options.heads(), dh = d / H;
  detail::check_float_tensor(module, "query", query, 3);
  detail::check_float_tensor(module, "key", key, 3);
  detail::check_float_tensor(module, "value", value, 3);
  detail::check_parameter_dtype(module, "query", query, q_proj->weight);
  detail::check_same_dtype(module, "key", key, "query", query);
  detail::check_same_dtype(module, "value", value, "query", query);
  detail::check_dim(module, "query", query, 2, d, "feature size");
  detail::check_dim(module, "key", key, 2, d, "feature size");
  detail::check_dim(module, "value", value, 2, d, "feature size");
  detail::check_dim(module, "key", key, 0, query.size(0), "batch size N");
  detail::check_dim(module, "value", value, 0, query.size(0), "batch size N");
  detail::check_dim(module, "value", value, 1, key.size(1), "length S");
  const int64_t N = query.size(0), L = query.size(1), S = key.size(1);
  // (N, T, D) -> (N, H, T, dh) as a strided view: the ops take strides, no copy.
  auto heads = [&](const torch::Tensor& x, int64_t T) { return x.view({N, T, H, dh}).transpose(1, 2); };
  auto q = heads(q_proj(query), L), k = heads(k_proj(key), S), v = heads(v_proj(value), S);
  if (probe) probe(q, k, v);
  auto out = attention->forward(q, k, v, AttendArgs{causal, key_lengths});
  return out_proj(out.transpose(1, 2).reshape({N, L, d}));
}

}  // namespace attnkit::nn
