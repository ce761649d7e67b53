// attnkit::scaled_dot_product_attention (torch 2's API over our exact kernel)
// against reference::scaled_dot_product_attention, the code torch 2.5's
// documentation gives as the function's equivalent, in float64: values and
// the gradients of query, key, value and a floating mask, for every kind of
// argument the documentation names (mask kinds and their broadcasting,
// is_causal with L < S, L = S and L > S, scale, grouped-query heads, rows with
// nothing visible, 2-D to 5-D inputs, broadcast batch dimensions, strided
// views), then the refusals. The reference itself is checked on hand-computed
// cases first. (tests/python/test_ops.py compares with torch 1.13's private
// _scaled_dot_product_attention where their arguments overlap.)
#include <attnkit/ops.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "reference/reference.h"
#include "test_util.h"

namespace scaled_dot_product_attention_op_test {

namespace {

using attnkit::ScaledDotProductAttentionFuncOptions;
using attnkit::testing::f32;
using attnkit::testing::f64;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Tolerances, on max |op - reference| / max(max |reference|, 1). The inputs
// and the cotangent are N(0, 1) with E <= 8 and S <= 9, so every term of
// every sum is O(1): an error is measured against that scale even where the
// result is 0 (a row with one visible key has dquery = 0 exactly in float64,
// and float32 rounding leaves ~1e-7 there). float64 through the op's
// composite backend: the same sums in another order, 1e-12. float32 through
// the kernel: each sum's rounding is below 16 u = 1e-6 of its terms'
// magnitude; 2e-5 leaves room for the softmax's exponentials.
constexpr double kFloat64Tolerance = 1e-12;
constexpr double kFloat32Tolerance = 2e-5;

double err(const torch::Tensor& a, const torch::Tensor& b) {
  const auto a64 = a.detach().to(torch::kDouble), b64 = b.detach().to(torch::kDouble);
  EXPECT_EQ(a64.sizes(), b64.sizes());
  if (a64.numel() == 0) return 0.0;
  return (a64 - b64).abs().max().item<double>() / std::max(b64.abs().max().item<double>(), 1.0);
}

struct Case {
  std::string name;
  std::vector<int64_t> q_shape, k_shape, v_shape;
  ScaledDotProductAttentionFuncOptions options;
  bool mask_requires_grad = false;
  bool transposed = false;  // q, k, v as transposed views (non-contiguous)
};

/// N(0, 1) values of the given shape; transposed: a view of a tensor stored
/// with its last two dimensions swapped (no dimension has stride 1).
torch::Tensor randn(const std::vector<int64_t>& shape, bool transposed) {
  if (!transposed) return torch::randn(shape, f64());
  auto stored = shape;
  std::swap(stored[stored.size() - 1], stored[stored.size() - 2]);
  return torch::randn(stored, f64()).transpose(-1, -2);
}

/// The op in `dtype` against the float64 reference: output and the gradients
/// of q, k, v (and the mask when it is floating and requires grad) under one
/// random cotangent.
void check(const Case& c) {
  SCOPED_TRACE(c.name);
  torch::manual_seed(11);
  const auto q = randn(c.q_shape, c.transposed), k = randn(c.k_shape, c.transposed);
  const auto v = randn(c.v_shape, c.transposed);
  const auto mask = c.options.attn_mask();

  auto leaves = [&](torch::ScalarType dtype) {
    // Fresh leaves each time (clone keeps the strides of a transposed view).
    auto leaf = [&](const torch::Tensor& x, bool grad) { return x.to(dtype).clone().requires_grad_(grad); };
    std::vector<torch::Tensor> t{leaf(q, true), leaf(k, true), leaf(v, true)};
    if (mask.defined() && mask.is_floating_point()) t.push_back(leaf(mask, c.mask_requires_grad));
    return t;
  };
  auto run = [&](const std::vector<torch::Tensor>& t, bool reference) {
    auto o = c.options;
    if (t.size() == 4) o.attn_mask(t[3]);
    return reference ? attnkit::reference::scaled_dot_product_attention(t[0], t[1], t[2], o)
                     : attnkit::scaled_dot_product_attention(t[0], t[1], t[2], o);
  };

  const auto ref_in = leaves(torch::kDouble);
  const auto ref_out = run(ref_in, true);
  const auto cot = torch::randn(ref_out.sizes(), f64());
  (ref_out * cot).sum().backward();

  for (const auto dtype : {torch::kDouble, torch::kFloat}) {
    SCOPED_TRACE(dtype == torch::kDouble ? "float64 (composite)" : "float32 (kernel)");
    const double tol = dtype == torch::kDouble ? kFloat64Tolerance : kFloat32Tolerance;
    const auto in = leaves(dtype);
    const auto out = run(in, false);
    ASSERT_EQ(out.sizes(), ref_out.sizes());
    EXPECT_EQ(out.scalar_type(), dtype);
    EXPECT_TRUE(attnkit::testing::all_finite(out));
    EXPECT_LE(err(out, ref_out), tol) << "output";
    (out * cot.to(dtype)).sum().backward();
    const char* names[] = {"dquery", "dkey", "dvalue", "dmask"};
    for (size_t i = 0; i < in.size(); ++i) {
      if (!ref_in[i].requires_grad()) continue;
      ASSERT_TRUE(in[i].grad().defined()) << names[i];
      EXPECT_TRUE(attnkit::testing::all_finite(in[i].grad())) << names[i];
      EXPECT_LE(err(in[i].grad(), ref_in[i].grad()), tol) << names[i];
    }
  }
}

torch::Tensor bool_mask(const std::vector<int64_t>& shape, double keep, int64_t seed) {
  torch::manual_seed(seed);
  return torch::rand(shape, f64()) < keep;
}

// --------------------------------------------------------------- the reference

TEST(SdpaReference, HandComputedCases) {
  // One query, two keys, E = 1: scores 0 and 1 at scale 1, values 1 and 3.
  const auto q = torch::ones({1, 1, 1}, f64()), k = torch::tensor({0.0, 1.0}, f64()).view({1, 2, 1});
  const auto v = torch::tensor({1.0, 3.0}, f64()).view({1, 2, 1});
  auto out = [&](ScaledDotProductAttentionFuncOptions o) {
    return attnkit::reference::scaled_dot_product_attention(q, k, v, o.scale(1.0)).item<double>();
  };
  const double e = std::exp(1.0);
  EXPECT_NEAR(out({}), (1 + 3 * e) / (1 + e), 1e-15);
  EXPECT_NEAR(out(ScaledDotProductAttentionFuncOptions().is_causal(true)), 1.0, 1e-15);  // top-left: key 0 only
  EXPECT_NEAR(out(ScaledDotProductAttentionFuncOptions().attn_mask(torch::tensor({false, true}))), 3.0, 1e-15);
  EXPECT_NEAR(out(ScaledDotProductAttentionFuncOptions().attn_mask(torch::tensor({0.0, -1.0}, f64()))), 2.0,
              1e-15);
  EXPECT_EQ(out(ScaledDotProductAttentionFuncOptions().attn_mask(torch::tensor({false, false}))), 0.0);
  // Default scale 1 / sqrt(E) with E = 4: q . k = 2 gives a score of 1.
  const auto q4 = torch::full({1, 1, 4}, 0.5, f64()), k4 = torch::cat({torch::zeros({1, 1, 4}, f64()),
                                                                        torch::ones({1, 1, 4}, f64())}, 1);
  EXPECT_NEAR(attnkit::reference::scaled_dot_product_attention(q4, k4, v, {}).item<double>(), (1 + 3 * e) / (1 + e),
              1e-15);
  // Grouped-query heads: two query heads read the one key/value head.
  const auto q2 = torch::ones({2, 1, 1}, f64());
  const auto gqa = attnkit::reference::scaled_dot_product_attention(
      q2, k, v, ScaledDotProductAttentionFuncOptions().scale(1.0).enable_gqa(true));
  EXPECT_NEAR(gqa[0].item<double>(), (1 + 3 * e) / (1 + e), 1e-15);
  EXPECT_NEAR(gqa[1].item<double>(), (1 + 3 * e) / (1 + e), 1e-15);
}

// --------------------------------------------------------------- conformance

TEST(Sdpa, PlainFourDimensional) {
  check({"4-D", {2, 3, 5, 8}, {2, 3, 7, 8}, {2, 3, 7, 6}, {}});
  check({"4-D, scale 0.3", {2, 3, 5, 8}, {2, 3, 7, 8}, {2, 3, 7, 6}, ScaledDotProductAttentionFuncOptions().scale(0.3)});
  check({"length 1", {1, 1, 1, 3}, {1, 1, 1, 3}, {1, 1, 1, 1}, {}});
  check({"strided views", {2, 3, 5, 8}, {2, 3, 7, 8}, {2, 3, 7, 6}, {}, false, true});
}

TEST(Sdpa, Ranks) {
  check({"2-D", {5, 4}, {6, 4}, {6, 3}, ScaledDotProductAttentionFuncOptions().is_causal(true)});
  check({"3-D", {4, 5, 4}, {4, 6, 4}, {4, 6, 3}, ScaledDotProductAttentionFuncOptions().attn_mask(
                                                                     bool_mask({5, 6}, 0.7, 1))});
  check({"5-D with a mask over the middle dimension", {2, 3, 2, 5, 4}, {2, 3, 2, 6, 4}, {2, 3, 2, 6, 3},
         ScaledDotProductAttentionFuncOptions().attn_mask(torch::randn({3, 1, 5, 6}, f64())), true});
  check({"broadcast batch dimensions", {2, 3, 5, 4}, {1, 3, 6, 4}, {2, 1, 6, 3}, {}});
}

TEST(Sdpa, IsCausalIsTopLeftAligned) {
  for (const auto& [L, S] : {std::pair<int64_t, int64_t>{4, 4}, {3, 7}, {7, 3}, {1, 5}, {5, 1}}) {
    check({"is_causal L=" + std::to_string(L) + " S=" + std::to_string(S), {2, 2, L, 4}, {2, 2, S, 4},
           {2, 2, S, 3}, ScaledDotProductAttentionFuncOptions().is_causal(true)});
  }
  // L = S is our own causal flag, bitwise.
  torch::manual_seed(3);
  const auto q = torch::randn({1, 2, 6, 8}), k = torch::randn({1, 2, 6, 8}), v = torch::randn({1, 2, 6, 8});
  EXPECT_TRUE(torch::equal(
      attnkit::scaled_dot_product_attention(q, k, v, ScaledDotProductAttentionFuncOptions().is_causal(true)),
      attnkit::softmax_attention(q, k, v, attnkit::SoftmaxAttentionFuncOptions().causal(true))));
}

TEST(Sdpa, MaskKindsAndBroadcasting) {
  const std::vector<int64_t> qs{2, 3, 5, 4}, ks{2, 3, 6, 4}, vs{2, 3, 6, 3};
  check({"bool (L, S)", qs, ks, vs, ScaledDotProductAttentionFuncOptions().attn_mask(bool_mask({5, 6}, 0.6, 2))});
  check({"bool (N, 1, L, S)", qs, ks, vs,
         ScaledDotProductAttentionFuncOptions().attn_mask(bool_mask({2, 1, 5, 6}, 0.6, 3))});
  check({"bool (S)", qs, ks, vs, ScaledDotProductAttentionFuncOptions().attn_mask(bool_mask({6}, 0.6, 4))});
  check({"float (L, S), with its gradient", qs, ks, vs,
         ScaledDotProductAttentionFuncOptions().attn_mask(torch::randn({5, 6}, f64())), true});
  check({"float (H, 1, S), with its gradient", qs, ks, vs,
         ScaledDotProductAttentionFuncOptions().attn_mask(torch::randn({3, 1, 6}, f64())), true});
  check({"float with -inf entries, scale 2", qs, ks, vs,
         ScaledDotProductAttentionFuncOptions()
             .attn_mask(torch::randn({2, 3, 5, 6}, f64()).masked_fill(bool_mask({2, 3, 5, 6}, 0.3, 5), -kInf))
             .scale(2.0)});
}

TEST(Sdpa, RowsWithNothingVisibleGiveZeros) {
  auto mask = bool_mask({2, 1, 5, 6}, 0.6, 6);
  mask.index_put_({0, 0, 2}, false);  // row 2 of batch 0 sees nothing
  mask.index_put_({1, 0, 0}, false);
  check({"bool mask with empty rows", {2, 3, 5, 4}, {2, 3, 6, 4}, {2, 3, 6, 3},
         ScaledDotProductAttentionFuncOptions().attn_mask(mask)});
  torch::manual_seed(7);
  const auto q = torch::randn({2, 3, 5, 4}).requires_grad_(), k = torch::randn({2, 3, 6, 4}).requires_grad_();
  const auto v = torch::randn({2, 3, 6, 3}).requires_grad_();
  const auto out = attnkit::scaled_dot_product_attention(q, k, v, ScaledDotProductAttentionFuncOptions().attn_mask(mask));
  EXPECT_TRUE(torch::equal(out.index({0, torch::indexing::Slice(), 2}), torch::zeros({3, 3})));
  out.sum().backward();
  EXPECT_TRUE(torch::equal(q.grad().index({0, torch::indexing::Slice(), 2}), torch::zeros({3, 4})));
}

TEST(Sdpa, GroupedQueryHeads) {
  check({"gqa 6 query heads over 2", {2, 6, 5, 4}, {2, 2, 7, 4}, {2, 2, 7, 3},
         ScaledDotProductAttentionFuncOptions().enable_gqa(true)});
  check({"gqa, key heads 3 and value heads 2, causal L < S", {1, 6, 4, 4}, {1, 3, 7, 4}, {1, 2, 7, 3},
         ScaledDotProductAttentionFuncOptions().enable_gqa(true).is_causal(true)});
  check({"multi-query (one key/value head), float mask", {2, 4, 5, 4}, {2, 1, 6, 4}, {2, 1, 6, 3},
         ScaledDotProductAttentionFuncOptions().enable_gqa(true).attn_mask(torch::randn({4, 5, 6}, f64())), true});
  check({"gqa with equal heads is plain attention", {2, 3, 5, 4}, {2, 3, 6, 4}, {2, 3, 6, 3},
         ScaledDotProductAttentionFuncOptions().enable_gqa(true)});
  // Each group of query heads equals plain attention over its repeated key/value head.
  torch::manual_seed(8);
  const auto q = torch::randn({1, 4, 5, 8}), k = torch::randn({1, 2, 6, 8}), v = torch::randn({1, 2, 6, 8});
  const auto gqa = attnkit::scaled_dot_product_attention(q, k, v, ScaledDotProductAttentionFuncOptions().enable_gqa(true));
  const auto repeated = attnkit::softmax_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1));
  EXPECT_TRUE(torch::equal(gqa, repeated));
}

