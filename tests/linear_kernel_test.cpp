// The linear attention kernels (src/kernels/linear_attention) against the
// float64 reference, in values and gradients: every feature map / normaliser /
// causal combination, S != L, E != M, chunk sizes that do and do not divide L,
// strided inputs, rows that see no key, thread counts; the gated recurrence
// with both backward methods, and the drift of the seed's reverse
// recomputation over 10^4 steps. Also the float32 op path through autograd.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include <iostream>

#include "ops/binding.h"
#include "kernels/gated_linear_attention.h"
#include "kernels/linear_attention.h"
#include "reference/reference.h"
#include "test_util.h"

namespace attnkit {
namespace {

using testing::f32;
using testing::f64;
using testing::rel_err;

// Float32 kernels against float64 results. The kernels sum at most S + E
// (<= 270 here) rounded products per entry, plus chunk-state updates of the
// same size: a worst-case relative error of about 300 * 2^-24 = 1.8e-5 of the
// sum of |terms|. Errors are measured relative to the largest |entry| of the
// float64 result; kRelTol allows that worst case.
constexpr double kRelTol = 2e-5;
// Where the float64 result is itself a cancellation (the normalised output of a
// query that sees one key is v whatever q and k are, so its gradients in q and
// k are O(eps) differences of O(1) terms), no float32 computation resolves it:
// there the bound is this many times the error of libtorch's float32 run of the
// reference on the same inputs. 4x leaves room for a different summation order.
constexpr double kVsFloat32Factor = 4.0;

torch::Tensor empty_like_f32(at::IntArrayRef sizes) { return torch::empty(sizes, f32()); }


struct Grads {
  torch::Tensor out, dq, dk, dv;
};

/// Forward and backward of the linear kernels on float32 tensors of any strides.
Grads linear_kernels(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& dout, const LinearAttentionOptions& o, int64_t chunk) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  const int64_t E = q.size(3), M = v.size(3);
  Grads g{empty_like_f32({N, H, L, M}), empty_like_f32({N, H, L, E}), empty_like_f32({N, H, S, E}),
          empty_like_f32({N, H, S, M})};
  auto den = empty_like_f32({N, H, L});
  kernels::LinearAttentionBackwardParams p;
  detail::bind(p.q, p.q_stride, q);
  detail::bind(p.k, p.k_stride, k);
  detail::bind(p.v, p.v_stride, v);
  detail::bind(p.out, p.out_stride, g.out);
  p.den = den.data_ptr<float>();
  p.N = N, p.H = H, p.L = L, p.S = S, p.E = E, p.M = M;
  p.feature_map = o.feature_map() == FeatureMap::elu ? kernels::FeatureMapKind::elu
                                                     : kernels::FeatureMapKind::identity;
  p.normalize = o.normalize();
  p.causal = o.causal();
  p.eps = static_cast<float>(o.eps());
  p.chunk = chunk;
  kernels::linear_attention_forward(p);
  detail::bind(p.dout, p.dout_stride, dout);
  detail::bind(p.dq, p.dq_stride, g.dq);
  detail::bind(p.dk, p.dk_stride, g.dk);
  detail::bind(p.dv, p.dv_stride, g.dv);
  kernels::linear_attention_backward(p);
  return g;
}

/// Output and input gradients of f(inputs) against dout by autograd, in the
/// inputs' dtype.
std::vector<torch::Tensor> autograd_run(
    const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
    std::vector<torch::Tensor> inputs, const torch::Tensor& dout) {
  for (auto& x : inputs) x = x.detach().clone().requires_grad_(true);
  auto out = f(inputs);
  auto grads = torch::autograd::grad({out}, inputs, {dout.to(out.scalar_type())});
  std::vector<torch::Tensor> result{out.detach()};
  for (auto& g : grads) result.push_back(g);
  return result;
}

/// Checks float32 `got` against the float64 `want`, with the float32 run of the
/// reference (`f32_ref`) calibrating the cancellation cases (see kVsFloat32Factor).
void expect_matches(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                    const std::vector<torch::Tensor>& f32_ref, const std::string& what) {
  const char* names[] = {"out", "grad 0", "grad 1", "grad 2", "grad 3"};
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = rel_err(got[i], want[i]);
    const double bound = std::max(kRelTol, kVsFloat32Factor * rel_err(f32_ref[i], want[i]));
    EXPECT_LE(err, bound) << what << ", " << names[i];
  }
}

