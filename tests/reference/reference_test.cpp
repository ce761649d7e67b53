// The reference implementations (src/reference) on tiny cases whose answers are
// worked out by hand in the comments: no other implementation is consulted.
// Everything runs in float64.
#include "base/random.h"
#include "reference/reference.h"
#include "test_util.h"

#include <cmath>
#include <limits>
#include <set>

namespace attnkit::testing::reference_test {
namespace {

// Hand results are exact rationals or short closed forms; float64 evaluation of
// a handful of O(1) operations is accurate to ~1e-15 relative.
constexpr double kHandTol = 1e-12;

const double kInf = std::numeric_limits<double>::infinity();
const double kLn2 = std::log(2.0), kLn3 = std::log(3.0), kLn5 = std::log(5.0);
const double kE = std::exp(1.0);

/// float64 tensor of the given shape from a flat list of values.
torch::Tensor t64(std::vector<double> values, std::vector<int64_t> shape) {
  return torch::tensor(values, f64()).view(shape);
}

void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double tol = kHandTol) {
  ASSERT_EQ(actual.sizes(), expected.sizes());
  EXPECT_LE(rel_err(actual, expected), tol) << "actual:\n" << actual << "\nexpected:\n" << expected;
}

// ============================================================================
// softmax_attention
// ============================================================================

TEST(ReferenceSoftmax, ExplicitScaleOneGivesQuarterThreeQuarters) {
  // E = 1, scale 1: scores q.k = (0, ln 3) -> weights (1, 3) / 4.
  // out = 1/4 * (4, 8) + 3/4 * (8, 0) = (1 + 6, 2 + 0) = (7, 2).
  auto q = t64({1}, {1, 1, 1, 1});
  auto k = t64({0, kLn3}, {1, 1, 2, 1});
  auto v = t64({4, 8, 8, 0}, {1, 1, 2, 2});
  torch::Tensor w;
  auto out = reference::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().scale(1.0), &w);
  expect_close(out, t64({7, 2}, {1, 1, 1, 2}));
  expect_close(w, t64({0.25, 0.75}, {1, 1, 1, 2}));
}

TEST(ReferenceSoftmax, DefaultScaleIsOneOverSqrtE) {
  // E = 4: q.k1 = 2 ln 3, times 1/sqrt(4) = ln 3; q.k0 = 0 -> weights (1/4, 3/4).
  // out = 1/4 * 4 + 3/4 * 8 = 7.
  auto q = t64({2, 0, 0, 0}, {1, 1, 1, 4});
  auto k = t64({0, 0, 0, 0, kLn3, 0, 0, 0}, {1, 1, 2, 4});
  auto v = t64({4, 8}, {1, 1, 2, 1});
  expect_close(reference::softmax_attention(q, k, v, {}), t64({7}, {1, 1, 1, 1}));
}

TEST(ReferenceSoftmax, CustomScaleMultipliesScores) {
  // scale 0.25: q.k1 = 4 ln 3 -> score ln 3 -> weights (1/4, 3/4); out = 7.
  auto q = t64({4}, {1, 1, 1, 1});
  auto k = t64({0, kLn3}, {1, 1, 2, 1});
  auto v = t64({4, 8}, {1, 1, 2, 1});
  expect_close(reference::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().scale(0.25)),
               t64({7}, {1, 1, 1, 1}));
}

TEST(ReferenceSoftmax, CausalFewerQueriesThanKeysIsBottomRightAligned) {
  // L = 2, S = 3, q = 0 so visible keys share weight equally.
  // Query 0 sees j <= 0 + (3 - 2) = 1: mean(3, 6) = 4.5; query 1 sees all: 6.
  auto q = torch::zeros({1, 1, 2, 1}, f64());
  auto k = t64({1, 2, 3}, {1, 1, 3, 1});
  auto v = t64({3, 6, 9}, {1, 1, 3, 1});
  torch::Tensor w;
  auto out = reference::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true), &w);
  expect_close(out, t64({4.5, 6}, {1, 1, 2, 1}));
  expect_close(w, t64({0.5, 0.5, 0, 1. / 3, 1. / 3, 1. / 3}, {1, 1, 2, 3}));
}

TEST(ReferenceSoftmax, CausalMoreQueriesThanKeysLeavesEarlyRowsEmpty) {
  // L = 3, S = 2: query i sees j <= i - 1. Query 0 sees nothing -> exactly 0;
  // query 1 sees key 0 -> 3; query 2 sees keys 0, 1 -> mean(3, 6) = 4.5.
  auto q = torch::zeros({1, 1, 3, 1}, f64());
  auto k = t64({1, 2}, {1, 1, 2, 1});
  auto v = t64({3, 6}, {1, 1, 2, 1});
  torch::Tensor w;
  auto out = reference::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true), &w);
  expect_close(out, t64({0, 3, 4.5}, {1, 1, 3, 1}));
  EXPECT_EQ(out[0][0][0][0].item<double>(), 0.0);
  EXPECT_TRUE(torch::equal(w[0][0][0], torch::zeros({2}, f64())));
}

TEST(ReferenceSoftmax, KeyLengthsHideTrailingKeysAndZeroLengthGivesZero) {
  // N = 3, q = 0, v = (3, 6, 9) in every batch; key_lengths (1, 3, 0):
  // batch 0 sees key 0 -> 3; batch 1 sees all -> 6; batch 2 sees none -> 0.
  auto q = torch::zeros({3, 1, 1, 1}, f64());
  auto k = torch::ones({3, 1, 3, 1}, f64());
  auto v = t64({3, 6, 9}, {1, 1, 3, 1}).expand({3, 1, 3, 1}).contiguous();
  auto out = reference::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().key_lengths(i64({1, 3, 0})));
  expect_close(out, t64({3, 6, 0}, {3, 1, 1, 1}));
  EXPECT_EQ(out[2][0][0][0].item<double>(), 0.0);
}

