// attnkit::softmax_attention, the op, in float32 (the kernel path) against the
// float64 composite reference: values and every gradient (q, k, v and the
// bias in each broadcast shape), on awkward shapes, masks, strided inputs and
// the stride-0 output gradient that sum().backward() gives. Also the op's
// contract around the kernel: dispatch, NaN scores, double backward and
// in-place changes between forward and backward.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "reference/masking.h"
#include "reference/reference.h"
#include "test_util.h"

namespace softmax_attention_op_test {

namespace {

using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::f32;
using attnkit::testing::f64;

// Tolerance of every float32 result against the float64 reference, per element:
// |op - reference| <= kTolerance * mag, where mag is the element's error scale
// built as in softmax_attention_kernel_test.cpp (the sum of the absolute values
// of the terms that make it up, P weighted by 1 + sigma_i with sigma_i the
// largest |score term| of row i). kTolerance = 64 u, u = 2^-24 (3.8e-6): float32
// sums of n <= 1000 terms err by about sqrt(n) u. Where mag is 0 the result
// must be exactly 0.
constexpr double kTolerance = 64.0 / (1 << 24);
constexpr double kInf = std::numeric_limits<double>::infinity();

/// test_util's expect_error, also for the std::runtime_error that autograd's
/// engine rethrows from an Error node (as a c10::Error with the same message).
void expect_error(const std::function<void()>& body, const std::vector<std::string>& fragments) {
  attnkit::testing::expect_error(
      [&] {
        try {
          body();
        } catch (const c10::Error&) {
          throw;
        } catch (const std::exception& e) {
          TORCH_CHECK(false, e.what());
        }
      },
      fragments);
}

struct OpCase {
  int64_t N = 2, H = 3, L = 5, S = 7, E = 4, M = 6;
  bool causal = false;
  std::vector<int64_t> key_lengths;  // empty: none
  std::vector<int64_t> bias_shape;   // empty: no bias
  double bias_inf_fraction = 0.0;    // share of bias entries set to -inf
  bool strided = false;              // q, k, v as (N, L, H, E) views, v transposed in memory
  bool sum_backward = false;         // out.sum().backward(): a stride-0 output gradient

