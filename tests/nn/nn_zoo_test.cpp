// The classic zoo modules (include/attnkit/nn/zoo.h; docs/MATH.md, "The classic
// zoo"): shapes,
// small cases against the formulas written out here with explicit loops (and a
// few literal numbers), key_lengths masking, the sinusoidal table, Shaw's
// relative-position attention against a direct O(L^2 dz) loop, float64
// finite-difference gradients of every parameter and input, and bad input.
#include <attnkit/nn/zoo.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace attnkit::nn::nn_zoo_test {
namespace {

using testing::all_finite;
using testing::expect_error;
using testing::expect_gradients_match;
using testing::f64;
using testing::i64;
using testing::max_abs;
using testing::rel_err;

/// Module (composite libtorch, float64) vs explicit loops in float64: both sum
/// O(10) products of O(1) numbers, so they agree to ~1e-15; 1e-12 leaves room.
constexpr double kLoopTol = 1e-12;
/// The sinusoidal table is stored in float32: values in [-1, 1] carry at most
/// 2^-24 rounding; formula mistakes show up at >= 1e-3.
constexpr double kTableTol = 1e-6;
/// Literals below are printed with 17 significant digits and the module does a
/// handful of float64 operations on O(1) values: agreement to ~1e-16 expected.
constexpr double kLiteralTol = 1e-14;
/// Row sums of float32 softmax weights: a few ulps of 1 (2^-23 each).
constexpr double kFloatSumTol = 1e-5;

/// Overwrites a parameter with literal values (row-major).
void set(torch::Tensor& param, const std::vector<double>& values) {
  torch::NoGradGuard no_grad;
  ASSERT_EQ(param.numel(), static_cast<int64_t>(values.size()));
  param.copy_(torch::tensor(values, f64()).view(param.sizes()));
}

/// Masked softmax and weighted sum with loops: scores (N, L, S) already
/// computed, keys j >= lengths[n] hidden, an empty row gives zeros.
AttentionOutput loop_attend(const torch::Tensor& scores, const torch::Tensor& values,
                            const std::vector<int64_t>& lengths) {
  const int64_t N = scores.size(0), L = scores.size(1), S = scores.size(2), D = values.size(2);
  auto e = scores.accessor<double, 3>();
  auto val = values.accessor<double, 3>();
  auto weights = torch::zeros({N, L, S}, f64());
  auto context = torch::zeros({N, L, D}, f64());
  auto w = weights.accessor<double, 3>();
  auto c = context.accessor<double, 3>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = lengths.empty() ? S : lengths[n];
    for (int64_t i = 0; i < L; ++i) {
      if (len == 0) continue;
      double mx = -std::numeric_limits<double>::infinity(), sum = 0;
      for (int64_t j = 0; j < len; ++j) mx = std::max(mx, e[n][i][j]);
      for (int64_t j = 0; j < len; ++j) sum += std::exp(e[n][i][j] - mx);
      for (int64_t j = 0; j < len; ++j) {
        w[n][i][j] = std::exp(e[n][i][j] - mx) / sum;
        for (int64_t d = 0; d < D; ++d) c[n][i][d] += w[n][i][j] * val[n][j][d];
      }
    }
  }
  return {context, weights};
}

// --- Scores with loops, one per scoring module ---------------------------------------

torch::Tensor additive_scores_loop(AdditiveAttention& m, const torch::Tensor& s, const torch::Tensor& h) {
  const int64_t N = s.size(0), L = s.size(1), S = h.size(1), A = m->options.hidden_dim();
  auto W = m->W->weight.detach(), b = m->W->bias.detach(), U = m->U->weight.detach(), v = m->v.detach();
  auto out = torch::zeros({N, L, S}, f64());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j) {
        double e = 0;
        for (int64_t a = 0; a < A; ++a) {
          double pre = b[a].item<double>();
          for (int64_t d = 0; d < s.size(2); ++d) pre += W[a][d].item<double>() * s[n][i][d].item<double>();
          for (int64_t d = 0; d < h.size(2); ++d) pre += U[a][d].item<double>() * h[n][j][d].item<double>();
          e += v[a].item<double>() * std::tanh(pre);
        }
        out[n][i][j] = e;
      }
  return out;
}

torch::Tensor general_scores_loop(GeneralAttention& m, const torch::Tensor& s, const torch::Tensor& h) {
  const int64_t N = s.size(0), L = s.size(1), S = h.size(1);
  auto W = m->W.detach();
  auto out = torch::zeros({N, L, S}, f64());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j) {
        double e = 0;
        for (int64_t a = 0; a < s.size(2); ++a)
          for (int64_t b = 0; b < h.size(2); ++b)
            e += s[n][i][a].item<double>() * W[a][b].item<double>() * h[n][j][b].item<double>();
        out[n][i][j] = e;
      }
  return out;
}

