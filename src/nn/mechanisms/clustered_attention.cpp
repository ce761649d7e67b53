// "clustered" and "improved-clustered": queries grouped by LSH and Hamming
// K-means attend through their centroid; the improved form adds exact
// attention on each cluster's top-k keys (ops.h clustered_attention). Their
// module is nn::ClusteredAttention, whose options (and their defaults, taken
// from the op's) hold the seed policy.
#include <attnkit/nn/clustered_attention.h>

#include <algorithm>

#include "ops/checks.h"
#include "nn/mechanisms/mechanism.h"
#include "reference/reference.h"

namespace attnkit::nn::registration {
namespace {

/// The improved form's default top-k: the clustered-attention paper's value.
constexpr int64_t kTopk = 32;

ClusteredAttentionOptions clustered_module_options(const MechanismSpec& spec) {
  const ClusteredAttentionOptions d;
  return ClusteredAttentionOptions()
      .clusters(spec.get_int("clusters", d.clusters()))
      .bits(spec.get_int("bits", d.bits()))
      .iterations(spec.get_int("iterations", d.iterations()))
      .topk(spec.name == "improved-clustered" ? spec.get_int("topk", kTopk) : 0)
      .hash_bias(spec.get_bool("hash_bias", d.hash_bias()))
      .seed(spec.get_int("seed", d.seed()))
      .advance_seed(spec.get_bool("advance_seed", d.advance_seed()));
}

/// The op's options for one call: the module's, capped at what the input has.
ClusteredAttentionFuncOptions clustered_options(const MechanismSpec& spec, const Inputs& x,
                                                const AttendArgs& a) {
  const auto o = clustered_module_options(spec);
  const int64_t L = x[0].size(2), S = x[1].size(2);
  return ClusteredAttentionFuncOptions()
      .clusters(std::max<int64_t>(1, std::min(o.clusters(), L)))
      .bits(o.bits())
      .iterations(o.iterations())
      .topk(std::min(o.topk(), S))
      .hash_bias(o.hash_bias())
      .seed(o.seed())
      .key_lengths(a.key_lengths);
}

/// nn::ClusteredAttention behind the registry's interface, so that its seed
/// policy (fresh planes per training step) and `calls` buffer come along.
class ClusteredMechanism : public MechanismImpl {
 public:
  ClusteredMechanism(const MechanismInfo* info, const MechanismSpec& spec) : info_(info), spec_(spec) {
    module_ = register_module("clustered", ClusteredAttention(clustered_module_options(spec)));
  }
  /// A deep copy: the inner module's clone carries the `calls` counter.
  std::shared_ptr<MechanismImpl> copy(const c10::optional<torch::Device>& device) const override {
    auto copy = std::make_shared<ClusteredMechanism>(info_, spec_);
    copy->module_ = copy->replace_module(
        "clustered", ClusteredAttention(std::dynamic_pointer_cast<ClusteredAttentionImpl>(
                         module_->clone(device))));
    return copy;
  }
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttendArgs& args) override {
    detail::check_qkv(info_->name.c_str(), q, k, v, /*grouped_heads=*/true);
    check_supports(*info_, q, k, v, args);
    return module_->forward(q, k, v, args.key_lengths);
  }

 private:
  const MechanismInfo* info_;
  MechanismSpec spec_;
  ClusteredAttention module_{nullptr};
};

MechanismInfo clustered_entry(const std::string& name) {
  const bool improved = name == "improved-clustered";
  const ClusteredAttentionOptions d;
  MechanismInfo m;
  m.name = name;
  m.summary = improved ? "clusters of queries attend through their centroid, plus exact "
                         "attention on each cluster's top-k keys"
                       : "queries grouped by LSH + Hamming K-means attend through their centroid";
  m.options = {
      MechanismOption::integer("clusters", d.clusters(), 1, "query clusters (capped at L)"),
      MechanismOption::integer("bits", d.bits(), 1, "LSH hash bits", 63),
      // 0 iterations: the initial assignment alone.
      MechanismOption::integer("iterations", d.iterations(), 0, "Hamming K-means iterations",
                               ClusteredAttentionFuncOptions::kMaxIterations),
      MechanismOption::boolean("hash_bias", d.hash_bias(),
                               "hyperplanes with a threshold (false: through 0)"),
      MechanismOption::integer("seed", d.seed(), 0, "seed of the planes and the K-means start"),
      MechanismOption::boolean("advance_seed", d.advance_seed(),
                               "module: fresh planes per training-mode call")};
  if (improved)
    m.options.push_back(
        MechanismOption::integer("topk", kTopk, 1, "keys attended exactly per cluster (capped at S)"));
  m.supports.key_lengths = true;
  m.supports.cross = true;
  m.supports.value_dim = true;
  m.supports.grouped_heads = true;  // each query head's clusters attend over its group's keys
  m.supports.rotary = RotarySupport::inputs;  // clusters and scores from the rotated q and k
  m.approximates_exact = true;
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = [](const MechanismSpec& spec) -> std::shared_ptr<MechanismImpl> {
    return std::make_shared<ClusteredMechanism>(&find_mechanism(spec.name), spec);
  };
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return clustered_attention(x[0], x[1], x[2], clustered_options(spec, x, a));
  };
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return reference::clustered_attention(x[0], x[1], x[2], clustered_options(spec, x, a));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return clustered_attention_dispatch(x[0], x[1], x[2], clustered_options(spec, x, a));
  };
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(clustered, 50, {
  return {clustered_entry("clustered"), clustered_entry("improved-clustered")};
});

}  // namespace attnkit::nn::registration
