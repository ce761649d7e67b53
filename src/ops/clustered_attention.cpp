// Op boundary of clustered and improved-clustered attention: validation, then
// the backend that clustered_attention_dispatch names: for float32 the kernels
// (clustering without gradient, then the attention as an autograd Function with
// the labels as constants); other dtypes the composite. The kernels are ops of
// their own (ops/kernel_op.h) with CPU and Meta kernels, so that torch.compile
// and torch.export trace the op: attnkit::_cluster_queries (the labels) and
// _clustered_attention_forward / _backward. Registers its schemas
// (clustered_attention and the kernel ops) at its bottom.
#include "kernels/clustered_attention.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "ops/checks.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/dispatch_util.h"
#include "ops/head_features.h"
#include "ops/kernel_op.h"
#include "ops/schema.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

using detail::OptionalTensor;
using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

const int64_t* data_or_null(const OptionalTensor& t) { return t.has_value() ? t->data_ptr<int64_t>() : nullptr; }

/// The options' checks, shared by the op and its kernel ops.
void check_clustering(const char* op, const torch::Tensor& q, int64_t clusters, int64_t bits, int64_t iterations) {
  const int64_t L = q.size(2);
  TORCH_CHECK(clusters >= 1, op, ": option 'clusters' must be >= 1, got ", clusters);
  TORCH_CHECK(clusters <= std::max<int64_t>(L, 1), op, ": option 'clusters' (", clusters,
              ") must not exceed the number of queries L = ", L);
  TORCH_CHECK(bits >= 1 && bits <= 63, op, ": option 'bits' must be in [1, 63], got ", bits);
  // K-means stops at convergence (no label changed); the bound caps the runs
  // that cycle without converging, whose cost is O(iterations L C) per head.
  constexpr int64_t kMaxIterations = ClusteredAttentionFuncOptions::kMaxIterations;
  TORCH_CHECK(iterations >= 0 && iterations <= kMaxIterations, op, ": option 'iterations' must be in [0, ",
              kMaxIterations, "] (K-means stops earlier once no label changes), got ", iterations);
}

void check_topk(const char* op, const torch::Tensor& k, int64_t topk) {
  TORCH_CHECK(topk >= 0, op, ": option 'topk' must be >= 0, got ", topk);
  TORCH_CHECK(topk <= k.size(2), op, ": option 'topk' (", topk, ") must not exceed the number of keys S = ", k.size(2));
}

/// A kernel op's int64 argument: contiguous, of the given shape.
void check_index_tensor(const char* op, const char* name, const torch::Tensor& t, torch::IntArrayRef shape) {
  TORCH_CHECK(t.scalar_type() == torch::kLong && t.is_contiguous() && t.sizes() == shape, op, ": argument '", name,
              "' must be contiguous int64 of shape ", shape, ", got ", detail::dtype_name(t.scalar_type()), " ",
              detail::shape_str(t));
}

/// Every entry in [lo, hi), where the values are there to read (the kernel
/// indexes with them).
void check_index_values(const char* op, const char* name, const torch::Tensor& t, int64_t lo, int64_t hi) {
  if (!detail::has_data(t)) return;
  const int64_t* entry = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK(entry[i] >= lo && entry[i] < hi, op, ": argument '", name, "' has an entry ", entry[i], " outside [",
                lo, ", ", hi, ")");
}

/// The forward's top keys: each row of k' entries strictly increasing within
/// [0, S) (the backward searches and indexes key blocks with them), where the
/// values are there to read.
void check_top_keys(const char* op, const torch::Tensor& top, int64_t S) {
  if (!detail::has_data(top) || top.numel() == 0) return;
  const int64_t width = top.size(3);
  const int64_t* entry = top.data_ptr<int64_t>();
  for (int64_t i = 0; i < top.numel(); ++i) {
    TORCH_CHECK(entry[i] >= 0 && entry[i] < S, op, ": argument 'top' has an entry ", entry[i], " outside [0, ", S, ")");
    TORCH_CHECK(i % width == 0 || entry[i] > entry[i - 1], op,
                ": argument 'top' must be the forward's (each row strictly increasing), got ", entry[i - 1], " then ",
                entry[i]);
  }
}

