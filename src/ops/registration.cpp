// Registers every op as torch.ops.attnkit.<name>. The schemas name the keyword
// arguments Python callers use; each wrapper only unpacks them into the C++
// options struct and calls the C++ op, so both languages share one
// implementation and one set of checks. The ops are composite (their autograd
// comes from the functions they call), hence CompositeImplicitAutograd; the
// two tensor factories, attention_dropout_mask and edge_pattern, have CPU and
// Meta kernels instead (at the end of this file).
#include <attnkit/ops.h>
#include <torch/library.h>

#include <cstdio>
#include <string>

namespace attnkit {
namespace {

torch::Tensor softmax_attention_op(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, c10::optional<double> scale,
                                   bool causal, const c10::optional<torch::Tensor>& key_lengths,
                                   const c10::optional<torch::Tensor>& bias,
                                   const c10::optional<torch::Tensor>& alibi_slopes,
                                   int64_t rotary_dim, double rotary_base, int64_t window, double dropout_p,
                                   c10::optional<int64_t> dropout_seed) {
  return softmax_attention(q, k, v, SoftmaxAttentionFuncOptions()
                                        .scale(scale)
                                        .causal(causal)
                                        .key_lengths(key_lengths.value_or(torch::Tensor()))
                                        .bias(bias.value_or(torch::Tensor()))
                                        .alibi_slopes(alibi_slopes.value_or(torch::Tensor()))
                                        .rotary_dim(rotary_dim)
                                        .rotary_base(rotary_base)
                                        .window(window)
                                        .dropout_p(dropout_p)
                                        .dropout_seed(dropout_seed));
}

torch::Tensor varlen_attention_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                  c10::optional<double> scale, bool causal,
                                  const c10::optional<torch::Tensor>& alibi_slopes, int64_t rotary_dim,
                                  double rotary_base, int64_t window, double dropout_p,
                                  c10::optional<int64_t> dropout_seed) {
  return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k,
                          SoftmaxAttentionFuncOptions()
                              .scale(scale)
                              .causal(causal)
                              .alibi_slopes(alibi_slopes.value_or(torch::Tensor()))
                              .rotary_dim(rotary_dim)
                              .rotary_base(rotary_base)
                              .window(window)
                              .dropout_p(dropout_p)
                              .dropout_seed(dropout_seed));
}

torch::Tensor rotary_embedding_op(const torch::Tensor& x, int64_t dim, double base, int64_t offset) {
  return rotary_embedding(x, RotaryEmbeddingFuncOptions(dim).base(base).offset(offset));
}

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

torch::Tensor gated_linear_attention_op(const torch::Tensor& f, const torch::Tensor& q,
                                        const torch::Tensor& alpha, const torch::Tensor& beta,
                                        bool causal) {
  return gated_linear_attention(f, q, alpha, beta, GatedLinearAttentionFuncOptions().causal(causal));
}

torch::Tensor agglomerative_attention_op(const torch::Tensor& cq, const torch::Tensor& cr,
                                         const torch::Tensor& v, bool causal, double clip) {
  return agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().causal(causal).clip(clip));
}

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

torch::Tensor sparse_attention_op(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& offsets,
                                  const torch::Tensor& columns, c10::optional<double> scale,
                                  const c10::optional<torch::Tensor>& alibi_slopes) {
  return sparse_attention(q, k, v, EdgeList{offsets, columns},
                          SparseAttentionFuncOptions().scale(scale).alibi_slopes(alibi_slopes.value_or(torch::Tensor())));
}

std::tuple<torch::Tensor, torch::Tensor> edge_pattern_op(c10::string_view name, int64_t n,
                                                         int64_t param) {
  auto e = edges::by_name(std::string(name), n, param);
  return {e.offsets, e.columns};
}

/// Default values as a schema writes them.
std::string schema_bool(bool x) { return x ? "True" : "False"; }
std::string schema_float(double x) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", x);  // reads back as x
  return text;
}

}  // namespace

