// "full": exact softmax attention, the tiled kernel (ops.h softmax_attention).
#include "nn/mechanisms/mechanism.h"
#include "reference/reference.h"

namespace attnkit::nn::registration {
namespace {

SoftmaxAttentionFuncOptions softmax_options(const AttendArgs& a) {
  return SoftmaxAttentionFuncOptions()
      .causal(a.causal)
      .key_lengths(a.key_lengths)
      .alibi_slopes(a.alibi_slopes)
      .rotary_dim(a.rotary_dim)
      .rotary_base(a.rotary_base);
}

MechanismInfo full_entry() {
  MechanismInfo m;
  m.name = "full";
  m.summary = "exact softmax attention (tiled kernel)";
  m.supports.causal = true;
  m.supports.key_lengths = true;
  m.supports.cross = true;
  m.supports.value_dim = true;
  m.supports.decoding_state = true;
  m.supports.grouped_heads = true;
  m.supports.alibi = true;
  m.supports.rotary = RotarySupport::kernel;
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  m.start_decoding = [](const MechanismSpec&) -> std::unique_ptr<CausalState> {
    return std::make_unique<CachedSoftmaxState>([](int64_t) { return int64_t{0}; });
  };
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    return softmax_attention(x[0], x[1], x[2], softmax_options(a));
  };
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    return reference::softmax_attention(x[0], x[1], x[2], softmax_options(a));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec&) {
    return softmax_attention_dispatch(x[0], x[1], x[2], softmax_options(a));
  };
  m.flops = [](const AttentionShape& s, bool causal, const MechanismSpec&) -> c10::optional<double> {
    // q k^T and P v: 2 (E + M) per visible (query, key) pair. Causal, query i
    // sees the keys j <= i + S - L: L (S - L) + L (L + 1) / 2 pairs when
    // L <= S, and S (S + 1) / 2 when L > S (the first L - S queries see none).
    const double L = double(s.L), S = double(s.S);
    const double pairs = !causal ? L * S : L <= S ? L * (S - L) + L * (L + 1) / 2 : S * (S + 1) / 2;
    return 2.0 * s.N * s.H * pairs * (s.E + s.M);
  };
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(full, 10, { return {full_entry()}; });

}  // namespace attnkit::nn::registration