void check_float_state(const char* op, const char* name, const torch::Tensor& t, torch::IntArrayRef shape) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.sizes() == shape, op, ": argument '", name,
              "' must be the forward's (contiguous float32 of shape ", shape, "), got ",
              detail::dtype_name(t.scalar_type()), " ", detail::shape_str(t));
}

/// _clustered_attention_forward's and _backward's common checks: float32 q,
/// k, v, labels (N, H, L) in [-1, C), key lengths as the op takes them.
void check_attention_kernel(const char* op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& labels, const OptionalTensor& key_lengths, int64_t clusters,
                            int64_t topk, double scale) {
  detail::check_qkv(op, q, k, v, /*grouped_heads=*/true);
  TORCH_CHECK(q.scalar_type() == torch::kFloat, op, ": the kernel takes float32, got ",
              detail::dtype_name(q.scalar_type()));
  TORCH_CHECK(clusters >= 1 && clusters <= std::max<int64_t>(q.size(2), 1), op,
              ": argument 'clusters' must be in [1, max(L, 1)], got ", clusters);
  check_topk(op, k, topk);
  detail::check_scale(op, scale, q.scalar_type());
  check_index_tensor(op, "labels", labels, {q.size(0), q.size(1), q.size(2)});
  check_index_values(op, "labels", labels, -1, clusters);
  const torch::Tensor lengths = key_lengths.value_or(torch::Tensor());
  detail::check_lengths(op, "key_lengths", lengths, q.size(0), k.size(2));
  TORCH_CHECK(!lengths.defined() || lengths.is_contiguous(), op, ": argument 'key_lengths' must be contiguous");
}

// --- attnkit::_cluster_queries ----------------------------------------------------------

using ClusterSignature = torch::Tensor(const torch::Tensor&, const OptionalTensor&, int64_t, int64_t, int64_t, int64_t,
                                       bool);

torch::Tensor cluster_queries_meta(const torch::Tensor& q, const OptionalTensor&, int64_t, int64_t, int64_t, int64_t,
                                   bool) {
  return torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kLong));
}

/// Labels (N, H, L) of the queries: LSH bits from the seed, then Hamming
/// K-means; -1 for padded queries.
torch::Tensor cluster_queries_cpu(const torch::Tensor& q, const OptionalTensor& query_lengths, int64_t clusters,
                                  int64_t bits, int64_t iterations, int64_t seed, bool hash_bias) {
  constexpr const char* op = "_cluster_queries";
  detail::check_float_tensor(op, "q", q, 4);
  TORCH_CHECK(q.scalar_type() == torch::kFloat, op, ": the kernel takes float32, got ",
              detail::dtype_name(q.scalar_type()));
  check_clustering(op, q, clusters, bits, iterations);
  const torch::Tensor lengths = query_lengths.value_or(torch::Tensor());
  detail::check_lengths(op, "query_lengths", lengths, q.size(0), q.size(2));
  TORCH_CHECK(!lengths.defined() || lengths.is_contiguous(), op, ": argument 'query_lengths' must be contiguous");
  auto labels = cluster_queries_meta(q, query_lengths, clusters, bits, iterations, seed, hash_bias);
  kernels::ClusterParams p;
  detail::bind(p.q, p.q_stride, q);
  p.query_lengths = data_or_null(query_lengths);
  p.labels = labels.data_ptr<int64_t>();
  p.N = q.size(0), p.H = q.size(1), p.L = q.size(2), p.E = q.size(3);
  p.clusters = clusters, p.bits = bits, p.iterations = iterations, p.seed = seed;
  p.hash_bias = hash_bias;
  kernels::cluster_queries(p);
  return labels;
}

// --- attnkit::_clustered_attention_forward / _backward ----------------------------------

