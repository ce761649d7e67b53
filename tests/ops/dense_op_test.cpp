// attnkit::linear (the dense layer) and nn::Linear: float32 kernel against the
// float64 definition, values and every gradient, on awkward shapes and layouts.
//
// Tolerance: the classic bound of a float32 dot product of length K computed
// in any order, |fl(a . b) - a . b| <= gamma_K |a| . |b| with
// gamma_K = K u / (1 - K u), u = 2^-24, applied per element with K the length
// of the reduction (+1 for the bias add). The inputs are float32 values, so the
// float64 definition is exact to 1e-16 and the bound cannot fail spuriously,
// while any indexing or stride error shows as an O(1) violation.
#include <attnkit/nn/dense.h>
#include <attnkit/ops.h>
#include <torch/nn/modules/linear.h>

#include <cmath>

#include "test_util.h"

namespace attnkit::dense_op_test {
namespace {

using testing::expect_error;

/// Expects |got - want| <= gamma_K * bound element-wise (see the file comment).
void expect_within_dot_bound(const torch::Tensor& got, const torch::Tensor& want,
                             const torch::Tensor& abs_product, int64_t K, const char* what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double u = std::ldexp(1.0, -24);
  const double gamma = (K + 1) * u / (1 - (K + 1) * u);
  const auto err = (got.detach().to(torch::kDouble) - want.detach()).abs();
  const auto limit = gamma * abs_product.detach() + 1e-300;
  const auto ratio = (err / limit);
  EXPECT_TRUE((err <= limit).all().item<bool>())
      << what << ": worst error is " << (ratio.numel() ? ratio.max().item<double>() : 0.0)
      << " times the float32 dot-product bound (K = " << K << ")";
}

struct Case {
  std::vector<int64_t> x_shape;  // (..., in)
  int64_t out;
  bool bias;
};

/// Runs the float32 op and the float64 definition on the same values and
/// compares the output and the gradients of x, weight and bias.
void check_case(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "x " << c10::IntArrayRef(c.x_shape) << ", out " << c.out
                                    << (c.bias ? ", bias" : ", no bias"));
  const int64_t in = c.x_shape.back();
  auto x32 = torch::randn(c.x_shape).requires_grad_();
  auto w32 = torch::randn({c.out, in}).requires_grad_();
  auto b32 = c.bias ? torch::randn({c.out}).requires_grad_() : torch::Tensor();
  auto x64 = x32.detach().to(torch::kDouble).requires_grad_();
  auto w64 = w32.detach().to(torch::kDouble).requires_grad_();
  auto b64 = c.bias ? b32.detach().to(torch::kDouble).requires_grad_() : torch::Tensor();

  auto y32 = attnkit::linear(x32, w32, b32);
  auto y64 = torch::matmul(x64, w64.t());
  if (c.bias) y64 = y64 + b64;
  auto abs_y = torch::matmul(x64.abs(), w64.abs().t());
  if (c.bias) abs_y = abs_y + b64.abs();
  expect_within_dot_bound(y32, y64, abs_y, in + 1, "y");

