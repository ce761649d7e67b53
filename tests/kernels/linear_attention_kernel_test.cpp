// The linear attention kernels (src/kernels/linear_attention) against the
// float64 reference, in values and gradients: every feature map / normaliser /
// causal combination, S != L, E != M, chunk sizes that do and do not divide L,
// strided inputs, rows that see no key, thread counts. The gated recurrence is
// in gated_linear_attention_kernel_test.cpp, the op (float32 through autograd)
// in tests/ops/linear_attention_op_test.cpp.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/binding.h"
#include "kernels/linear_attention.h"
#include "kernels/linear_attention_cases.h"
#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::linear_attention_kernel_test {
namespace {

using namespace testing::linear;  // tolerances, autograd_run, expect_matches, ...
using testing::f32;
using testing::f64;
using testing::rel_err;

struct Grads {
  torch::Tensor out, dq, dk, dv;
};

/// Forward and backward of the linear kernels on float32 tensors of any strides.
Grads linear_kernels(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& dout, const LinearAttentionFuncOptions& o, int64_t chunk) {
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

std::string describe(const LinearAttentionFuncOptions& o, int64_t L, int64_t S, int64_t chunk) {
  return "L=" + std::to_string(L) + " S=" + std::to_string(S) + " chunk=" + std::to_string(chunk) +
         " map=" + to_string(o.feature_map()) + (o.normalize() ? " normalize" : "") +
         (o.causal() ? " causal" : "");
}

// ---------------------------------------------------------------------------
// Feature-map linear attention
// ---------------------------------------------------------------------------

/// Error scales of the normalised forms out = num / den, num a polynomial with
/// non-negative coefficients of the features: the sums of |terms| of num / den
/// and of its gradients with den held at its value (term_magnitudes), doubled
/// for the normaliser's own gradient terms, which are as large and cancel them
/// where a query sees one key.
std::vector<torch::Tensor> normalised_magnitudes(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const torch::Tensor& dout,
                                                 const LinearAttentionFuncOptions& o) {
  auto unnormalised = o;
  unnormalised.normalize(false);
  // den = phi(q_i) . sum of the visible phi(k_j), + eps: num with v = 1.
  const auto ones = torch::ones({k.size(0), k.size(1), k.size(2), 1}, k.options());
  const auto den = reference::linear_attention(q, k, ones, unnormalised) + o.eps();
  auto scaled = testing::term_magnitudes(
      [&](const std::vector<torch::Tensor>& x) {
        return reference::linear_attention(x[0], x[1], x[2], unnormalised) / den;
      },
      {q, k, v}, dout);
  for (auto& t : scaled) t = 2 * t;
  return scaled;
}

TEST(LinearKernel, MatchesFloat64ReferenceInValuesAndGradients) {
  const int64_t N = 2, H = 2;
  torch::manual_seed(1);
  // E != M, small; and E = M = 64 (a full SIMD width and more), with L and S
  // kept to S + E <= 270 (the bound of kRelTol).
  for (auto [E, M, lengths] : {std::tuple{int64_t{5}, int64_t{7}, std::vector<int64_t>{1, 5, 64, 257}},
                               std::tuple{int64_t{64}, int64_t{64}, std::vector<int64_t>{5, 64, 150}}})
  for (int64_t L : lengths)
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
              LinearAttentionFuncOptions().feature_map(map).normalize(normalize).causal(causal);
          // The identity map with the normaliser needs a positive denominator.
          const bool positive = map == FeatureMap::identity && normalize;
          const auto qq = positive ? q.abs() : q, kk = positive ? k.abs() : k;
          auto f = [&](const std::vector<torch::Tensor>& x) {
            return reference::linear_attention(x[0], x[1], x[2], o);
          };
          const auto want = autograd_run(f, {qq, kk, v}, dout);
          const auto f32_ref = autograd_run(
              f, {qq.to(torch::kFloat), kk.to(torch::kFloat), v.to(torch::kFloat)}, dout);
          const bool polynomial = map == FeatureMap::identity && !normalize;
          const auto magnitudes =
              polynomial ? testing::term_magnitudes(f, {qq, kk, v}, dout)
              : normalize ? normalised_magnitudes(qq, kk, v, dout, o)
                          : std::vector<torch::Tensor>{};
          // 64 and 1 divide every L; 7 and 16 divide none but 1 (or 64 for 16).
          for (int64_t chunk : {1, 7, 16, 64}) {
            if (!causal && chunk != 64) continue;  // non-causal is one chunk whatever the size
            auto g = linear_kernels(qq.to(torch::kFloat), kk.to(torch::kFloat), v.to(torch::kFloat),
                                    dout.to(torch::kFloat), o, chunk);
            const std::string what = describe(o, L, S, chunk) + " E=" + std::to_string(E);
            if (normalize)  // per entry only: see kVsFloat32Factor
              expect_per_entry({g.out, g.dq, g.dk, g.dv}, want, magnitudes, what);
            else
              expect_matches({g.out, g.dq, g.dk, g.dv}, want, f32_ref, what);
            if (polynomial) expect_per_entry({g.out, g.dq, g.dk, g.dv}, want, magnitudes, what);
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
      const auto o = LinearAttentionFuncOptions()
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
  const auto o = LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true).causal(true);
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
      LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true).causal(true).eps(0);
  auto g = linear_kernels(q, k, v, dout, o, 4);
  EXPECT_TRUE(testing::all_finite(g.out) && testing::all_finite(g.dq) && testing::all_finite(g.dk));
  EXPECT_EQ(testing::max_abs(g.out.narrow(2, 0, L - S)), 0.0);
  EXPECT_EQ(testing::max_abs(g.dq.narrow(2, 0, L - S)), 0.0);
  auto want = reference::linear_attention(q.to(torch::kDouble), k.to(torch::kDouble),
                                          v.to(torch::kDouble), o);
  EXPECT_TRUE(testing::all_finite(want));
  EXPECT_LT(rel_err(g.out, want), kRelTol);
}

}  // namespace
}  // namespace attnkit::linear_attention_kernel_test