torch::Tensor dot_scores_loop(const torch::Tensor& s, const torch::Tensor& h, bool scaled) {
  const int64_t N = s.size(0), L = s.size(1), S = h.size(1), d = s.size(2);
  auto out = torch::zeros({N, L, S}, f64());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j) {
        double e = 0;
        for (int64_t a = 0; a < d; ++a) e += s[n][i][a].item<double>() * h[n][j][a].item<double>();
        out[n][i][j] = scaled ? e / std::sqrt(double(d)) : e;
      }
  return out;
}

/// Location: W s_i + b restricted to the first S source positions.
torch::Tensor location_scores_loop(LocationAttention& m, const torch::Tensor& s, int64_t S) {
  const int64_t N = s.size(0), L = s.size(1);
  auto W = m->W->weight.detach(), b = m->W->bias.detach();
  auto out = torch::zeros({N, L, S}, f64());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t p = 0; p < S; ++p) {
        double e = b[p].item<double>();
        for (int64_t a = 0; a < s.size(2); ++a) e += W[p][a].item<double>() * s[n][i][a].item<double>();
        out[n][i][p] = e;
      }
  return out;
}

void expect_output_matches(const AttentionOutput& got, const AttentionOutput& want) {
  ASSERT_EQ(got.context.sizes(), want.context.sizes());
  ASSERT_EQ(got.weights.sizes(), want.weights.sizes());
  EXPECT_LT(rel_err(got.weights, want.weights), kLoopTol);
  EXPECT_LT(rel_err(got.context, want.context), kLoopTol);
}

// --- Shapes ----------------------------------------------------------------------------

TEST(NnZooTest, OutputShapes) {
  torch::manual_seed(1);
  const int64_t N = 2, L = 3, S = 5, Dq = 4, Dk = 6, Dv = 7;
  auto s = torch::randn({N, L, Dq}), h = torch::randn({N, S, Dk}), val = torch::randn({N, S, Dv});
  auto check = [&](const AttentionOutput& o, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(o.context.sizes(), (std::vector<int64_t>{N, L, Dv}));
    EXPECT_EQ(o.weights.sizes(), (std::vector<int64_t>{N, L, S}));
    EXPECT_TRUE(all_finite(o.context));
    EXPECT_LT((o.weights.sum(-1) - 1).abs().max().item<double>(), kFloatSumTol);
  };
  check(AdditiveAttention(AdditiveAttentionOptions(Dq, Dk, 8))->forward(s, h, val), "additive");
  check(GeneralAttention(GeneralAttentionOptions(Dq, Dk))->forward(s, h, val), "general");
  auto hq = torch::randn({N, S, Dq});
  check(DotAttention()->forward(s, hq, val), "dot");
  check(DotAttention(DotAttentionOptions().scaled(false))->forward(s, hq, val), "dot unscaled");
  check(LocationAttention(LocationAttentionOptions(Dq, 9))->forward(s, val), "location");
  auto x = torch::randn({N, L, 8});
  EXPECT_EQ(SinusoidalPositionalEncoding(SinusoidalPositionalEncodingOptions(8))->forward(x).sizes(),
            x.sizes());
  EXPECT_EQ(RelativePositionAttention(RelativePositionAttentionOptions(8, 2, 2))->forward(x).sizes(),
            x.sizes());
  EXPECT_TRUE(DotAttentionOptions().scaled()) << "DotAttention is scaled by default";
}

// --- Hand-computed cases ---------------------------------------------------------------

TEST(NnZooTest, AdditiveLiteralCase) {
  // hidden = 1: e_j = v tanh(w s + b + u h_j) with v = 2, w = 1, b = 0, u = 1,
  // s = 0.5, h = (0.5, -0.5): e = (2 tanh 1, 0). Values (3, -1).
  AdditiveAttention m(AdditiveAttentionOptions(1, 1, 1));
  m->to(torch::kDouble);
  set(m->W->weight, {1.0});
  set(m->W->bias, {0.0});
  set(m->U->weight, {1.0});
  set(m->v, {2.0});
  auto s = torch::tensor({0.5}, f64()).view({1, 1, 1});
  auto h = torch::tensor({0.5, -0.5}, f64()).view({1, 2, 1});
  auto val = torch::tensor({3.0, -1.0}, f64()).view({1, 2, 1});
  EXPECT_NEAR(m->scores(s, h)[0][0][0].item<double>(), 1.5231883119115297, kLiteralTol);
  EXPECT_NEAR(m->scores(s, h)[0][0][1].item<double>(), 0.0, kLiteralTol);
  auto o = m->forward(s, h, val);
  EXPECT_NEAR(o.weights[0][0][0].item<double>(), 0.8210074960059999, kLiteralTol);
  EXPECT_NEAR(o.weights[0][0][1].item<double>(), 0.17899250399400013, kLiteralTol);
  EXPECT_NEAR(o.context[0][0][0].item<double>(), 2.2840299840239995, kLiteralTol);
}

