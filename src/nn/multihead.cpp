// Mechanism registry and multi-head attention.
#include <attnkit/nn/multihead.h>

#include "ops/checks.h"

namespace attnkit::nn {

namespace {

const std::vector<std::string>& sparse_patterns() {
  static const std::vector<std::string> patterns{
      "full", "causal", "local", "local-causal", "segments", "segments-causal",
      "bp-tree", "star", "strided"};
  return patterns;
}

void reject(bool condition, const std::string& name, const char* what) {
  TORCH_CHECK(!condition, "attend: mechanism '", name, "' does not support ", what);
}

}  // namespace

EdgeList pattern_edges(const std::string& pattern, int64_t n, int64_t param) {
  if (pattern == "bp-tree") {
    TORCH_CHECK(n % 2 == 1, "attend: sparse-bp-tree needs an odd node count 2t - 1, got ", n);
    return edges::bp_tree((n + 1) / 2);
  }
  if (pattern == "star") {
    TORCH_CHECK(n >= 2, "attend: sparse-star needs at least 2 nodes, got ", n);
    return edges::star(n - 1);
  }
  return edges::by_name(pattern, n, param);
}

std::vector<std::string> mechanism_names() {
  std::vector<std::string> names{"full", "linear", "causal-linear", "gated-linear", "clustered",
                                 "improved-clustered"};
  for (const auto& p : sparse_patterns()) names.push_back("sparse-" + p);
  return names;
}

torch::Tensor attend(const MechanismOptions& m, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v, bool causal, const torch::Tensor& key_lengths) {
  const std::string& name = m.name();
  // Ranks and sizes first: the mechanisms below read sizes before their op checks.
  detail::check_qkv("attend", q, k, v);
  if (name == "full")
    return softmax_attention(q, k, v, SoftmaxAttentionOptions().causal(causal).key_lengths(key_lengths));
  if (name == "linear" || name == "causal-linear") {
    reject(key_lengths.defined(), name, "key_lengths (padding)");
    return linear_attention(q, k, v, LinearAttentionOptions()
                                         .feature_map(m.feature_map())
                                         .normalize(m.normalize())
                                         .causal(causal || name == "causal-linear"));
  }
  if (name == "gated-linear") {
    reject(key_lengths.defined(), name, "key_lengths (padding)");
    TORCH_CHECK(k.size(3) == v.size(3), "attend: mechanism 'gated-linear' gates the values with "
                "the keys and needs E == M, got E = ", k.size(3), ", M = ", v.size(3));
    // The cheap-linear-attention paper's f = sigmoid(W h + b) * h with the key
    // projection as W h + b and the value projection as h. Its alpha = beta = 1
    // make the recurrence linear attention with keys = values = f (nn/linear.h;
    // docs/MATH.md, "Gated linear attention").
    const auto f = torch::sigmoid(k) * v;
    return linear_attention(q, f, f, LinearAttentionOptions().causal(causal));
  }
  if (name == "clustered" || name == "improved-clustered") {
    reject(causal, name, "causal masking");
    const bool improved = name == "improved-clustered";
    TORCH_CHECK(m.clusters() >= 1, "attend: mechanism '", name,
                "' needs clusters >= 1, got ", m.clusters());
    TORCH_CHECK(!improved || m.topk() >= 1, "attend: mechanism 'improved-clustered' needs "
                "topk >= 1, got ", m.topk());
    // A layer meets many lengths: cap the settings at what this input has.
    const int64_t L = q.size(2), S = k.size(2);
    return clustered_attention(
        q, k, v, ClusteredAttentionOptions()
                     .clusters(std::min(m.clusters(), std::max<int64_t>(L, 1)))
                     .bits(m.bits())
                     .iterations(m.iterations())
                     .topk(improved ? std::min(m.topk(), S) : 0)
                     .seed(m.seed())
                     .key_lengths(key_lengths));
  }
  if (name.rfind("sparse-", 0) == 0) {
    reject(key_lengths.defined(), name, "key_lengths (padding)");
    reject(causal, name, "the causal flag (choose a causal pattern instead)");
    TORCH_CHECK(q.size(2) == k.size(2), "attend: mechanism '", name,
                "' is self-attention and needs L == S, got L = ", q.size(2), ", S = ", k.size(2));
    return sparse_attention(q, k, v, pattern_edges(name.substr(7), q.size(2), m.pattern_param()));
  }
  std::string known;
  for (const auto& n : mechanism_names()) known += (known.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, "attend: unknown mechanism '", name, "'; known: ", known);
}

MultiheadAttentionImpl::MultiheadAttentionImpl(const MultiheadAttentionOptions& options_)
    : options(options_) {
  reset();
}

void MultiheadAttentionImpl::reset() {
  const int64_t d = options.embed_dim(), h = options.heads();
  TORCH_CHECK(d > 0 && h > 0 && d % h == 0, "MultiheadAttention: embed_dim (", d,
              ") must be a positive multiple of heads (", h, ")");
  auto linear = [&] { return Linear(torch::nn::LinearOptions(d, d).bias(options.bias())); };
  q_proj = register_module("q_proj", linear());
  k_proj = register_module("k_proj", linear());
  v_proj = register_module("v_proj", linear());
  out_proj = register_module("out_proj", linear());
}

torch::Tensor MultiheadAttentionImpl::forward(const torch::Tensor& query, const torch::Tensor& key,
                                              const torch::Tensor& value,
                                              const torch::Tensor& key_lengths, bool causal) {
  constexpr const char* module = "MultiheadAttention";
  const int64_t d = options.embed_dim(), H = options.heads(), dh = d / H;
  detail::check_float_tensor(module, "query", query, 3);
  detail::check_float_tensor(module, "key", key, 3);
  detail::check_float_tensor(module, "value", value, 3);
  detail::check_dim(module, "query", query, 2, d, "feature size");
  detail::check_dim(module, "key", key, 2, d, "feature size");
  detail::check_dim(module, "value", value, 2, d, "feature size");
  detail::check_dim(module, "key", key, 0, query.size(0), "batch size N");
  detail::check_dim(module, "value", value, 0, query.size(0), "batch size N");
  detail::check_dim(module, "value", value, 1, key.size(1), "length S");
  const int64_t N = query.size(0), L = query.size(1), S = key.size(1);
  // (N, T, D) -> (N, H, T, dh) as a strided view: the ops take strides, no copy.
  auto heads = [&](const torch::Tensor& x, int64_t T) { return x.view({N, T, H, dh}).transpose(1, 2); };
  auto out = attend(options.mechanism(), heads(q_proj(query), L), heads(k_proj(key), S),
                    heads(v_proj(value), S), causal, key_lengths);
  return out_proj(out.transpose(1, 2).reshape({N, L, d}));
}

}  // namespace attnkit::nn