// out and what the backward reads: centroid_lse (N, H, C), background
// (N, H, C, M), and for the improved variant (topk > 0) top (N, H, C, k'),
// mass (N, H, C) and query_lse (N, H, L) (else empty along their last axes).
using ClusteredForwardResult =
    std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>;
using ClusteredGradients = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
using ClusteredForwardSignature = ClusteredForwardResult(const torch::Tensor&, const torch::Tensor&,
                                                         const torch::Tensor&, const torch::Tensor&,
                                                         const OptionalTensor&, int64_t, int64_t, double);
using ClusteredBackwardSignature = ClusteredGradients(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                      const torch::Tensor&, const torch::Tensor&, const OptionalTensor&,
                                                      const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                      const torch::Tensor&, const torch::Tensor&, int64_t, int64_t,
                                                      double);

/// The shapes of what the forward writes.
struct SavedShapes {
  std::vector<int64_t> out, centroid_lse, background, top, mass, query_lse;
};

SavedShapes saved_shapes(const torch::Tensor& q, const torch::Tensor& v, int64_t clusters, int64_t topk) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
  return {{N, H, L, M},
          {N, H, clusters},
          {N, H, clusters, M},
          {N, H, clusters, topk},
          {N, H, topk > 0 ? clusters : 0},
          {N, H, topk > 0 ? L : 0}};
}

ClusteredForwardResult clustered_forward_meta(const torch::Tensor& q, const torch::Tensor&, const torch::Tensor& v,
                                              const torch::Tensor&, const OptionalTensor&, int64_t clusters,
                                              int64_t topk, double) {
  const auto s = saved_shapes(q, v, clusters, topk);
  const auto f32 = q.options();
  return {torch::empty(s.out, f32),        torch::empty(s.centroid_lse, f32),
          torch::empty(s.background, f32), torch::empty(s.top, f32.dtype(torch::kLong)),
          torch::empty(s.mass, f32),       torch::empty(s.query_lse, f32)};
}

void fill(kernels::ClusteredAttentionParams& p, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
          const torch::Tensor& labels, const OptionalTensor& key_lengths, int64_t clusters, int64_t topk,
          double scale) {
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

ClusteredForwardResult clustered_forward_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                             const torch::Tensor& labels, const OptionalTensor& key_lengths,
                                             int64_t clusters, int64_t topk, double scale) {
  check_attention_kernel("_clustered_attention_forward", q, k, v, labels, key_lengths, clusters, topk, scale);
  auto result = clustered_forward_meta(q, k, v, labels, key_lengths, clusters, topk, scale);
  auto& [out, centroid_lse, background, top, mass, query_lse] = result;
  kernels::ClusteredAttentionParams p;
  fill(p, q, k, v, labels, key_lengths, clusters, topk, scale);
  detail::bind(p.out, p.out_stride, out);
  p.centroid_lse = centroid_lse.data_ptr<float>();
  p.background = background.data_ptr<float>();
  p.top = top.data_ptr<int64_t>();
  p.mass = mass.data_ptr<float>();
  p.query_lse = query_lse.data_ptr<float>();
  kernels::clustered_attention_forward(p);
  return result;
}

ClusteredGradients clustered_backward_meta(const torch::Tensor&, const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, const torch::Tensor&, const OptionalTensor&,
                                           const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                           const torch::Tensor&, const torch::Tensor&, int64_t, int64_t, double) {
  const auto contiguous = torch::MemoryFormat::Contiguous;
  return {torch::empty_like(q, contiguous), torch::empty_like(k, contiguous), torch::empty_like(v, contiguous)};
}

