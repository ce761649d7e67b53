// nn::AgglomerativeAttention: the layer of docs/MATH.md, "Agglomerative
// attention", written out class by class, float32 (fast kernels) against float64
// (reference) in values and every gradient, the one-class identity, streaming
// decoding, dropout and errors.
#include <ATen/CPUGeneratorImpl.h>
#include <attnkit/nn/agglomerative_attention.h>

#include <map>
#include <string>
#include <vector>

#include "test_util.h"

namespace attnkit::nn::agglomerative_attention_module_test {
namespace {

using testing::expect_error;
using testing::f32;
using testing::f64;
using testing::rel_err;

// float64 against float64 computed in another order: rounding only.
constexpr double kDoubleTol = 1e-10;
// float32 layer against float64, relative to the largest reference entry: the
// op's errors (agglomerative_attention_kernel_test: up to 2.2e-6, in dcr) pass through
// matmuls over d = 32 and, for W_r and b_r, a sum over N S rows of the softmax
// Jacobian times dcr, whose terms cancel. Measured maximum: 3.6e-6 (b_r). A
// wrong index, block or gradient shows up at 1e-2 or more.
constexpr double kFloatTol = 1e-5;

/// A layer with random biases too (reset() zeroes them), in `dtype`.
AgglomerativeAttention make_layer(int64_t d, int64_t m, torch::Dtype dtype, uint64_t seed,
                                  double clip = AgglomerativeAttentionFuncOptions().clip()) {
  torch::manual_seed(seed);
  AgglomerativeAttention layer(AgglomerativeAttentionOptions(d, m).clip(clip));
  {
    torch::NoGradGuard no_grad;
    layer->b_q.uniform_(-1, 1);
    layer->b_r.uniform_(-1, 1);
  }
  layer->to(dtype);
  return layer;
}

/// The layer of docs/MATH.md, "Agglomerative attention", class by class,
/// independent of the op and its reference.
torch::Tensor spec_layer(AgglomerativeAttention& layer, const torch::Tensor& xq,
                         const torch::Tensor& xr, bool causal) {
  const int64_t d = layer->options.width(), m = layer->options.classes(), w = d / m;
  const int64_t N = xq.size(0), L = xq.size(1), S = xr.size(1);
  auto cq = torch::softmax(xq.matmul(layer->W_q) + layer->b_q, -1);  // (N, L, m)
  auto cr = torch::softmax(xr.matmul(layer->W_r) + layer->b_r, -1);  // (N, S, m)
  std::vector<torch::Tensor> classes;
  for (int64_t k = 0; k < m; ++k) {
    auto crk = cr.select(2, k);                                                   // (N, S)
    auto u = crk.unsqueeze(-1) * xr.matmul(layer->P.narrow(1, k * w, w));          // (N, S, w)
    std::vector<torch::Tensor> rows;
    for (int64_t i = 0; i < L; ++i) {
      const int64_t visible = causal ? i + S - L + 1 : S;  // keys t < visible
      if (visible <= 0) {
        rows.push_back(torch::zeros({N, w}, xq.options()));
        continue;
      }
      auto den = crk.narrow(1, 0, visible).sum(1, /*keepdim=*/true);
      const double clip = layer->options.clip();
      den = torch::where(den < clip, torch::full_like(den, clip), den);
      rows.push_back(u.narrow(1, 0, visible).sum(1) / den);
    }
    classes.push_back(cq.select(2, k).unsqueeze(-1) * torch::stack(rows, 1));  // (N, L, w)
  }
  return torch::cat(classes, 2).matmul(layer->Q);
}

TEST(AgglomerativeModule, ParametersHaveTheSpecifiedShapes) {
  AgglomerativeAttention layer(AgglomerativeAttentionOptions(12, 3));
  const auto params = layer->named_parameters();
  ASSERT_EQ(params.size(), 6u);
  EXPECT_EQ(params["W_q"].sizes(), torch::IntArrayRef({12, 3}));
  EXPECT_EQ(params["b_q"].sizes(), torch::IntArrayRef({3}));
  EXPECT_EQ(params["W_r"].sizes(), torch::IntArrayRef({12, 3}));
  EXPECT_EQ(params["b_r"].sizes(), torch::IntArrayRef({3}));
  EXPECT_EQ(params["P"].sizes(), torch::IntArrayRef({12, 12}));
  EXPECT_EQ(params["Q"].sizes(), torch::IntArrayRef({12, 12}));
}

TEST(AgglomerativeModule, MatchesTheSpecificationInFloat64) {
  auto layer = make_layer(12, 3, torch::kDouble, 1);
  for (bool causal : {false, true})
    for (auto [L, S] : {std::pair<int64_t, int64_t>{5, 5}, {4, 7}, {7, 4}}) {
      SCOPED_TRACE("causal " + std::to_string(causal) + " L " + std::to_string(L) + " S " +
                   std::to_string(S));
      auto xq = torch::randn({2, L, 12}, f64()), xr = torch::randn({2, S, 12}, f64());
      EXPECT_LT(rel_err(layer->forward(xq, xr, causal), spec_layer(layer, xq, xr, causal)), kDoubleTol);
      if (L == S)  // an undefined x_ref is self-attention
        EXPECT_LT(rel_err(layer->forward(xq, {}, causal), spec_layer(layer, xq, xq, causal)), kDoubleTol);
    }
}

/// Output and the gradients of sum(out * cotangent) for the inputs and every
/// parameter, keyed by name ("x_query", "x_ref", "W_q", ...).
std::map<std::string, torch::Tensor> layer_run(AgglomerativeAttention& layer, const torch::Tensor& xq,
                                               const torch::Tensor& xr, bool causal,
                                               const torch::Tensor& cotangent) {
  const auto dtype = layer->P.scalar_type();
  auto q = xq.detach().to(dtype).requires_grad_();
  auto r = xr.defined() ? xr.detach().to(dtype).requires_grad_() : torch::Tensor();
  layer->zero_grad();
  auto out = layer->forward(q, r, causal);
  (out * cotangent.to(dtype)).sum().backward();
  std::map<std::string, torch::Tensor> result{{"out", out.detach()}, {"x_query", q.grad()}};
  if (r.defined()) result["x_ref"] = r.grad();
  for (const auto& p : layer->named_parameters()) result[p.key()] = p.value().grad();
  return result;
}

void expect_float_layer_matches_double(int64_t L, int64_t S, bool self, bool causal) {
  SCOPED_TRACE("causal " + std::to_string(causal) + " L " + std::to_string(L) + " S " +
               std::to_string(S) + (self ? " self" : " cross"));
  const int64_t N = 2, d = 32, m = 4;
  auto layer32 = make_layer(d, m, torch::kFloat, 2);
  auto layer64 = std::dynamic_pointer_cast<AgglomerativeAttentionImpl>(layer32->clone());
  AgglomerativeAttention double_layer(layer64);
  double_layer->to(torch::kDouble);
  auto xq = torch::randn({N, L, d}, f64());
  auto xr = self ? torch::Tensor() : torch::randn({N, S, d}, f64());
  auto cotangent = torch::randn({N, L, d}, f64());
  auto fast = layer_run(layer32, xq, xr, causal, cotangent);
  auto ref = layer_run(double_layer, xq, xr, causal, cotangent);
  ASSERT_EQ(fast.size(), ref.size());
  for (const auto& [name, expected] : ref) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(fast[name].defined());
    EXPECT_EQ(fast[name].scalar_type(), torch::kFloat);
    if (S == 1 && (name == "W_r" || name == "b_r")) {
      // One key: its average is its projected value whatever its class
      // weights, so the reference classifier's gradient is zero in exact
      // arithmetic and float32 leaves the rounding of cancelling O(1) terms.
      EXPECT_LT(testing::max_abs(fast[name]), kFloatTol);
      continue;
    }
    EXPECT_LT(rel_err(fast[name], expected), kFloatTol);
  }
}

TEST(AgglomerativeModule, Float32MatchesFloat64InValuesAndAllGradients) {
  for (bool causal : {false, true})
    for (int64_t L : {1, 2, 63, 64, 65, 300}) expect_float_layer_matches_double(L, L, /*self=*/true, causal);
}

TEST(AgglomerativeModule, CrossAttentionWithUnequalLengths) {
  for (bool causal : {false, true})
    for (auto [L, S] : {std::pair<int64_t, int64_t>{1, 2}, {63, 130}, {130, 63}, {65, 300}})
      expect_float_layer_matches_double(L, S, /*self=*/false, causal);
}

TEST(AgglomerativeModule, OneClassIsTheMeanOfProjectedValues) {
  // One class: both softmaxes are 1, so p_i is the mean of x_t P over all t
  // (full) or over t <= i (causal).
  const int64_t N = 2, L = 65, d = 8;
  auto layer = make_layer(d, 1, torch::kFloat, 3);
  auto x = torch::randn({N, L, d}, f32());
  auto P = layer->P.detach().to(torch::kDouble), Q = layer->Q.detach().to(torch::kDouble);
  auto projected = x.to(torch::kDouble).matmul(P);  // (N, L, d)
  auto full_mean = projected.mean(1, /*keepdim=*/true).expand({N, L, d});
  auto prefix_mean = projected.cumsum(1) / torch::arange(1, L + 1, f64()).view({1, L, 1});
  EXPECT_LT(rel_err(layer->forward(x), full_mean.matmul(Q)), kFloatTol);
  EXPECT_LT(rel_err(layer->forward(x, {}, /*causal=*/true), prefix_mean.matmul(Q)), kFloatTol);
}

TEST(AgglomerativeModule, StreamingEqualsTheCausalLayer) {
  const int64_t N = 2, L = 65, d = 16, m = 4;
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    SCOPED_TRACE(dtype == torch::kFloat ? "float32" : "float64");
    auto layer = make_layer(d, m, dtype, 4);
    auto x = torch::randn({N, L, d}, torch::TensorOptions().dtype(dtype)).requires_grad_();
    auto whole = layer->forward(x, {}, /*causal=*/true);
    AgglomerativeState state;
    std::vector<torch::Tensor> steps;
    for (int64_t t = 0; t < L; ++t) steps.push_back(layer->step(x.select(1, t), state));
    EXPECT_EQ(state.sums.sizes(), torch::IntArrayRef({N, m, d / m}));
    EXPECT_EQ(state.counts.sizes(), torch::IntArrayRef({N, m}));
    auto streamed = torch::stack(steps, 1);
    const double tol = dtype == torch::kFloat ? kFloatTol : kDoubleTol;
    EXPECT_LT(rel_err(streamed, whole), tol);
    // The steps are differentiable and give the layer's input gradient.
    auto cotangent = torch::randn_like(whole);
    auto g_whole = torch::autograd::grad({(whole * cotangent).sum()}, {x})[0];
    auto g_streamed = torch::autograd::grad({(streamed * cotangent).sum()}, {x})[0];
    EXPECT_LT(rel_err(g_streamed, g_whole), tol);
  }
}