  std::string str() const {
    std::ostringstream s;
    s << "N=" << N << " H=" << H << " L=" << L << " S=" << S << " E=" << E << " M=" << M
      << " causal=" << causal << " key_lengths=" << key_lengths.size() << " bias=[";
    for (auto d : bias_shape) s << d << ",";
    s << "] inf=" << bias_inf_fraction << " strided=" << strided << " sum=" << sum_backward;
    return s.str();
  }
};

/// A float32 tensor of logical shape (N, H, R, X) holding `values`, stored as
/// (N, R, H, X) (the usual projection layout) or, transposed, (N, H, X, R).
torch::Tensor layout_as(const torch::Tensor& values, bool strided, bool transposed) {
  auto f = values.to(torch::kFloat);
  if (!strided) return f.contiguous();
  if (transposed) return f.transpose(2, 3).contiguous().transpose(2, 3);
  return f.permute({0, 2, 1, 3}).contiguous().permute({0, 2, 1, 3});
}

/// max over elements of |got - want| / mag; infinite when they differ where
/// mag is 0 or when exactly one of them is NaN.
double scaled_error(const torch::Tensor& got, const torch::Tensor& want, const torch::Tensor& mag) {
  EXPECT_EQ(got.sizes(), want.sizes());
  if (want.numel() == 0) return 0.0;
  auto g = got.detach().to(torch::kDouble), w = want.detach();
  auto diff = (g - w).abs();
  auto ratio = torch::where(diff == 0, torch::zeros_like(diff), diff / mag);
  ratio = torch::where(torch::isnan(g) != torch::isnan(w), torch::full_like(ratio, kInf), ratio);
  return ratio.nan_to_num(0.0, kInf, kInf).max().item<double>();
}

struct Grads {
  torch::Tensor out, dq, dk, dv, dbias;
};

/// Runs the op on `inputs` (q, k, v, bias; bias may be undefined) with
/// gradients, backward with `dout` (or out.sum() when dout is undefined).
Grads run(const std::vector<torch::Tensor>& inputs, const OpCase& c, const torch::Tensor& dout) {
  auto q = inputs[0].detach().requires_grad_(true), k = inputs[1].detach().requires_grad_(true),
       v = inputs[2].detach().requires_grad_(true);
  torch::Tensor bias;
  SoftmaxAttentionFuncOptions o;
  o.causal(c.causal);
  if (inputs[3].defined()) {
    bias = inputs[3].detach().requires_grad_(true);
    o.bias(bias);
  }
  if (!c.key_lengths.empty()) o.key_lengths(torch::tensor(c.key_lengths, torch::kLong));
  auto out = attnkit::softmax_attention(q, k, v, o);
  if (dout.defined())
    out.backward(dout.to(out.scalar_type()));
  else
    out.sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad(), bias.defined() ? bias.grad() : torch::Tensor()};
}

void check_case(const OpCase& c) {
  SCOPED_TRACE(c.str());
  torch::manual_seed(1234);
  const int64_t N = c.N, H = c.H, L = c.L, S = c.S;
  auto q64 = torch::randn({N, H, L, c.E}, f64()), k64 = torch::randn({N, H, S, c.E}, f64());
  auto v64 = torch::randn({N, H, S, c.M}, f64());
  torch::Tensor bias64;
  if (!c.bias_shape.empty()) {
    bias64 = torch::randn(c.bias_shape, f64());
    if (c.bias_inf_fraction > 0)
      bias64.masked_fill_(torch::rand(c.bias_shape, f64()) < c.bias_inf_fraction, -kInf);
  }
  torch::Tensor dout64;
  if (!c.sum_backward) dout64 = torch::randn({N, H, L, c.M}, f64());

  // Quantise to float32 first, so both sides see the same inputs.
  q64 = q64.to(torch::kFloat).to(torch::kDouble);
  k64 = k64.to(torch::kFloat).to(torch::kDouble);
  v64 = v64.to(torch::kFloat).to(torch::kDouble);
  if (bias64.defined()) bias64 = bias64.to(torch::kFloat).to(torch::kDouble);
  if (dout64.defined()) dout64 = dout64.to(torch::kFloat).to(torch::kDouble);

  const Grads got = run({layout_as(q64, c.strided, false), layout_as(k64, c.strided, false),
                         layout_as(v64, c.strided, true),
                         bias64.defined() ? bias64.to(torch::kFloat) : torch::Tensor()},
                        c, dout64);
  ASSERT_EQ(got.out.scalar_type(), torch::kFloat);
  const Grads want = run({q64, k64, v64, bias64}, c, dout64);

  // Error scales (see kTolerance), in float64 from the reference's weights.
  torch::NoGradGuard no_grad;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.E));
  SoftmaxAttentionFuncOptions o;
  o.causal(c.causal);
  if (bias64.defined()) o.bias(bias64);
  if (!c.key_lengths.empty()) o.key_lengths(torch::tensor(c.key_lengths, torch::kLong));
  torch::Tensor P;
  attnkit::reference::softmax_attention(q64, k64, v64, o, &P);
  P = P.nan_to_num(0.0);
  auto visible = attnkit::detail::visibility(N, L, S, c.causal, o.key_lengths()).expand({N, H, L, S});
  auto term = scale * q64.abs().matmul(k64.abs().transpose(-2, -1));
  if (bias64.defined()) {
    visible = visible & (bias64 > -kInf);
    term = term + bias64.abs().nan_to_num(0.0, 0.0, 0.0);
  }
  const auto sigma = S == 0 ? torch::zeros({N, H, L, 1}, f64())
                            : torch::where(visible, term, torch::zeros_like(term)).amax(-1, true);
  const auto weight = (1.0 + sigma) * P;
  const auto g = dout64.defined() ? dout64.abs() : torch::ones({N, H, L, c.M}, f64());
  const auto dp_mag = g.matmul(v64.abs().transpose(-2, -1));
  const auto d_mag = (P * dp_mag).sum(-1, true);
  const auto ds_mag = weight * (dp_mag + d_mag);
  struct Check {
    const char* name;
    torch::Tensor got, want, mag;
  };
  std::vector<Check> checks = {
      {"out", got.out, want.out, weight.matmul(v64.abs())},
      {"dq", got.dq, want.dq, scale * ds_mag.matmul(k64.abs())},
      {"dk", got.dk, want.dk, scale * ds_mag.transpose(-2, -1).matmul(q64.abs())},
      {"dv", got.dv, want.dv, weight.transpose(-2, -1).matmul(g)},
  };
  if (bias64.defined())
    checks.push_back({"dbias", got.dbias, want.dbias, ds_mag.sum_to_size(bias64.sizes())});
  for (const auto& ch : checks) {
    ASSERT_TRUE(ch.got.defined()) << ch.name << " missing";
    EXPECT_EQ(ch.got.sizes(), ch.want.sizes()) << ch.name;
    EXPECT_TRUE(torch::isfinite(ch.got).all().item<bool>()) << ch.name << " not finite";
    EXPECT_LE(scaled_error(ch.got, ch.want, ch.mag), kTolerance) << ch.name;
  }
}

