// "agglomerative": one head per class, class-weighted value means (ops.h
// agglomerative_attention). Its per-head inputs are class weights, which the
// layer nn::AgglomerativeAttention computes with its own projections, so the
// entry has no module of its own (make is null).
#include "nn/mechanisms/mechanism.h"
#include "reference/reference.h"

namespace attnkit::nn::registration {
namespace {

MechanismInfo agglomerative_entry() {
  MechanismInfo m;
  m.name = "agglomerative";
  m.layer = MechanismLayer::class_projections;  // nn::AgglomerativeAttention
  m.summary = "one head per class: class-weighted value means (layer: nn::AgglomerativeAttention)";
  m.options = {
      MechanismOption::real("clip", AgglomerativeAttentionFuncOptions().clip(), 0,
                            "lower bound of a class's weight sum", /*min_exclusive=*/true),
      MechanismOption::integer("classes", 0, 0, "layer: class count m (0: the model's head count)")};
  m.supports.causal = true;
  m.supports.cross = true;
  m.supports.value_dim = true;
  m.supports.decoding_state = true;  // through the layer: nn::AgglomerativeAttention::step
  m.inputs = {"cq", "cr", "v"};
  m.sample = [](const AttentionShape& s, torch::Dtype dtype) -> MechanismInputs {
    // Class weights are softmaxes over the H classes, as the layer makes them.
    auto o = torch::TensorOptions().dtype(dtype);
    return {torch::softmax(torch::randn({s.N, s.L, s.H}, o), -1).permute({0, 2, 1}),
            torch::softmax(torch::randn({s.N, s.S, s.H}, o), -1).permute({0, 2, 1}),
            torch::randn({s.N, s.H, s.S, s.M}, o)};
  };
  auto options = [](const AttendArgs& a, const MechanismSpec& spec) {
    return AgglomerativeAttentionFuncOptions().causal(a.causal).clip(
        spec.get_double("clip", AgglomerativeAttentionFuncOptions().clip()));
  };
  m.run = [options](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return agglomerative_attention(x[0], x[1], x[2], options(a, spec));
  };
  m.reference = [options](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return reference::agglomerative_attention(x[0], x[1], x[2], options(a, spec));
  };
  m.dispatch = [options](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return agglomerative_attention_dispatch(x[0], x[1], x[2], options(a, spec));
  };
  m.flops = [](const AttentionShape& s, bool, const MechanismSpec&) -> c10::optional<double> {
    // Class sums (S M) and the read-out (L M), 2 flops each, per class.
    return 2.0 * s.N * s.H * (s.S + s.L) * s.M;
  };
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(agglomerative, 40, { return {agglomerative_entry()}; });

}  // namespace attnkit::nn::registration
