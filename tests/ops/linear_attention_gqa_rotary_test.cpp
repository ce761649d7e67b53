// Grouped-query heads and rotary positions in attnkit::linear_attention.
//
// Grouped heads: k and v with Hkv heads, a divisor of q's H; the kernel
// builds each key/value head's state once for its group and sums dk, dv over
// the group in head order. Rotary positions (rotary_dim): RoFormer's linear
// form, phi(q) and phi(k) rotated in the numerator only, the normaliser
// unrotated. Checked:
// - the float32 kernel against the float64 reference, values and the
//   gradients of q, k and v, on awkward shapes (L = 1, L < S and L > S
//   causal, lengths that are no multiple of the chunk of 32, E != M, strided
//   (N, L, H, E) views, Hkv = H, H / 2 and 1), both feature maps, with and
//   without the normaliser, causal and not;
// - the reference itself on a case computed by hand;
// - grouped heads against the same op on k and v repeated to H heads: out
//   and dq bitwise, dk and dv to rounding (R summed over the group times v,
//   instead of per head and then added); every result bitwise the same on 1
//   and 2 threads;
// - the refusals.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::linear_attention_gqa_rotary_test {
namespace {

using testing::f64;
using testing::relative_error;

// float32 kernel against float64: max |op - reference| / max(max |reference|, 1).
// The kernel sums at most S + E + chunk (<= 200 here) rounded products per
// entry, each at most about the largest entry of the result (inputs and
// cotangent N(0, 1), or |N(0, 1)|, E <= 8): worst case about 200 u = 1.2e-5
// (u = 2^-24), as tests/kernels/linear_attention_cases.h argues; 2e-5 allows it.
constexpr double kTolerance = 2e-5;
// Grouped heads against repeated ones: out and dq are the same products on
// the same values (a state built once or per head), bitwise; dk and dv take
// the group sum before the product with v (or phi(k)) instead of after: the
// same sums of at most n = G L + M <= 150 terms (here) in two orders, each
// within n u = 9e-6 of the sum of |terms|, which N(0, 1) data keeps near the
// largest entry: 1e-5 of it (at most 8.6e-7 measured over these shapes).
constexpr double kGroupedVsRepeated = 1e-5;

struct Case {
  std::string name;
  int64_t N = 2, H = 4, Hkv = 4, L = 5, S = 7, E = 4, M = 3;
  bool causal = false;
  int64_t rotary_dim = 0;
  bool strided = false;  // q, k, v as (N, L, H, E) views
};

/// The four forms: feature map x normaliser.
struct Form {
  FeatureMap map;
  bool normalize;
  std::string str() const { return to_string(map) + (normalize ? " normalised" : ""); }
};
const Form kForms[] = {{FeatureMap::identity, false}, {FeatureMap::identity, true}, {FeatureMap::elu, false},
                       {FeatureMap::elu, true}};

struct Inputs {
  torch::Tensor q, k, v;
};

/// float64 inputs of case c from `seed`: N(0, 1), and |N(0, 1)| for q and k
/// of the normalised identity map, whose normaliser must stay positive.
Inputs make_inputs(const Case& c, const Form& f, uint64_t seed) {
  torch::manual_seed(seed);
  auto tensor = [&](int64_t heads, int64_t rows, int64_t cols) {
    if (!c.strided) return torch::randn({c.N, heads, rows, cols}, f64());
    return torch::randn({c.N, rows, heads, cols}, f64()).transpose(1, 2);
  };
  Inputs x{tensor(c.H, c.L, c.E), tensor(c.Hkv, c.S, c.E), tensor(c.Hkv, c.S, c.M)};
  if (f.map == FeatureMap::identity && f.normalize) {
    x.q = x.q.abs();
    x.k = x.k.abs();
  }
  return x;
}

LinearAttentionFuncOptions options_of(const Case& c, const Form& f) {
  return LinearAttentionFuncOptions().feature_map(f.map).normalize(f.normalize).causal(c.causal).rotary_dim(
      c.rotary_dim);
}

/// out, dq, dk, dv in `dtype` under the cotangent `cot`, by the op or the reference.
std::vector<torch::Tensor> run(const Inputs& x, const LinearAttentionFuncOptions& o, torch::ScalarType dtype,
                               const torch::Tensor& cot, bool reference) {
  // clone keeps a strided view's strides (the kernel reads them in place).
  auto leaf = [&](const torch::Tensor& t) { return t.to(dtype).clone().requires_grad_(); };
  std::vector<torch::Tensor> in{leaf(x.q), leaf(x.k), leaf(x.v)};
  const auto out = reference ? reference::linear_attention(in[0], in[1], in[2], o)
                             : linear_attention(in[0], in[1], in[2], o);
  (out * cot.to(dtype)).sum().backward();
  return {out.detach(), in[0].grad(), in[1].grad(), in[2].grad()};
}

const char* kNames[] = {"out", "dq", "dk", "dv"};

std::vector<Case> cases() {
  std::vector<Case> c;
  // Grouped heads: Hkv = H / 2, H / 3, 1 (multi-query) and H.
  c.push_back({"grouped, L != S", 2, 6, 3, 5, 7, 4, 3});
  c.push_back({"grouped causal, L < S, not multiples of the chunk", 2, 4, 2, 37, 70, 5, 6, true});
  c.push_back({"grouped causal, L > S: rows that see no key", 2, 4, 2, 70, 37, 6, 5, true});
  c.push_back({"multi-query causal", 1, 4, 1, 45, 45, 4, 7, true});
  c.push_back({"multi-query, L = 1", 2, 4, 1, 1, 9, 4, 4});
  c.push_back({"grouped causal, L = 1", 2, 6, 2, 1, 9, 4, 4, true});
  c.push_back({"grouped, strided views", 2, 6, 2, 33, 40, 4, 3, true, 0, true});
  // Rotary positions, with and without grouped heads.
  c.push_back({"rotary, every entry", 2, 2, 2, 5, 7, 4, 3, false, 4});
  c.push_back({"rotary causal, L < S, half the entries", 2, 2, 2, 37, 70, 8, 5, true, 4});
  c.push_back({"rotary causal, L > S", 2, 2, 2, 70, 37, 6, 6, true, 2});
  c.push_back({"rotary causal, L = S", 1, 3, 3, 67, 67, 6, 4, true, 6});
  c.push_back({"rotary causal, L = 1", 2, 2, 2, 1, 9, 4, 5, true, 4});
  c.push_back({"rotary, L = 1", 2, 2, 2, 1, 9, 4, 5, false, 2});
  c.push_back({"rotary grouped causal, strided", 2, 4, 2, 40, 33, 6, 5, true, 4, true});
  c.push_back({"rotary multi-query", 1, 4, 1, 35, 35, 4, 3, false, 4});
  return c;
}

TEST(LinearAttentionGqaRotary, MatchesTheFloat64Reference) {
  uint64_t seed = 100;
  for (const auto& c : cases())
    for (const auto& f : kForms) {
      SCOPED_TRACE(c.name + ", " + f.str());
      const auto x = make_inputs(c, f, ++seed);
      const auto o = options_of(c, f);
      const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
      const auto want = run(x, o, torch::kDouble, cot, true);
      const auto got = run(x, o, torch::kFloat, cot, false);
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(got[i].scalar_type(), torch::kFloat) << kNames[i];
        EXPECT_EQ(got[i].sizes(), want[i].sizes()) << kNames[i];
        EXPECT_TRUE(testing::all_finite(got[i])) << kNames[i];
        EXPECT_LE(relative_error(got[i], want[i]), kTolerance) << kNames[i];
      }
      // The float64 op takes the composite: the reference itself.
      const auto composite = run(x, o, torch::kDouble, cot, false);
      for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(composite[i], want[i])) << kNames[i];
    }
}

