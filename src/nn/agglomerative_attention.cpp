// Agglomerative attention layer and its streaming step (docs/MATH.md,
// "Agglomerative attention").
#include <attnkit/nn/agglomerative_attention.h>

#include <attnkit/ops.h>

#include <cmath>

#include "ops/checks.h"

namespace attnkit::nn {

namespace {

constexpr const char* kAgglomerativeModule = "AgglomerativeAttention";

/// Glorot (Xavier) uniform: U(-b, b) with b = sqrt(6 / (fan_in + fan_out)).
torch::Tensor glorot_uniform(int64_t fan_in, int64_t fan_out) {
  const double bound = std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  return torch::empty({fan_in, fan_out}).uniform_(-bound, bound);
}

/// x W + b for a parameter W stored (in, out), as the paper writes it, through
/// attnkit::linear (our GEMM, not libtorch's matmul).
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& W,
                      const torch::Tensor& b = {}) {
  return attnkit::linear(x, W.t(), b);
}

}  // namespace

AgglomerativeAttentionImpl::AgglomerativeAttentionImpl(const AgglomerativeAttentionOptions& options_)
    : options(options_) {
  reset();
}

void AgglomerativeAttentionImpl::reset() {
  const int64_t d = options.width(), m = options.classes();
  TORCH_CHECK(d > 0 && m > 0 && d % m == 0, kAgglomerativeModule, ": width (", d,
              ") must be a positive multiple of classes (", m, ")");
  TORCH_CHECK(options.dropout() >= 0 && options.dropout() < 1, kAgglomerativeModule,
              ": option 'dropout' must be in [0, 1), got ", options.dropout());
  // (The op checks the clip against each call's dtype too.)
  TORCH_CHECK(std::isfinite(options.clip()) && options.clip() > 0, kAgglomerativeModule,
              ": option 'clip' must be finite and > 0, got ", options.clip());
  W_q = register_parameter("W_q", glorot_uniform(d, m));
  b_q = register_parameter("b_q", torch::zeros({m}));
  W_r = register_parameter("W_r", glorot_uniform(d, m));
  b_r = register_parameter("b_r", torch::zeros({m}));
  P = register_parameter("P", glorot_uniform(d, d));
  Q = register_parameter("Q", glorot_uniform(d, d));
}

torch::Tensor AgglomerativeAttentionImpl::dropout(const torch::Tensor& p) {
  const double rate = options.dropout();
  if (!is_training() || rate == 0) return p;
  auto keep = torch::empty_like(p).bernoulli_(1 - rate, options.generator());
  return p * keep.div_(1 - rate);
}

torch::Tensor AgglomerativeAttentionImpl::forward(const torch::Tensor& x_query,
                                                  const torch::Tensor& x_ref, bool causal) {
  const int64_t d = options.width(), m = options.classes();
  auto check_input = [&](const char* name, const torch::Tensor& x) {
    detail::check_float_tensor(kAgglomerativeModule, name, x, 3);
    detail::check_dim(kAgglomerativeModule, name, x, 2, d, "feature size (the width)");
    TORCH_CHECK(x.scalar_type() == P.scalar_type(), kAgglomerativeModule, ": argument '", name, "' has dtype ",
                x.scalar_type(), " but the parameters have dtype ", P.scalar_type());
  };
  check_input("x_query", x_query);
  if (x_ref.defined()) {
    check_input("x_ref", x_ref);
    detail::check_dim(kAgglomerativeModule, "x_ref", x_ref, 0, x_query.size(0), "batch size N");
  }
  const torch::Tensor& x = x_ref.defined() ? x_ref : x_query;
  const int64_t N = x_query.size(0), L = x_query.size(1), S = x.size(1);

  auto cq = torch::softmax(project(x_query, W_q, b_q), -1);  // (N, L, m)
  auto cr = torch::softmax(project(x, W_r, b_r), -1);        // (N, S, m)
  auto v = project(x, P).view({N, S, m, d / m}).transpose(1, 2);  // (N, m, S, d/m), a view
  auto a = agglomerative_attention(cq.transpose(1, 2), cr.transpose(1, 2), v,
                                   AgglomerativeAttentionFuncOptions().causal(causal).clip(options.clip()));
  // a: (N, m, L, d/m)
  // The op lays its output out like v, (N, L, m, d/m) in memory: the class
  // concatenation is a view.
  auto p = a.transpose(1, 2).reshape({N, L, d});
  return project(dropout(p), Q);
}

torch::Tensor AgglomerativeAttentionImpl::step(const torch::Tensor& x_t, AgglomerativeState& state) {
  const int64_t d = options.width(), m = options.classes();
  detail::check_float_tensor(kAgglomerativeModule, "x_t", x_t, 2);
  detail::check_dim(kAgglomerativeModule, "x_t", x_t, 1, d, "feature size (the width)");
  TORCH_CHECK(x_t.scalar_type() == P.scalar_type(), kAgglomerativeModule, ": argument 'x_t' has dtype ",
              x_t.scalar_type(), " but the parameters have dtype ", P.scalar_type());
  // The op's bound on the clip (ops/agglomerative_attention.cpp says why).
  const double smallest_clip = std::sqrt(detail::dtype_min_normal(x_t.scalar_type()));
  TORCH_CHECK(options.clip() >= smallest_clip, kAgglomerativeModule, ": option 'clip' must be at least ",
              smallest_clip, " for ", detail::dtype_name(x_t.scalar_type()), " inputs, got ", options.clip());
  const int64_t N = x_t.size(0);
  if (!state.sums.defined()) {
    state.sums = torch::zeros({N, m, d / m}, x_t.options());
    state.counts = torch::zeros({N, m}, x_t.options());
  }
  TORCH_CHECK(state.sums.sizes() == torch::IntArrayRef({N, m, d / m}) &&
                  state.counts.sizes() == torch::IntArrayRef({N, m}),
              kAgglomerativeModule, ": the state has sums ", detail::shape_str(state.sums), " and counts ",
              detail::shape_str(state.counts), ", expected (", N, ", ", m, ", ", d / m, ") and (", N,
              ", ", m, ") for x_t of batch size ", N);

  auto cq = torch::softmax(project(x_t, W_q, b_q), -1);  // (N, m)
  auto cr = torch::softmax(project(x_t, W_r, b_r), -1);  // (N, m)
  // Out of place, so that a graph through earlier steps stays valid.
  state.sums = state.sums + cr.unsqueeze(-1) * project(x_t, P).view({N, m, d / m});
  state.counts = state.counts + cr;
  // clamp_min passes no gradient where it is active, like the op's clip.
  auto a = state.sums / torch::clamp_min(state.counts, options.clip()).unsqueeze(-1);  // (N, m, d/m)
  auto p = (cq.unsqueeze(-1) * a).reshape({N, d});
  return project(dropout(p), Q);
}

}  // namespace attnkit::nn