// ---------------------------------------------------------------------------
// Values and gradients against the float64 reference
// ---------------------------------------------------------------------------

TEST(SoftmaxAttentionOp, BiasShapesAgreeWithReference) {
  for (auto shape : std::vector<std::vector<int64_t>>{{5, 7}, {1, 3, 1, 7}, {2, 1, 5, 7},
                                                       {2, 3, 5, 7}, {7}, {3, 5, 1}, {1}})
    for (bool causal : {false, true}) {
      OpCase c;
      c.bias_shape = shape;
      c.causal = causal;
      c.key_lengths = {7, 4};
      check_case(c);
    }
}

TEST(SoftmaxAttentionOp, AwkwardShapes) {
  // L = 1; L < S and L > S with causal (rows before the first key see
  // nothing); E != M; lengths across the kernel's 128 x 256 blocks.
  for (auto [L, S, E, M] : std::vector<std::array<int64_t, 4>>{
           {1, 7, 4, 6}, {1, 1, 3, 2}, {3, 9, 5, 2}, {9, 3, 2, 5}, {131, 263, 8, 5}, {257, 130, 5, 8}})
    for (bool causal : {false, true}) {
      OpCase c;
      c.N = 2, c.H = 2, c.L = L, c.S = S, c.E = E, c.M = M;
      c.causal = causal;
      c.key_lengths = {S, S / 2};
      c.bias_shape = {1, 2, 1, S};
      check_case(c);
      c.bias_shape = {L, S};
      check_case(c);
    }
}

TEST(SoftmaxAttentionOp, FullyMaskedRows) {
  OpCase c;
  c.key_lengths = {0, 3};  // batch 0: every row of every head sees nothing
  c.bias_shape = {2, 3, 5, 7};
  c.bias_inf_fraction = 0.6;  // and some rows lose every key to -inf
  check_case(c);
  c.causal = true;
  c.L = 9, c.S = 4;  // causal, L > S: the first 5 rows see no key
  c.key_lengths = {4, 2};
  c.bias_shape = {9, 4};
  check_case(c);
}

TEST(SoftmaxAttentionOp, StridedInputsAndStrideZeroOutputGradient) {
  for (bool sum_backward : {false, true}) {
    OpCase c;
    c.strided = true;
    c.sum_backward = sum_backward;
    c.key_lengths = {6, 7};
    c.bias_shape = {1, 3, 5, 7};
    check_case(c);
    c.causal = true;
    c.bias_shape = {5, 7};
    check_case(c);
  }
}

TEST(SoftmaxAttentionOp, EmptyDimensions) {
  for (auto [N, L, S] : std::vector<std::array<int64_t, 3>>{{0, 5, 7}, {2, 0, 7}, {2, 5, 0}}) {
    OpCase c;
    c.N = N, c.L = L, c.S = S;
    c.bias_shape = {1, 3, 1, S};
    if (N > 0) c.key_lengths = std::vector<int64_t>(N, S);
    check_case(c);
    c.bias_shape = {L, S};
    check_case(c);
    c.bias_shape = {N, 3, L, S};
    check_case(c);
  }
}

// ---------------------------------------------------------------------------
// The bias gradient is deterministic and independent of the thread count
// ---------------------------------------------------------------------------