TEST(ReferenceSoftmax, BiasIsAddedToScoresAndBroadcasts) {
  // q = 0, bias (1, 1, L=2, S=2) rows (0, ln 3) and (ln 3, 0):
  // row 0 weights (1/4, 3/4) -> 1/4*4 + 3/4*8 = 7; row 1 (3/4, 1/4) -> 3 + 2 = 5.
  auto q = torch::zeros({1, 1, 2, 1}, f64());
  auto k = torch::ones({1, 1, 2, 1}, f64());
  auto v = t64({4, 8}, {1, 1, 2, 1});
  auto bias = t64({0, kLn3, kLn3, 0}, {2, 2});  // broadcasts as (1, 1, 2, 2)
  expect_close(reference::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().bias(bias)),
               t64({7, 5}, {1, 1, 2, 1}));
}

TEST(ReferenceSoftmax, MinusInfinityBiasHidesKeysAndFullyMaskedRowIsExactlyZero) {
  // Row 0: bias (-inf, 0, 0) -> mean(6, 9) = 7.5. Row 1: all -inf -> exactly 0,
  // not a uniform row (which would be 6) and not NaN.
  auto q = torch::zeros({1, 1, 2, 1}, f64());
  auto k = torch::ones({1, 1, 3, 1}, f64());
  auto v = t64({3, 6, 9}, {1, 1, 3, 1});
  auto bias = t64({-kInf, 0, 0, -kInf, -kInf, -kInf}, {1, 1, 2, 3});
  torch::Tensor w;
  auto out = reference::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().bias(bias), &w);
  expect_close(out, t64({7.5, 0}, {1, 1, 2, 1}));
  EXPECT_EQ(out[0][0][1][0].item<double>(), 0.0);
  EXPECT_TRUE(torch::equal(w[0][0][1], torch::zeros({3}, f64())));
  EXPECT_TRUE(all_finite(w));
}

// ============================================================================
// linear_attention
// ============================================================================

TEST(ReferenceLinear, IdentityWithKeysEqualValuesIsCq) {
  // H = [[1, 2], [3, 4]]: C = H^T H = [[1+9, 2+12], [2+12, 4+16]] = [[10, 14], [14, 20]].
  // q = (1, -1): C q = (10 - 14, 14 - 20) = (-4, -6); q = (0, 1): (14, 20).
  auto h = t64({1, 2, 3, 4}, {1, 1, 2, 2});
  auto q = t64({1, -1, 0, 1}, {1, 1, 2, 2});
  expect_close(reference::linear_attention(q, h, h, {}), t64({-4, -6, 14, 20}, {1, 1, 2, 2}));
}

TEST(ReferenceLinear, IdentityNormalizedDividesByScoreSum) {
  // q = (1, 1), k = I, v = (2, 4): scores (1, 1); numerator 2 + 4 = 6,
  // denominator q.z + eps = (1 + 1) + 0 = 2 -> 3 (eps = 0 to keep it exact).
  auto q = t64({1, 1}, {1, 1, 1, 2});
  auto k = t64({1, 0, 0, 1}, {1, 1, 2, 2});
  auto v = t64({2, 4}, {1, 1, 2, 1});
  auto o = LinearAttentionFuncOptions().normalize(true).eps(0.0);
  expect_close(reference::linear_attention(q, k, v, o), t64({3}, {1, 1, 1, 1}));
  // With the default eps = 1e-6 the denominator is 2 + 1e-6.
  expect_close(reference::linear_attention(q, k, v, LinearAttentionFuncOptions().normalize(true)),
               t64({6 / (2 + 1e-6)}, {1, 1, 1, 1}));
}

TEST(ReferenceLinear, EluFeatureMapIsEluPlusOne) {
  // phi(x) = elu(x) + 1: phi(0) = 1, phi(1) = 2, phi(-1) = e^-1.
  // q = 0 -> phi = 1; k = (1, -1) -> phi = (2, e^-1); v = (1, 5).
  // Unnormalised: 1 * (2 * 1 + e^-1 * 5) = 2 + 5/e.
  // Normalised (eps 0): (2 + 5/e) / (2 + 1/e).
  auto q = t64({0}, {1, 1, 1, 1});
  auto k = t64({1, -1}, {1, 1, 2, 1});
  auto v = t64({1, 5}, {1, 1, 2, 1});
  auto elu = LinearAttentionFuncOptions().feature_map(FeatureMap::elu);
  expect_close(reference::linear_attention(q, k, v, elu), t64({2 + 5 / kE}, {1, 1, 1, 1}));
  expect_close(reference::linear_attention(q, k, v, elu.normalize(true).eps(0.0)),
               t64({(2 + 5 / kE) / (2 + 1 / kE)}, {1, 1, 1, 1}));
}

TEST(ReferenceLinear, CausalPrefixWithFewerQueriesThanKeys) {
  // L = 2, S = 3, E = M = 1, identity: q = (1, 2), k = (1, 1, 1), v = (1, 2, 4).
  // Query 0 sees keys 0, 1: 1 * (1 + 2) = 3. Query 1 sees 0..2: 2 * 7 = 14.
  // Normalised (eps 0): 3 / (1 + 1) = 1.5 and 14 / (2 * 3) = 7/3.
  auto q = t64({1, 2}, {1, 1, 2, 1});
  auto k = t64({1, 1, 1}, {1, 1, 3, 1});
  auto v = t64({1, 2, 4}, {1, 1, 3, 1});
  auto o = LinearAttentionFuncOptions().causal(true);
  expect_close(reference::linear_attention(q, k, v, o), t64({3, 14}, {1, 1, 2, 1}));
  expect_close(reference::linear_attention(q, k, v, o.normalize(true).eps(0.0)),
               t64({1.5, 7. / 3}, {1, 1, 2, 1}));
}

