// "gated-linear": the cheap-linear-attention paper's gated form with a
// document memory, f = sigmoid(k) * v, out = (sum_t f_t f_t^T) q, with
// alpha = beta = 1 (ops.h gated_linear_attention for the general gates).
#include <attnkit/nn/linear_attention.h>

#include "nn/mechanisms/mechanism.h"
#include "reference/reference.h"

namespace attnkit::nn::registration {
namespace {

/// Decoding: the recurrent state of linear attention with keys = values = f
/// (identity map, no normaliser), O(E^2) per position; one per key/value head.
class GatedCausalState : public CausalState {
 public:
  torch::Tensor step(const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override {
    const auto f = torch::sigmoid(k) * v;
    return state_.step(q, f, f);
  }
  int64_t steps() const override { return state_.steps(); }

 private:
  LinearAttentionState state_{LinearAttentionStateOptions()};
};

MechanismInfo gated_linear_entry() {
  MechanismInfo m;
  m.name = "gated-linear";
  m.summary =
      "cheap linear attention with a document memory: f = sigmoid(k) * v, out = (sum f f^T) q";
  m.supports.causal = true;
  m.supports.cross = true;
  m.supports.decoding_state = true;
  // f has k's heads: linear_attention and its state read them per group.
  m.supports.grouped_heads = true;
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  m.start_decoding = [](const MechanismSpec&) -> std::unique_ptr<CausalState> {
    return std::make_unique<GatedCausalState>();
  };
  // C = sum_t f_t f_t^T is linear attention with keys = values = f (identity
  // map, no normaliser), which also lets the number of queries differ from
  // the document length.
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    const auto f = torch::sigmoid(x[1]) * x[2];
    return linear_attention(x[0], f, f, LinearAttentionFuncOptions().causal(a.causal));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    return linear_attention_dispatch(x[0], x[1], x[2], LinearAttentionFuncOptions().causal(a.causal));
  };
  // Its definition is the recurrence C_t = C_{t-1} + f_t f_t^T read out by q
  // (a different computation from the one above), where L = S allows it.
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    auto f = torch::sigmoid(x[1]) * x[2];
    // Grouped heads: the recurrence reads f per query head, each key/value head repeated.
    if (f.size(1) != x[0].size(1) && f.size(1) > 0) f = f.repeat_interleave(x[0].size(1) / f.size(1), 1);
    if (x[0].size(2) != f.size(2))
      return reference::linear_attention(x[0], f, f, LinearAttentionFuncOptions().causal(a.causal));
    const auto ones = torch::ones({f.size(0), f.size(1), f.size(2)}, f.options());
    return reference::gated_linear_attention(f, x[0], ones, ones,
                                             GatedLinearAttentionFuncOptions().causal(a.causal));
  };
  m.flops = [](const AttentionShape& s, bool, const MechanismSpec&) -> c10::optional<double> {
    return 2.0 * s.N * (s.Hk() * s.S + s.H * s.L) * s.E * s.E;  // the state once per key/value head
  };
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(gated_linear, 30, { return {gated_linear_entry()}; });

}  // namespace attnkit::nn::registration