TEST(NnZooTest, AdditiveMatchesLoops) {
  // W has a bias, U does not: e_ij = v^T tanh(W s_i + b + U h_j).
  AdditiveAttention m(AdditiveAttentionOptions(2, 3, 2));
  m->to(torch::kDouble);
  EXPECT_TRUE(m->W->bias.defined());
  EXPECT_FALSE(m->U->bias.defined());
  set(m->W->weight, {0.5, -1.0, 0.25, 0.75});
  set(m->W->bias, {0.1, -0.2});
  set(m->U->weight, {1.0, 0.0, -0.5, 0.3, 0.2, 0.1});
  set(m->v, {1.5, -0.7});
  auto s = torch::tensor({0.3, -0.4, 1.0, 0.2, -0.6, 0.9, 0.0, 0.5}, f64()).view({2, 2, 2});
  auto h = torch::linspace(-1, 1, 18, f64()).view({2, 3, 3});
  auto val = torch::linspace(-2, 3, 12, f64()).view({2, 3, 2});
  auto e = additive_scores_loop(m, s, h);
  EXPECT_LT(rel_err(m->scores(s, h), e), kLoopTol);
  expect_output_matches(m->forward(s, h, val), loop_attend(e, val, {}));
  expect_output_matches(m->forward(s, h, val, i64({2, 1})), loop_attend(e, val, {2, 1}));
}

TEST(NnZooTest, GeneralMatchesLoops) {
  GeneralAttention m(GeneralAttentionOptions(2, 3));
  m->to(torch::kDouble);
  set(m->W, {1.0, 0.5, -0.5, 0.0, 2.0, 0.25});
  auto s = torch::tensor({1.0, 0.0, 0.5, -1.0, 0.2, 0.3}, f64()).view({1, 3, 2});
  auto h = torch::tensor({1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.5, 0.5, -1.0, 0.3, 0.2, 0.1}, f64()).view({1, 4, 3});
  auto val = torch::arange(8, f64()).view({1, 4, 2});
  // Spelled out: s_0 = (1, 0), h_0 = e_0 -> W[0][0] = 1; h_1 = e_1 -> W[0][1] = 0.5.
  auto e = general_scores_loop(m, s, h);
  EXPECT_DOUBLE_EQ(e[0][0][0].item<double>(), 1.0);
  EXPECT_DOUBLE_EQ(e[0][0][1].item<double>(), 0.5);
  EXPECT_LT(rel_err(m->scores(s, h), e), kLoopTol);
  expect_output_matches(m->forward(s, h, val), loop_attend(e, val, {}));
  expect_output_matches(m->forward(s, h, val, i64({3})), loop_attend(e, val, {3}));
}

TEST(NnZooTest, DotLiteralAndLoops) {
  // Unscaled: s = (1, 0), keys e_0, e_1 -> e = (1, 0), weights (e/(e+1), 1/(e+1)).
  auto s = torch::tensor({1.0, 0.0}, f64()).view({1, 1, 2});
  auto h = torch::tensor({1.0, 0.0, 0.0, 1.0}, f64()).view({1, 2, 2});
  auto val = torch::tensor({10.0, 20.0}, f64()).view({1, 2, 1});
  auto o = DotAttention(DotAttentionOptions().scaled(false))->forward(s, h, val);
  EXPECT_NEAR(o.weights[0][0][0].item<double>(), 0.7310585786300049, kLiteralTol);
  EXPECT_NEAR(o.weights[0][0][1].item<double>(), 0.2689414213699951, kLiteralTol);
  EXPECT_NEAR(o.context[0][0][0].item<double>(), 10 * 0.7310585786300049 + 20 * 0.2689414213699951, 10 * kLiteralTol);  // values of size 20
  // Scaled by 1/sqrt(d) with d = 4: s = (2, 2, 2, 2), h_0 = (1, 1, 1, 1) -> 8 / 2 = 4.
  auto s4 = torch::full({1, 1, 4}, 2.0, f64());
  auto h4 = torch::stack({torch::ones({4}, f64()), torch::zeros({4}, f64())}).view({1, 2, 4});
  EXPECT_DOUBLE_EQ(DotAttention()->scores(s4, h4)[0][0][0].item<double>(), 4.0);
  EXPECT_DOUBLE_EQ(DotAttention(DotAttentionOptions().scaled(false))->scores(s4, h4)[0][0][0].item<double>(), 8.0);

  torch::manual_seed(3);
  auto sr = torch::randn({2, 3, 5}, f64()), hr = torch::randn({2, 4, 5}, f64()), vr = torch::randn({2, 4, 3}, f64());
  for (bool scaled : {true, false}) {
    SCOPED_TRACE(scaled ? "scaled" : "unscaled");
    auto e = dot_scores_loop(sr, hr, scaled);
    DotAttention m(DotAttentionOptions().scaled(scaled));
    expect_output_matches(m->forward(sr, hr, vr), loop_attend(e, vr, {}));
    expect_output_matches(m->forward(sr, hr, vr, i64({4, 2})), loop_attend(e, vr, {4, 2}));
  }
}

