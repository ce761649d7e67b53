// Clustered attention module (docs/MATH.md, "Clustered attention").
#include <attnkit/nn/clustered_attention.h>

#include <ostream>

namespace attnkit::nn {

ClusteredAttentionImpl::ClusteredAttentionImpl(const ClusteredAttentionOptions& options_)
    : options(options_) {
  reset();
}

void ClusteredAttentionImpl::reset() {
  constexpr const char* module = "ClusteredAttention";
  TORCH_CHECK(options.clusters() >= 1, module, ": option 'clusters' must be >= 1, got ",
              options.clusters());
  TORCH_CHECK(options.bits() >= 1 && options.bits() <= 63, module,
              ": option 'bits' must be in [1, 63], got ", options.bits());
  TORCH_CHECK(options.iterations() >= 0 &&
                  options.iterations() <= ClusteredAttentionFuncOptions::kMaxIterations,
              module, ": option 'iterations' must be in [0, ", ClusteredAttentionFuncOptions::kMaxIterations,
              "], got ", options.iterations());
  TORCH_CHECK(options.topk() >= 0, module, ": option 'topk' must be >= 0, got ", options.topk());
  calls = register_buffer("calls", torch::zeros({}, torch::kLong));
}

int64_t ClusteredAttentionImpl::next_seed() const {
  return options.advance_seed() && is_training() ? options.seed() + calls.item<int64_t>()
                                                 : options.seed();
}

torch::Tensor ClusteredAttentionImpl::forward(const torch::Tensor& q, const torch::Tensor& k,
                                              const torch::Tensor& v,
                                              const torch::Tensor& key_lengths,
                                              const torch::Tensor& query_lengths) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "ClusteredAttention: q and k must be (N, H, L, E) "
              "and (N, H, S, E), got ", q.dim(), " and ", k.dim(), " dimensions");
  const int64_t L = q.size(2), S = k.size(2);
  const int64_t seed = next_seed();
  auto out = clustered_attention(q, k, v,
                                 ClusteredAttentionFuncOptions()
                                     .clusters(std::max<int64_t>(1, std::min(options.clusters(), L)))
                                     .bits(options.bits())
                                     .iterations(options.iterations())
                                     .topk(std::min(options.topk(), S))
                                     .hash_bias(options.hash_bias())
                                     .seed(seed)
                                     .scale(options.scale())
                                     .key_lengths(key_lengths)
                                     .query_lengths(query_lengths));
  if (options.advance_seed() && is_training()) {
    torch::NoGradGuard no_grad;
    calls.add_(1);
  }
  return out;
}

void ClusteredAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::nn::ClusteredAttention(clusters=" << options.clusters()
         << ", bits=" << options.bits() << ", iterations=" << options.iterations()
         << ", topk=" << options.topk() << ", seed=" << options.seed()
         << (options.advance_seed() ? ", advance_seed" : "") << ")";
}

}  // namespace attnkit::nn