// The layer's clip reaches the op and the streaming step (issue 47: both used
// the op's default whatever the spec said). A clip of 0.6 is active wherever
// a class's weight sum is below it: the first positions of a causal pass.
TEST(AgglomerativeModule, ClipOptionReachesForwardAndStep) {
  const int64_t N = 2, L = 9, d = 12, m = 3;
  auto layer = make_layer(d, m, torch::kDouble, 6, /*clip=*/0.6);
  auto x = torch::randn({N, L, d}, f64());
  const auto whole = layer->forward(x, {}, /*causal=*/true);
  EXPECT_LT(rel_err(whole, spec_layer(layer, x, x, /*causal=*/true)), kDoubleTol);
  AgglomerativeState state;
  std::vector<torch::Tensor> steps;
  for (int64_t t = 0; t < L; ++t) steps.push_back(layer->step(x.select(1, t), state));
  EXPECT_LT(rel_err(torch::stack(steps, 1), whole), kDoubleTol);
  auto default_clip = make_layer(d, m, torch::kDouble, 6);
  EXPECT_GT(rel_err(default_clip->forward(x, {}, /*causal=*/true), whole), 1e-3) << "the clip changed nothing";
  // As the op, the layer refuses a clip that is not positive.
  for (const double bad : {0.0, -1.0})
    expect_error([&] { AgglomerativeAttention(AgglomerativeAttentionOptions(d, m).clip(bad)); },
                 {"AgglomerativeAttention", "clip"});
}