TEST(NnZooTest, LocationMatchesLoopsOnFirstSPositions) {
  // max_source_length 5, actual S = 3: only rows 0..2 of W take part.
  LocationAttention m(LocationAttentionOptions(2, 5));
  m->to(torch::kDouble);
  set(m->W->weight, {1.0, 0.0, 0.0, 1.0, -1.0, 0.5, 9.0, 9.0, -9.0, 9.0});
  set(m->W->bias, {0.0, 0.1, 0.2, 50.0, 50.0});
  auto s = torch::tensor({0.5, -0.5, 1.0, 2.0}, f64()).view({1, 2, 2});
  auto val = torch::tensor({1.0, 0.0, 0.0, 1.0, 2.0, 2.0}, f64()).view({1, 3, 2});
  auto e = location_scores_loop(m, s, 3);
  // Spelled out for query 0: (0.5, -0.5 + 0.1, -0.75 + 0.2).
  EXPECT_DOUBLE_EQ(e[0][0][0].item<double>(), 0.5);
  EXPECT_NEAR(e[0][0][1].item<double>(), -0.4, kLiteralTol);
  EXPECT_NEAR(e[0][0][2].item<double>(), -0.55, kLiteralTol);
  auto o = m->forward(s, val);
  expect_output_matches(o, loop_attend(e, val, {}));
  expect_output_matches(m->forward(s, val, i64({2})), loop_attend(e, val, {2}));
  // The key side is never looked at: the source length comes from the values.
  auto val5 = torch::randn({1, 5, 2}, f64());
  auto o5 = m->forward(s, val5);
  EXPECT_EQ(o5.weights.sizes(), (std::vector<int64_t>{1, 2, 5}));
  expect_output_matches(o5, loop_attend(location_scores_loop(m, s, 5), val5, {}));
}

// --- Masking -------------------------------------------------------------------------------

TEST(NnZooTest, KeyLengthsMaskIncludingZeroLength) {
  torch::manual_seed(5);
  const int64_t N = 3, L = 2, S = 4, D = 3;
  const std::vector<int64_t> lens{4, 2, 0};
  auto s = torch::randn({N, L, D}, f64()), h = torch::randn({N, S, D}, f64());
  auto val = torch::randn({N, S, 2}, f64());
  AdditiveAttention add(AdditiveAttentionOptions(D, D, 4));
  GeneralAttention gen(GeneralAttentionOptions(D, D));
  DotAttention dot;
  LocationAttention loc(LocationAttentionOptions(D, 6));
  add->to(torch::kDouble);
  gen->to(torch::kDouble);
  loc->to(torch::kDouble);
  std::vector<std::pair<std::string, std::function<AttentionOutput(const torch::Tensor&, const torch::Tensor&,
                                                                   const torch::Tensor&)>>>
      modules{{"additive", [&](auto& a, auto& b, auto& c) { return add->forward(a, b, c, i64(lens)); }},
              {"general", [&](auto& a, auto& b, auto& c) { return gen->forward(a, b, c, i64(lens)); }},
              {"dot", [&](auto& a, auto& b, auto& c) { return dot->forward(a, b, c, i64(lens)); }},
              {"location", [&](auto& a, auto&, auto& c) { return loc->forward(a, c, i64(lens)); }}};
  for (auto& [name, fwd] : modules) {
    SCOPED_TRACE(name);
    auto sg = s.clone().requires_grad_(true), hg = h.clone().requires_grad_(true);
    auto vg = val.clone().requires_grad_(true);
    auto o = fwd(sg, hg, vg);
    EXPECT_TRUE(all_finite(o.context) && all_finite(o.weights));
    // Zero length: context and weights exactly 0.
    EXPECT_EQ(max_abs(o.context[2]), 0.0);
    EXPECT_EQ(max_abs(o.weights[2]), 0.0);
    // Length 2: keys 2, 3 get exactly zero weight, the rest sums to 1.
    EXPECT_EQ(max_abs(o.weights[1].narrow(1, 2, 2)), 0.0);
    EXPECT_NEAR(o.weights[1].sum(-1).sub(1).abs().max().item<double>(), 0.0, kLoopTol);
    EXPECT_NEAR(o.weights[0].sum(-1).sub(1).abs().max().item<double>(), 0.0, kLoopTol);
    // Backward through the empty row: finite, and nothing flows into sequence 2's inputs.
    (o.context.sum() + o.weights.pow(2).sum()).backward();
    EXPECT_TRUE(all_finite(sg.grad()) && all_finite(vg.grad()));
    EXPECT_EQ(max_abs(sg.grad()[2]), 0.0);
    EXPECT_EQ(max_abs(vg.grad()[2]), 0.0);
    EXPECT_EQ(max_abs(vg.grad()[1].narrow(0, 2, 2)), 0.0);  // masked values get no gradient
    if (hg.grad().defined()) {
      EXPECT_TRUE(all_finite(hg.grad()));
      EXPECT_EQ(max_abs(hg.grad()[2]), 0.0);
    }
  }
}

