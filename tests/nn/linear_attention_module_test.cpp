// The linear attention modules: the streaming decoding state against the
// causal op token by token, and LinearAttention (gated linear attention's are
// in gated_linear_attention_module_test.cpp).
#include <attnkit/nn/linear_attention.h>
#include <attnkit/ops.h>

#include "test_util.h"

namespace attnkit::nn::linear_attention_module_test {
namespace {

using testing::expect_error;
using testing::f32;
using testing::f64;
using testing::rel_err;

// Two float64 evaluations of the same sums in different orders.
constexpr double kSameMathTol64 = 1e-12;
// Float32 runs of the same math in different orders (sums of <= 64 terms):
// 64 * 2^-24 = 4e-6 of the terms' scale, with room for the normaliser's division.
constexpr double kSameMathTol32 = 1e-5;

/// Token-by-token outputs of a fresh state over (N, H, L, .) inputs, as (N, H, L, M).
torch::Tensor stream(LinearAttentionState state, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) {
  std::vector<torch::Tensor> outs;
  for (int64_t t = 0; t < q.size(2); ++t)
    outs.push_back(state.step(q.select(2, t), k.select(2, t), v.select(2, t)));
  return torch::stack(outs, 2);
}

TEST(LinearState, StepsEqualTheCausalOpTokenByToken) {
  // Also with grouped-query heads (Hk key/value heads: the state keeps Hk)
  // and rotary positions (step t turns phi(q_t), phi(k_t) to position t).
  torch::manual_seed(1);
  const int64_t N = 2, H = 4, L = 41, E = 4, M = 6;
  for (auto dtype : {torch::kDouble, torch::kFloat})
    for (auto [map, normalize] : {std::pair{FeatureMap::identity, false},
                                  {FeatureMap::elu, false},
                                  {FeatureMap::elu, true}})
      for (int64_t Hk : {H, int64_t{2}, int64_t{1}})
        for (int64_t rotary_dim : {0, 2, 4}) {
          SCOPED_TRACE(to_string(map) + (normalize ? " normalize " : " ") + c10::toString(dtype) + " Hk " +
                       std::to_string(Hk) + " rotary_dim " + std::to_string(rotary_dim));
          const auto opts = torch::TensorOptions().dtype(dtype);
          auto q = torch::randn({N, H, L, E}, opts), k = torch::randn({N, Hk, L, E}, opts);
          auto v = torch::randn({N, Hk, L, M}, opts);
          LinearAttention module(LinearAttentionFuncOptions()
                                     .feature_map(map)
                                     .normalize(normalize)
                                     .causal(true)
                                     .rotary_dim(rotary_dim)
                                     .rotary_base(100.0));
          auto whole = module(q, k, v);  // float32: the chunked kernels; float64: the reference
          auto state = module->state();
          auto steps = stream(state, q, k, v);
          EXPECT_LT(rel_err(steps, whole), dtype == torch::kDouble ? kSameMathTol64 : kSameMathTol32);
        }
}

TEST(LinearState, KeepsOneStatePerKeyValueHead) {
  // Grouped heads: Hk states, each read by its group; the same outputs as a
  // state over each key/value head repeated to H (the same sums in float64).
  torch::manual_seed(3);
  const int64_t N = 2, H = 6, Hk = 2, E = 3, M = 4, T = 7;
  LinearAttentionState grouped(LinearAttentionStateOptions().feature_map(FeatureMap::elu).normalize(true).rotary_dim(2));
  LinearAttentionState repeated(grouped.options());
  for (int64_t t = 0; t < T; ++t) {
    auto q = torch::randn({N, H, E}, f64()), k = torch::randn({N, Hk, E}, f64()), v = torch::randn({N, Hk, M}, f64());
    EXPECT_LT(rel_err(grouped.step(q, k, v), repeated.step(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))),
              kSameMathTol64);
  }
  EXPECT_EQ(grouped.sum_kv().sizes(), (std::vector<int64_t>{N, Hk, E, M}));
  EXPECT_EQ(grouped.sum_k().sizes(), (std::vector<int64_t>{N, Hk, E}));
  EXPECT_EQ(repeated.sum_kv().size(1), H);
  expect_error([&] { grouped.step(torch::randn({N, H, E}, f64()), torch::randn({N, 3, E}, f64()), torch::randn({N, 3, M}, f64())); },
               {"LinearAttentionState::step", "(2, 2, 3, 4)", "6 query heads"});
  expect_error([] { LinearAttentionState().step(torch::randn({1, 4, 2}), torch::randn({1, 3, 2}), torch::randn({1, 3, 2})); },
               {"LinearAttentionState::step", "head count 3, which must divide q's head count 4"});
}

TEST(LinearState, StepsAreDifferentiableLikeTheOp) {
  torch::manual_seed(2);
  const int64_t L = 9, E = 3, M = 2;
  auto q = torch::randn({1, 2, L, E}, f64()), k = torch::randn({1, 2, L, E}, f64());
  auto v = torch::randn({1, 2, L, M}, f64());
  const auto o = LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true).causal(true);
  testing::expect_gradients_match(
      [&](const std::vector<torch::Tensor>& x) {
        return stream(LinearAttention(o)->state(), x[0], x[1], x[2]);
      },
      {q, k, v});
}

TEST(LinearState, ShapeChangesNeedAReset) {
  LinearAttentionState state;
  EXPECT_EQ(state.steps(), 0);
  state.step(torch::randn({2, 3, 4}), torch::randn({2, 3, 4}), torch::randn({2, 3, 5}));
  EXPECT_EQ(state.steps(), 1);
  EXPECT_EQ(state.sum_kv().sizes(), (std::vector<int64_t>{2, 3, 4, 5}));
  expect_error(
      [&] {
        state.step(torch::randn({2, 3, 4}), torch::randn({2, 3, 4}), torch::randn({2, 3, 6}));
      },
      {"LinearAttentionState::step", "(2, 3, 4, 5)", "reset()"});
  expect_error(
      [&] {
        state.step(torch::randn({2, 3, 4}), torch::randn({2, 3, 5}), torch::randn({2, 3, 5}));
      },
      {"LinearAttentionState::step", "'k'", "feature size E"});
  state.reset();
  EXPECT_EQ(state.steps(), 0);
  EXPECT_FALSE(state.sum_kv().defined());
  auto out = state.step(torch::randn({1, 1, 2}), torch::randn({1, 1, 2}), torch::randn({1, 1, 7}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{1, 1, 7}));
  expect_error([] { LinearAttentionState(LinearAttentionStateOptions().eps(-1)); },
               {"LinearAttentionState", "eps"});
}

TEST(LinearModule, IsTheOpWithItsOptions) {
  torch::manual_seed(3);
  auto q = torch::randn({2, 2, 5, 3}), k = torch::randn({2, 2, 7, 3}),
       v = torch::randn({2, 2, 7, 4});
  const auto o = LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true);
  LinearAttention module(o);
  EXPECT_TRUE(torch::equal(module(q, k, v), linear_attention(q, k, v, o)));
  EXPECT_TRUE(module->parameters().empty());
}

}  // namespace
}  // namespace attnkit::nn::linear_attention_module_test
