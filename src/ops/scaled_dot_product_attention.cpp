// torch 2's scaled_dot_product_attention over softmax_attention: its
// arguments are translated into ours (a mask into an additive bias, is_causal
// into our bottom-right `causal` or a top-left bias, the batch dimensions
// into (N, H), grouped-query heads into softmax_attention's own, which reads
// each key and value head for its group in place), and softmax_attention
// validates, dispatches and differentiates. docs/API.md,
// "scaled_dot_product_attention", says what each argument costs. Registers
// its schema at its bottom.
#include <attnkit/ops.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "ops/checks.h"

namespace attnkit {

namespace {

constexpr const char* kOp = "scaled_dot_product_attention";

/// A defined, dense, floating CPU tensor of rank >= 2 (torch's (N, ..., L, E)).
void check_input(const char* name, const torch::Tensor& t) {
  detail::check_float_cpu(kOp, name, t);
  TORCH_CHECK(t.dim() >= 2, kOp, ": argument '", name, "' must have at least 2 dimensions (..., ",
              name == std::string("query") ? "L" : "S", ", features), got shape ", detail::shape_str(t));
}

/// The batch dimensions (all but the last two) of t; with `heads` > 0, its
/// head dimension (-3) counted as `heads` (grouped-query heads, as the query's).
std::vector<int64_t> batch_of(const torch::Tensor& t, int64_t heads = 0) {
  std::vector<int64_t> batch(t.sizes().begin(), t.sizes().end() - 2);
  if (heads > 0) batch.back() = heads;
  return batch;
}

/// Batch dimensions broadcast together; the error names t's shape.
std::vector<int64_t> broadcast_batch(const std::vector<int64_t>& a, const std::vector<int64_t>& batch,
                                     const torch::Tensor& t, const char* name) {
  const int64_t rank = std::max<int64_t>(static_cast<int64_t>(a.size()), static_cast<int64_t>(batch.size()));
  std::vector<int64_t> out(rank);
  for (int64_t d = 0; d < rank; ++d) {
    const int64_t ia = d - (rank - static_cast<int64_t>(a.size()));
    const int64_t ib = d - (rank - static_cast<int64_t>(batch.size()));
    const int64_t x = ia >= 0 ? a[ia] : 1, y = ib >= 0 ? batch[ib] : 1;
    TORCH_CHECK(x == y || x == 1 || y == 1, kOp, ": the batch dimensions of '", name, "' ",
                detail::shape_str(t), " do not broadcast with the others' (",
                c10::IntArrayRef(a), "); with fewer key/value heads than query heads, pass enable_gqa=True");
    out[d] = x == 1 ? y : x;
  }
  return out;
}

/// Repeats each head (dimension -3) of t `times` times in place order: head
/// h of the result is head h / times of t. A single head is expanded (no copy).
torch::Tensor repeat_heads(const torch::Tensor& t, int64_t times) {
  if (times == 1) return t;
  if (t.size(-3) == 1) {
    auto sizes = t.sizes().vec();
    sizes[sizes.size() - 3] = times;
    return t.expand(sizes);
  }
  return t.repeat_interleave(times, -3);
}

/// The translation of is_causal and attn_mask into softmax_attention's bias
/// (undefined: none) and causal flag.
struct Masking {
  torch::Tensor bias;
  bool causal = false;
};

Masking masking(const ScaledDotProductAttentionFuncOptions& o, const torch::Tensor& q, int64_t L, int64_t S,
                const std::vector<int64_t>& batch) {
  Masking m;
  const double inf = std::numeric_limits<double>::infinity();
  const auto& mask = o.attn_mask();
  if (o.is_causal()) {
    TORCH_CHECK(!mask.defined(), kOp, ": attn_mask and is_causal=True cannot be given together (as in torch); "
                "put the causal mask into attn_mask instead");
    if (L == S) {
      m.causal = true;  // top-left and bottom-right alignment coincide
    } else {
      const auto keep = torch::ones({L, S}, q.options().dtype(torch::kBool)).tril(0);
      m.bias = torch::zeros({L, S}, q.options()).masked_fill(keep.logical_not(), -inf);
    }
    return m;
  }
  if (!mask.defined()) return m;
  detail::check_strided(kOp, "attn_mask", mask);
  TORCH_CHECK(mask.device().is_cpu(), kOp, ": argument 'attn_mask' must be on the CPU, got device ", mask.device());
  TORCH_CHECK(mask.scalar_type() == torch::kBool || mask.scalar_type() == q.scalar_type(), kOp,
              ": argument 'attn_mask' must be boolean (True: takes part) or have the query's dtype ",
              detail::dtype_name(q.scalar_type()), ", got ", detail::dtype_name(mask.scalar_type()));
  auto full = batch;
  full.push_back(L);
  full.push_back(S);
  bool ok = mask.dim() <= static_cast<int64_t>(full.size());
  for (int64_t d = 1; ok && d <= mask.dim(); ++d) {
    const int64_t size = mask.size(-d);
    ok = size == 1 || size == full[full.size() - d];
  }
  TORCH_CHECK(ok, kOp, ": argument 'attn_mask' must broadcast to (..., L, S) = ", c10::IntArrayRef(full),
              ", got shape ", detail::shape_str(mask));
  m.bias = mask.scalar_type() == torch::kBool ? torch::zeros(mask.sizes(), q.options()).masked_fill(~mask, -inf)
                                              : mask;
  return m;
}

/// (..., X, Y) with the batch dimensions `batch` as (N, H, X, Y): H is the
/// last batch dimension (1 when there is none), N the product of the others.
/// A view when the dimensions merge (always for rank <= 4), else a copy.
torch::Tensor as_nhxy(const torch::Tensor& t, const std::vector<int64_t>& batch) {
  auto full = batch;
  full.push_back(t.size(-2));
  full.push_back(t.size(-1));
  const auto expanded = t.expand(full);
  const int64_t H = batch.empty() ? 1 : batch.back();
  const int64_t N = batch.empty() ? 1 : std::accumulate(batch.begin(), batch.end() - 1, int64_t{1},
                                                         std::multiplies<int64_t>());
  return expanded.reshape({N, H, t.size(-2), t.size(-1)});
}

}  // namespace

torch::Tensor scaled_dot_product_attention(const torch::Tensor& query, const torch::Tensor& key,
                                           const torch::Tensor& value,
                                           const ScaledDotProductAttentionFuncOptions& options) {
  check_input("query", query);
  check_input("key", key);
  check_input("value", value);
  detail::check_same_dtype(kOp, "key", key, "query", query);
  detail::check_same_dtype(kOp, "value", value, "query", query);
  TORCH_CHECK(key.size(-1) == query.size(-1), kOp, ": 'key' has feature size ", key.size(-1),
              " but 'query' has ", query.size(-1), " (shapes ", detail::shape_str(key), " and ",
              detail::shape_str(query), ")");
  TORCH_CHECK(value.size(-2) == key.size(-2), kOp, ": 'value' has ", value.size(-2), " positions but 'key' has ",
              key.size(-2), " (shapes ", detail::shape_str(value), " and ", detail::shape_str(key), ")");
  const double p = options.dropout_p();
  TORCH_CHECK(p >= 0 && p <= 1, kOp, ": dropout_p must be in [0, 1], got ", p);

  auto k = key, v = value;
  bool grouped = false;  // k and v keep their fewer heads: softmax_attention takes them as they are
  if (options.enable_gqa()) {
    TORCH_CHECK(query.dim() >= 3 && key.dim() >= 3 && value.dim() >= 3, kOp,
                ": enable_gqa needs a head dimension (-3) in query, key and value, got shapes ",
                detail::shape_str(query), ", ", detail::shape_str(key), ", ", detail::shape_str(value));
    const int64_t Hq = query.size(-3);
    for (const auto& [name, t] : {std::pair<const char*, const torch::Tensor*>{"key", &key}, {"value", &value}}) {
      const int64_t heads = t->size(-3);
      TORCH_CHECK(heads > 0 && Hq % heads == 0, kOp, ": enable_gqa: the ", heads, " heads of '", name,
                  "' must divide the query's ", Hq, " (shapes ", detail::shape_str(query), " and ",
                  detail::shape_str(*t), ")");
    }
    grouped = key.size(-3) == value.size(-3) && key.size(-3) != Hq;
    if (!grouped) {  // key and value heads that differ: both repeated to the query's (copies)
      k = repeat_heads(key, Hq / key.size(-3));
      v = repeat_heads(value, Hq / value.size(-3));
    }
  }
  // The batch dimensions; with grouped heads, those of all but the head dimension.
  const int64_t as_query = grouped ? query.size(-3) : 0;
  auto batch = broadcast_batch({}, batch_of(query), query, "query");
  batch = broadcast_batch(batch, batch_of(k, as_query), k, "key");
  batch = broadcast_batch(batch, batch_of(v, as_query), v, "value");
  auto kv_batch = batch;
  if (grouped) kv_batch.back() = k.size(-3);

  const int64_t L = query.size(-2), S = k.size(-2);
  const Masking m = masking(options, query, L, S, batch);
  // A bias of rank <= 4 broadcasts against (N, H, L, S) as it is whenever the
  // inputs have rank <= 4 (N and H are then their own batch dimensions).
  torch::Tensor bias = m.bias;
  if (bias.defined() && batch.size() > 2) bias = as_nhxy(bias, batch);

  auto out = softmax_attention(as_nhxy(query, batch), as_nhxy(k, kv_batch), as_nhxy(v, kv_batch),
                               SoftmaxAttentionFuncOptions()
                                   .scale(options.scale())
                                   .causal(m.causal)
                                   .bias(bias)
                                   .dropout_p(p < 1 ? p : 0.0));
  // dropout_p = 1 drops every weight: zeros (and zero gradients), as torch's.
  if (p == 1) out = out * 0.0;
  auto out_shape = batch;
  out_shape.push_back(L);
  out_shape.push_back(value.size(-1));
  return out.reshape(out_shape);
}

namespace {

torch::Tensor scaled_dot_product_attention_op(const torch::Tensor& query, const torch::Tensor& key,
                                              const torch::Tensor& value,
                                              const c10::optional<torch::Tensor>& attn_mask, double dropout_p,
                                              bool is_causal, c10::optional<double> scale, bool enable_gqa) {
  return scaled_dot_product_attention(query, key, value, ScaledDotProductAttentionFuncOptions()
                                                             .attn_mask(attn_mask.value_or(torch::Tensor()))
                                                             .dropout_p(dropout_p)
                                                             .is_causal(is_causal)
                                                             .scale(scale)
                                                             .enable_gqa(enable_gqa));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  // torch 2.5's schema of torch.nn.functional.scaled_dot_product_attention.
  m.def("scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
        "float dropout_p=0.0, bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor",
        &scaled_dot_product_attention_op);
}

}  // namespace attnkit