// --- Sinusoidal positions ----------------------------------------------------------------------

double pe_formula(int64_t p, int64_t c, int64_t d) {
  const int64_t two_i = c - c % 2;  // columns 2i and 2i+1 share the frequency
  const double angle = double(p) / std::pow(10000.0, double(two_i) / double(d));
  return c % 2 == 0 ? std::sin(angle) : std::cos(angle);
}

TEST(NnZooTest, SinusoidalTableValues) {
  for (int64_t d : {4, 5, 1}) {
    SCOPED_TRACE("width " + std::to_string(d));
    SinusoidalPositionalEncoding pe(SinusoidalPositionalEncodingOptions(d, 64));
    EXPECT_EQ(pe->table.sizes(), (std::vector<int64_t>{64, d}));
    for (int64_t p : {0, 1, 2, 7, 33, 63})
      for (int64_t c = 0; c < d; ++c)
        EXPECT_NEAR(pe->table[p][c].item<double>(), pe_formula(p, c, d), kTableTol) << "p " << p << " col " << c;
  }
  // Literal numbers, d = 4: PE(1, 0) = sin 1, PE(1, 1) = cos 1, PE(1, 2) = sin(1/100), PE(1, 3) = cos(1/100).
  SinusoidalPositionalEncoding pe4(SinusoidalPositionalEncodingOptions(4, 8));
  EXPECT_NEAR(pe4->table[1][0].item<double>(), 0.8414709848078965, kTableTol);
  EXPECT_NEAR(pe4->table[1][1].item<double>(), 0.5403023058681398, kTableTol);
  EXPECT_NEAR(pe4->table[1][2].item<double>(), 0.009999833334166664, kTableTol);
  EXPECT_NEAR(pe4->table[1][3].item<double>(), 0.9999500004166653, kTableTol);
  // Position 0: sin columns 0, cos columns 1 (odd d = 5 has three sin columns, two cos).
  SinusoidalPositionalEncoding pe5(SinusoidalPositionalEncodingOptions(5, 8));
  EXPECT_EQ(pe5->table[0].to(torch::kDouble).sum().item<double>(), 2.0);
  EXPECT_EQ(SinusoidalPositionalEncoding(SinusoidalPositionalEncodingOptions(3))->table.size(0), 8192)
      << "default max_length";
}

TEST(NnZooTest, SinusoidalOffsetAndForward) {
  SinusoidalPositionalEncoding pe(SinusoidalPositionalEncodingOptions(5, 20));
  auto enc = pe->encoding(4, 7);
  ASSERT_EQ(enc.sizes(), (std::vector<int64_t>{4, 5}));
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t c = 0; c < 5; ++c) EXPECT_NEAR(enc[r][c].item<double>(), pe_formula(7 + r, c, 5), kTableTol);
  torch::manual_seed(2);
  auto x = torch::randn({2, 4, 5}, f64());
  auto y = pe->forward(x, 7);
  EXPECT_EQ(y.scalar_type(), torch::kDouble);
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t c = 0; c < 5; ++c)
        EXPECT_NEAR(y[n][r][c].item<double>(), x[n][r][c].item<double>() + pe_formula(7 + r, c, 5), kTableTol);
  EXPECT_TRUE(torch::equal(pe->forward(x), x + pe->encoding(4).to(torch::kDouble)));
  EXPECT_EQ(pe->encoding(20, 0).size(0), 20);  // the whole table is allowed
  EXPECT_EQ(pe->encoding(0, 20).size(0), 0);
}

TEST(NnZooTest, SinusoidalErrors) {
  SinusoidalPositionalEncoding pe(SinusoidalPositionalEncodingOptions(4, 10));
  expect_error([&] { pe->encoding(3, 8); }, {"SinusoidalPositionalEncoding", "max_length 10", "[8, 11)"});
  expect_error([&] { pe->encoding(2, -1); }, {"SinusoidalPositionalEncoding", "max_length"});
  expect_error([&] { pe->forward(torch::zeros({1, 11, 4})); }, {"SinusoidalPositionalEncoding", "max_length"});
  expect_error([&] { pe->forward(torch::zeros({1, 3, 4}), 8); }, {"SinusoidalPositionalEncoding", "max_length"});
  expect_error([&] { pe->forward(torch::zeros({1, 3, 5})); }, {"SinusoidalPositionalEncoding", "'x'", "feature size"});
  expect_error([&] { pe->forward(torch::zeros({3, 4})); }, {"SinusoidalPositionalEncoding", "'x'", "3 dimensions"});
  expect_error([] { SinusoidalPositionalEncoding(SinusoidalPositionalEncodingOptions(0)); },
               {"SinusoidalPositionalEncoding", "width"});
}

// --- Relative positions (Shaw) ------------------------------------------------------------------