TEST(LinearAttentionGqaRotary, RowsThatSeeNoKeyAreZeroWithRotaryPositions) {
  // Causal, L > S: queries i < L - S see nothing; with eps = 0 too.
  const Case c{"", 1, 2, 1, 9, 4, 4, 3, true, 4};
  const auto x = make_inputs(c, {FeatureMap::elu, true}, 7);
  const auto o = options_of(c, {FeatureMap::elu, true}).eps(0);
  const auto got = run(x, o, torch::kFloat, torch::randn({1, 2, 9, 3}, f64()), false);
  for (const auto& t : got) EXPECT_TRUE(testing::all_finite(t));
  EXPECT_EQ(testing::max_abs(got[0].narrow(2, 0, 5)), 0.0);
  EXPECT_EQ(testing::max_abs(got[1].narrow(2, 0, 5)), 0.0);
}

TEST(LinearAttentionGqaRotary, ReferenceMatchesACaseComputedByHand) {
  // One head, E = M = 2, the identity map, rotary_dim 2, base b: entries
  // (x0, x1) turn by the angle t (theta_0 = b^0 = 1). Queries at positions
  // S - L + i = 1 (L = 1, S = 2); keys at 0 and 1.
  const double q0 = 0.5, q1 = -1.0;
  const double k[2][2] = {{1.0, 2.0}, {-0.5, 0.25}};
  const double v[2][2] = {{3.0, -1.0}, {0.5, 2.0}};
  auto turn = [](double a, double b, double t) {
    return std::vector<double>{a * std::cos(t) - b * std::sin(t), b * std::cos(t) + a * std::sin(t)};
  };
  const auto rq = turn(q0, q1, 1.0);
  double num[2] = {0, 0}, den = 1e-6;
  for (int j = 0; j < 2; ++j) {
    const auto rk = turn(k[j][0], k[j][1], j);
    const double score = rq[0] * rk[0] + rq[1] * rk[1];
    for (int m = 0; m < 2; ++m) num[m] += score * v[j][m];
    den += q0 * k[j][0] + q1 * k[j][1];  // the normaliser: unrotated
  }
  const auto q = torch::tensor({q0, q1}, f64()).view({1, 1, 1, 2});
  const auto kt = torch::tensor({k[0][0], k[0][1], k[1][0], k[1][1]}, f64()).view({1, 1, 2, 2});
  const auto vt = torch::tensor({v[0][0], v[0][1], v[1][0], v[1][1]}, f64()).view({1, 1, 2, 2});
  for (bool causal : {false, true}) {
    const auto o = LinearAttentionFuncOptions().causal(causal).rotary_dim(2).rotary_base(7.0);
    const auto plain = reference::linear_attention(q, kt, vt, o);
    EXPECT_NEAR(plain[0][0][0][0].item<double>(), num[0], 1e-12);
    EXPECT_NEAR(plain[0][0][0][1].item<double>(), num[1], 1e-12);
    const auto normalised = reference::linear_attention(q, kt, vt, LinearAttentionFuncOptions(o).normalize(true));
    EXPECT_NEAR(normalised[0][0][0][0].item<double>(), num[0] / den, 1e-12);
    EXPECT_NEAR(normalised[0][0][0][1].item<double>(), num[1] / den, 1e-12);
  }
}