TEST(ReferenceLinear, CausalPrefixWithMoreQueriesThanKeys) {
  // L = 3, S = 2: query i sees j <= i - 1. q = (5, 1, 2), k = (1, 1), v = (1, 2):
  // query 0 sees nothing -> 0 (also normalised: 0 / eps = 0); query 1: 1 * 1 = 1;
  // query 2: 2 * (1 + 2) = 6.
  auto q = t64({5, 1, 2}, {1, 1, 3, 1});
  auto k = t64({1, 1}, {1, 1, 2, 1});
  auto v = t64({1, 2}, {1, 1, 2, 1});
  auto o = LinearAttentionFuncOptions().causal(true);
  expect_close(reference::linear_attention(q, k, v, o), t64({0, 1, 6}, {1, 1, 3, 1}));
  // Normalised, eps 1e-6: 0/1e-6 = 0, 1/(1 + 1e-6), 6/(4 + 1e-6).
  expect_close(reference::linear_attention(q, k, v, o.normalize(true)),
               t64({0, 1 / (1 + 1e-6), 6 / (4 + 1e-6)}, {1, 1, 3, 1}));
}

TEST(ReferenceLinear, QueryThatSeesNoKeyIsZeroEvenWithEpsZero) {
  // As above with eps = 0: query 0's normaliser would be 0 / 0; it outputs 0
  // with zero, finite gradients. Queries 1, 2: 1 / 1 = 1 and 6 / 4 = 1.5.
  // With no key at all (S = 0, causal or not) every query outputs 0.
  auto q = t64({5, 1, 2}, {1, 1, 3, 1}).requires_grad_();
  auto k = t64({1, 1}, {1, 1, 2, 1}).requires_grad_();
  auto v = t64({1, 2}, {1, 1, 2, 1});
  auto o = LinearAttentionFuncOptions().causal(true).normalize(true).eps(0.0);
  auto out = reference::linear_attention(q, k, v, o);
  expect_close(out, t64({0, 1, 1.5}, {1, 1, 3, 1}));
  out.sum().backward();
  EXPECT_TRUE(torch::isfinite(q.grad()).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(k.grad()).all().item<bool>());
  EXPECT_EQ(q.grad()[0][0][0][0].item<double>(), 0.0);
  auto none = torch::zeros({1, 1, 0, 1}, torch::kDouble);
  for (bool causal : {false, true})
    expect_close(reference::linear_attention(q.detach(), none, none, LinearAttentionFuncOptions(o).causal(causal)),
                 torch::zeros({1, 1, 3, 1}, torch::kDouble));
}

// ============================================================================
// gated_linear_attention
// ============================================================================

TEST(ReferenceGated, ScalarRecurrenceThreeSteps) {
  // E = 1: C_t = alpha_t C_{t-1} + beta_t f_t^2, f = (1, 2, 3),
  // alpha = (0.5, 0.5, 2), beta = (1, 2, 1):
  // C_1 = 0 + 1 = 1; C_2 = 0.5 + 2*4 = 8.5; C_3 = 2*8.5 + 9 = 26.
  // q = (1, 1, 2): causal out = (1*1, 8.5*1, 26*2) = (1, 8.5, 52);
  // non-causal out = C_3 q = (26, 26, 52).
  auto f = t64({1, 2, 3}, {1, 1, 3, 1});
  auto q = t64({1, 1, 2}, {1, 1, 3, 1});
  auto alpha = t64({0.5, 0.5, 2}, {1, 1, 3});
  auto beta = t64({1, 2, 1}, {1, 1, 3});
  expect_close(reference::gated_linear_attention(f, q, alpha, beta, GatedLinearAttentionFuncOptions().causal(true)),
               t64({1, 8.5, 52}, {1, 1, 3, 1}));
  expect_close(reference::gated_linear_attention(f, q, alpha, beta, {}), t64({26, 26, 52}, {1, 1, 3, 1}));
}

TEST(ReferenceGated, OuterProductRecurrenceTwoSteps) {
  // E = 2: f_1 = (1, 0), f_2 = (1, 1); alpha = (3, 0.5), beta = (2, 1).
  // C_1 = 3*0 + 2 [[1,0],[0,0]] = [[2,0],[0,0]];
  // C_2 = 0.5 C_1 + [[1,1],[1,1]] = [[2,1],[1,1]].
  // q_1 = (1, 1), q_2 = (1, -1).
  // causal: C_1 q_1 = (2, 0), C_2 q_2 = (1, 0).
  // non-causal: C_2 q_1 = (3, 2), C_2 q_2 = (1, 0).
  // A second head, same f and q, alpha = beta = 1: C_1 = [[1,0],[0,0]],
  // C_2 = C_1 + [[1,1],[1,1]] = [[2,1],[1,1]]: causal (1, 0), (1, 0);
  // non-causal (3, 2), (1, 0).
  auto f = t64({1, 0, 1, 1}, {1, 1, 2, 2}).expand({1, 2, 2, 2}).contiguous();
  auto q = t64({1, 1, 1, -1}, {1, 1, 2, 2}).expand({1, 2, 2, 2}).contiguous();
  auto alpha = t64({3, 0.5, 1, 1}, {1, 2, 2});
  auto beta = t64({2, 1, 1, 1}, {1, 2, 2});
  expect_close(reference::gated_linear_attention(f, q, alpha, beta, GatedLinearAttentionFuncOptions().causal(true)),
               t64({2, 0, 1, 0, 1, 0, 1, 0}, {1, 2, 2, 2}));
  expect_close(reference::gated_linear_attention(f, q, alpha, beta, {}),
               t64({3, 2, 1, 0, 3, 2, 1, 0}, {1, 2, 2, 2}));
}

// ============================================================================
// agglomerative_attention
// ============================================================================

