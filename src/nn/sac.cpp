// SAC attention: see include/attnkit/nn/sac.h.
#include <attnkit/nn/sac.h>

#include <torch/torch.h>

#include <ostream>

#include "ops/checks.h"
#include "nn/mechanisms/mechanism.h"

namespace attnkit::nn {

SacOptions SacOptions::from_spec(const MechanismSpec& spec) {
  SacOptions o;
  o.alpha = spec.get_int("alpha", o.alpha);
  o.variant = edge_predictor_variant_from_string(spec.get("variant", to_string(o.variant)));
  o.max_distance = spec.get_int("max_distance", o.max_distance);
  o.hidden = spec.get_int("hidden", o.hidden);
  o.beam = spec.get_int("beam", o.beam);
  o.decode = spec.get("decode", o.decode);
  TORCH_CHECK(o.decode == "beam" || o.decode == "sample", "mechanism '", spec.str(),
              "': option 'decode' must be beam or sample, got '", o.decode, "'");
  o.seed = static_cast<uint64_t>(spec.get_int("seed", static_cast<int64_t>(o.seed)));
  o.reward = spec.get("reward", o.reward);
  o.entropy = spec.get_double("entropy", o.entropy);
  TORCH_CHECK(o.entropy >= 0, "mechanism '", spec.str(), "': option 'entropy' must be >= 0, got ", o.entropy);
  TORCH_CHECK(o.reward == "sequence" || o.reward == "edge", "mechanism '", spec.str(),
              "': option 'reward' must be sequence or edge, got '", o.reward, "'");
  // Per-edge credit rewards a destination with its origin's label; a predicted
  // origin has no row of its own to be credited with.
  TORCH_CHECK(o.reward == "sequence" || o.variant == EdgePredictorVariant::all_connected,
              "mechanism '", spec.str(), "': reward=edge credits each destination with its origin's "
              "label and needs the origins fed: variant=all-connected");
  return o;
}

bool SacOptions::same_training(const SacOptions& other) const {
  return alpha == other.alpha && variant == other.variant && max_distance == other.max_distance &&
         hidden == other.hidden && reward == other.reward && entropy == other.entropy;
}

EdgePredictorOptions SacOptions::predictor(int64_t width, int64_t heads) const {
  return EdgePredictorOptions(width, hidden)
      .alpha(alpha)
      .variant(variant)
      .heads(heads)
      .max_distance(max_distance);
}

SacAttentionImpl::SacAttentionImpl(MechanismSpec spec)
    : spec_(std::move(spec)), options_(SacOptions::from_spec(spec_)) {}

torch::Tensor SacAttentionImpl::forward(const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const AttendArgs& args) {
  detail::check_qkv("sac", q, k, v, /*grouped_heads=*/true);
  check_supports(find_mechanism("sac"), q, k, v, args);
  const auto options = registration::sparse_options(args);
  if (structures_.empty())
    return sparse_attention(q, k, v, edges::random(q.size(2), options_.alpha, options_.seed), options);
  const int64_t N = q.size(0);
  TORCH_CHECK(static_cast<int64_t>(structures_.size()) == N, "sac: the model set ",
              structures_.size(), " structures for a batch of ", N, " sequences");
  // One call per sequence: each has its own structure.
  std::vector<torch::Tensor> out;
  out.reserve(N);
  for (int64_t b = 0; b < N; ++b) {
    out.push_back(sparse_attention(q.narrow(0, b, 1), k.narrow(0, b, 1), v.narrow(0, b, 1),
                                   structures_[b], options));
  }
  return N == 1 ? out[0] : torch::cat(out, 0);
}

std::shared_ptr<MechanismImpl> SacAttentionImpl::copy(const c10::optional<torch::Device>&) const {
  auto other = std::make_shared<SacAttentionImpl>(spec_);
  other->structures_ = structures_;
  return other;
}

void SacAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::nn::SacAttention(" << spec_.str() << ")";
}

}  // namespace attnkit::nn
