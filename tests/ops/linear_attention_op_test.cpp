// The linear_attention op: float32 through the kernels with autograd against the float64
// reference, float64 exactly the reference, rows that see no key without eps, empty
// dimensions, and the dispatch report.
#include <attnkit/ops.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/linear_attention_cases.h"
#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::linear_attention_op_test {
namespace {

using namespace testing::linear;  // kRelTol, autograd_run, to_f32, expect_matches
using testing::f32;
using testing::f64;
using testing::rel_err;

TEST(LinearOp, RowsThatSeeNoKeyAreZeroWithoutEpsInFloat64AndFloat32) {
  // eps = 0 and the normaliser: causal rows i < L - S, and every row when
  // S = 0, see no key. Both backends give exactly 0 there, with zero and
  // finite gradients, and agree elsewhere.
  torch::manual_seed(14);
  for (auto [L, S, causal] : {std::tuple<int64_t, int64_t, bool>{9, 4, true}, {5, 0, true}, {5, 0, false}}) {
    SCOPED_TRACE("L=" + std::to_string(L) + " S=" + std::to_string(S) + (causal ? " causal" : ""));
    const int64_t blind = causal ? std::max<int64_t>(L - S, 0) : L;  // rows that see no key
    auto q = torch::randn({2, 1, L, 3}, f64()), k = torch::randn({2, 1, S, 3}, f64());
    auto v = torch::randn({2, 1, S, 2}, f64()), dout = torch::randn({2, 1, L, 2}, f64());
    const auto o =
        LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true).causal(causal).eps(0);
    auto op = [&](const std::vector<torch::Tensor>& x) { return linear_attention(x[0], x[1], x[2], o); };
    const auto r64 = autograd_run(op, {q, k, v}, dout);
    const auto r32 = autograd_run(op, to_f32({q, k, v}), dout);
    for (size_t i = 0; i < r64.size(); ++i) {
      EXPECT_TRUE(testing::all_finite(r64[i])) << "float64, result " << i;
      EXPECT_TRUE(testing::all_finite(r32[i])) << "float32, result " << i;
    }
    EXPECT_EQ(testing::max_abs(r64[0].narrow(2, 0, blind)), 0.0);
    EXPECT_EQ(testing::max_abs(r32[0].narrow(2, 0, blind)), 0.0);
    EXPECT_EQ(testing::max_abs(r64[1].narrow(2, 0, blind)), 0.0);
    EXPECT_EQ(testing::max_abs(r32[1].narrow(2, 0, blind)), 0.0);
    for (size_t i = 0; i < r64.size(); ++i) EXPECT_LE(rel_err(r32[i], r64[i]), kRelTol) << i;
  }
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
        LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true).causal(causal);
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
      auto out = linear_attention(q, k, v, LinearAttentionFuncOptions().normalize(true).causal(causal));
      ASSERT_EQ(out.sizes(), (std::vector<int64_t>{N, 2, L, 4}));
      EXPECT_EQ(testing::max_abs(out), 0.0);
      out.sum().backward();
      EXPECT_EQ(testing::max_abs(q.grad()), 0.0);
      EXPECT_EQ(testing::max_abs(k.grad()), 0.0);
      EXPECT_EQ(testing::max_abs(v.grad()), 0.0);
    }
}

TEST(LinearOp, DispatchNamesTheBackendThatRuns) {
  // float32 -> the kernel (its autograd Function made the output); float64 ->
  // the composite, with a reason naming the dtype, and exactly the reference.
  torch::manual_seed(11);
  auto q = torch::randn({1, 2, 5, 3}, f64()), k = torch::randn({1, 2, 6, 3}, f64());
  auto v = torch::randn({1, 2, 6, 4}, f64());
  const auto o = LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true).causal(true);
  const auto q32 = q.to(torch::kFloat).requires_grad_(), k32 = k.to(torch::kFloat),
             v32 = v.to(torch::kFloat);
  testing::expect_kernel(linear_attention_dispatch(q32, k32, v32, o));
  EXPECT_NE(testing::grad_fn_name(linear_attention(q32, k32, v32, o)).find("LinearAttentionFunction"),
            std::string::npos);
  testing::expect_composite(linear_attention_dispatch(q, k, v, o),
                            "q is float64; the kernel is float32 only");
  EXPECT_TRUE(torch::equal(linear_attention(q, k, v, o), reference::linear_attention(q, k, v, o)));
  testing::expect_composite(linear_attention_dispatch(q.to(torch::kHalf), k, v, o),
                            "q is float16; the kernel is float32 only");
  // The first argument that is not float32 is named (the op itself would reject the mix).
  testing::expect_composite(linear_attention_dispatch(q32, k32, v, o),
                            "v is float64; the kernel is float32 only");
}

}  // namespace
}  // namespace attnkit::linear_attention_op_test
