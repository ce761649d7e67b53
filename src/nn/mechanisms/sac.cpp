// "sac": attention over a structure that a learned edge predictor chooses per
// sequence (the SAC paper; nn/sac.h). Alone, without a model to set the
// structures, it attends over edges::random.
#include <attnkit/nn/sac.h>

#include "nn/mechanisms/mechanism.h"

namespace attnkit::nn::registration {
namespace {

MechanismInfo sac_entry() {
  const SacOptions d;
  MechanismInfo m;
  m.name = "sac";
  m.model_structures = true;  // the model's edge predictor (nn::SacOptions::from_spec)
  m.summary = "SAC: attention over a structure that a learned edge predictor chooses per sequence "
              "(in a model; alone: over edges::random)";
  m.options = {
      MechanismOption::integer("alpha", d.alpha, 1, "predicted edges per node (plus the self-edge)"),
      MechanismOption::choice("variant", to_string(d.variant), {"shared", "all-connected", "head-adaptive"},
                              "the edge predictor's variant"),
      MechanismOption::integer("max_distance", d.max_distance, 0, "distance encoding clip (0: off)"),
      MechanismOption::integer("hidden", d.hidden, 1, "the edge predictor's LSTM width"),
      MechanismOption::integer("beam", d.beam, 1, "beam width of the structure at evaluation"),
      MechanismOption::choice("decode", d.decode, {"beam", "sample"},
                              "the structure at evaluation: beam search (the paper) or one sample"),
      MechanismOption::integer("seed", static_cast<int64_t>(d.seed), 0,
                               "edges::random's seed when no predictor supplies one; decode=sample's draws"),
      MechanismOption::choice("reward", d.reward, {"sequence", "edge"},
                              "REINFORCE credit: sequence (the paper) or edge (per edge's row)"),
      MechanismOption::real("entropy", d.entropy, 0,
                            "weight of an entropy bonus on the predictor (0: none, the paper)")};
  m.validate = [](const MechanismSpec& spec) { SacOptions::from_spec(spec); };  // reward vs variant
  m.supports.value_dim = true;
  m.supports.grouped_heads = true;
  m.supports.alibi = true;
  // Rotary positions on q and k before the call: rotating keys as the
  // kernel loads them would repeat it per edge or band block (docs/MATH.md,
  // "Sparse attention", counts it).
  m.supports.rotary = RotarySupport::inputs;
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = [](const MechanismSpec& spec) -> std::shared_ptr<MechanismImpl> {
    return std::make_shared<SacAttentionImpl>(spec);
  };
  attend_over_edges(m, [](int64_t n, const MechanismSpec& spec) {
    const auto o = SacOptions::from_spec(spec);
    return edges::random(n, o.alpha, o.seed);
  });
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(sac, 70, { return {sac_entry()}; });

}  // namespace attnkit::nn::registration