TORCH_LIBRARY(attnkit, m) {
  const SoftmaxAttentionFuncOptions soft;
  m.def(("softmax_attention(Tensor q, Tensor k, Tensor v, *, float? scale=None, bool causal=False, "
         "Tensor? key_lengths=None, Tensor? bias=None, Tensor? alibi_slopes=None, int rotary_dim=" +
         std::to_string(soft.rotary_dim()) + ", float rotary_base=" + schema_float(soft.rotary_base()) +
         ", int window=" + std::to_string(soft.window()) + ", float dropout_p=" + schema_float(soft.dropout_p()) +
         ", int? dropout_seed=None) -> Tensor")
            .c_str(),
        &softmax_attention_op);
  m.def(("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, *, "
         "float? scale=None, bool causal=False, Tensor? alibi_slopes=None, int rotary_dim=" +
         std::to_string(soft.rotary_dim()) + ", float rotary_base=" + schema_float(soft.rotary_base()) +
         ", int window=" + std::to_string(soft.window()) + ", float dropout_p=" + schema_float(soft.dropout_p()) +
         ", int? dropout_seed=None) -> Tensor")
            .c_str(),
        &varlen_attention_op);
  m.def("attention_dropout_mask(int N, int H, int L, int S, float dropout_p, int seed) -> Tensor");
  m.def("alibi_slopes(int heads) -> Tensor", &alibi_slopes);
  m.def(("rotary_embedding(Tensor x, int dim, *, float base=" +
         schema_float(RotaryEmbeddingFuncOptions(2).base()) + ", int offset=0) -> Tensor")
            .c_str(),
        &rotary_embedding_op);
  // torch 2.5's schema of torch.nn.functional.scaled_dot_product_attention.
  m.def("scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
        "float dropout_p=0.0, bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor",
        &scaled_dot_product_attention_op);
  // The schemas' defaults are the *FuncOptions' (ops.h), written once there.
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
  m.def("gated_linear_attention(Tensor f, Tensor q, Tensor alpha, Tensor beta, *, "
        "bool causal=False) -> Tensor",
        &gated_linear_attention_op);
  m.def(("agglomerative_attention(Tensor cq, Tensor cr, Tensor v, *, bool causal=False, float clip=" +
         schema_float(AgglomerativeAttentionFuncOptions().clip()) + ") -> Tensor")
            .c_str(),
        &agglomerative_attention_op);
  const ClusteredAttentionFuncOptions clu;
  m.def(("clustered_attention(Tensor q, Tensor k, Tensor v, *, int clusters=" + std::to_string(clu.clusters()) +
         ", int bits=" + std::to_string(clu.bits()) + ", int iterations=" + std::to_string(clu.iterations()) +
         ", int topk=" + std::to_string(clu.topk()) + ", bool hash_bias=" + schema_bool(clu.hash_bias()) +
         ", int seed=" + std::to_string(clu.seed()) +
         ", float? scale=None, Tensor? key_lengths=None, Tensor? query_lengths=None) -> Tensor")
            .c_str(),
        &clustered_attention_op);
  m.def("sparse_attention(Tensor q, Tensor k, Tensor v, Tensor offsets, Tensor columns, *, "
        "float? scale=None, Tensor? alibi_slopes=None) -> Tensor",
        &sparse_attention_op);
  m.def("edge_pattern(str name, int n, int param=0) -> (Tensor offsets, Tensor columns)");
}

// A factory has no tensor argument to dispatch on: its kernel is registered
// as CompositeExplicitAutograd, which the dispatcher also runs when no
// argument names a backend. A tracer shapes their outputs with the fake
// implementations python/attnkit/_compile.py registers (torch's fake tensors
// treat a one-tensor factory as a constructor taking a device, which these
// are not, so a Meta kernel would not be reached).
TORCH_LIBRARY_IMPL(attnkit, CompositeExplicitAutograd, m) {
  m.impl("attention_dropout_mask", &attention_dropout_mask);
  m.impl("edge_pattern", &edge_pattern_op);
}

}  // namespace attnkit
