// "none": the control without attention. Each position attends to itself
// alone, so a block's attention output is the position's own value v_i. The
// block keeps its value and output projections (a per-position linear map,
// the same parameters and compute on that path as under every other
// mechanism) and loses only what attention adds: mixing between positions. A
// zero output would drop that per-position map too, and with it capacity the
// mechanisms it is compared with have. Queries and keys get no gradient:
// nothing reads them.
#include "nn/mechanisms/mechanism.h"
#include "reference/reference.h"

namespace attnkit::nn::registration {
namespace {

/// v, or 0 in the rows of positions past their sequence's key length (their
/// one key is padding, so they see none: as exact attention's empty rows).
torch::Tensor own_values(const torch::Tensor& v, const AttendArgs& a) {
  if (!a.key_lengths.defined()) return v.clone();
  const auto positions = torch::arange(v.size(2), a.key_lengths.options());
  const auto seen = positions.unsqueeze(0) < a.key_lengths.unsqueeze(1);  // (N, L)
  return v * seen.view({v.size(0), 1, v.size(2), 1}).to(v.scalar_type());
}

/// The same as exact softmax attention with a bias that hides every key but
/// the query's own: an independent definition for the float64 check.
torch::Tensor diagonal_softmax(const Inputs& x, const AttendArgs& a) {
  const int64_t L = x[0].size(2);
  const auto eye = torch::eye(L, x[0].options().dtype(torch::kBool));
  const auto bias = torch::zeros({L, L}, x[0].options()).masked_fill(eye.logical_not(), -INFINITY);
  return reference::softmax_attention(
      x[0], x[1], x[2],
      SoftmaxAttentionFuncOptions().causal(a.causal).key_lengths(a.key_lengths).bias(bias));
}

/// Decoding: the next position's own value.
class OwnValueState : public CausalState {
 public:
  torch::Tensor step(const torch::Tensor&, const torch::Tensor&, const torch::Tensor& v) override {
    ++steps_;
    return v.clone();
  }
  int64_t steps() const override { return steps_; }

 private:
  int64_t steps_ = 0;
};

MechanismInfo none_entry() {
  MechanismInfo m;
  m.name = "none";
  m.summary = "no attention, the control: each position's output is its own value";
  m.supports.causal = true;
  m.supports.key_lengths = true;
  m.supports.value_dim = true;
  m.supports.decoding_state = true;
  m.supports.rotary = RotarySupport::inputs;  // reads no q or k: rotating them changes nothing
  m.always_causal = true;  // no position sees another
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  m.start_decoding = [](const MechanismSpec&) -> std::unique_ptr<CausalState> {
    return std::make_unique<OwnValueState>();
  };
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) { return own_values(x[2], a); };
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    return diagonal_softmax(x, a);
  };
  m.dispatch = [](const Inputs&, const AttendArgs&, const MechanismSpec&) {
    return Dispatch::composite("no attention: each position's own value (a copy)");
  };
  m.flops = [](const AttentionShape&, bool, const MechanismSpec&) -> c10::optional<double> {
    return 0.0;
  };
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(none, 80, { return {none_entry()}; });

}  // namespace attnkit::nn::registration
