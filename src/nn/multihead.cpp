// Multi-head attention over any mechanism of the registry.
#include <attnkit/nn/multihead.h>

#include "ops/checks.h"

namespace attnkit::nn {

MultiheadAttentionImpl::MultiheadAttentionImpl(const MultiheadAttentionOptions& options_)
    : options(options_) {
  reset();
}

namespace {

bool reads_grouped_heads(const std::string& spec) {
  return resolve_mechanism(spec).first->supports.grouped_heads;
}

void check_takes_alibi(const std::string& spec) {
  const auto* info = resolve_mechanism(spec).first;
  TORCH_CHECK(info->supports.alibi, "MultiheadAttention: ALiBi needs a mechanism that takes its slopes "
              "(MechanismSupports::alibi, e.g. 'full'); '", spec, "' does not");
}

/// Whether the mechanism of `spec` rotates q and k in its kernel (else the
/// module rotates them); refuses one that takes no rotary positions.
bool rotates_in_kernel(const std::string& spec) {
  const auto* info = resolve_mechanism(spec).first;
  TORCH_CHECK(info->supports.rotary != RotarySupport::none, "MultiheadAttention: rotary positions need a "
              "mechanism whose scores are dot products of q and k, or of their features (MechanismSupports::rotary); '", spec,
              "' has none (mechanisms that take them: ",
              mechanism_names_where([](const MechanismInfo& m) { return m.supports.rotary != RotarySupport::none; }),
              ")");
  return info->supports.rotary == RotarySupport::kernel;
}

}  // namespace

void MultiheadAttentionImpl::reset() {
  const int64_t d = options.width(), h = options.heads(), hk = options.kv_heads();
  TORCH_CHECK(d > 0 && h > 0 && d % h == 0, "MultiheadAttention: width (", d,
              ") must be a positive multiple of heads (", h, ")");
  TORCH_CHECK(hk >= 0 && (hk == 0 || h % hk == 0), "MultiheadAttention: kv_heads (", hk,
              ") must divide heads (", h, "), or be 0 for as many as heads");
  const int64_t kv_width = kv_head_count() * (d / h);
  auto linear = [&](int64_t out) { return Linear(torch::nn::LinearOptions(d, out).bias(options.bias())); };
  q_proj = register_module("q_proj", linear(d));
  k_proj = register_module("k_proj", linear(kv_width));
  v_proj = register_module("v_proj", linear(kv_width));
  out_proj = register_module("out_proj", linear(d));
  attention = register_module("attention", make_mechanism(options.attention()));
  mechanism_reads_groups_ = reads_grouped_heads(options.attention());
  if (options.alibi()) check_takes_alibi(options.attention());
  alibi_slopes_ = options.alibi() ? attnkit::alibi_slopes(h) : torch::Tensor();
  const int64_t r = options.rotary_dim();
  detail::check_rotary("MultiheadAttention", "rotary_dim", r, "rotary_base", options.rotary_base(), d / h);
  mechanism_rotates_ = r > 0 && rotates_in_kernel(options.attention());
  TORCH_CHECK(options.dropout() >= 0 && options.dropout() < 1,
              "MultiheadAttention: option 'dropout' must be in [0, 1), got ", options.dropout());
  TORCH_CHECK(options.dropout() == 0 || resolve_mechanism(options.attention()).first->supports.dropout,
              "MultiheadAttention: option 'dropout' (attention dropout, ", options.dropout(), ") needs a mechanism "
              "that drops weights inside its kernel; '", options.attention(), "' does not (mechanisms that do: ",
              mechanism_names_where([](const MechanismInfo& m) { return m.supports.dropout; }), ")");
}

torch::Tensor MultiheadAttentionImpl::rotate(const torch::Tensor& x, int64_t offset) const {
  if (options.rotary_dim() == 0) return x;
  return rotary_embedding(x, RotaryEmbeddingFuncOptions(options.rotary_dim()).base(options.rotary_base()).offset(offset));
}

int64_t MultiheadAttentionImpl::kv_head_count() const {
  return options.kv_heads() > 0 ? options.kv_heads() : options.heads();
}

torch::Tensor MultiheadAttentionImpl::for_mechanism(const torch::Tensor& kv, int64_t head_dim) const {
  const int64_t group = options.heads() / kv_head_count();
  if (group == 1 || mechanism_reads_groups_) return kv;
  return kv.repeat_interleave(group, head_dim);
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
  if (options.alibi()) check_takes_alibi(spec);
  const bool rotates = options.rotary_dim() > 0 && rotates_in_kernel(spec);
  attention = replace_module("attention", make_mechanism(spec));
  options.attention(spec);
  mechanism_reads_groups_ = reads_grouped_heads(spec);
  mechanism_rotates_ = rotates;
}

MultiheadAttentionImpl::Heads MultiheadAttentionImpl::queries_and_keys(const char* what, const torch::Tensor& query,
                                                                      const torch::Tensor& key,
                                                                      const torch::Tensor& key_lengths,
                                                                      bool causal) {
  const int64_t d = options.width(), H = options.heads(), dh = d / H;
  detail::check_float_tensor(what, "query", query, 3);
  detail::check_float_tensor(what, "key", key, 3);
  detail::check_parameter_dtype(what, "query", query, q_proj->weight);
  detail::check_same_dtype(what, "key", key, "query", query);
  detail::check_dim(what, "query", query, 2, d, "feature size");
  detail::check_dim(what, "key", key, 2, d, "feature size");
  detail::check_dim(what, "key", key, 0, query.size(0), "batch size N");
  const int64_t N = query.size(0), L = query.size(1), S = key.size(1);
  // (N, T, heads * dh) -> (N, heads, T, dh) as a strided view: the ops take strides, no copy.
  auto q = q_proj(query).view({N, L, H, dh}).transpose(1, 2);
  auto k = k_proj(key).view({N, S, kv_head_count(), dh}).transpose(1, 2);
  AttendArgs args{causal, key_lengths, alibi_slopes_};
  // Rotary positions: query i at i + S - L, key j at j (the causal mask's alignment).
  if (mechanism_rotates_) {
    args.rotary_dim = options.rotary_dim();
    args.rotary_base = options.rotary_base();
  } else {
    q = rotate(q, S - L);
    k = rotate(k, 0);
  }
  return {q, for_mechanism(k), args};
}

torch::Tensor MultiheadAttentionImpl::forward(const torch::Tensor& query, const torch::Tensor& key,
                                              const torch::Tensor& value,
                                              const torch::Tensor& key_lengths, bool causal) {
  constexpr const char* module = "MultiheadAttention";
  auto [q, k, args] = queries_and_keys(module, query, key, key_lengths, causal);
  detail::check_float_tensor(module, "value", value, 3);
  detail::check_same_dtype(module, "value", value, "query", query);
  detail::check_dim(module, "value", value, 2, options.width(), "feature size");
  detail::check_dim(module, "value", value, 0, query.size(0), "batch size N");
  detail::check_dim(module, "value", value, 1, key.size(1), "length S");
  const int64_t N = query.size(0), L = query.size(1), S = key.size(1);
  if (is_training()) args.dropout_p = options.dropout();
  auto v = for_mechanism(v_proj(value).view({N, S, kv_head_count(), options.width() / options.heads()}).transpose(1, 2));
  if (probe) {
    if (mechanism_rotates_)
      probe(rotate(q, S - L), rotate(k, 0), v);
    else
      probe(q, k, v);
  }
  auto out = attention->forward(q, k, v, args);
  return out_proj(out.transpose(1, 2).reshape({N, L, options.width()}));
}

torch::Tensor MultiheadAttentionImpl::attention_weights(const torch::Tensor& query, const torch::Tensor& key,
                                                        const torch::Tensor& key_lengths, bool causal,
                                                        bool average) {
  constexpr const char* what = "MultiheadAttention.attention_weights";
  TORCH_CHECK(resolve_mechanism(options.attention()).first->exact, what, " (need_weights) needs exact attention ('",
              exact_mechanism().name, "'); '", options.attention(), "' forms no (L, S) weight matrix (swap in '",
              exact_mechanism().name, "' with set_attention to inspect one)");
  auto [q, k, args] = queries_and_keys(what, query, key, key_lengths, causal);
  // P V with V the identity is P: the mechanism's own masks, positions and
  // options, with no second code path to keep equal to the kernel's. The
  // identity is one (S, S) matrix read through stride 0 over batch and heads.
  const int64_t N = query.size(0), S = key.size(1);
  const auto identity = torch::eye(S, q.options()).expand({N, k.size(1), S, S});
  auto weights = attention->forward(q, k, identity, args);  // args.dropout_p is 0: the weights before dropout
  return average ? weights.mean(1) : weights;
}

}  // namespace attnkit::nn
