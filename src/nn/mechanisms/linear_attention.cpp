// "linear" and "causal-linear": linear attention phi(q) (sum phi(k) v^T) /
// normaliser (ops.h linear_attention), and the always-causal (RNN) form.
//
// Their defaults differ from the op's on purpose. The op's (identity map, no
// normaliser) are the bare product that the gated layer and the document
// memory build on; as an attention mechanism in a model, "linear" is the
// linear transformer of Katharopoulos et al. (2020): elu(x) + 1, normalised.
// The op's eps is kept.
#include <attnkit/nn/linear_attention.h>

#include "nn/mechanisms/mechanism.h"
#include "reference/reference.h"

namespace attnkit::nn::registration {
namespace {

constexpr FeatureMap kFeatureMap = FeatureMap::elu;
constexpr bool kNormalize = true;

/// Causal linear attention decoded through its recurrent state (S, z) per
/// key/value head, O(E M) per position whatever the context. Rotary
/// positions turn phi(q), phi(k) in the numerator only, so the state applies
/// them itself (the caller cannot rotate q and k for it).
class LinearCausalState : public CausalState {
 public:
  explicit LinearCausalState(const LinearAttentionStateOptions& options) : options_(options), state_(options) {}
  torch::Tensor step(const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override {
    return state_.step(q, k, v);
  }
  int64_t steps() const override { return state_.steps(); }
  bool rotate_inside(int64_t dim, double base) override {
    TORCH_CHECK(state_.steps() == 0, "causal linear attention's decoding state takes rotary positions before "
                "its first step");
    state_ = LinearAttentionState(options_.rotary_dim(dim).rotary_base(base));
    return true;
  }

 private:
  LinearAttentionStateOptions options_;
  LinearAttentionState state_;
};

LinearAttentionFuncOptions linear_options(const MechanismSpec& spec, const AttendArgs& a) {
  return LinearAttentionFuncOptions()
      .feature_map(feature_map_from_string(spec.get("feature_map", to_string(kFeatureMap))))
      .normalize(spec.get_bool("normalize", kNormalize))
      .eps(spec.get_double("eps", LinearAttentionFuncOptions().eps()))
      .causal(a.causal || spec.name == "causal-linear")
      .rotary_dim(a.rotary_dim)
      .rotary_base(a.rotary_base);
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
  m.supports.grouped_heads = true;   // a state per key/value head, in the kernel and in decoding
  m.supports.rotary = RotarySupport::kernel;  // RoFormer's linear form: phi(q), phi(k) in the numerator
  m.always_causal = name == "causal-linear";
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  m.start_decoding = [](const MechanismSpec& spec) -> std::unique_ptr<CausalState> {
    const auto o = linear_options(spec, AttendArgs(true));
    return std::make_unique<LinearCausalState>(
        LinearAttentionStateOptions().feature_map(o.feature_map()).normalize(o.normalize()).eps(o.eps()));
  };
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return linear_attention(x[0], x[1], x[2], linear_options(spec, a));
  };
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return reference::linear_attention(x[0], x[1], x[2], linear_options(spec, a));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return linear_attention_dispatch(x[0], x[1], x[2], linear_options(spec, a));
  };
  m.flops = [](const AttentionShape& s, bool, const MechanismSpec&) -> c10::optional<double> {
    // phi(k)^T v (S E M, once per key/value head) and phi(q) times that
    // (L E M per query head), 2 flops each.
    return 2.0 * s.N * (s.Hk() * s.S + s.H * s.L) * s.E * s.M;
  };
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(linear, 20, { return {linear_entry("linear"), linear_entry("causal-linear")}; });

}  // namespace attnkit::nn::registration