ClusteredGradients clustered_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v, const torch::Tensor& labels,
                                          const OptionalTensor& key_lengths, const torch::Tensor& centroid_lse,
                                          const torch::Tensor& background, const torch::Tensor& top,
                                          const torch::Tensor& mass, const torch::Tensor& query_lse, int64_t clusters,
                                          int64_t topk, double scale) {
  constexpr const char* op = "_clustered_attention_backward";
  check_attention_kernel(op, q, k, v, labels, key_lengths, clusters, topk, scale);
  const auto s = saved_shapes(q, v, clusters, topk);
  TORCH_CHECK(grad_out.scalar_type() == torch::kFloat && grad_out.sizes() == torch::IntArrayRef(s.out), op,
              ": argument 'grad_out' must be float32 of shape ", torch::IntArrayRef(s.out), ", got ",
              detail::dtype_name(grad_out.scalar_type()), " ", detail::shape_str(grad_out));
  check_float_state(op, "centroid_lse", centroid_lse, s.centroid_lse);
  check_float_state(op, "background", background, s.background);
  check_index_tensor(op, "top", top, s.top);
  check_top_keys(op, top, k.size(2));
  check_float_state(op, "mass", mass, s.mass);
  check_float_state(op, "query_lse", query_lse, s.query_lse);
  kernels::ClusteredAttentionBackwardParams p;
  fill(p, q, k, v, labels, key_lengths, clusters, topk, scale);
  p.centroid_lse = centroid_lse.data_ptr<float>();
  p.background = background.data_ptr<float>();
  p.top = top.data_ptr<int64_t>();
  p.mass = mass.data_ptr<float>();
  p.query_lse = query_lse.data_ptr<float>();
  // Grouped-query heads: the kernel writes each query head's share of dk
  // and dv, summed here over each group in a fixed order.
  auto [dq, dk, dv] = detail::bind_qkv_grads(p, q, k, v, grad_out, /*per_query_head=*/p.kv_group > 1);
  kernels::clustered_attention_backward(p);
  if (p.kv_group > 1) {
    dk = detail::sum_over_groups(dk, p.kv_group);
    dv = detail::sum_over_groups(dv, p.kv_group);
  }
  return {dq, dk, dv};
}

/// The attention given the labels. Saves for the backward q, k, v, the labels
/// and O(C (k' + M) + L) numbers per head, never an L x S matrix.
class ClusteredAttentionFunction : public torch::autograd::Function<ClusteredAttentionFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& labels, const OptionalTensor& key_lengths,
                               int64_t clusters, int64_t topk, double scale) {
    static const auto op = detail::kernel_op<ClusteredForwardSignature>("attnkit::_clustered_attention_forward");
    auto [out, centroid_lse, background, top, mass, query_lse] =
        op.call(q, k, v, labels, key_lengths, clusters, topk, scale);
    ctx->save_for_backward(
        {q, k, v, labels, key_lengths.value_or(torch::Tensor()), centroid_lse, background, top, mass, query_lse});
    ctx->saved_data["clusters"] = clusters;
    ctx->saved_data["topk"] = topk;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = detail::kernel_op<ClusteredBackwardSignature>("attnkit::_clustered_attention_backward");
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    const auto& dout = grads[0];
    torch::Tensor dq, dk, dv;
    if (!dout.defined()) {
      dq = torch::zeros_like(q), dk = torch::zeros_like(k), dv = torch::zeros_like(v);
    } else {
      std::tie(dq, dk, dv) = op.call(dout, q, k, v, saved[3], detail::as_optional(saved[4]), saved[5], saved[6],
                                     saved[7], saved[8], saved[9], ctx->saved_data["clusters"].toInt(),
                                     ctx->saved_data["topk"].toInt(), ctx->saved_data["scale"].toDouble());
    }
    const torch::Tensor none;
    return detail::once_differentiable("clustered_attention", {dq, dk, dv, none, none, none, none, none},
                                       {q, k, v, grads[0]});
  }
};

}  // namespace