  auto dy32 = torch::randn(y32.sizes());
  auto dy64 = dy32.to(torch::kDouble);
  y32.backward(dy32);
  y64.backward(dy64);
  int64_t rows = 1;  // explicit: reshape(-1, 0) is ambiguous for empty tensors
  for (size_t d = 0; d + 1 < c.x_shape.size(); ++d) rows *= c.x_shape[d];
  const auto dy2 = dy64.reshape({rows, c.out}), x2 = x64.detach().reshape({rows, in});
  expect_within_dot_bound(x32.grad(), x64.grad(),
                          torch::matmul(dy2.abs(), w64.detach().abs()).view(x64.sizes()), c.out, "dx");
  expect_within_dot_bound(w32.grad(), w64.grad(), torch::matmul(dy2.abs().t(), x2.abs()), rows, "dW");
  if (c.bias) expect_within_dot_bound(b32.grad(), b64.grad(), dy2.abs().sum(0), rows, "db");
}

TEST(DenseOp, MatchesFloat64OnEveryRankAndAwkwardSizes) {
  torch::manual_seed(1);
  const std::vector<Case> cases{
      {{5, 7}, 4, true},          {{5, 7}, 4, false},       {{2, 3, 7}, 5, true},
      {{2, 3, 2, 7}, 3, true},    {{1, 7}, 4, true},        {{9}, 4, true},
      {{6, 1}, 4, true},          {{6, 3}, 1, true},        {{0, 7}, 4, true},
      {{37, 129}, 65, true},      {{3, 0, 5}, 2, true},     {{4, 0}, 3, true},
      {{4, 5}, 0, true},
  };
  for (const auto& c : cases) check_case(c);
}

TEST(DenseOp, NonContiguousInputsBindWithoutChangingTheResult) {
  torch::manual_seed(2);
  auto base = torch::randn({11, 13});
  auto w = torch::randn({6, 11});
  auto b = torch::randn({6});
  // A transposed view (column stride 13) and a row-strided slice (row stride 26).
  for (const auto& x : {base.t(), torch::randn({10, 2, 11}).select(1, 1)}) {
    auto xv = x.detach().requires_grad_();
    auto xc = x.detach().contiguous().requires_grad_();
    auto yv = attnkit::linear(xv, w, b), yc = attnkit::linear(xc, w, b);
    EXPECT_TRUE(torch::equal(yv, yc));
    yv.sum().backward();  // a stride-0 gradient
    yc.backward(torch::ones_like(yc));
    EXPECT_TRUE(torch::equal(xv.grad(), xc.grad()));
  }
  // A transposed weight: (out, in) viewed from an (in, out) parameter.
  auto wt = torch::randn({11, 6}).requires_grad_();
  auto x = torch::randn({4, 11});
  auto y = attnkit::linear(x, wt.t(), b);
  EXPECT_TRUE(torch::allclose(y, torch::matmul(x, wt) + b, 1e-5, 1e-5));
  y.sum().backward();
  EXPECT_TRUE(torch::allclose(wt.grad(), torch::matmul(x.t(), torch::ones({4, 6})), 1e-5, 1e-5));
}

TEST(DenseOp, WeightStoredTransposedOrStridedMatchesFloat64) {
  // An (in, out) parameter used as weight = P.t() binds without a copy (the
  // kernel's transposed layout); a weight with neither unit stride is copied.
  torch::manual_seed(6);
  const int64_t rows = 9, in = 7, out = 5;
  for (const bool strided : {false, true}) {
    SCOPED_TRACE(strided ? "strided" : "transposed");
    auto base = strided ? torch::randn({in, 2 * out}) : torch::randn({in, out});
    auto p32 = base.requires_grad_();
    auto weight32 = strided ? p32.slice(1, 0, 2 * out, 2).t() : p32.t();  // (out, in)
    auto p64 = p32.detach().to(torch::kDouble).requires_grad_();
    auto weight64 = strided ? p64.slice(1, 0, 2 * out, 2).t() : p64.t();
    auto x32 = torch::randn({rows, in}).requires_grad_();
    auto x64 = x32.detach().to(torch::kDouble).requires_grad_();
    auto b = torch::randn({out});
    auto y32 = attnkit::linear(x32, weight32, b);
    auto y64 = torch::matmul(x64, weight64.t()) + b.to(torch::kDouble);
    expect_within_dot_bound(y32, y64,
                            torch::matmul(x64.abs(), weight64.abs().t()) + b.to(torch::kDouble).abs(),
                            in + 1, "y");
    auto dy = torch::randn({rows, out});
    y32.backward(dy);
    y64.backward(dy.to(torch::kDouble));
    const auto dy64 = dy.to(torch::kDouble);
    expect_within_dot_bound(x32.grad(), x64.grad(), torch::matmul(dy64.abs(), weight64.detach().abs()),
                            out, "dx");
    // dP: the weight gradient mapped back to the parameter by autograd.
    auto bound = torch::zeros_like(p64);
    auto dw_bound = torch::matmul(dy64.abs().t(), x64.detach().abs());  // (out, in)
    (strided ? bound.slice(1, 0, 2 * out, 2) : bound).copy_(dw_bound.t());
    expect_within_dot_bound(p32.grad(), p64.grad(), bound, rows, "dP");
  }
}

TEST(DenseOp, OutputCanBeModifiedInPlace) {
  // As with torch::nn::functional::linear: y.relu_() and friends must work
  // (an output that were a view made inside the autograd Function could not).
  auto x = torch::randn({2, 3, 5}).requires_grad_();
  auto w = torch::randn({4, 5}).requires_grad_();
  auto y = attnkit::linear(x, w);
  y.relu_();
  y.sum().backward();
  auto x64 = x.detach().to(torch::kDouble).requires_grad_();
  auto w64 = w.detach().to(torch::kDouble).requires_grad_();
  torch::matmul(x64, w64.t()).relu().sum().backward();
  EXPECT_LT(testing::rel_err(x.grad(), x64.grad()), 1e-5);
  EXPECT_LT(testing::rel_err(w.grad(), w64.grad()), 1e-5);
}

TEST(DenseOp, WeightSharedByTwoCallsAccumulatesBothGradients) {
  torch::manual_seed(3);
  auto w = torch::randn({4, 5}).requires_grad_();
  auto x1 = torch::randn({3, 5}), x2 = torch::randn({2, 5});
  (attnkit::linear(x1, w).sum() + 2 * attnkit::linear(x2, w).sum()).backward();
  auto expected = torch::ones({4, 3}).mm(x1) + 2 * torch::ones({4, 2}).mm(x2);
  EXPECT_TRUE(torch::allclose(w.grad(), expected, 1e-5, 1e-5));
}

TEST(DenseOp, OnlyRequestedGradientsAreComputed) {
  auto x = torch::randn({3, 5});
  auto w = torch::randn({4, 5}).requires_grad_();
  auto b = torch::randn({4});
  attnkit::linear(x, w, b).sum().backward();
  EXPECT_TRUE(w.grad().defined());
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(b.grad().defined());
}

TEST(DenseOp, DispatchNamesTheBackendAndWhy) {
  auto x = torch::randn({3, 5});
  auto w = torch::randn({4, 5});
  EXPECT_EQ(attnkit::linear_dispatch(x, w).backend, Backend::kernel);
  EXPECT_TRUE(attnkit::linear_dispatch(x, w).reason.empty());
  const auto d = attnkit::linear_dispatch(x.to(torch::kDouble), w.to(torch::kDouble));
  EXPECT_EQ(d.backend, Backend::composite);
  EXPECT_EQ(d.reason, "x is float64; the kernel is float32 and bfloat16 only");
  // The composite is the float64 definition: gradients by finite differences.
  testing::expect_gradients_match(
      [](const std::vector<torch::Tensor>& t) { return attnkit::linear(t[0], t[1], t[2]); },
      {torch::randn({2, 3, 4}, testing::f64()), torch::randn({2, 4}, testing::f64()),
       torch::randn({2}, testing::f64())});
}

TEST(DenseOp, DoubleBackwardThroughTheKernelIsRefused) {
  auto x = torch::randn({3, 5}).requires_grad_();
  auto w = torch::randn({4, 5}).requires_grad_();
  // Both a cotangent that needs a gradient (pow) and a constant one (sum):
  // the error must reach x and w either way, never a silently missing term.
  for (const bool constant_cotangent : {false, true}) {
    SCOPED_TRACE(constant_cotangent ? "sum" : "pow(2).sum");
    auto y = constant_cotangent ? attnkit::linear(x, w).sum() : attnkit::linear(x, w).pow(2).sum();
    // First-order gradients under create_graph are fine; their own gradient is refused.
    auto g = torch::autograd::grad({y}, {x, w}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    auto plain = torch::autograd::grad({y}, {x, w}, {}, /*retain_graph=*/true);
    EXPECT_TRUE(torch::equal(g[0], plain[0]) && torch::equal(g[1], plain[1]));
    for (const auto& gi : g)
      for (const auto& wrt : {x, w})
        expect_error([&] { torch::autograd::grad({(gi * gi).sum()}, {wrt}, {}, true, false, true); },
                     {"linear", "double backward", "float64"});
  }
}

TEST(DenseOp, BadInputGetsOneClearError) {
  auto x = torch::randn({3, 5});
  auto w = torch::randn({4, 5});
  expect_error([&] { attnkit::linear(torch::randn({3, 6}), w); }, {"linear", "weight", "in = 5", "(3, 6)"});
  expect_error([&] { attnkit::linear(x, w.to(torch::kDouble)); }, {"linear", "weight", "dtype"});
  expect_error([&] { attnkit::linear(x, w, torch::randn({5})); }, {"linear", "bias", "(4)"});
  expect_error([&] { attnkit::linear(x, w, torch::randn({4}, testing::f64())); }, {"linear", "bias", "dtype"});
  expect_error([&] { attnkit::linear(torch::tensor(1.f), w); }, {"linear", "'x'", "at least 1 dimension"});
  expect_error([&] { attnkit::linear(x, torch::randn({5})); }, {"linear", "weight", "2 dimensions"});
  expect_error([&] { attnkit::linear(x.to(torch::kLong), w); }, {"linear", "'x'", "floating"});
}

TEST(DenseModule, StateDictInterchangesWithTorchLinear) {
  torch::manual_seed(4);
  torch::nn::Linear theirs(torch::nn::LinearOptions(6, 3));
  nn::Linear ours(torch::nn::LinearOptions(6, 3));
  // Same names and shapes, in the same order.
  auto a = theirs->named_parameters(), b = ours->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].key(), b[i].key());
    EXPECT_EQ(a[i].value().sizes(), b[i].value().sizes());
  }
  // Their weights loaded into ours give their outputs.
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a.size(); ++i) b[i].value().copy_(a[i].value());
  }
  auto x = torch::randn({2, 5, 6});
  EXPECT_TRUE(torch::allclose(ours(x), theirs(x), 1e-5, 1e-6));

  nn::Linear no_bias(torch::nn::LinearOptions(6, 3).bias(false));
  EXPECT_EQ(no_bias->parameters().size(), 1u);
  EXPECT_FALSE(no_bias->bias.defined());
  EXPECT_EQ(no_bias(x).sizes(), (std::vector<int64_t>{2, 5, 3}));
}

TEST(DenseModule, InitialisationFollowsTorchLinearBounds) {
  torch::manual_seed(5);
  nn::Linear m(torch::nn::LinearOptions(400, 300));
  // kaiming_uniform(a = sqrt(5)) on fan_in 400 and the bias both give U(-1/20, 1/20).
  const double bound = 1.0 / std::sqrt(400.0);
  EXPECT_LE(m->weight.abs().max().item<double>(), bound);
  EXPECT_GT(m->weight.abs().max().item<double>(), 0.95 * bound);
  EXPECT_NEAR(m->weight.std().item<double>(), bound / std::sqrt(3.0), 0.01 * bound);
  EXPECT_LE(m->bias.abs().max().item<double>(), bound);
}

}  // namespace
}  // namespace attnkit::dense_op_test