TEST(LinearAttentionGqaRotary, NumeratorScoresDependOnTheDistanceAlone) {
  // Without normaliser, with one key, the output is (R_p phi(q))^T (R_j phi(k)) v:
  // moving query and key by the same number of positions leaves it unchanged.
  torch::manual_seed(8);
  const auto q = torch::randn({1, 1, 1, 6}), k = torch::randn({1, 1, 1, 6}), v = torch::randn({1, 1, 1, 3});
  const auto o = LinearAttentionFuncOptions().feature_map(FeatureMap::elu).rotary_dim(6).rotary_base(100.0);
  // Query at position S - 1 over S keys, the key of interest at S - 3, the others zero values.
  auto at = [&](int64_t S) {
    auto keys = torch::randn({1, 1, S, 6}), values = torch::zeros({1, 1, S, 3});
    keys.select(2, S - 3).copy_(k.select(2, 0));
    values.select(2, S - 3).copy_(v.select(2, 0));
    return linear_attention(q, keys, values, o);
  };
  const auto near = at(4), far = at(40);
  EXPECT_LE(testing::rel_err(far, near), 1e-5);
  EXPECT_GT(testing::rel_err(linear_attention(q, k, v, o), near), 1e-3);  // distance 0 differs
}

/// The grouped run's results and the repeated run's in the grouped shapes
/// (dk, dv: each group's per-head gradients summed in head order).
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> grouped_and_repeated(const Case& c,
                                                                                      const Form& f) {
  const auto x = make_inputs(c, f, 31);
  const auto o = options_of(c, f);
  const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
  const int64_t group = c.H / c.Hkv;
  auto grouped = run(x, o, torch::kFloat, cot, false);
  auto full = run({x.q, x.k.repeat_interleave(group, 1), x.v.repeat_interleave(group, 1)}, o, torch::kFloat,
                  cot, false);
  for (int i : {2, 3}) full[i] = full[i].view({c.N, c.Hkv, group, c.S, full[i].size(3)}).sum(2);
  return {grouped, full};
}

