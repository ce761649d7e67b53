// Op boundary of clustered and improved-clustered attention: validation, then
// the backend that clustered_attention_dispatch names: for float32 the kernels
// (clustering without gradient, then the attention as an autograd Function with
// the labels as constants); other dtypes the composite.
#include "base/checks.h"
#include "kernels/clustered_attention.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/dispatch_util.h"
#include "ops/head_features.h"
#include "reference/reference.h"

#include <torch/autograd.h>

namespace attnkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;


const int64_t* data_or_null(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<int64_t>() : nullptr;
}

/// Labels (N, H, L) of the queries: LSH bits from the options' seed, then
/// Hamming K-means; -1 for padded queries.
torch::Tensor cluster_labels(const torch::Tensor& q, const ClusteredAttentionFuncOptions& o,
                             const torch::Tensor& query_lengths) {
  auto labels = torch::empty({q.size(0), q.size(1), q.size(2)}, torch::kLong);
  kernels::ClusterParams p;
  detail::bind(p.q, p.q_stride, q);
  p.query_lengths = data_or_null(query_lengths);
  p.labels = labels.data_ptr<int64_t>();
  p.N = q.size(0), p.H = q.size(1), p.L = q.size(2), p.E = q.size(3);
  p.clusters = o.clusters(), p.bits = o.bits(), p.iterations = o.iterations(), p.seed = o.seed();
  p.hash_bias = o.hash_bias();
  kernels::cluster_queries(p);
  return labels;
}

/// The attention given the labels. Saves for the backward q, k, v, the labels
/// and O(C (k' + M) + L) numbers per head, never an L x S matrix.
class ClusteredAttentionFunction : public torch::autograd::Function<ClusteredAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& labels,
                               const c10::optional<torch::Tensor>& key_lengths_or_none,
                               int64_t clusters, int64_t topk, double scale) {
    const torch::Tensor key_lengths = key_lengths_or_none.value_or(torch::Tensor());
    const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
    auto f32 = q.options();
    auto out = torch::empty({N, H, L, M}, f32);
    auto centroid_lse = torch::empty({N, H, clusters}, f32);
    auto background = torch::empty({N, H, clusters, M}, f32);
    auto top = torch::empty({N, H, clusters, topk}, torch::kLong);
    auto mass = torch::empty({N, H, topk > 0 ? clusters : 0}, f32);
    auto query_lse = torch::empty({N, H, topk > 0 ? L : 0}, f32);
    kernels::ClusteredAttentionParams p;
    fill(p, q, k, v, labels, key_lengths, clusters, topk, scale);
    detail::bind(p.out, p.out_stride, out);
    p.centroid_lse = centroid_lse.data_ptr<float>();
    p.background = background.data_ptr<float>();
    p.top = top.data_ptr<int64_t>();
    p.mass = mass.data_ptr<float>();
    p.query_lse = query_lse.data_ptr<float>();
    kernels::clustered_attention_forward(p);

    ctx->save_for_backward(
        {q, k, v, labels, key_lengths, centroid_lse, background, top, mass, query_lse});
    ctx->saved_data["clusters"] = clusters;
    ctx->saved_data["topk"] = topk;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    const auto& dout = grads[0];
    torch::Tensor dq, dk, dv;
    if (!dout.defined()) {
      dq = torch::zeros_like(q), dk = torch::zeros_like(k), dv = torch::zeros_like(v);
    } else {
      kernels::ClusteredAttentionBackwardParams p;
      fill(p, q, k, v, saved[3], saved[4], ctx->saved_data["clusters"].toInt(),
           ctx->saved_data["topk"].toInt(), ctx->saved_data["scale"].toDouble());
      p.centroid_lse = saved[5].data_ptr<float>();
      p.background = saved[6].data_ptr<float>();
      p.top = saved[7].data_ptr<int64_t>();
      p.mass = saved[8].data_ptr<float>();
      p.query_lse = saved[9].data_ptr<float>();
      // Grouped-query heads: the kernel writes each query head's share of dk
      // and dv, summed here over each group in a fixed order.
      const auto bound = detail::bind_qkv_grads(p, q, k, v, dout, /*per_query_head=*/p.kv_group > 1);
      kernels::clustered_attention_backward(p);
      dq = bound[0];
      dk = p.kv_group > 1 ? detail::sum_over_groups(bound[1], p.kv_group) : bound[1];
      dv = p.kv_group > 1 ? detail::sum_over_groups(bound[2], p.kv_group) : bound[2];
    }
    const torch::Tensor none;
    return detail::once_differentiable("clustered_attention",
                                       {dq, dk, dv, none, none, none, none, none},
                                       {q, k, v, grads[0]});
  }

 private:
  static void fill(kernels::ClusteredAttentionParams& p, const torch::Tensor& q,
                   const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& labels,
                   const torch::Tensor& key_lengths, int64_t clusters, int64_t topk, double scale) {
    detail::bind(p.q, p.q_stride, q);
    detail::bind(p.k, p.k_stride, k);
    detail::bind(p.v, p.v_stride, v);
    p.labels = labels.data_ptr<int64_t>();
    p.key_lengths = data_or_null(key_lengths);
    p.N = q.size(0), p.H = q.size(1), p.L = q.size(2), p.S = k.size(2);
    p.E = q.size(3), p.M = v.size(3);
    p.kv_group = detail::kv_group(q, k);
    p.C = clusters, p.topk = topk;
    p.scale = static_cast<float>(scale);
  }
};

}  // namespace