torch::Tensor clustered_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const ClusteredAttentionFuncOptions& options) {
  constexpr const char* op = "clustered_attention";
  detail::check_qkv(op, q, k, v, /*grouped_heads=*/true);
  check_clustering(op, q, options.clusters(), options.bits(), options.iterations());
  check_topk(op, k, options.topk());
  detail::check_scale(op, options.scale(), q.scalar_type());
  detail::check_lengths(op, "key_lengths", options.key_lengths(), q.size(0), k.size(2));
  detail::check_lengths(op, "query_lengths", options.query_lengths(), q.size(0), q.size(2));
  if (!clustered_attention_dispatch(q, k, v, options).uses_kernel())
    return reference::clustered_attention(q, k, v, options);

  const auto contiguous_or_none = [](const torch::Tensor& t) {
    return t.defined() ? OptionalTensor(t.contiguous()) : c10::nullopt;
  };
  const OptionalTensor key_lengths = contiguous_or_none(options.key_lengths());
  torch::Tensor labels;
  {
    torch::NoGradGuard no_grad;  // clustering has no gradient
    static const auto cluster = detail::kernel_op<ClusterSignature>("attnkit::_cluster_queries");
    labels = cluster.call(q.detach(), contiguous_or_none(options.query_lengths()), options.clusters(), options.bits(),
                          options.iterations(), options.seed(), options.hash_bias());
  }
  return ClusteredAttentionFunction::apply(q, k, v, labels, key_lengths, options.clusters(), options.topk(),
                                           detail::scale_or_default(options.scale(), q.size(3)));
}

Dispatch clustered_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const ClusteredAttentionFuncOptions&) {
  return detail::float32_kernel_or_composite({{"q", &q}, {"k", &k}, {"v", &v}});
}

namespace {

torch::Tensor clustered_attention_op(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, int64_t clusters, int64_t bits,
                                     int64_t iterations, int64_t topk, bool hash_bias,
                                     int64_t seed, c10::optional<double> scale,
                                     const c10::optional<torch::Tensor>& key_lengths,
                                     const c10::optional<torch::Tensor>& query_lengths) {
  return clustered_attention(q, k, v, ClusteredAttentionFuncOptions()
                                          .clusters(clusters)
                                          .bits(bits)
                                          .iterations(iterations)
                                          .topk(topk)
                                          .hash_bias(hash_bias)
                                          .seed(seed)
                                          .scale(scale)
                                          .key_lengths(key_lengths.value_or(torch::Tensor()))
                                          .query_lengths(query_lengths.value_or(torch::Tensor())));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  using detail::schema_bool;
  const ClusteredAttentionFuncOptions clu;
  m.def(("clustered_attention(Tensor q, Tensor k, Tensor v, *, int clusters=" + std::to_string(clu.clusters()) +
         ", int bits=" + std::to_string(clu.bits()) + ", int iterations=" + std::to_string(clu.iterations()) +
         ", int topk=" + std::to_string(clu.topk()) + ", bool hash_bias=" + schema_bool(clu.hash_bias()) +
         ", int seed=" + std::to_string(clu.seed()) +
         ", float? scale=None, Tensor? key_lengths=None, Tensor? query_lengths=None) -> Tensor")
            .c_str(),
        &clustered_attention_op);
  m.def(
      "_cluster_queries(Tensor q, Tensor? query_lengths, int clusters, int bits, int iterations, int seed, "
      "bool hash_bias) -> Tensor labels");
  m.def(
      "_clustered_attention_forward(Tensor q, Tensor k, Tensor v, Tensor labels, Tensor? key_lengths, int clusters, "
      "int topk, float scale) -> (Tensor out, Tensor centroid_lse, Tensor background, Tensor top, Tensor mass, "
      "Tensor query_lse)");
  m.def(
      "_clustered_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor labels, "
      "Tensor? key_lengths, Tensor centroid_lse, Tensor background, Tensor top, Tensor mass, Tensor query_lse, "
      "int clusters, int topk, float scale) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("_cluster_queries", &cluster_queries_cpu);
  m.impl("_clustered_attention_forward", &clustered_forward_cpu);
  m.impl("_clustered_attention_backward", &clustered_backward_cpu);
}

TORCH_LIBRARY_IMPL(attnkit, Meta, m) {
  m.impl("_cluster_queries", &cluster_queries_meta);
  m.impl("_clustered_attention_forward", &clustered_forward_meta);
  m.impl("_clustered_attention_backward", &clustered_backward_meta);
}

}  // namespace attnkit