TEST(SoftmaxAttentionOp, BiasGradientIndependentOfThreadCount) {
  torch::manual_seed(7);
  const int64_t N = 3, H = 2, L = 140, S = 300, E = 8;
  auto q = torch::randn({N, H, L, E}, f32()), k = torch::randn({N, H, S, E}, f32());
  auto v = torch::randn({N, H, S, E}, f32()), dout = torch::randn({N, H, L, E}, f32());
  const int threads = attnkit::num_threads();
  for (auto shape : std::vector<std::vector<int64_t>>{{L, S}, {1, H, 1, S}, {N, 1, L, 1}, {N, H, L, S}}) {
    SCOPED_TRACE(::testing::PrintToString(shape));
    auto bias = torch::randn(shape, f32());
    std::vector<torch::Tensor> grads;
    for (int t : {1, 2, 3}) {
      attnkit::set_num_threads(t);
      auto b = bias.clone().requires_grad_(true);
      auto out = attnkit::softmax_attention(
          q, k, v, SoftmaxAttentionFuncOptions().causal(true).bias(b).key_lengths(
              torch::tensor(std::vector<int64_t>{S, 200, 17})));
      out.backward(dout);
      grads.push_back(b.grad());
    }
    EXPECT_TRUE(torch::equal(grads[0], grads[1]));
    EXPECT_TRUE(torch::equal(grads[0], grads[2]));
  }
  attnkit::set_num_threads(threads);
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------

TEST(SoftmaxAttentionOp, DispatchNamesTheBackendAndWhy) {
  auto q = torch::randn({1, 2, 3, 4}, f32()), k = torch::randn({1, 2, 5, 4}, f32());
  auto v = torch::randn({1, 2, 5, 4}, f32());
  EXPECT_TRUE(attnkit::softmax_attention_dispatch(q, k, v).uses_kernel());
  auto bias = torch::randn({3, 5}, f32()).requires_grad_(true);
  EXPECT_TRUE(
      attnkit::softmax_attention_dispatch(q, k, v, SoftmaxAttentionFuncOptions().bias(bias)).uses_kernel());
  const auto d = attnkit::softmax_attention_dispatch(q.to(torch::kDouble), k.to(torch::kDouble),
                                                     v.to(torch::kDouble));
  EXPECT_EQ(d.backend, attnkit::Backend::composite);
  EXPECT_NE(d.reason.find("float64"), std::string::npos) << d.reason;
  EXPECT_NE(d.reason.find("float32"), std::string::npos) << d.reason;
  // The dispatch validates as the op does.
  expect_error([&] { attnkit::softmax_attention_dispatch(q, k.to(torch::kDouble), v); },
               {"softmax_attention", "k"});
}

TEST(SoftmaxAttentionOp, ParameterBiasUnderNoGradTakesTheKernel) {
  auto q = torch::randn({2, 2, 9, 4}, f32()), k = torch::randn({2, 2, 11, 4}, f32());
  auto v = torch::randn({2, 2, 11, 3}, f32());
  auto bias = torch::randn({9, 11}, f32()).requires_grad_(true);  // as a Parameter is
  const auto constant = attnkit::softmax_attention(
      q, k, v, SoftmaxAttentionFuncOptions().bias(bias.detach()));  // the kernel with a constant bias
  torch::NoGradGuard no_grad;
  const SoftmaxAttentionFuncOptions o = SoftmaxAttentionFuncOptions().bias(bias);
  EXPECT_TRUE(attnkit::softmax_attention_dispatch(q, k, v, o).uses_kernel());
  const auto out = attnkit::softmax_attention(q, k, v, o);
  EXPECT_FALSE(out.requires_grad());
  EXPECT_TRUE(torch::equal(out, constant));  // bitwise: the same kernel ran
}

// ---------------------------------------------------------------------------
// NaN scores propagate, on both paths alike
// ---------------------------------------------------------------------------

TEST(SoftmaxAttentionOp, NaNScoresPropagateToTheirRowsOnBothPaths) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const int64_t N = 1, H = 2, L = 6, S = 6, E = 4;
  auto q = torch::randn({N, H, L, E}, f64()), k = torch::randn({N, H, S, E}, f64());
  auto v = torch::randn({N, H, S, E}, f64());
  auto bias = torch::zeros({L, S}, f64());
  q[0][0][1][2] = nan;  // row 1 of head 0: every score NaN
  bias[3][2] = nan;     // row 3, key 2: visible under causal
  bias[4][5] = nan;     // row 4, key 5: hidden by the causal mask, so no effect
  bias[5].fill_(-kInf);
  bias[5][0] = nan;     // row 5: its only non -inf score is NaN
  const auto o = SoftmaxAttentionFuncOptions().causal(true).bias(bias);
  const auto want = attnkit::softmax_attention(q, k, v, o);
  auto o32 = SoftmaxAttentionFuncOptions().causal(true).bias(bias.to(torch::kFloat));
  const auto got =
      attnkit::softmax_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), o32);
  const auto nan_rows = torch::isnan(want).all(-1);
  auto expected = torch::zeros({N, H, L}, torch::kBool);
  expected[0][0][1] = true;
  expected.select(2, 3).fill_(true);
  expected.select(2, 5).fill_(true);
  EXPECT_TRUE(torch::equal(nan_rows, expected)) << nan_rows;
  EXPECT_TRUE(torch::equal(torch::isnan(got).all(-1), expected)) << torch::isnan(got);
  EXPECT_FALSE(torch::isnan(want).any(-1).logical_and(nan_rows.logical_not()).any().item<bool>());
  EXPECT_FALSE(torch::isnan(got).any(-1).logical_and(nan_rows.logical_not()).any().item<bool>());
  const auto finite = nan_rows.logical_not().unsqueeze(-1).expand_as(want);
  EXPECT_LE(attnkit::testing::rel_err(got.masked_select(finite), want.masked_select(finite)), 1e-5);
}