torch::Tensor clustered_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const ClusteredAttentionFuncOptions& options) {
  constexpr const char* op = "clustered_attention";
  detail::check_qkv(op, q, k, v, /*grouped_heads=*/true);
  const int64_t L = q.size(2), S = k.size(2);
  TORCH_CHECK(options.clusters() >= 1, op, ": option 'clusters' must be >= 1, got ",
              options.clusters());
  TORCH_CHECK(options.clusters() <= std::max<int64_t>(L, 1), op, ": option 'clusters' (",
              options.clusters(), ") must not exceed the number of queries L = ", L);
  TORCH_CHECK(options.bits() >= 1 && options.bits() <= 63, op,
              ": option 'bits' must be in [1, 63], got ", options.bits());
  // K-means stops at convergence (no label changed); the bound caps the runs
  // that cycle without converging, whose cost is O(iterations L C) per head.
  constexpr int64_t kMaxIterations = ClusteredAttentionFuncOptions::kMaxIterations;
  TORCH_CHECK(options.iterations() >= 0 && options.iterations() <= kMaxIterations, op,
              ": option 'iterations' must be in [0, ", kMaxIterations,
              "] (K-means stops earlier once no label changes), got ", options.iterations());
  TORCH_CHECK(options.topk() >= 0, op, ": option 'topk' must be >= 0, got ", options.topk());
  TORCH_CHECK(options.topk() <= S, op, ": option 'topk' (", options.topk(),
              ") must not exceed the number of keys S = ", S);
  detail::check_scale(op, options.scale(), q.scalar_type());
  detail::check_lengths(op, "key_lengths", options.key_lengths(), q.size(0), S);
  detail::check_lengths(op, "query_lengths", options.query_lengths(), q.size(0), L);
  if (!clustered_attention_dispatch(q, k, v, options).uses_kernel())
    return reference::clustered_attention(q, k, v, options);

  // Key lengths go to the autograd Function as an optional: it rejects undefined tensors.
  c10::optional<torch::Tensor> key_lengths;
  if (options.key_lengths().defined()) key_lengths = options.key_lengths().contiguous();
  const auto query_lengths =
      options.query_lengths().defined() ? options.query_lengths().contiguous() : torch::Tensor();
  torch::Tensor labels;
  {
    torch::NoGradGuard no_grad;  // clustering has no gradient
    labels = cluster_labels(q.detach(), options, query_lengths);
  }
  return ClusteredAttentionFunction::apply(q, k, v, labels, key_lengths, options.clusters(),
                                           options.topk(),
                                           detail::scale_or_default(options.scale(), q.size(3)));
}

Dispatch clustered_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const ClusteredAttentionFuncOptions&) {
  return detail::float32_kernel_or_composite({{"q", &q}, {"k", &k}, {"v", &v}});
}

}  // namespace attnkit