TEST(Sdpa, Refusals) {
  const auto q = torch::randn({2, 4, 5, 8}), k = torch::randn({2, 4, 6, 8}), v = torch::randn({2, 4, 6, 3});
  using O = ScaledDotProductAttentionFuncOptions;
  auto call = [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c, const O& o) {
    return [=] { attnkit::scaled_dot_product_attention(a, b, c, o); };
  };
  using attnkit::testing::expect_error;
  expect_error(call(q, k, v, O().dropout_p(1.5)), {"scaled_dot_product_attention", "dropout_p must be in [0, 1]"});
  expect_error(call(q, k, v, O().dropout_p(-0.1)), {"dropout_p must be in [0, 1]"});
  expect_error(call(q, k, v, O().is_causal(true).attn_mask(torch::ones({5, 6}, torch::kBool))),
               {"attn_mask and is_causal=True"});
  expect_error(call(q, k, v, O().attn_mask(torch::ones({5, 6}, f64()))), {"'attn_mask'", "float32", "float64"});
  expect_error(call(q, k, v, O().attn_mask(torch::ones({5, 4}, torch::kBool))), {"'attn_mask' must broadcast",
                                                                               "(5, 4)"});
  expect_error(call(q, torch::randn({2, 3, 6, 8}), torch::randn({2, 3, 6, 3}), O().enable_gqa(true)),
               {"enable_gqa", "3 heads of 'key' must divide the query's 4"});
  expect_error(call(q, torch::randn({2, 2, 6, 8}), torch::randn({2, 2, 6, 3}), O()),
               {"do not broadcast", "enable_gqa=True"});
  expect_error(call(torch::randn({5, 8}), torch::randn({6, 8}), torch::randn({6, 3}), O().enable_gqa(true)),
               {"enable_gqa needs a head dimension"});
  expect_error(call(torch::randn({8}), k, v, O()), {"'query' must have at least 2 dimensions"});
  expect_error(call(q, torch::randn({2, 4, 6, 7}), v, O()), {"'key' has feature size 7"});
  expect_error(call(q, k, torch::randn({2, 4, 5, 3}), O()), {"'value' has 5 positions but 'key' has 6"});
  expect_error(call(q, k.to(torch::kDouble), v, O()), {"'key' must have dtype"});
}

}  // namespace

}  // namespace scaled_dot_product_attention_op_test