// ---------------------------------------------------------------------------
// Autograd contract of the kernel path
// ---------------------------------------------------------------------------

TEST(SoftmaxAttentionOp, DoubleBackwardThroughTheKernelRaises) {
  auto q = torch::randn({1, 2, 4, 3}, f32()).requires_grad_(true);
  auto k = torch::randn({1, 2, 5, 3}, f32()).requires_grad_(true);
  auto v = torch::randn({1, 2, 5, 3}, f32()).requires_grad_(true);
  auto bias = torch::randn({4, 5}, f32()).requires_grad_(true);
  auto out = attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().bias(bias));
  // First-order gradients with create_graph are still right...
  auto first = torch::autograd::grad({out.pow(2).sum()}, {q, k, v, bias}, {}, /*retain_graph=*/true,
                                     /*create_graph=*/true);
  auto plain = torch::autograd::grad({out.pow(2).sum()}, {q, k, v, bias}, {}, true, false);
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(torch::equal(first[i], plain[i])) << i;
  // ...but differentiating them again raises instead of dropping terms.
  for (size_t i = 0; i < first.size(); ++i)
    expect_error([&] { torch::autograd::grad({first[i].sum()}, {q}, {}, true, false, true); },
                 {"softmax_attention", "double backward", "float64"});
  // The float64 composite supports it (the advertised way out).
  auto q64 = q.detach().to(torch::kDouble).requires_grad_(true);
  auto out64 = attnkit::softmax_attention(q64, k.detach().to(torch::kDouble),
                                          v.detach().to(torch::kDouble));
  auto g64 = torch::autograd::grad({out64.pow(2).sum()}, {q64}, {}, true, true);
  EXPECT_NO_THROW(torch::autograd::grad({g64[0].sum()}, {q64}));
}

TEST(SoftmaxAttentionOp, InPlaceChangeBetweenForwardAndBackwardRaises) {
  auto q = torch::randn({2, 2, 4, 3}, f32()).requires_grad_(true);
  auto k = torch::randn({2, 2, 5, 3}, f32()), v = torch::randn({2, 2, 5, 3}, f32());
  {  // a constant bias
    auto bias = torch::randn({4, 5}, f32());
    auto out = attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().bias(bias));
    bias.add_(1.0);
    expect_error([&] { out.sum().backward(); }, {"modified by an inplace operation"});
  }
  {  // a bias that needs its gradient
    auto leaf = torch::randn({4, 5}, f32()).requires_grad_(true);
    auto bias = leaf * 1.0;
    auto out = attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().bias(bias));
    bias.mul_(2.0);
    expect_error([&] { out.sum().backward(); }, {"modified by an inplace operation"});
  }
  {  // key lengths
    auto lengths = torch::tensor({5, 3}, torch::kLong);
    auto out = attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().key_lengths(lengths));
    lengths[1] = 1;
    expect_error([&] { out.sum().backward(); }, {"modified by an inplace operation"});
  }
}

}  // namespace

}  // namespace softmax_attention_op_test