std::string describe(const LinearAttentionOptions& o, int64_t L, int64_t S, int64_t chunk) {
  return "L=" + std::to_string(L) + " S=" + std::to_string(S) + " chunk=" + std::to_string(chunk) +
         " map=" + to_string(o.feature_map()) + (o.normalize() ? " normalize" : "") +
         (o.causal() ? " causal" : "");
}

// ---------------------------------------------------------------------------
// Feature-map linear attention
// ---------------------------------------------------------------------------

TEST(LinearKernel, MatchesFloat64ReferenceInValuesAndGradients) {
  const int64_t N = 2, H = 2, E = 5, M = 7;  // E != M
  torch::manual_seed(1);
  for (int64_t L : {1, 5, 64, 257})
    for (int64_t S : {L, L + 3, L - 2}) {
      if (S < 1) continue;
      auto q = torch::randn({N, H, L, E}, f64()) * 0.5;
      auto k = torch::randn({N, H, S, E}, f64()) * 0.5;
      auto v = torch::randn({N, H, S, M}, f64());
      auto dout = torch::randn({N, H, L, M}, f64());
      for (auto [map, normalize] : {std::pair{FeatureMap::identity, false},
                                    {FeatureMap::identity, true},
                                    {FeatureMap::elu, false},
                                    {FeatureMap::elu, true}})
        for (bool causal : {false, true}) {
          const auto o =
              LinearAttentionOptions().feature_map(map).normalize(normalize).causal(causal);
          // The identity map with the normaliser needs a positive denominator.
          const bool positive = map == FeatureMap::identity && normalize;
          const auto qq = positive ? q.abs() : q, kk = positive ? k.abs() : k;
          auto f = [&](const std::vector<torch::Tensor>& x) {
            return reference::linear_attention(x[0], x[1], x[2], o);
          };
          const auto want = autograd_run(f, {qq, kk, v}, dout);
          const auto f32_ref = autograd_run(
              f, {qq.to(torch::kFloat), kk.to(torch::kFloat), v.to(torch::kFloat)}, dout);
          // 64 and 1 divide every L; 7 and 16 divide none but 1 (or 64 for 16).
          for (int64_t chunk : {1, 7, 16, 64}) {
            if (!causal && chunk != 64) continue;  // non-causal is one chunk whatever the size
            auto g = linear_kernels(qq.to(torch::kFloat), kk.to(torch::kFloat), v.to(torch::kFloat),
                                    dout.to(torch::kFloat), o, chunk);
            expect_matches({g.out, g.dq, g.dk, g.dv}, want, f32_ref, describe(o, L, S, chunk));
          }
        }
    }
}

TEST(LinearKernel, StridedInputsAndGradientsGiveTheContiguousResult) {
  // (N, L, H, E) tensors viewed as (N, H, L, E), and an expanded output gradient
  // (what sum().backward() passes): only sgemm's summation order may change.
  constexpr double kSameMathTol = 1e-6;
  torch::manual_seed(2);
  const int64_t N = 2, H = 3, L = 37, E = 6, M = 5;
  auto q = torch::randn({N, L, H, E}, f32()).transpose(1, 2);
  auto k = torch::randn({N, L, H, E}, f32()).transpose(1, 2);
  auto v = torch::randn({N, L, H, M}, f32()).transpose(1, 2);
  auto dout = torch::randn({1, 1, 1, M}, f32()).expand({N, H, L, M});
  ASSERT_FALSE(q.is_contiguous());
  for (bool causal : {false, true})
    for (auto map : {FeatureMap::identity, FeatureMap::elu}) {
      const auto o = LinearAttentionOptions()
                         .feature_map(map)
                         .normalize(map == FeatureMap::elu)
                         .causal(causal);
      auto strided = linear_kernels(q, k, v, dout, o, 16);
      auto dense =
          linear_kernels(q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), o, 16);
      EXPECT_LT(rel_err(strided.out, dense.out), kSameMathTol);
      EXPECT_LT(rel_err(strided.dq, dense.dq), kSameMathTol);
      EXPECT_LT(rel_err(strided.dk, dense.dk), kSameMathTol);
      EXPECT_LT(rel_err(strided.dv, dense.dv), kSameMathTol);
    }
}

