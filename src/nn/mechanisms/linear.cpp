// "linear" and "causal-linear": linear attention phi(q) (sum phi(k) v^T) /
// normaliser (ops.h linear_attention), and the always-causal (RNN) form.
//
// Their defaults differ from the op's on purpose. The op's (identity map, no
// normaliser) are the bare product that the gated layer and the document
// memory build on; as an attention mechanism in a model, "linear" is the
// linear transformer of Katharopoulos et al. (2020): elu(x) + 1, normalised.
// The op's eps is kept.
#include <attnkit/nn/linear.h>

#include "nn/mechanisms/mechanism.h"
#include "reference/reference.h"

namespace attnkit::nn::registration {
namespace {

constexpr FeatureMap kFeatureMap = FeatureMap::elu;
constexpr bool kNormalize = true;

/// Causal linear attention decoded through its recurrent state (S, z), O(E M)
/// per position whatever the context.
class LinearCausalState : public CausalState {
 public:
  explicit LinearCausalState(const LinearAttentionStateOptions& options) : state_(options) {}
  torch::Tensor step(const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override {
    return state_.step(q, k, v);
  }
  int64_t steps() const override { return state_.steps(); }

 private:
  LinearAttentionState state_;
};

LinearAttentionFuncOptions linear_options(const MechanismSpec& spec, bool causal) {
  return LinearAttentionFuncOptions()
      .feature_map(feature_map_from_string(spec.get("feature_map", to_string(kFeatureMap))))
      .normalize(spec.get_bool("normalize", kNormalize))
      .eps(spec.get_double("eps", LinearAttentionFuncOptions().eps()))
      .causal(causal || spec.name == "causal-linear");
}

MechanismInfo linear_entry(const std::string& name) {
  MechanismInfo m;
  m.name = name;
  m.summary = name == "linear" ? "linear attention phi(q) (sum phi(k) v^T) / normaliser"
                               : "linear attention, always causal (the RNN form)";
  m.options = {
      MechanismOption::choice("feature_map", to_string(kFeatureMap), {"identity", "elu"},
                              "phi: identity, or elu (elu(x) + 1)"),
      MechanismOption::boolean("normalize", kNormalize, "divide by phi(q) . sum phi(k) + eps"),
      MechanismOption::real("eps", LinearAttentionFuncOptions().eps(), 0, "added to the normaliser")};
  m.supports.causal = true;
  m.supports.cross = true;
  m.supports.value_dim = true;
  m.supports.decoding_state = true;  // "linear" when called causal, "causal-linear" always
  m.always_causal = name == "causal-linear";
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  m.start_decoding = [](const MechanismSpec& spec) -> std::unique_ptr<CausalState> {
    const auto o = linear_options(spec, true);
    return std::make_unique<LinearCausalState>(
        LinearAttentionStateOptions().feature_map(o.feature_map()).normalize(o.normalize()).eps(o.eps()));
  };
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return linear_attention(x[0], x[1], x[2], linear_options(spec, a.causal));
  };
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return reference::linear_attention(x[0], x[1], x[2], linear_options(spec, a.causal));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return linear_attention_dispatch(x[0], x[1], x[2], linear_options(spec, a.causal));
  };
  m.flops = [](const AttentionShape& s, bool, const MechanismSpec&) -> c10::optional<double> {
    // phi(k)^T v (S E M) and phi(q) times that (L E M), 2 flops each.
    return 2.0 * s.N * s.H * (s.S + s.L) * s.E * s.M;
  };
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(linear, 20, { return {linear_entry("linear"), linear_entry("causal-linear")}; });

}  // namespace attnkit::nn::registration