TEST(ReferenceAgglomerative, FullIsClassWeightedMeanScaledByQueryWeight) {
  // cr = (1, 2, 1), v = (4, 2, 0): a = (4 + 4 + 0) / (1 + 2 + 1) = 2.
  // cq = (0.5, 1): out = (1, 2).
  auto cq = t64({0.5, 1}, {1, 1, 2});
  auto cr = t64({1, 2, 1}, {1, 1, 3});
  auto v = t64({4, 2, 0}, {1, 1, 3, 1});
  expect_close(reference::agglomerative_attention(cq, cr, v, {}), t64({1, 2}, {1, 1, 2, 1}));
}

TEST(ReferenceAgglomerative, CausalUsesPrefixSums) {
  // L = S = 3, cr = (1, 2, 1), v = (4, 2, 0), cq = (1, 2, 1):
  // prefix num (4, 8, 8), prefix den (1, 3, 4) -> a = (4, 8/3, 2) -> out = (4, 16/3, 2).
  auto cq = t64({1, 2, 1}, {1, 1, 3});
  auto cr = t64({1, 2, 1}, {1, 1, 3});
  auto v = t64({4, 2, 0}, {1, 1, 3, 1});
  expect_close(reference::agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().causal(true)),
               t64({4, 16. / 3, 2}, {1, 1, 3, 1}));
}

TEST(ReferenceAgglomerative, CausalWithLNotEqualSIsBottomRightAligned) {
  // cr = (1, 2, 1), v = (4, 2, 0) as above, cq = 1.
  // L = 2, S = 3: query i reads prefix i + 1 -> (8/3, 2).
  auto cr = t64({1, 2, 1}, {1, 1, 3});
  auto v = t64({4, 2, 0}, {1, 1, 3, 1});
  auto causal = AgglomerativeAttentionFuncOptions().causal(true);
  expect_close(reference::agglomerative_attention(torch::ones({1, 1, 2}, f64()), cr, v, causal),
               t64({8. / 3, 2}, {1, 1, 2, 1}));
  // L = 3, S = 2 (first two keys): query 0 sees nothing -> 0, then prefixes 0, 1 -> (4, 8/3).
  auto out = reference::agglomerative_attention(torch::ones({1, 1, 3}, f64()), cr.narrow(2, 0, 2),
                                                v.narrow(2, 0, 2), causal);
  expect_close(out, t64({0, 4, 8. / 3}, {1, 1, 3, 1}));
  EXPECT_EQ(out[0][0][0][0].item<double>(), 0.0);
}

TEST(ReferenceAgglomerative, ClipBoundsTheDenominator) {
  // cr = (1e-4, 2e-4), v = (1, 4): num = 1e-4 + 8e-4 = 9e-4, den = 3e-4 < 1e-3,
  // so a = 9e-4 / 1e-3 = 0.9 (unclipped it would be 3).
  auto cq = t64({1}, {1, 1, 1});
  auto cr = t64({1e-4, 2e-4}, {1, 1, 2});
  auto v = t64({1, 4}, {1, 1, 2, 1});
  expect_close(reference::agglomerative_attention(cq, cr, v, {}), t64({0.9}, {1, 1, 1, 1}));
  // A custom clip 1e-4 is inactive: 9e-4 / 3e-4 = 3.
  expect_close(reference::agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().clip(1e-4)),
               t64({3}, {1, 1, 1, 1}));
  // Causal (L = S = 2): prefix 0: 1e-4 / max(1e-4, 1e-3) = 0.1; prefix 1: 0.9.
  expect_close(reference::agglomerative_attention(torch::ones({1, 1, 2}, f64()), cr, v,
                                                  AgglomerativeAttentionFuncOptions().causal(true)),
               t64({0.1, 0.9}, {1, 1, 2, 1}));
}

TEST(ReferenceAgglomerative, ClassesAreIndependentHeads) {
  // H = 2 classes over the same v = (4, 2, 0): class 0 cr = (1, 2, 1) -> a = 8/4 = 2;
  // class 1 cr = (1, 0, 0) -> a = 4/1 = 4. cq = 1 (class 0), 0.25 (class 1) -> out (2, 1).
  auto cq = t64({1, 0.25}, {1, 2, 1});
  auto cr = t64({1, 2, 1, 1, 0, 0}, {1, 2, 3});
  auto v = t64({4, 2, 0}, {1, 1, 3, 1}).expand({1, 2, 3, 1}).contiguous();
  expect_close(reference::agglomerative_attention(cq, cr, v, {}), t64({2, 1}, {1, 2, 1, 1}));
}

// ============================================================================
// Clustered attention, step by step
// ============================================================================