TEST(LinearKernel, ThreadCountDoesNotChangeResults) {
  // Each head runs on one thread in a fixed order: bitwise equal.
  torch::manual_seed(3);
  const int64_t N = 3, H = 2, L = 50, E = 4, M = 6;
  auto q = torch::randn({N, H, L, E}, f32()), k = torch::randn({N, H, L, E}, f32());
  auto v = torch::randn({N, H, L, M}, f32()), dout = torch::randn({N, H, L, M}, f32());
  const auto o = LinearAttentionOptions().feature_map(FeatureMap::elu).normalize(true).causal(true);
  const int saved = num_threads();
  set_num_threads(1);
  auto one = linear_kernels(q, k, v, dout, o, 16);
  set_num_threads(2);
  auto two = linear_kernels(q, k, v, dout, o, 16);
  set_num_threads(saved);
  EXPECT_TRUE(torch::equal(one.out, two.out));
  EXPECT_TRUE(torch::equal(one.dq, two.dq));
  EXPECT_TRUE(torch::equal(one.dk, two.dk));
  EXPECT_TRUE(torch::equal(one.dv, two.dv));
}

TEST(LinearKernel, QueriesThatSeeNoKeyGetZerosEvenWithoutEps) {
  // Causal with S < L: queries i < L - S see no key. With eps = 0 their
  // normaliser is 0 / 0; the contract is zeros and zero gradients, no NaN.
  torch::manual_seed(4);
  const int64_t L = 9, S = 4, E = 3, M = 2;
  auto q = torch::randn({1, 1, L, E}, f32()), k = torch::randn({1, 1, S, E}, f32());
  auto v = torch::randn({1, 1, S, M}, f32()), dout = torch::randn({1, 1, L, M}, f32());
  const auto o =
      LinearAttentionOptions().feature_map(FeatureMap::elu).normalize(true).causal(true).eps(0);
  auto g = linear_kernels(q, k, v, dout, o, 4);
  EXPECT_TRUE(testing::all_finite(g.out) && testing::all_finite(g.dq) && testing::all_finite(g.dk));
  EXPECT_EQ(testing::max_abs(g.out.narrow(2, 0, L - S)), 0.0);
  EXPECT_EQ(testing::max_abs(g.dq.narrow(2, 0, L - S)), 0.0);
  auto want =
      reference::linear_attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                                  LinearAttentionOptions(o).eps(1e-30));
  EXPECT_LT(rel_err(g.out.narrow(2, L - S, S), want.narrow(2, L - S, S)), kRelTol);
}

TEST(LinearOp, Float32GoesThroughTheKernelsWithAutograd) {
  // The op's float32 path (autograd Function over the kernels) against the
  // float64 reference, and float64 inputs taking the reference path exactly.
  torch::manual_seed(5);
  const int64_t N = 2, H = 2, L = 70, S = 66, E = 4, M = 3;
  auto q = torch::randn({N, H, L, E}, f64()), k = torch::randn({N, H, S, E}, f64());
  auto v = torch::randn({N, H, S, M}, f64()), dout = torch::randn({N, H, L, M}, f64());
  for (bool causal : {false, true}) {
    const auto o =
        LinearAttentionOptions().feature_map(FeatureMap::elu).normalize(true).causal(causal);
    auto op = [&](const std::vector<torch::Tensor>& x) {
      return linear_attention(x[0], x[1], x[2], o);
    };
    auto ref = [&](const std::vector<torch::Tensor>& x) {
      return reference::linear_attention(x[0], x[1], x[2], o);
    };
    const auto want = autograd_run(ref, {q, k, v}, dout);
    const auto f32_ref =
        autograd_run(ref, {q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat)}, dout);
    const auto got =
        autograd_run(op, {q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat)}, dout);
    expect_matches(got, want, f32_ref, causal ? "op causal" : "op");
    const auto exact = autograd_run(op, {q, k, v}, dout);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(exact[i], want[i]));
  }
}

