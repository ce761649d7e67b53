// The gated linear attention kernels (src/kernels/gated_linear_attention) and op against the
// float64 reference, in values and gradients, with both backward methods; the drift of the
// cheap-linear-attention paper's reverse recomputation over 10^4 steps.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "ops/binding.h"
#include "kernels/gated_linear_attention.h"
#include "kernels/linear_attention_cases.h"
#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::gated_linear_attention_kernel_test {
namespace {

using namespace testing::linear;  // tolerances, autograd_run, to_f32, expect_matches, ...
using testing::f32;
using testing::f64;
using testing::rel_err;

struct GatedGrads {
  torch::Tensor out, df, dq, dalpha, dbeta;
};

/// Forward and backward of the gated kernels on float32 tensors of any strides.
GatedGrads gated_kernels(const torch::Tensor& f, const torch::Tensor& q, const torch::Tensor& alpha,
                         const torch::Tensor& beta, const torch::Tensor& dout, bool causal,
                         int64_t chunk, kernels::GatedBackwardMethod method) {
  const auto sizes = f.sizes();
  GatedGrads g{empty_like_f32(sizes), empty_like_f32(sizes), empty_like_f32(sizes),
               empty_like_f32(alpha.sizes()), empty_like_f32(beta.sizes())};
  kernels::GatedLinearAttentionBackwardParams p;
  detail::bind(p.f, p.f_stride, f);
  detail::bind(p.q, p.q_stride, q);
  detail::bind(p.alpha, p.alpha_stride, alpha);
  detail::bind(p.beta, p.beta_stride, beta);
  detail::bind(p.out, p.out_stride, g.out);
  p.N = f.size(0), p.H = f.size(1), p.L = f.size(2), p.E = f.size(3);
  p.causal = causal;
  p.chunk = chunk;
  kernels::gated_linear_attention_forward(p);
  detail::bind(p.dout, p.dout_stride, dout);
  detail::bind(p.df, p.df_stride, g.df);
  detail::bind(p.dq, p.dq_stride, g.dq);
  p.dalpha = g.dalpha.data_ptr<float>();
  p.dbeta = g.dbeta.data_ptr<float>();
  p.method = method;
  kernels::gated_linear_attention_backward(p);
  return g;
}

std::vector<torch::Tensor> gated_reference(const std::vector<torch::Tensor>& in,
                                           const torch::Tensor& dout, bool causal) {
  return autograd_run(
      [&](const std::vector<torch::Tensor>& x) {
        return reference::gated_linear_attention(x[0], x[1], x[2], x[3],
                                                 GatedLinearAttentionFuncOptions().causal(causal));
      },
      in, dout);
}

TEST(LinearGated, MatchesFloat64ReferenceInValuesAndGradients) {
  using kernels::GatedBackwardMethod;
  const int64_t N = 2, H = 2;
  torch::manual_seed(6);
  for (auto [E, lengths] : {std::pair{int64_t{5}, std::vector<int64_t>{1, 5, 64, 257}},
                            std::pair{int64_t{64}, std::vector<int64_t>{5, 64, 150}}})
  for (int64_t L : lengths) {
    auto f = torch::randn({N, H, L, E}, f64()) * 0.5;
    auto q = torch::randn({N, H, L, E}, f64());
    auto dout = torch::randn({N, H, L, E}, f64());
    auto beta = torch::rand({N, H, L}, f64()) + 0.5;
    // Forgetting gates in (0.5, 1) with exact zeros (a reset) sprinkled in: the
    // checkpoint backward never divides by alpha.
    auto alpha =
        (torch::rand({N, H, L}, f64()) * 0.5 + 0.5) * (torch::rand({N, H, L}, f64()) > 0.1);
    // Gates near 1 for the reverse recomputation, whose error grows like
    // prod 1/alpha_t (the drift test below measures it): (1/0.98)^64 = 3.6.
    auto alpha_near_one = torch::rand({N, H, L}, f64()) * 0.02 + 0.98;
    for (bool causal : {false, true})
      for (const auto* gates : {&alpha, &alpha_near_one}) {
        const bool reverse_too = gates == &alpha_near_one && L <= 64;
        const std::vector<torch::Tensor> in{f, q, *gates, beta};
        const auto want = gated_reference(in, dout, causal);
        const auto f32_ref = gated_reference(to_f32(in), dout, causal);
        const auto magnitudes = testing::term_magnitudes(
            [&](const std::vector<torch::Tensor>& x) {
              return reference::gated_linear_attention(x[0], x[1], x[2], x[3],
                                                       GatedLinearAttentionFuncOptions().causal(causal));
            },
            in, dout);
        for (int64_t chunk : {1, 7, 16, 64})
          for (auto method :
               {GatedBackwardMethod::checkpoints, GatedBackwardMethod::reverse_recompute}) {
            if (method == GatedBackwardMethod::reverse_recompute && (!reverse_too || !causal))
              continue;
            const auto x = to_f32(in);
            auto g = gated_kernels(x[0], x[1], x[2], x[3], dout.to(torch::kFloat), causal, chunk,
                                   method);
            const std::string what =
                "gated E=" + std::to_string(E) + " L=" + std::to_string(L) +
                " chunk=" + std::to_string(chunk) + (causal ? " causal" : "") +
                (method == GatedBackwardMethod::checkpoints ? " checkpoints" : " reverse");
            expect_matches({g.out, g.df, g.dq, g.dalpha, g.dbeta}, want, f32_ref, what);
            // The reverse recomputation drifts by design (its own bound, the
            // f32_ref factor above and the drift test below).
            if (method == GatedBackwardMethod::checkpoints)
              expect_per_entry({g.out, g.df, g.dq, g.dalpha, g.dbeta}, want, magnitudes, what);
          }
      }
  }
}

TEST(LinearGated, OpUsesTheKernelsAndComputesGateGradientsOnlyWhenAsked) {
  torch::manual_seed(7);
  const int64_t N = 1, H = 3, L = 40, E = 4;
  auto f = torch::randn({N, L, H, E}, f64()).transpose(1, 2);  // strided
  auto q = torch::randn({N, H, L, E}, f64());
  auto alpha = torch::rand({N, H, L}, f64()) * 0.5 + 0.5, beta = torch::rand({N, H, L}, f64());
  auto dout = torch::randn({N, H, L, E}, f64());
  for (bool causal : {false, true}) {
    const auto want = gated_reference({f, q, alpha, beta}, dout, causal);
    const auto f32_ref = gated_reference(to_f32({f, q, alpha, beta}), dout, causal);
    const auto got = autograd_run(
        [&](const std::vector<torch::Tensor>& x) {
          return gated_linear_attention(x[0], x[1], x[2], x[3],
                                        GatedLinearAttentionFuncOptions().causal(causal));
        },
        to_f32({f, q, alpha, beta}), dout);
    expect_matches(got, want, f32_ref, causal ? "op causal" : "op");
    // Fixed gates (the paper's alpha = beta = 1): the backward skips their
    // gradients; f's and q's must still be right. Then only alpha trainable.
    const auto ones = torch::ones({N, H, L}, f64());
    const auto want_fixed = gated_reference({f, q, ones, ones}, dout, causal);
    const auto f32_fixed = gated_reference(to_f32({f, q, ones, ones}), dout, causal);
    auto fl = f.to(torch::kFloat).requires_grad_(true), ql = q.to(torch::kFloat).requires_grad_(true);
    auto gates = ones.to(torch::kFloat);
    gated_linear_attention(fl, ql, gates, gates, GatedLinearAttentionFuncOptions().causal(causal))
        .backward(dout.to(torch::kFloat));
    expect_matches({fl.grad(), ql.grad()}, {want_fixed[1], want_fixed[2]},
                   {f32_fixed[1], f32_fixed[2]}, causal ? "fixed gates causal" : "fixed gates");
    auto al = alpha.to(torch::kFloat).requires_grad_(true);
    auto bl = beta.to(torch::kFloat);
    gated_linear_attention(f.to(torch::kFloat), q.to(torch::kFloat), al, bl,
                           GatedLinearAttentionFuncOptions().causal(causal))
        .backward(dout.to(torch::kFloat));
    EXPECT_FALSE(bl.grad().defined());
    expect_matches({al.grad()}, {want[3]}, {f32_ref[3]}, causal ? "alpha only causal" : "alpha only");
  }
}

TEST(LinearGated, EmptyDimensionsGiveEmptyOrZeroResults) {
  // N = 0 or L = 0: empty outputs and gradients, in float32 (the kernels) and
  // float64 (the composite) alike. With L = 0 the composite's output does not
  // depend on f, alpha, beta at all, so autograd leaves their gradients
  // undefined (= zero); the kernel's Function returns empty ones.
  for (auto [N, L] : {std::pair<int64_t, int64_t>{0, 4}, {2, 0}})
    for (bool causal : {false, true})
      for (auto dtype : {torch::kFloat, torch::kDouble}) {
        SCOPED_TRACE("N=" + std::to_string(N) + " L=" + std::to_string(L) + (causal ? " causal" : "") +
                     (dtype == torch::kFloat ? " float32" : " float64"));
        auto opt = torch::TensorOptions().dtype(dtype).requires_grad(true);
        auto f = torch::randn({N, 2, L, 3}, opt), q = torch::randn({N, 2, L, 3}, opt);
        auto alpha = torch::rand({N, 2, L}, opt), beta = torch::rand({N, 2, L}, opt);
        auto out = gated_linear_attention(f, q, alpha, beta, GatedLinearAttentionFuncOptions().causal(causal));
        ASSERT_EQ(out.sizes(), f.sizes());
        ASSERT_EQ(out.scalar_type(), dtype);
        out.sum().backward();
        for (const auto* x : {&f, &q, &alpha, &beta}) {
          if (dtype == torch::kFloat || N == 0) ASSERT_TRUE(x->grad().defined());
          if (x->grad().defined()) EXPECT_EQ(x->grad().sizes(), x->sizes());
        }
      }
}

TEST(LinearGated, DispatchNamesTheBackendThatRuns) {
  torch::manual_seed(12);
  const int64_t N = 1, H = 2, L = 6, E = 3;
  auto f = torch::randn({N, H, L, E}, f64()), q = torch::randn({N, H, L, E}, f64());
  auto alpha = torch::rand({N, H, L}, f64()), beta = torch::rand({N, H, L}, f64());
  const auto o = GatedLinearAttentionFuncOptions().causal(true);
  const auto x = to_f32({f, q, alpha, beta});
  const auto f_leaf = x[0].clone().requires_grad_();
  testing::expect_kernel(gated_linear_attention_dispatch(f_leaf, x[1], x[2], x[3], o));
  EXPECT_NE(testing::grad_fn_name(gated_linear_attention(f_leaf, x[1], x[2], x[3], o))
                .find("GatedLinearAttentionFunction"),
            std::string::npos);
  testing::expect_composite(gated_linear_attention_dispatch(f, q, alpha, beta, o),
                            "f is float64; the kernel is float32 only");
  EXPECT_TRUE(torch::equal(gated_linear_attention(f, q, alpha, beta, o),
                           reference::gated_linear_attention(f, q, alpha, beta, o)));
  testing::expect_composite(gated_linear_attention_dispatch(x[0], x[1], alpha, x[3], o),
                            "alpha is float64; the kernel is float32 only");
}

TEST(LinearGated, ThreadCountDoesNotChangeResults) {
  torch::manual_seed(8);
  const int64_t N = 2, H = 3, L = 45, E = 4;
  auto f = torch::randn({N, H, L, E}, f32()), q = torch::randn({N, H, L, E}, f32());
  auto alpha = torch::rand({N, H, L}, f32()), beta = torch::rand({N, H, L}, f32());
  auto dout = torch::randn({N, H, L, E}, f32());
  const int saved = num_threads();
  for (bool causal : {false, true}) {
    set_num_threads(1);
    auto one = gated_kernels(f, q, alpha, beta, dout, causal, 16,
                             kernels::GatedBackwardMethod::checkpoints);
    set_num_threads(2);
    auto two = gated_kernels(f, q, alpha, beta, dout, causal, 16,
                             kernels::GatedBackwardMethod::checkpoints);
    EXPECT_TRUE(torch::equal(one.out, two.out) && torch::equal(one.df, two.df) &&
                torch::equal(one.dq, two.dq) && torch::equal(one.dalpha, two.dalpha) &&
                torch::equal(one.dbeta, two.dbeta));
  }
  set_num_threads(saved);
}

/// The causal gated recurrence's output gradients in float64 by the textbook
/// method, for N = H = 1: store every C_t going forwards, then backwards
/// G_t = dout_t q_t^T + alpha_{t+1} G_{t+1} and dq_t = C_t^T dout_t,
/// df_t = beta_t (G_t + G_t^T) f_t, dalpha_t = <G_t, C_{t-1}>, dbeta_t = f_t^T G_t f_t.
/// Returns {df, dq, dalpha, dbeta}. O(L E^2) time and memory, no autograd graph.
std::vector<torch::Tensor> stored_state_gradients(const std::vector<torch::Tensor>& in,
                                                  const torch::Tensor& dout) {
  const auto f = in[0].contiguous(), q = in[1].contiguous(), g = dout.contiguous();
  const auto alpha = in[2].contiguous(), beta = in[3].contiguous();
  const int64_t L = f.size(2), E = f.size(3);
  const double *F = f.data_ptr<double>(), *Q = q.data_ptr<double>(), *D = g.data_ptr<double>();
  const double *A = alpha.data_ptr<double>(), *B = beta.data_ptr<double>();
  std::vector<double> C((L + 1) * E * E, 0.0);  // C[t + 1] = C_t, C[0] = C_{-1} = 0
  for (int64_t t = 0; t < L; ++t)
    for (int64_t i = 0; i < E; ++i)
      for (int64_t j = 0; j < E; ++j)
        C[(t + 1) * E * E + i * E + j] =
            A[t] * C[t * E * E + i * E + j] + B[t] * F[t * E + i] * F[t * E + j];
  auto df = torch::zeros_like(f), dq = torch::zeros_like(q);
  auto dalpha = torch::zeros_like(alpha), dbeta = torch::zeros_like(beta);
  double *dF = df.data_ptr<double>(), *dQ = dq.data_ptr<double>();
  double *dA = dalpha.data_ptr<double>(), *dB = dbeta.data_ptr<double>();
  std::vector<double> G(E * E, 0.0);
  for (int64_t t = L - 1; t >= 0; --t) {
    const double *ft = F + t * E, *qt = Q + t * E, *gt = D + t * E;
    const double *Ct = &C[(t + 1) * E * E], *Cprev = &C[t * E * E];
    for (int64_t i = 0; i < E; ++i)
      for (int64_t j = 0; j < E; ++j) G[i * E + j] += gt[i] * qt[j];
    for (int64_t i = 0; i < E; ++i)
      for (int64_t j = 0; j < E; ++j) {
        dQ[t * E + j] += Ct[i * E + j] * gt[i];
        dF[t * E + i] += B[t] * (G[i * E + j] + G[j * E + i]) * ft[j];
        dA[t] += G[i * E + j] * Cprev[i * E + j];
        dB[t] += ft[i] * G[i * E + j] * ft[j];
      }
    for (auto& x : G) x *= A[t];
  }
  return {df, dq, dalpha, dbeta};
}

TEST(LinearGated, StoredStateOracleMatchesTheReference) {
  // The float64 oracle of the drift test below, checked against autograd.
  torch::manual_seed(10);
  const int64_t L = 60, E = 4;
  const std::vector<torch::Tensor> in{torch::randn({1, 1, L, E}, f64()),
                                      torch::randn({1, 1, L, E}, f64()),
                                      torch::rand({1, 1, L}, f64()), torch::rand({1, 1, L}, f64())};
  auto dout = torch::randn({1, 1, L, E}, f64());
  const auto want = gated_reference(in, dout, /*causal=*/true);
  const auto got = stored_state_gradients(in, dout);
  constexpr double kSameMathTol64 = 1e-12;
  for (int i = 0; i < 4; ++i) EXPECT_LT(rel_err(got[i], want[i + 1]), kSameMathTol64) << i;
}

TEST(LinearGated, ReverseRecomputationDriftsFromCheckpointsOver10kSteps) {
  // The paper's backward inverts C_t = alpha_t C_{t-1} + beta_t f_t f_t^T from
  // C_{L-1}: every step subtracts a rank-one term from a large C and divides by
  // alpha_t, so rounding accumulates, and grows like prod 1/alpha for alpha < 1.
  // The chunk checkpoints recompute C forwards instead. Over 10^4 steps both are
  // measured against float64; the numbers are printed and recorded as test
  // properties (docs/PERFORMANCE.md, "Gated recurrence", quotes them). Only dq and dalpha
  // read the recomputed C; df and dbeta need the adjoint alone. Asserted:
  // checkpoints are accurate everywhere; the reverse method is as accurate for
  // df and dbeta, and for every gradient when alpha = 1 (no division grows the
  // error); with alpha < 1 its dq and dalpha drift at least 10x further from
  // float64 than the checkpoints' (measured: ~100x for [0.999, 1], ~1e21x for
  // [0.99, 1]) - the reason the checkpoints are the default.
  constexpr double kDriftFactor = 10.0;
  constexpr int64_t L = 10000, E = 16;
  // Checkpoints stay float32-accurate: the running sums' rounding grows like
  // sqrt(L) 2^-24, about 1e-5 of the largest entries at L = 10^4.
  constexpr double kCheckpointTol = 1e-4;
  torch::manual_seed(9);
  auto f = torch::randn({1, 1, L, E}, f64()) * 0.25;
  auto q = torch::randn({1, 1, L, E}, f64());
  auto dout = torch::randn({1, 1, L, E}, f64());
  auto beta = torch::ones({1, 1, L}, f64());
  struct Case {
    const char* name;
    torch::Tensor alpha;
    bool forgets;  // some alpha < 1
  };
  for (const Case& c :
       {Case{"alpha=1 (the paper's gated form)", torch::ones({1, 1, L}, f64()), false},
        Case{"alpha in [0.999, 1]", 1.0 - torch::rand({1, 1, L}, f64()) * 1e-3, true},
        Case{"alpha in [0.99, 1]", 1.0 - torch::rand({1, 1, L}, f64()) * 1e-2, true}}) {
    const std::vector<torch::Tensor> in{f, q, c.alpha, beta};
    const auto want = stored_state_gradients(in, dout);
    const auto x = to_f32(in);
    auto ck = gated_kernels(x[0], x[1], x[2], x[3], dout.to(torch::kFloat), true, 64,
                            kernels::GatedBackwardMethod::checkpoints);
    auto rev = gated_kernels(x[0], x[1], x[2], x[3], dout.to(torch::kFloat), true, 64,
                             kernels::GatedBackwardMethod::reverse_recompute);
    const char* names[] = {"df", "dq", "dalpha", "dbeta"};
    const torch::Tensor ck_grads[] = {ck.df, ck.dq, ck.dalpha, ck.dbeta};
    const torch::Tensor rev_grads[] = {rev.df, rev.dq, rev.dalpha, rev.dbeta};
    std::cout << "[ drift ] " << c.name << ", L = " << L << ", E = " << E << "\n";
    for (int i = 0; i < 4; ++i) {
      const double e_ck = rel_err(ck_grads[i], want[i]);
      const double e_rev = rel_err(rev_grads[i], want[i]);
      const double e_diff = rel_err(rev_grads[i], ck_grads[i]);
      std::cout << "[ drift ]   " << names[i] << ": checkpoints vs float64 " << e_ck
                << ", reverse vs float64 " << e_rev << ", reverse vs checkpoints " << e_diff
                << "\n";
      ::testing::Test::RecordProperty(
          std::string(c.name) + " " + names[i] + " reverse_vs_checkpoints", std::to_string(e_diff));
      EXPECT_LE(e_ck, kCheckpointTol) << c.name << " " << names[i];
      const bool reads_recomputed_state = i == 1 || i == 2;  // dq, dalpha
      if (reads_recomputed_state && c.forgets)
        EXPECT_GE(e_rev, kDriftFactor * e_ck) << c.name << " " << names[i];
      else
        EXPECT_LE(e_rev, kCheckpointTol) << c.name << " " << names[i];
    }
  }
}

}  // namespace
}  // namespace attnkit::gated_linear_attention_kernel_test