TEST(AgglomerativeModule, DropoutIsSeededAndOnlyInTraining) {
  const int64_t d = 16, m = 4;
  auto x = torch::randn({2, 9, d}, f32());
  auto plain = make_layer(d, m, torch::kFloat, 5);
  auto run = [&](bool training, uint64_t seed) {
    torch::manual_seed(5);  // the same parameters as `plain`
    AgglomerativeAttention layer(AgglomerativeAttentionOptions(d, m).dropout(0.5).generator(
        at::make_generator<at::CPUGeneratorImpl>(seed)));
    {
      torch::NoGradGuard no_grad;
      layer->b_q.uniform_(-1, 1);
      layer->b_r.uniform_(-1, 1);
    }
    layer->train(training);
    return layer->forward(x);
  };
  EXPECT_TRUE(torch::equal(run(/*training=*/false, 1), plain->forward(x)));
  EXPECT_TRUE(torch::equal(run(true, 1), run(true, 1)));
  EXPECT_FALSE(torch::equal(run(true, 1), run(true, 2)));
  EXPECT_FALSE(torch::equal(run(true, 1), plain->forward(x)));
}

TEST(AgglomerativeModule, RejectsBadInputs) {
  AgglomerativeAttention layer(AgglomerativeAttentionOptions(8, 2));
  auto x = torch::randn({2, 5, 8}, f32());
  expect_error([&] { layer->forward(torch::randn({2, 5, 6}, f32())); },
               {"AgglomerativeAttention", "x_query", "feature size", "6", "expected 8"});
  expect_error([&] { layer->forward(torch::randn({5, 8}, f32())); },
               {"AgglomerativeAttention", "x_query", "3 dimensions"});
  expect_error([&] { layer->forward(x, torch::randn({3, 5, 8}, f32())); },
               {"AgglomerativeAttention", "x_ref", "batch size", "3", "expected 2"});
  expect_error([&] { layer->forward(x.to(torch::kDouble)); },
               {"AgglomerativeAttention", "x_query", "Double", "Float"});
  expect_error([] { AgglomerativeAttention(AgglomerativeAttentionOptions(10, 3)); },
               {"AgglomerativeAttention", "width (10)", "classes (3)"});
  expect_error([] { AgglomerativeAttention(AgglomerativeAttentionOptions(8, 2).dropout(1.0)); },
               {"AgglomerativeAttention", "dropout", "[0, 1)"});
  AgglomerativeState state;
  layer->step(torch::randn({2, 8}, f32()), state);
  expect_error([&] { layer->step(torch::randn({3, 8}, f32()), state); },
               {"AgglomerativeAttention", "state", "batch size 3"});
  expect_error([&] { layer->step(torch::randn({2, 7}, f32()), state); },
               {"AgglomerativeAttention", "x_t", "feature size"});
}

}  // namespace
}  // namespace attnkit::nn::agglomerative_attention_module_test