/// Shaw et al. written out: per (n, head, i) the scores over visible j, the
/// softmax, and z_i = sum_j a_ij (v_j + wV[b_ij]); b_ij = clip(j - i, -K, K) + K.
torch::Tensor shaw_loop(RelativePositionAttention& m, const torch::Tensor& x,
                        const std::vector<int64_t>& lengths, bool causal) {
  torch::NoGradGuard no_grad;
  const int64_t N = x.size(0), L = x.size(1), d = m->options.width(), H = m->options.heads();
  const int64_t K = m->options.max_relative(), dz = d / H;
  auto proj = [&](Linear& lin) { return torch::matmul(x, lin->weight.t()) + lin->bias; };
  auto q = proj(m->q_proj), k = proj(m->k_proj), v = proj(m->v_proj);
  auto qa = q.accessor<double, 3>(), ka = k.accessor<double, 3>(), va = v.accessor<double, 3>();
  auto wK = m->wK.detach().contiguous(), wV = m->wV.detach().contiguous();
  auto wKa = wK.accessor<double, 2>(), wVa = wV.accessor<double, 2>();
  auto z = torch::zeros({N, L, d}, f64());
  auto za = z.accessor<double, 3>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = lengths.empty() ? L : lengths[n];
    for (int64_t hd = 0; hd < H; ++hd)
      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> e(L, -std::numeric_limits<double>::infinity());
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < L; ++j) {
          if (j >= len || (causal && j > i)) continue;
          const int64_t b = std::min(std::max(j - i, -K), K) + K;
          double dot = 0;
          for (int64_t c = 0; c < dz; ++c) dot += qa[n][i][hd * dz + c] * (ka[n][j][hd * dz + c] + wKa[b][c]);
          e[j] = dot / std::sqrt(double(dz));
          mx = std::max(mx, e[j]);
        }
        if (mx == -std::numeric_limits<double>::infinity()) continue;  // no visible key: z_i = 0
        double sum = 0;
        for (int64_t j = 0; j < L; ++j) sum += std::isinf(e[j]) ? 0.0 : std::exp(e[j] - mx);
        for (int64_t j = 0; j < L; ++j) {
          if (std::isinf(e[j])) continue;
          const double a = std::exp(e[j] - mx) / sum;
          const int64_t b = std::min(std::max(j - i, -K), K) + K;
          for (int64_t c = 0; c < dz; ++c) za[n][i][hd * dz + c] += a * (va[n][j][hd * dz + c] + wVa[b][c]);
        }
      }
  }
  return torch::matmul(z, m->out_proj->weight.t()) + m->out_proj->bias;
}

TEST(NnZooTest, RelativePositionMatchesShawLoop) {
  torch::manual_seed(11);
  const int64_t N = 2, L = 6, d = 6;
  for (int64_t heads : {1, 3})
    for (int64_t K : {0, 1, 2, 8}) {  // K = 8 >= L - 1: no clipping; K = 0: one shared bucket
      SCOPED_TRACE("heads " + std::to_string(heads) + " K " + std::to_string(K));
      RelativePositionAttention m(RelativePositionAttentionOptions(d, heads, K));
      m->to(torch::kDouble);
      EXPECT_EQ(m->wK.sizes(), (std::vector<int64_t>{2 * K + 1, d / heads}));
      EXPECT_EQ(m->wV.sizes(), (std::vector<int64_t>{2 * K + 1, d / heads}));
      auto x = torch::randn({N, L, d}, f64());
      EXPECT_LT(rel_err(m->forward(x), shaw_loop(m, x, {}, false)), kLoopTol);
      EXPECT_LT(rel_err(m->forward(x, {}, true), shaw_loop(m, x, {}, true)), kLoopTol);
      EXPECT_LT(rel_err(m->forward(x, i64({4, 6})), shaw_loop(m, x, {4, 6}, false)), kLoopTol);
      EXPECT_LT(rel_err(m->forward(x, i64({3, 5}), true), shaw_loop(m, x, {3, 5}, true)), kLoopTol);
    }
}

TEST(NnZooTest, RelativePositionTablesMatter) {
  // Large tables change the output (they are used), and a zero length gives the
  // out_proj bias only (z = 0), finite.
  torch::manual_seed(12);
  RelativePositionAttention m(RelativePositionAttentionOptions(4, 2, 1));
  m->to(torch::kDouble);
  auto x = torch::randn({2, 3, 4}, f64());
  auto base = m->forward(x);
  {
    torch::NoGradGuard g;
    m->wV.add_(1.0);
  }
  EXPECT_GT(max_abs(m->forward(x) - base), 1e-3);
  auto y = m->forward(x, i64({0, 3}));
  EXPECT_TRUE(all_finite(y));
  EXPECT_LT(max_abs(y[0] - m->out_proj->bias.detach().expand({3, 4})), kLoopTol);
  EXPECT_LT(rel_err(y, shaw_loop(m, x, {0, 3}, false)), kLoopTol);
}

// --- Gradients (float64 finite differences) ----------------------------------------------------

