// "full": exact softmax attention, the tiled kernel (ops.h softmax_attention).
#include "nn/mechanisms/mechanism.h"
#include "reference/reference.h"

namespace attnkit::nn::registration {
namespace {

int64_t window_of(const MechanismSpec& spec) { return spec.get_int("window", 0); }

SoftmaxAttentionFuncOptions softmax_options(const AttendArgs& a, const MechanismSpec& spec) {
  return SoftmaxAttentionFuncOptions()
      .window(window_of(spec))
      .causal(a.causal)
      .key_lengths(a.key_lengths)
      .alibi_slopes(a.alibi_slopes)
      .rotary_dim(a.rotary_dim)
      .rotary_base(a.rotary_base)
      .dropout_p(a.dropout_p)
      .dropout_seed(a.dropout_seed);
}

MechanismInfo full_entry() {
  MechanismInfo m;
  m.name = "full";
  m.exact = true;
  m.torch_baseline = true;  // torch's own SDPA (torch 2) or its composite
  m.summary = "exact softmax attention (tiled kernel)";
  m.options = {MechanismOption::integer("window", 0, 0,
                                        "a local window: each query sees the keys within window - 1 of its "
                                        "position (before it when causal); 0: none")};
  m.supports.causal = true;
  m.supports.key_lengths = true;
  m.supports.cross = true;
  m.supports.value_dim = true;
  m.supports.decoding_state = true;
  m.supports.grouped_heads = true;
  m.supports.alibi = true;
  m.supports.rotary = RotarySupport::kernel;
  m.supports.dropout = true;
  m.inputs = {"q", "k", "v"};
  m.sample = sample_qkv;
  m.make = make_functional;
  m.start_decoding = [](const MechanismSpec& spec) -> std::unique_ptr<CausalState> {
    // A window keeps the last `window` positions: the cache forgets the rest.
    const int64_t window = window_of(spec);
    if (window > 0) return std::make_unique<CachedSoftmaxState>([window](int64_t t) { return t - window + 1; });
    return std::make_unique<CachedSoftmaxState>([](int64_t) { return int64_t{0}; });
  };
  m.run = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return softmax_attention(x[0], x[1], x[2], softmax_options(a, spec));
  };
  m.reference = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return reference::softmax_attention(x[0], x[1], x[2], softmax_options(a, spec));
  };
  m.dispatch = [](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return softmax_attention_dispatch(x[0], x[1], x[2], softmax_options(a, spec));
  };
  m.flops = [](const AttentionShape& s, bool causal, const MechanismSpec& spec) -> c10::optional<double> {
    // q k^T and P v: 2 (E + M) per visible (query, key) pair. Query i sits at
    // p = i + S - L and sees the keys j with 0 <= j < S, j <= p when causal,
    // and |p - j| < window with a window.
    const int64_t window = window_of(spec);
    double pairs = 0;
    for (int64_t i = 0; i < s.L; ++i) {
      const int64_t p = i + s.S - s.L;
      const int64_t first = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      const int64_t end = causal ? std::min(s.S, p + 1) : window > 0 ? std::min(s.S, p + window) : s.S;
      pairs += double(std::max<int64_t>(0, end - first));
    }
    return 2.0 * s.N * s.H * pairs * (s.E + s.M);
  };
  return m;
}

}  // namespace

ATTNKIT_REGISTER_MECHANISMS(full, 10, { return {full_entry()}; });

}  // namespace attnkit::nn::registration