TEST(LinearOp, EmptyDimensionsGiveEmptyOrZeroResults) {
  for (auto [N, L, S] : {std::tuple<int64_t, int64_t, int64_t>{0, 3, 3}, {2, 0, 3}, {2, 3, 0}})
    for (bool causal : {false, true}) {
      auto q = torch::randn({N, 2, L, 3}, f32()).requires_grad_(true);
      auto k = torch::randn({N, 2, S, 3}, f32()).requires_grad_(true);
      auto v = torch::randn({N, 2, S, 4}, f32()).requires_grad_(true);
      auto out = linear_attention(q, k, v, LinearAttentionOptions().normalize(true).causal(causal));
      ASSERT_EQ(out.sizes(), (std::vector<int64_t>{N, 2, L, 4}));
      EXPECT_EQ(testing::max_abs(out), 0.0);
      out.sum().backward();
      EXPECT_EQ(testing::max_abs(q.grad()), 0.0);
      EXPECT_EQ(testing::max_abs(k.grad()), 0.0);
      EXPECT_EQ(testing::max_abs(v.grad()), 0.0);
    }
}

// ---------------------------------------------------------------------------
// Gated recurrence
// ---------------------------------------------------------------------------

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
                                                 GatedLinearAttentionOptions().causal(causal));
      },
      in, dout);
}

std::vector<torch::Tensor> to_f32(const std::vector<torch::Tensor>& x) {
  std::vector<torch::Tensor> out;
  for (const auto& t : x) out.push_back(t.to(torch::kFloat));
  return out;
}

TEST(LinearGated, MatchesFloat64ReferenceInValuesAndGradients) {
  using kernels::GatedBackwardMethod;
  const int64_t N = 2, H = 2, E = 5;
  torch::manual_seed(6);
  for (int64_t L : {1, 5, 64, 257}) {
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
        for (int64_t chunk : {1, 7, 16, 64})
          for (auto method :
               {GatedBackwardMethod::checkpoints, GatedBackwardMethod::reverse_recompute}) {
            if (method == GatedBackwardMethod::reverse_recompute && (!reverse_too || !causal))
              continue;
            const auto x = to_f32(in);
            auto g = gated_kernels(x[0], x[1], x[2], x[3], dout.to(torch::kFloat), causal, chunk,
                                   method);
            expect_matches(
                {g.out, g.df, g.dq, g.dalpha, g.dbeta}, want, f32_ref,
                "gated L=" + std::to_string(L) + " chunk=" + std::to_string(chunk) +
                    (causal ? " causal" : "") +
                    (method == GatedBackwardMethod::checkpoints ? " checkpoints" : " reverse"));
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
                                        GatedLinearAttentionOptions().causal(causal));
        },
        to_f32({f, q, alpha, beta}), dout);
    expect_matches(got, want, f32_ref, causal ? "op causal" : "op");
    // Fixed gates (the seed's alpha = beta = 1): no gradient for them, same others.
    auto f32 = f.to(torch::kFloat).requires_grad_(true);
    auto out = gated_linear_attention(f32, q.to(torch::kFloat), torch::ones({N, H, L}),
                                      torch::ones({N, H, L}),
                                      GatedLinearAttentionOptions().causal(causal));
    out.backward(dout.to(torch::kFloat));
    EXPECT_TRUE(f32.grad().defined());
  }
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
  // The seed's backward inverts C_t = alpha_t C_{t-1} + beta_t f_t f_t^T from
  // C_{L-1}: every step subtracts a rank-one term from a large C and divides by
  // alpha_t, so rounding accumulates, and grows like prod 1/alpha for alpha < 1.
  // The chunk checkpoints recompute C forwards instead. Over 10^4 steps both are
  // measured against float64; the numbers are printed and recorded as test
  // properties (docs/performance/linear.md quotes them). Only dq and dalpha
  // read the recomputed C; df and dbeta need the adjoint alone.
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
  };
  for (const Case& c : {Case{"alpha=1 (the seed's gated form)", torch::ones({1, 1, L}, f64())},
                        Case{"alpha in [0.999, 1]", 1.0 - torch::rand({1, 1, L}, f64()) * 1e-3},
                        Case{"alpha in [0.99, 1]", 1.0 - torch::rand({1, 1, L}, f64()) * 1e-2}}) {
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
    }
  }
}

}  // namespace
}  // namespace attnkit