/// Both outputs of a scoring module as one vector, so the checker covers both.
torch::Tensor flat(const AttentionOutput& o) {
  return torch::cat({o.context.flatten(), o.weights.flatten()});
}

TEST(NnZooTest, AdditiveGradients) {
  torch::manual_seed(21);
  AdditiveAttention m(AdditiveAttentionOptions(2, 3, 2));
  m->to(torch::kDouble);
  auto len = i64({3, 2});
  expect_gradients_match(
      [&](const std::vector<torch::Tensor>& in) {
        m->W->weight = in[3];
        m->W->bias = in[4];
        m->U->weight = in[5];
        m->v = in[6];
        return flat(m->forward(in[0], in[1], in[2], len));
      },
      {torch::randn({2, 2, 2}, f64()), torch::randn({2, 3, 3}, f64()), torch::randn({2, 3, 2}, f64()),
       m->W->weight.detach(), m->W->bias.detach(), m->U->weight.detach(), m->v.detach()});
}

TEST(NnZooTest, GeneralGradients) {
  torch::manual_seed(22);
  GeneralAttention m(GeneralAttentionOptions(2, 3));
  m->to(torch::kDouble);
  auto len = i64({3, 1});
  expect_gradients_match(
      [&](const std::vector<torch::Tensor>& in) {
        m->W = in[3];
        return flat(m->forward(in[0], in[1], in[2], len));
      },
      {torch::randn({2, 2, 2}, f64()), torch::randn({2, 3, 3}, f64()), torch::randn({2, 3, 2}, f64()),
       m->W.detach()});
}

TEST(NnZooTest, DotGradients) {
  torch::manual_seed(23);
  for (bool scaled : {true, false}) {
    SCOPED_TRACE(scaled ? "scaled" : "unscaled");
    DotAttention m(DotAttentionOptions().scaled(scaled));
    auto len = i64({2, 3});
    expect_gradients_match(
        [&](const std::vector<torch::Tensor>& in) { return flat(m->forward(in[0], in[1], in[2], len)); },
        {torch::randn({2, 2, 3}, f64()), torch::randn({2, 3, 3}, f64()), torch::randn({2, 3, 2}, f64())});
  }
}

TEST(NnZooTest, LocationGradients) {
  torch::manual_seed(24);
  LocationAttention m(LocationAttentionOptions(2, 4));
  m->to(torch::kDouble);
  auto len = i64({3, 2});
  expect_gradients_match(
      [&](const std::vector<torch::Tensor>& in) {
        m->W->weight = in[2];
        m->W->bias = in[3];
        return flat(m->forward(in[0], in[1], len));
      },
      {torch::randn({2, 2, 2}, f64()), torch::randn({2, 3, 2}, f64()), m->W->weight.detach(),
       m->W->bias.detach()});
}

TEST(NnZooTest, SinusoidalGradient) {
  SinusoidalPositionalEncoding pe(SinusoidalPositionalEncodingOptions(3, 10));
  pe->to(torch::kDouble);
  expect_gradients_match([&](const std::vector<torch::Tensor>& in) { return pe->forward(in[0], 2); },
                         {torch::randn({2, 4, 3}, f64())});
}

TEST(NnZooTest, RelativePositionGradients) {
  torch::manual_seed(25);
  RelativePositionAttention m(RelativePositionAttentionOptions(4, 2, 1));
  m->to(torch::kDouble);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    auto len = i64({4, 3});
    std::vector<torch::Tensor> inputs{torch::randn({2, 4, 4}, f64())};
    std::vector<Linear*> lins{&m->q_proj, &m->k_proj, &m->v_proj, &m->out_proj};
    for (auto* lin : lins) {
      inputs.push_back((*lin)->weight.detach());
      inputs.push_back((*lin)->bias.detach());
    }
    inputs.push_back(m->wK.detach());
    inputs.push_back(m->wV.detach());
    expect_gradients_match(
        [&](const std::vector<torch::Tensor>& in) {
          for (size_t l = 0; l < lins.size(); ++l) {
            (*lins[l])->weight = in[1 + 2 * l];
            (*lins[l])->bias = in[2 + 2 * l];
          }
          m->wK = in[9];
          m->wV = in[10];
          return m->forward(in[0], len, causal);
        },
        inputs);
  }
}

// --- Bad input ---------------------------------------------------------------------------------