TEST(ReferenceHashPlanes, DeterministicPerSeedAndDifferentAcrossSeeds) {
  auto a = reference::hash_planes(5, 3, 7, true);
  auto b = reference::hash_planes(5, 3, 7, true);
  auto c = reference::hash_planes(5, 3, 8, true);
  EXPECT_EQ(a.sizes(), (torch::IntArrayRef{5, 4}));
  EXPECT_EQ(a.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE((a == c).any().item<bool>()) << "different seeds should share no value";
}

TEST(ReferenceHashPlanes, LooksLikeStandardNormal) {
  // 63 x 65 = 4095 draws: the sample mean has standard error 1/64 ~ 0.016 and the
  // sample variance ~ 0.022; bounds of ~5 standard errors.
  auto p = reference::hash_planes(63, 64, 123, true);
  EXPECT_NEAR(p.mean().item<double>(), 0.0, 0.08);
  EXPECT_NEAR(p.var().item<double>(), 1.0, 0.12);
}

TEST(ReferenceHashPlanes, NoHashBiasZeroesOnlyTheThresholdColumn) {
  auto with = reference::hash_planes(6, 3, 11, true);
  auto without = reference::hash_planes(6, 3, 11, false);
  EXPECT_TRUE(torch::equal(without.select(1, 3), torch::zeros({6}, f64())));
  EXPECT_TRUE(torch::equal(without.narrow(1, 0, 3), with.narrow(1, 0, 3)));
  EXPECT_TRUE((with.select(1, 3) != 0).all().item<bool>());
}

TEST(ReferenceHash, BitsUseStrictGreaterThanThreshold) {
  // Planes (B = 3, E + 1 = 3), last column the threshold:
  //   P0 = (1, 0 | 0), P1 = (0, 1 | 0.5), P2 = (1, 1 | 2).
  // q = (1, 0.5):  1 > 0 -> 1;   0.5 > 0.5 -> 0 (equality);  1.5 > 2 -> 0   => 0b001 = 1
  // q = (-1, 2):  -1 > 0 -> 0;   2 > 0.5 -> 1;               1 > 2 -> 0     => 0b010 = 2
  // q = (3, 3):    3 > 0 -> 1;   3 > 0.5 -> 1;               6 > 2 -> 1     => 0b111 = 7
  // q = (0, 0):    0 > 0 -> 0 (equality); 0 > 0.5 -> 0;      0 > 2 -> 0     => 0
  // q = (2, 0):    2 > 0 -> 1;   0 > 0.5 -> 0;               2 > 2 -> 0 (equality) => 1
  auto planes = t64({1, 0, 0, 0, 1, 0.5, 1, 1, 2}, {3, 3});
  auto q = t64({1, 0.5, -1, 2, 3, 3, 0, 0, 2, 0}, {1, 1, 5, 2});
  auto bits = reference::hash_bits(q, planes);
  ASSERT_EQ(bits.scalar_type(), torch::kBool);
  auto expected = torch::tensor({1, 0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 0, 0},
                                torch::TensorOptions().dtype(torch::kBool)).view({1, 1, 5, 3});
  EXPECT_TRUE(torch::equal(bits, expected)) << bits;
  EXPECT_TRUE(torch::equal(reference::pack_bits(bits), i64({1, 2, 7, 0, 1}).view({1, 1, 5})));
}

TEST(ReferenceHash, PackBitsIsLittleEndianPlaneZeroIsBitZero) {
  auto opts = torch::TensorOptions().dtype(torch::kBool);
  // (1,0,0) -> 1, (0,1,0) -> 2, (0,0,1) -> 4, (1,0,1) -> 5.
  auto bits = torch::tensor({1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 1}, opts).view({4, 3});
  EXPECT_TRUE(torch::equal(reference::pack_bits(bits), i64({1, 2, 4, 5})));
  // 63 bits: all ones -> 2^63 - 1; only bit 62 -> 2^62; only bit 0 -> 1.
  auto all = torch::ones({63}, opts);
  auto top = torch::zeros({63}, opts);
  top[62] = true;
  auto low = torch::zeros({63}, opts);
  low[0] = true;
  EXPECT_EQ(reference::pack_bits(all).item<int64_t>(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(reference::pack_bits(top).item<int64_t>(), int64_t{1} << 62);
  EXPECT_EQ(reference::pack_bits(low).item<int64_t>(), 1);
}

/// Labels of one sequence as a std::vector.
std::vector<int64_t> labels_of(const torch::Tensor& labels, int64_t n = 0, int64_t h = 0) {
  auto row = labels[n][h].contiguous();
  return std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
}

TEST(ReferenceKmeans, ObviousGroupsArePartitionedForEverySeed) {
  // 8-bit hashes: group A = {0x00, 0x01, 0x00} at positions 0, 1, 3 and group
  // B = {0xFF, 0xFE, 0xFF} at 2, 4, 5 (within-group distance <= 1, across >= 7).
  // Whatever two initial positions a seed picks, two rounds settle it: if both
  // initial centroids fall in one group, either the majority vote moves one of
  // them to the other group (e.g. centroids 0x00 / 0x01 pull 0xFE / 0xFF and
  // the votes give 0x00 / 0xFF), or the second cluster is empty and takes the
  // farthest hash (a B hash). So the labels split exactly into A and B.
  auto hashes = i64({0x00, 0x01, 0xFF, 0x00, 0xFE, 0xFF}).view({1, 1, 6});
  for (int64_t seed = 0; seed < 20; ++seed) {
    auto l = labels_of(reference::hamming_kmeans(hashes, 2, 8, 5, seed, {}));
    EXPECT_EQ(l[0], l[1]) << "seed " << seed;
    EXPECT_EQ(l[0], l[3]) << "seed " << seed;
    EXPECT_EQ(l[2], l[4]) << "seed " << seed;
    EXPECT_EQ(l[2], l[5]) << "seed " << seed;
    EXPECT_NE(l[0], l[2]) << "seed " << seed;
    EXPECT_TRUE((l[0] == 0 || l[0] == 1) && (l[2] == 0 || l[2] == 1)) << "seed " << seed;
  }
}

TEST(ReferenceKmeans, ThreeGroupsAreRecovered) {
  // Three groups of 12-bit hashes at positions g, g + 3, g + 6: A ~ 0x000,
  // B ~ 0xFF0, C ~ 0xF0F. Group centres are 8 bits apart pairwise, members at
  // most 1 bit from their centre; 10 rounds with the empty-cluster rule recover
  // the groups from any initial positions.
  auto hashes = i64({0x000, 0xFF0, 0xF0F, 0x001, 0xFF0, 0xF0F, 0x000, 0xFF1, 0xF0E}).view({1, 1, 9});
  for (int64_t seed = 0; seed < 10; ++seed) {
    auto l = labels_of(reference::hamming_kmeans(hashes, 3, 12, 10, seed, {}));
    for (int g = 0; g < 3; ++g) {
      EXPECT_EQ(l[g], l[g + 3]) << "seed " << seed;
      EXPECT_EQ(l[g], l[g + 6]) << "seed " << seed;
    }
    EXPECT_EQ(std::set<int64_t>({l[0], l[1], l[2]}), (std::set<int64_t>{0, 1, 2})) << "seed " << seed;
  }
}

TEST(ReferenceKmeans, IdenticalHashesTieToTheLowestCentroid) {
  // Every hash equals 0x2A: every centroid is 0x2A whatever the seed, so every
  // query ties with all centroids and must take centroid 0.
  auto hashes = torch::full({1, 1, 5}, 0x2A, torch::kLong);
  for (int64_t seed = 0; seed < 5; ++seed)
    for (int64_t iterations : {0, 3})
      EXPECT_EQ(labels_of(reference::hamming_kmeans(hashes, 3, 8, iterations, seed, {})),
                (std::vector<int64_t>{0, 0, 0, 0, 0}));
}

TEST(ReferenceKmeans, HalfwayQueryTiesToTheLowerCentroid) {
  // A = 0x00 (positions 0..3), B = 0x0F (4..7), X = 0x03 at position 8 is at
  // distance 2 from both groups. After convergence the centroids are 0x00 and
  // 0x0F (X cannot tip a majority: 1 of 5 or 4 of 5 votes), so X's final
  // assignment is a tie and goes to the lower of the two labels.
  auto hashes = i64({0, 0, 0, 0, 0x0F, 0x0F, 0x0F, 0x0F, 0x03}).view({1, 1, 9});
  for (int64_t seed = 0; seed < 20; ++seed) {
    auto l = labels_of(reference::hamming_kmeans(hashes, 2, 4, 10, seed, {}));
    for (int i = 1; i < 4; ++i) EXPECT_EQ(l[i], l[0]) << "seed " << seed;
    for (int i = 5; i < 8; ++i) EXPECT_EQ(l[i], l[4]) << "seed " << seed;
    ASSERT_NE(l[0], l[4]) << "seed " << seed;
    EXPECT_EQ(l[8], std::min(l[0], l[4])) << "seed " << seed;
  }
}

/// The initial positions of docs/API.md: a partial Fisher-Yates shuffle of
/// 0..n-1 driven by below(seed, 2^32 + n_index * H + h, c, n - c).
std::vector<int64_t> initial_positions(int64_t n, int64_t C, int64_t seed, uint64_t sequence = 0) {
  namespace rnd = kernels::random;
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  for (int64_t c = 0; c < C; ++c)
    std::swap(order[c], order[c + rnd::below(seed, rnd::kInitStream + sequence, c, n - c)]);
  order.resize(C);
  return order;
}

TEST(ReferenceKmeans, InitialCentroidsFollowTheDocumentedShuffle) {
  // One-hot hashes 1 << i are pairwise 2 bits apart. With 0 iterations the
  // labels are the first assignment: initial centroid c's own query gets c
  // (distance 0), every other query ties at distance 2 and gets 0.
  auto hashes = torch::tensor({1, 2, 4, 8, 16, 32, 64}, torch::kLong).view({1, 1, 7});
  for (int64_t seed = 0; seed < 6; ++seed) {
    auto init = initial_positions(7, 3, seed);
    std::vector<int64_t> expected(7, 0);
    for (int64_t c = 0; c < 3; ++c) expected[init[c]] = c;
    EXPECT_EQ(labels_of(reference::hamming_kmeans(hashes, 3, 8, 0, seed, {})), expected) << "seed " << seed;
  }
}

TEST(ReferenceKmeans, EmptyClusterTakesTheHashFarthestFromTheUpdatedCentroid) {
  // 4-bit hashes, C = 2, 1 iteration. The two initial positions (docs/API.md)
  // get hash 0000, the three others 0111. Round 1: both centroids are 0000, so
  // every query ties and joins cluster 0; cluster 1 is empty. Cluster 0's vote
  // over {0000, 0000, 0111, 0111, 0111}: bits 0..2 have 3 of 5 -> 0111.
  // The empty cluster takes the hash farthest from that just-updated centroid:
  // a 0000 query (distance 3; the 0111 queries are at 0), so the centroids are
  // (0111, 0000) and the final assignment gives 0 to the 0111 queries and 1 to
  // the two 0000 queries. (Measured against the centroid before the update,
  // 0000, the farthest would be a 0111 query and every label would be 0.)
  for (int64_t seed = 0; seed < 6; ++seed) {
    auto init = initial_positions(5, 2, seed);
    std::vector<int64_t> h(5, 0b0111), expected(5, 0);
    for (auto p : init) h[p] = 0, expected[p] = 1;
    auto hashes = torch::tensor(h, torch::kLong).view({1, 1, 5});
    EXPECT_EQ(labels_of(reference::hamming_kmeans(hashes, 2, 4, 1, seed, {})), expected) << "seed " << seed;
  }
}

TEST(ReferenceKmeans, PaddedQueriesAreLabelledMinusOne) {
  // N = 2, L = 5, query_lengths (3, 5): batch 0 positions 3, 4 get -1, the rest
  // a cluster in [0, 2). Hashes of the padding are garbage and must not matter.
  auto hashes = i64({0x00, 0x00, 0xFF, 0x7F, 0x55, 0x00, 0x01, 0xFF, 0xFE, 0xF0}).view({2, 1, 5});
  auto labels = reference::hamming_kmeans(hashes, 2, 8, 3, 0, i64({3, 5}));
  auto l0 = labels_of(labels, 0), l1 = labels_of(labels, 1);
  EXPECT_EQ(l0[3], -1);
  EXPECT_EQ(l0[4], -1);
  EXPECT_EQ(l0[0], l0[1]);
  EXPECT_NE(l0[0], l0[2]);
  for (auto x : l1) EXPECT_TRUE(x == 0 || x == 1);
  // Changing a padded hash changes nothing.
  auto other = hashes.clone();
  other[0][0][4] = 0x0F;
  EXPECT_TRUE(torch::equal(reference::hamming_kmeans(other, 2, 8, 3, 0, i64({3, 5})), labels));
  // query_lengths 0: every query is padding.
  auto none = reference::hamming_kmeans(hashes, 2, 8, 3, 0, i64({0, 2}));
  EXPECT_EQ(labels_of(none, 0), (std::vector<int64_t>(5, -1)));
  EXPECT_EQ(labels_of(none, 1)[2], -1);
}

TEST(ReferenceKmeans, FewerValidQueriesThanClusters) {
  // 4 clusters but only 2 valid queries with different hashes: each valid query
  // is its own cluster (the sequence uses min(C, n) = 2 clusters), padding is -1.
  auto hashes = i64({0x0F, 0xF0, 0x00, 0x00, 0x00}).view({1, 1, 5});
  for (int64_t seed = 0; seed < 5; ++seed) {
    auto l = labels_of(reference::hamming_kmeans(hashes, 4, 8, 3, seed, i64({2})));
    EXPECT_NE(l[0], l[1]);
    EXPECT_TRUE(l[0] >= 0 && l[0] < 2 && l[1] >= 0 && l[1] < 2);
    EXPECT_EQ(l[2], -1);
    EXPECT_EQ(l[3], -1);
    EXPECT_EQ(l[4], -1);
  }
}

TEST(ReferenceKmeans, SameSeedSameLabelsDifferentSeedsDiffer) {
  torch::manual_seed(5);
  auto hashes = torch::randint(0, 1 << 16, {2, 2, 40}, torch::kLong);
  auto a = reference::hamming_kmeans(hashes, 5, 16, 4, 3, {});
  EXPECT_TRUE(torch::equal(a, reference::hamming_kmeans(hashes, 5, 16, 4, 3, {})));
  bool any_differs = false;
  for (int64_t seed = 4; seed < 8; ++seed)
    any_differs |= !torch::equal(a, reference::hamming_kmeans(hashes, 5, 16, 4, seed, {}));
  EXPECT_TRUE(any_differs) << "40 random hashes in 5 clusters gave identical labels for 5 seeds";
}

TEST(ReferenceClusteredGivenLabels, PlainUsesCentroidAttention) {
  // E = 1, scale 1, q = (1, 3, 4), labels (0, 0, 1): centroids 2 and 4.
  // k = (0, ln 3 / 2): centroid 0 scores (0, ln 3) -> Ac_0 = (1/4, 3/4);
  // centroid 1 scores (0, 2 ln 3 = ln 9) -> Ac_1 = (1/10, 9/10).
  // v = (4, 8): Vc_0 = 1 + 6 = 7, Vc_1 = 0.4 + 7.2 = 7.6 -> out (7, 7, 7.6).
  auto q = t64({1, 3, 4}, {1, 1, 3, 1});
  auto k = t64({0, kLn3 / 2}, {1, 1, 2, 1});
  auto v = t64({4, 8}, {1, 1, 2, 1});
  auto labels = i64({0, 0, 1}).view({1, 1, 3});
  torch::Tensor w;
  auto out = reference::clustered_attention_given_labels(q, k, v, labels, 2, 0, 1.0, {}, &w);
  expect_close(out, t64({7, 7, 7.6}, {1, 1, 3, 1}));
  expect_close(w, t64({0.25, 0.75, 0.25, 0.75, 0.1, 0.9}, {1, 1, 3, 2}));
}

TEST(ReferenceClusteredGivenLabels, PaddedQueriesAndHiddenKeys) {
  // Labels (0, -1, 1) with q = (2, 100, 4): the centroids stay 2 and 4 (the
  // padded query is nobody's member) and the padded row is exactly 0.
  // A third key hidden by key_lengths = 2 changes nothing: out (7, 0, 7.6).
  auto q = t64({2, 100, 4}, {1, 1, 3, 1});
  auto k = t64({0, kLn3 / 2, 50}, {1, 1, 3, 1});
  auto v = t64({4, 8, 1000}, {1, 1, 3, 1});
  auto labels = i64({0, -1, 1}).view({1, 1, 3});
  torch::Tensor w;
  auto out = reference::clustered_attention_given_labels(q, k, v, labels, 2, 0, 1.0, i64({2}), &w);
  expect_close(out, t64({7, 0, 7.6}, {1, 1, 3, 1}));
  EXPECT_EQ(out[0][0][1][0].item<double>(), 0.0);
  expect_close(w, t64({0.25, 0.75, 0, 0, 0, 0, 0.1, 0.9, 0}, {1, 1, 3, 3}));
  // Improved (top-1 of the 2 visible keys) with the hidden key still 0.
  auto out2 = reference::clustered_attention_given_labels(q, k, v, labels, 2, 1, 1.0, i64({2}), &w);
  expect_close(out2, t64({7, 0, 7.6}, {1, 1, 3, 1}));
  EXPECT_EQ(out2[0][0][1][0].item<double>(), 0.0);
}

TEST(ReferenceClusteredGivenLabels, ImprovedRescalesTopKeysByCentroidMass) {
  // One cluster, E = 1, scale 1, q = (0, 2): centroid 1.
  // k = (0, ln 2, ln 5): Ac = (1, 2, 5) / 8; top-2 keys {2, 1}, mass m = 7/8.
  // Query 0 (q = 0): top scores (0, 0) -> softmax (1/2, 1/2)
  //   At_0 = (1/8, 7/16, 7/16).
  // Query 1 (q = 2): top scores (ln 4, ln 25) -> softmax (4/29, 25/29)
  //   At_1 = (1/8, 7/8 * 4/29, 7/8 * 25/29) = (1/8, 7/58, 175/232).
  // v = (8, 16, 32): out_0 = 1 + 7 + 14 = 22;
  //   out_1 = 1 + 16 * 7/58 + 32 * 175/232 = 1 + 56/29 + 700/29 = 785/29.
  auto q = t64({0, 2}, {1, 1, 2, 1});
  auto k = t64({0, kLn2, kLn5}, {1, 1, 3, 1});
  auto v = t64({8, 16, 32}, {1, 1, 3, 1});
  auto labels = i64({0, 0}).view({1, 1, 2});
  torch::Tensor w;
  auto out = reference::clustered_attention_given_labels(q, k, v, labels, 1, 2, 1.0, {}, &w);
  expect_close(out, t64({22, 785. / 29}, {1, 1, 2, 1}));
  expect_close(w, t64({1. / 8, 7. / 16, 7. / 16, 1. / 8, 7. / 58, 175. / 232}, {1, 1, 2, 3}));
  // Top-3 = all keys, mass 1: exact attention of each query.
  // Query 1: scores (0, ln 4, ln 25) -> (1, 4, 25)/30 -> out (8 + 64 + 800)/30 = 872/30.
  out = reference::clustered_attention_given_labels(q, k, v, labels, 1, 3, 1.0, {});
  expect_close(out, t64({56. / 3, 872. / 30}, {1, 1, 2, 1}));
}

TEST(ReferenceClusteredGivenLabels, TopKeyTiesGoToTheLowerIndex) {
  // E = 2, scale 1, one cluster, q_0 = (1, 1), q_1 = (1, -1): centroid (1, 0).
  // Keys k0 = (1, 0), k1 = (0, 1), k2 = (0, -1): centroid scores (1, 0, 0), a
  // tie between keys 1 and 2 for the second place: top-2 = {0, 1}.
  // Ac = (e, 1, 1) / (e + 2), m = (e + 1) / (e + 2).
  // Query 0 scores on {0, 1}: (1, 1) -> (1/2, 1/2): At_0 = (m/2, m/2, 1/(e+2)).
  // Query 1 scores on {0, 1}: (1, -1) -> (e, 1/e)/(e + 1/e):
  //   At_1 = (m e/(e + 1/e), m (1/e)/(e + 1/e), 1/(e+2)).
  // v = I (M = 3), so out = At.
  auto q = t64({1, 1, 1, -1}, {1, 1, 2, 2});
  auto k = t64({1, 0, 0, 1, 0, -1}, {1, 1, 3, 2});
  auto v = torch::eye(3, f64()).view({1, 1, 3, 3});
  auto labels = i64({0, 0}).view({1, 1, 2});
  const double m = (kE + 1) / (kE + 2), z1 = kE + 1 / kE;
  auto expected = t64({m / 2, m / 2, 1 / (kE + 2), m * kE / z1, m / kE / z1, 1 / (kE + 2)}, {1, 1, 2, 3});
  expect_close(reference::clustered_attention_given_labels(q, k, v, labels, 1, 2, 1.0, {}), expected);
}

// ============================================================================
// Sparse attention
// ============================================================================

TEST(ReferenceSparse, EdgeMaskOfSharedAndPerHeadLists) {
  // Shared: row 0 -> {0, 2}, row 1 -> {1}, row 2 -> {}.
  EdgeList shared{i64({0, 2, 3, 3}), i64({0, 2, 1})};
  auto m = reference::edge_mask(shared, 2, 3, 3);
  auto b = torch::TensorOptions().dtype(torch::kBool);
  EXPECT_TRUE(torch::equal(m, torch::tensor({1, 0, 1, 0, 1, 0, 0, 0, 0}, b).view({1, 3, 3})));
  // Per head (H = 2, L = 2, S = 2): head 0 rows {0}, {0, 1}; head 1 rows {1}, {}.
  EdgeList per_head{i64({0, 1, 3, 3, 4, 4}).view({2, 3}), i64({0, 0, 1, 1})};
  auto mh = reference::edge_mask(per_head, 2, 2, 2);
  EXPECT_TRUE(torch::equal(mh, torch::tensor({1, 0, 1, 1, 0, 1, 0, 0}, b).view({2, 2, 2})));
}

TEST(ReferenceSparse, SoftmaxOverNeighboursAndEmptyRowIsZero) {
  // E = 1, scale 1, k = (0, 5, 1), v = (3, 6, 9); edges row 0 {0, 2}, row 1 {1}, row 2 {}.
  // Query 0 = ln 3: scores on {0, 2} = (0, ln 3) -> (1/4, 3/4) -> 0.75 + 6.75 = 7.5.
  // Query 1 (any value): one neighbour -> 6. Query 2: no neighbour -> exactly 0.
  EdgeList edges{i64({0, 2, 3, 3}), i64({0, 2, 1})};
  auto q = t64({kLn3, 7, 1}, {1, 1, 3, 1});
  auto k = t64({0, 5, 1}, {1, 1, 3, 1});
  auto v = t64({3, 6, 9}, {1, 1, 3, 1});
  torch::Tensor w;
  auto out = reference::sparse_attention(q, k, v, edges, SparseAttentionFuncOptions().scale(1.0), &w);
  expect_close(out, t64({7.5, 6, 0}, {1, 1, 3, 1}));
  EXPECT_EQ(out[0][0][2][0].item<double>(), 0.0);
  expect_close(w, t64({0.25, 0, 0.75, 0, 1, 0, 0, 0, 0}, {1, 1, 3, 3}));
  // Default scale 1/sqrt(E) with E = 1 is 1 as well.
  expect_close(reference::sparse_attention(q, k, v, edges, {}), t64({7.5, 6, 0}, {1, 1, 3, 1}));
}

TEST(ReferenceSparse, PerHeadListsApplyToTheirHead) {
  // H = 2, q = 0 (uniform over neighbours), v = (3, 6, 9) in both heads.
  // Head 0 rows: {0, 1, 2} -> 6, {2} -> 9. Head 1 rows: {} -> 0, {0, 1} -> 4.5.
  EdgeList edges{i64({0, 3, 4, 4, 4, 6}).view({2, 3}), i64({0, 1, 2, 2, 0, 1})};
  auto q = torch::zeros({1, 2, 2, 1}, f64());
  auto k = torch::ones({1, 2, 3, 1}, f64());
  auto v = t64({3, 6, 9}, {1, 1, 3, 1}).expand({1, 2, 3, 1}).contiguous();
  expect_close(reference::sparse_attention(q, k, v, edges, {}), t64({6, 9, 0, 4.5}, {1, 2, 2, 1}));
}

}  // namespace
}  // namespace attnkit::testing::reference_test