TEST(LinearAttentionGqaRotary, GroupedHeadsEqualRepeatingKeysAndValues) {
  int grouped_cases = 0;
  for (const auto& c : cases()) {
    if (c.Hkv == c.H) continue;
    ++grouped_cases;
    for (const auto& f : kForms) {
      SCOPED_TRACE(c.name + ", " + f.str());
      const auto [grouped, repeated] = grouped_and_repeated(c, f);
      EXPECT_TRUE(torch::equal(grouped[0], repeated[0])) << "out";
      EXPECT_TRUE(torch::equal(grouped[1], repeated[1])) << "dq";
      for (size_t i : {2, 3}) EXPECT_LE(relative_error(grouped[i], repeated[i]), kGroupedVsRepeated) << kNames[i];
    }
  }
  EXPECT_EQ(grouped_cases, 9);
}

TEST(LinearAttentionGqaRotary, BitwiseTheSameOnOneAndTwoThreads) {
  for (const auto& c : cases())
    for (const auto& f : kForms) {
      SCOPED_TRACE(c.name + ", " + f.str());
      const auto x = make_inputs(c, f, 51);
      const auto o = options_of(c, f);
      const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
      std::vector<torch::Tensor> one, two;
      {
        testing::ThreadsGuard threads(1);
        one = run(x, o, torch::kFloat, cot, false);
      }
      {
        testing::ThreadsGuard threads(2);
        two = run(x, o, torch::kFloat, cot, false);
      }
      for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << kNames[i];
    }
}

TEST(LinearAttentionGqaRotary, RotaryDimZeroIsNoRotation) {
  torch::manual_seed(9);
  const auto q = torch::randn({1, 2, 20, 4}), k = torch::randn({1, 2, 20, 4}), v = torch::randn({1, 2, 20, 3});
  const auto o = LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true).causal(true);
  EXPECT_TRUE(torch::equal(linear_attention(q, k, v, o), linear_attention(q, k, v, LinearAttentionFuncOptions(o).rotary_dim(0).rotary_base(3.0))));
}

TEST(LinearAttentionGqaRotary, DispatchAndRefusals) {
  using testing::expect_error;
  const auto q = torch::randn({1, 4, 3, 8}), k = torch::randn({1, 2, 5, 8}), v = torch::randn({1, 2, 5, 6});
  EXPECT_TRUE(linear_attention_dispatch(q, k, v).uses_kernel());
  // bfloat16 takes the float32 kernel, grouped heads and rotary positions too.
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  EXPECT_EQ(linear_attention(bf(q), bf(k), bf(v), LinearAttentionFuncOptions().rotary_dim(4)).scalar_type(),
            torch::kBFloat16);
  expect_error([&] { linear_attention(q, torch::randn({1, 3, 5, 8}), torch::randn({1, 3, 5, 6})); },
               {"linear_attention", "argument 'k' has head count 3, which must divide q's head count 4"});
  expect_error([&] { linear_attention(q, k, torch::randn({1, 4, 5, 6})); },
               {"linear_attention", "argument 'v'", "head count (k's) 4", "expected 2"});
  expect_error([&] { linear_attention(q, k, v, LinearAttentionFuncOptions().rotary_dim(5)); },
               {"linear_attention", "option 'rotary_dim'", "even number in [2, E] = [2, 8], got 5"});
  expect_error([&] { linear_attention(q, k, v, LinearAttentionFuncOptions().rotary_dim(10)); },
               {"linear_attention", "option 'rotary_dim'", "got 10"});
  expect_error([&] { linear_attention(q, k, v, LinearAttentionFuncOptions().rotary_dim(-2)); },
               {"linear_attention", "option 'rotary_dim'", "got -2"});
  expect_error([&] { linear_attention(q, k, v, LinearAttentionFuncOptions().rotary_dim(4).rotary_base(0)); },
               {"linear_attention", "option 'rotary_base' must be finite and > 0, got 0"});
}

}  // namespace
}  // namespace attnkit::linear_attention_gqa_rotary_test