TEST(NnZooTest, ScoringModulesRejectBadInput) {
  AdditiveAttention add(AdditiveAttentionOptions(2, 3, 4));
  auto s = torch::zeros({2, 3, 2}), h = torch::zeros({2, 4, 3}), val = torch::zeros({2, 4, 5});
  expect_error([&] { add->forward(s[0], h, val); }, {"AdditiveAttention", "'query'", "3 dimensions"});
  expect_error([&] { add->forward(torch::zeros({2, 3, 3}), h, val); }, {"AdditiveAttention", "'query'", "feature size"});
  expect_error([&] { add->forward(s, torch::zeros({2, 4, 2}), val); }, {"AdditiveAttention", "'keys'", "feature size"});
  expect_error([&] { add->forward(s, torch::zeros({3, 4, 3}), val); }, {"AdditiveAttention", "'keys'", "batch size N"});
  expect_error([&] { add->forward(s, h, torch::zeros({2, 5, 5})); }, {"AdditiveAttention", "'values'", "key count S"});
  expect_error([&] { add->forward(s, h, torch::zeros({1, 4, 5})); }, {"AdditiveAttention", "'values'", "batch size N"});
  expect_error([&] { add->forward(s, h, val, i64({4, 5})); }, {"AdditiveAttention", "'key_lengths'", "5"});
  expect_error([&] { add->forward(s, h, val, i64({-1, 2})); }, {"AdditiveAttention", "'key_lengths'", "negative"});
  expect_error([&] { add->forward(s, h, val, i64({1})); }, {"AdditiveAttention", "'key_lengths'", "shape"});
  expect_error([&] { add->forward(s, h, val, torch::tensor({1, 2}, torch::kInt)); },
               {"AdditiveAttention", "'key_lengths'", "int64"});
  expect_error([&] { add->forward(s.to(torch::kLong), h, val); }, {"AdditiveAttention", "'query'", "floating"});
  expect_error([] { AdditiveAttention(AdditiveAttentionOptions(2, 0, 4)); }, {"AdditiveAttention", "key_dim"});

  GeneralAttention gen(GeneralAttentionOptions(2, 3));
  expect_error([&] { gen->forward(s, torch::zeros({2, 4, 4}), val); }, {"GeneralAttention", "'keys'", "feature size"});
  expect_error([&] { gen->forward(torch::zeros({2, 3, 1}), h, val); }, {"GeneralAttention", "'query'", "feature size"});
  expect_error([&] { gen->forward(s, h, torch::zeros({2, 4})); }, {"GeneralAttention", "'values'", "3 dimensions"});

  DotAttention dot;
  expect_error([&] { dot->forward(s, h, val); }, {"DotAttention", "'keys'", "feature size", "expected 2"});
  expect_error([&] { dot->forward(s, h[0], val); }, {"DotAttention", "'keys'", "3 dimensions"});
  expect_error([&] { dot->forward(s, torch::zeros({1, 4, 2}), val); }, {"DotAttention", "'keys'", "batch size N"});
  expect_error([&] { dot->forward(s, torch::zeros({2, 4, 2}), val, i64({9, 1})); },
               {"DotAttention", "'key_lengths'"});

  LocationAttention loc(LocationAttentionOptions(2, 4));
  expect_error([&] { loc->forward(s, torch::zeros({2, 5, 3})); },
               {"LocationAttention", "source length 5", "max_source_length 4"});
  expect_error([&] { loc->forward(torch::zeros({2, 3, 3}), val); }, {"LocationAttention", "'query'", "feature size"});
  expect_error([&] { loc->forward(s, torch::zeros({1, 4, 3})); }, {"LocationAttention", "'values'", "batch size N"});
  expect_error([&] { loc->forward(s, torch::zeros({2, 3, 3}), i64({4, 1})); },
               {"LocationAttention", "'key_lengths'"});
  expect_error([&] { loc->forward(s, torch::zeros({4, 3})); }, {"LocationAttention", "'values'", "3 dimensions"});
}

TEST(NnZooTest, DotRejectsWrongQueryRank) {
  // A rank-2 query must get the module's rank error naming 'query', like every
  // other module, not a bare torch index error.
  DotAttention dot;
  auto s = torch::zeros({3, 2}), h = torch::zeros({1, 4, 2}), val = torch::zeros({1, 4, 5});
  expect_error([&] { dot->forward(s, h, val); }, {"DotAttention", "'query'", "3 dimensions"});
}

TEST(NnZooTest, RelativePositionRejectsBadInput) {
  expect_error([] { RelativePositionAttention(RelativePositionAttentionOptions(6, 4, 2)); },
               {"RelativePositionAttention", "width (6)", "heads (4)"});
  expect_error([] { RelativePositionAttention(RelativePositionAttentionOptions(4, 2, -1)); },
               {"RelativePositionAttention", "max_relative"});
  RelativePositionAttention m(RelativePositionAttentionOptions(4, 2, 1));
  expect_error([&] { m->forward(torch::zeros({3, 4})); }, {"RelativePositionAttention", "'x'", "3 dimensions"});
  expect_error([&] { m->forward(torch::zeros({1, 3, 5})); }, {"RelativePositionAttention", "'x'", "feature size"});
  expect_error([&] { m->forward(torch::zeros({2, 3, 4}), i64({3, 4})); },
               {"RelativePositionAttention", "'key_lengths'"});
  expect_error([&] { m->forward(torch::zeros({2, 3, 4}), i64({3})); },
               {"RelativePositionAttention", "'key_lengths'"});
}

}  // namespace
}  // namespace attnkit::nn::nn_zoo_test
