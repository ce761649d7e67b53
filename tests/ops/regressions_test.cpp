// Regressions from issue 15 (a random sweep through torch.ops.attnkit): each
// test failed before its fix.
#include <attnkit/ops.h>

#include "test_util.h"

#include <cfloat>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace attnkit::testing::regressions_test {
namespace {

// ---------------------------------------------------------------------------
// A scale (or clip, eps) finite in float64 but not in the inputs' dtype.
// ---------------------------------------------------------------------------

TEST(Issue15Scale, OverflowingFloat32ScaleIsRefusedByEveryOpWithAScale) {
  auto q = torch::randn({1, 2, 5, 4}, f32());
  const EdgeList all = edges::full(5, 5);
  for (double scale : {1e39, -1e39, 3.5e38}) {
    const std::string value = scale == 3.5e38 ? "3.5e+38" : (scale < 0 ? "-1e+39" : "1e+39");
    expect_error([&] { softmax_attention(q, q, q, SoftmaxAttentionFuncOptions().scale(scale)); },
                 {"softmax_attention", "option 'scale'", "float32", value});
    expect_error([&] {
      clustered_attention(q, q, q, ClusteredAttentionFuncOptions().clusters(2).scale(scale));
    }, {"clustered_attention", "option 'scale'", "float32", value});
    expect_error([&] {
      clustered_attention(q, q, q, ClusteredAttentionFuncOptions().clusters(2).topk(2).scale(scale));
    }, {"clustered_attention", "option 'scale'", "float32", value});
    expect_error([&] { sparse_attention(q, q, q, all, SparseAttentionFuncOptions().scale(scale)); },
                 {"sparse_attention", "option 'scale'", "float32", value});
  }
}

TEST(Issue15Scale, LargestFloat32ScaleAndFloat64ScalesAreAccepted) {
  auto q = torch::randn({1, 2, 5, 4}, f32());
  // FLT_MAX is finite in float32: accepted (the output is whatever it is, but no error).
  EXPECT_NO_THROW(softmax_attention(q, q, q, SoftmaxAttentionFuncOptions().scale(FLT_MAX)));
  // In float64 1e39 is an ordinary scale: the softmax is a hard max, finite.
  auto q64 = q.to(torch::kDouble);
  auto out = softmax_attention(q64, q64, q64, SoftmaxAttentionFuncOptions().scale(1e39));
  EXPECT_TRUE(all_finite(out));
  EXPECT_NO_THROW(sparse_attention(q64, q64, q64, edges::full(5, 5),
                                   SparseAttentionFuncOptions().scale(1e39)));
  EXPECT_NO_THROW(clustered_attention(q64, q64, q64,
                                      ClusteredAttentionFuncOptions().clusters(2).scale(1e39)));
}

TEST(Issue15Scale, ClipAndEpsMustBeFiniteInFloat32) {
  auto cq = torch::rand({1, 2, 6}, f32()), cr = torch::rand({1, 2, 6}, f32());
  auto v = torch::randn({1, 2, 6, 3}, f32());
  expect_error([&] {
    agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().clip(1e39));
  }, {"agglomerative_attention", "option 'clip'", "float32", "1e+39"});
  auto q = torch::randn({1, 2, 6, 3}, f32());
  expect_error([&] {
    linear_attention(q, q, v, LinearAttentionFuncOptions().normalize(true).eps(1e39));
  }, {"linear_attention", "option 'eps'", "float32", "1e+39"});
  // float64 runs the composite with the value as given.
  auto out = agglomerative_attention(cq.to(torch::kDouble), cr.to(torch::kDouble),
                                     v.to(torch::kDouble),
                                     AgglomerativeAttentionFuncOptions().clip(1e39));
  EXPECT_TRUE(all_finite(out));
  EXPECT_NO_THROW(linear_attention(q.to(torch::kDouble), q.to(torch::kDouble), v.to(torch::kDouble),
                                   LinearAttentionFuncOptions().normalize(true).eps(1e39)));
}

// A clip below the dtype's smallest normal number rounds to 0 or a subnormal
// and made an empty prefix's average 0 / 0: all-NaN outputs in bfloat16, whose
// bound was not checked (only float32's was, after the dispatch). The bound is
// now the square root of that number (issue 47: Issue47Clip below).
TEST(Issue15Scale, ClipBelowTheSmallestNormalNumberIsRefusedPerDtype) {
  auto cq = torch::ones({1, 2, 3}), cr = torch::zeros({1, 2, 3});
  auto v = torch::ones({1, 2, 3, 2});
  for (auto type : {torch::kFloat, torch::kBFloat16}) {
    const double smallest = std::sqrt(type == torch::kFloat
                                          ? std::numeric_limits<float>::min()
                                          : static_cast<double>(std::numeric_limits<c10::BFloat16>::min()));
    const char* name = type == torch::kFloat ? "float32" : "bfloat16";
    expect_error([&] {
      agglomerative_attention(cq.to(type), cr.to(type), v.to(type), AgglomerativeAttentionFuncOptions().clip(1e-45));
    }, {"agglomerative_attention", "option 'clip'", "at least", name, "1e-45"});
    auto out = agglomerative_attention(cq.to(type), cr.to(type), v.to(type),
                                       AgglomerativeAttentionFuncOptions().clip(smallest));
    EXPECT_TRUE(all_finite(out.to(torch::kDouble))) << name;
  }
  // float64's bound is sqrt(DBL_MIN) = 2^-511: 1e-45 is an ordinary clip there.
  auto out = agglomerative_attention(cq.to(torch::kDouble), cr.to(torch::kDouble), v.to(torch::kDouble),
                                     AgglomerativeAttentionFuncOptions().clip(1e-45));
  EXPECT_TRUE(all_finite(out));
}

// Issue 47's fuzz: with clip at 1e-30 or 1.5e-38 agglomerative attention gave
// non-finite values from finite inputs (the gradient towards cr, where the
// clip is active: cq v / clip summed over the queries, past float32's range)
// and, in two calls, values far from float64's. Such clips are refused; at
// the smallest accepted one (2^-63) the reproducer's output and gradients are
// finite and match float64.
TEST(Issue47Clip, ClipsWhoseGradientsOverflowAreRefusedAndTheSmallestAcceptedIsFinite) {
  torch::manual_seed(0);
  const auto cq0 = torch::rand({1, 3, 8}).permute({0, 2, 1});  // (1, 8, 3), strided
  const auto cr0 = torch::zeros({1, 8, 17});
  const auto v0 = torch::randn({1, 8, 17, 6});
  for (const double clip : {1.5e-38, 1e-30, 1e-20})
    expect_error([&] {
      agglomerative_attention(cq0, cr0, v0, AgglomerativeAttentionFuncOptions().causal(true).clip(clip));
    }, {"agglomerative_attention", "option 'clip'", "at least", "float32", "overflow"});
  const double smallest = std::ldexp(1.0, -63);
  const auto g0 = torch::randn({1, 8, 3, 6}, torch::kDouble);  // the output's gradient
  for (const bool causal : {true, false}) {
    auto run = [&](torch::Dtype type) {
      auto cq = cq0.to(type).requires_grad_(), cr = cr0.to(type).requires_grad_(), v = v0.to(type).requires_grad_();
      auto out = agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().causal(causal).clip(smallest));
      const auto grads = torch::autograd::grad({out}, {cq, cr, v}, {g0.to(type)});
      return std::vector<torch::Tensor>{out, grads[0], grads[1], grads[2]};
    };
    const auto got = run(torch::kFloat), want = run(torch::kDouble);
    const char* names[] = {"out", "dcq", "dcr", "dv"};
    for (int i = 0; i < 4; ++i) {
      SCOPED_TRACE(std::string(names[i]) + (causal ? " causal" : ""));
      EXPECT_TRUE(all_finite(got[i].to(torch::kDouble)));
      // float32 rounding of sums of a few terms, relative to the largest entry.
      const double scale = want[i].abs().max().item<double>() + 1e-300;
      EXPECT_LE((got[i].to(torch::kDouble) - want[i]).abs().max().item<double>() / scale, 1e-5);
    }
  }
}

// ---------------------------------------------------------------------------
// Edge lists with L = 0.
// ---------------------------------------------------------------------------

TEST(Issue15EdgeList, PerHeadOffsetsAreRangeCheckedWithNoQueries) {
  auto q = torch::randn({1, 2, 0, 4}, f32()), k = torch::randn({1, 2, 3, 4}, f32());
  const auto cols = torch::empty({0}, torch::kLong);
  EdgeList bad{torch::tensor({{int64_t{-7}}, {int64_t{1} << 62}}), cols};
  expect_error([&] { sparse_attention(q, k, k, bad); },
               {"sparse_attention", "'offsets'", "[0, 0]", "offsets[0][0] = -7"});
  EdgeList high{torch::tensor({{int64_t{0}}, {int64_t{1} << 62}}), cols};
  expect_error([&] { sparse_attention(q, k, k, high); },
               {"sparse_attention", "'offsets'", "offsets[1][0] = 4611686018427387904"});
  // Valid per-head and shared lists with no queries still work: an empty output.
  EdgeList ok{torch::zeros({2, 1}, torch::kLong), cols};
  EXPECT_EQ(sparse_attention(q, k, k, ok).sizes(), (std::vector<int64_t>{1, 2, 0, 4}));
  EdgeList shared{torch::zeros({1}, torch::kLong), cols};
  EXPECT_EQ(sparse_attention(q, k, k, shared).sizes(), (std::vector<int64_t>{1, 2, 0, 4}));
  // The first offset of a list with queries is checked too (it used to be
  // reached only through the pair check of its first row).
  auto q1 = torch::randn({1, 2, 1, 4}, f32());
  EdgeList neg{torch::tensor({{int64_t{-1}, int64_t{0}}, {int64_t{0}, int64_t{0}}}), cols};
  expect_error([&] { sparse_attention(q1, k, k, neg); }, {"sparse_attention", "offsets[0][0] = -1"});
}

// ---------------------------------------------------------------------------
// Gated linear attention with E = 0.
// ---------------------------------------------------------------------------

TEST(Issue15Gated, WrongGateShapeWithZeroFeaturesGivesTheShapeError) {
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    auto f = torch::zeros({2, 3, 4, 0}, torch::TensorOptions().dtype(dtype));
    auto good = torch::rand({2, 3, 4}, torch::TensorOptions().dtype(dtype));
    auto bad = torch::rand({2, 3, 5}, torch::TensorOptions().dtype(dtype));
    expect_error([&] { gated_linear_attention(f, f, bad, good); },
                 {"gated_linear_attention", "argument 'alpha'", "(N, H, L) = (2, 3, 4)", "(2, 3, 5)"});
    expect_error([&] { gated_linear_attention(f, f, good, bad); },
                 {"gated_linear_attention", "argument 'beta'", "(N, H, L) = (2, 3, 4)", "(2, 3, 5)"});
    // With the right shapes E = 0 is an empty output.
    EXPECT_EQ(gated_linear_attention(f, f, good, good).sizes(), f.sizes());
  }
}

TEST(Issue15Gated, CausalWithNoPositionsInFloat64AndFloat32) {
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto o = torch::TensorOptions().dtype(dtype);
    auto f = torch::randn({2, 3, 0, 4}, o).requires_grad_(true);
    auto q = torch::randn({2, 3, 0, 4}, o).requires_grad_(true);
    auto alpha = torch::rand({2, 3, 0}, o).requires_grad_(true);
    auto beta = torch::rand({2, 3, 0}, o).requires_grad_(true);
    auto out = gated_linear_attention(f, q, alpha, beta, GatedLinearAttentionFuncOptions().causal(true));
    EXPECT_EQ(out.sizes(), f.sizes());
    out.sum().backward();
    // With L = 0 the float64 composite reads neither f nor the gates, so
    // autograd leaves their gradients undefined (PyTorch's "None", meaning
    // zeros); the kernel gives empty tensors. Either way, nothing but empty.
    for (const auto& x : {f, q, alpha, beta})
      if (x.grad().defined()) EXPECT_EQ(x.grad().sizes(), x.sizes());
  }
}

// ---------------------------------------------------------------------------
// Edge patterns too large to build.
// ---------------------------------------------------------------------------

TEST(Issue15Patterns, HugeSizesAreRefusedNamingPatternAndSize) {
  const int64_t huge = int64_t{1} << 62;
  expect_error([&] { edges::by_name("star", huge, 0); }, {"edges::star", "n = 4611686018427387904", "limit"});
  expect_error([&] { edges::star(std::numeric_limits<int64_t>::max()); }, {"edges::star", "limit"});
  expect_error([&] { edges::by_name("bp-tree", huge, 0); }, {"edges::bp_tree", "n = 4611686018427387904"});
  expect_error([&] { edges::by_name("full", huge, 0); }, {"edges::full", "L = 4611686018427387904", "limit"});
  expect_error([&] { edges::by_name("causal", int64_t{1} << 20, 0); }, {"edges::causal", "L = 1048576"});
  expect_error([&] { edges::by_name("strided", int64_t{1} << 20, 4); }, {"edges::strided", "n = 1048576"});
  expect_error([&] { edges::by_name("local", huge, 1); }, {"edges::local", "n = 4611686018427387904"});
  expect_error([&] { edges::by_name("segments", huge, 2); }, {"edges::segments", "n = 4611686018427387904"});
  // A span or segment far beyond n is fine (the rows are those of span = n) and
  // no longer overflows i + span.
  const auto wide = edges::local(5, std::numeric_limits<int64_t>::max());
  EXPECT_TRUE(torch::equal(wide.columns, edges::full(5, 5).columns));
  EXPECT_TRUE(torch::equal(wide.offsets, edges::full(5, 5).offsets));
  const auto seg = edges::segments(5, std::numeric_limits<int64_t>::max());
  EXPECT_TRUE(torch::equal(seg.columns, edges::full(5, 5).columns));
}

// ---------------------------------------------------------------------------
// float16: refused at the op boundary, clearly.
// ---------------------------------------------------------------------------

TEST(Issue15Dtypes, Float16IsRefusedByEveryOpNamingTheArgument) {
  const auto h = torch::TensorOptions().dtype(torch::kHalf);
  auto q = torch::randn({1, 2, 4, 3}).to(torch::kHalf);
  const std::vector<std::string> common = {"has dtype float16", "float32, float64 and bfloat16"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), common.begin(), common.end());
    return v;
  };
  expect_error([&] { softmax_attention(q, q, q); }, with({"softmax_attention", "argument 'q'"}));
  expect_error([&] { linear_attention(q, q, q); }, with({"linear_attention", "argument 'q'"}));
  expect_error([&] { clustered_attention(q, q, q, ClusteredAttentionFuncOptions().clusters(2)); },
               with({"clustered_attention", "argument 'q'"}));
  expect_error([&] { sparse_attention(q, q, q, edges::full(4, 4)); },
               with({"sparse_attention", "argument 'q'"}));
  auto gates = torch::rand({1, 2, 4}).to(torch::kHalf);
  expect_error([&] { gated_linear_attention(q, q, gates, gates); },
               with({"gated_linear_attention", "argument 'f'"}));
  expect_error([&] { agglomerative_attention(gates, gates, q); },
               with({"agglomerative_attention", "argument 'cq'"}));
  expect_error([&] { attnkit::linear(torch::randn({2, 3}, h), torch::randn({4, 3}, h)); },
               with({"linear", "argument 'x'"}));
  // A float16 tensor among float32 ones is named too.
  auto q32 = q.to(torch::kFloat);
  expect_error([&] { softmax_attention(q32, q, q32); }, with({"softmax_attention", "argument 'k'"}));
}

TEST(Issue15Dtypes, Bfloat16RunsEveryOpForwardAndBackward) {
  // bfloat16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3); these
  // composites chain a few dozen rounded operations on O(1) values, so 5e-2
  // relative to float64 of the same (bfloat16-rounded) inputs.
  constexpr double kBf16Tol = 5e-2;
  const auto bf = torch::kBFloat16;
  auto check = [&](const char* name, const std::function<torch::Tensor(std::vector<torch::Tensor>)>& f,
                   std::vector<torch::Tensor> inputs) {
    SCOPED_TRACE(name);
    std::vector<torch::Tensor> low, high;
    for (auto& x : inputs) {
      auto r = x.to(bf);
      low.push_back(r.clone().requires_grad_(true));
      high.push_back(r.to(torch::kDouble).requires_grad_(true));
    }
    auto out = f(low);
    EXPECT_EQ(out.scalar_type(), bf);
    auto ref = f(high);
    EXPECT_LT(rel_err(out, ref), kBf16Tol);
    out.to(torch::kFloat).sum().backward();
    ref.sum().backward();
    for (size_t i = 0; i < low.size(); ++i) {
      ASSERT_TRUE(low[i].grad().defined()) << "input " << i;
      EXPECT_LT(rel_err(low[i].grad(), high[i].grad()), kBf16Tol) << "input " << i;
    }
  };
  auto q = torch::randn({1, 2, 5, 4}), k = torch::randn({1, 2, 6, 4}), v = torch::randn({1, 2, 6, 3});
  check("softmax", [](auto x) {
    return softmax_attention(x[0], x[1], x[2], SoftmaxAttentionFuncOptions().causal(true));
  }, {q, k, v});
  check("linear", [](auto x) {
    return linear_attention(x[0], x[1], x[2],
                            LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true));
  }, {q, k, v});
  check("gated", [](auto x) {
    return gated_linear_attention(x[0], x[1], x[2], x[3], GatedLinearAttentionFuncOptions().causal(true));
  }, {q, q.flip(2), torch::rand({1, 2, 5}), torch::rand({1, 2, 5})});
  check("agglomerative", [](auto x) {
    return agglomerative_attention(x[0], x[1], x[2], AgglomerativeAttentionFuncOptions().causal(true));
  }, {torch::rand({1, 2, 5}) + 0.5, torch::rand({1, 2, 6}) + 0.5, v});
  check("improved clustered, topk = S", [](auto x) {
    return clustered_attention(x[0], x[1], x[2], ClusteredAttentionFuncOptions().clusters(2).topk(6));
  }, {q, k, v});
  check("sparse", [](auto x) { return sparse_attention(x[0], x[1], x[2], edges::local(5, 1)); },
        {q, q.flip(2), torch::randn({1, 2, 5, 3})});
  check("linear (dense)", [](auto x) { return attnkit::linear(x[0], x[1], x[2]); },
        {torch::randn({3, 4}), torch::randn({2, 4}), torch::randn({2})});
}

// Found while chasing issue 47's fuzz: no query heads (H = 0) with a key and
// value head (any head count divides 0) killed sparse attention with SIGFPE
// (a group of 0 heads divided by) and left dk and dv uninitialised in the
// float32 and bfloat16 backward of every grouped-head op. Now the output is
// empty and the key and value gradients are exact zeros, in every dtype.
TEST(Issue47NoQueryHeads, EveryGroupedHeadOpGivesEmptyOutputAndZeroKeyGradients) {
  for (auto type : {torch::kFloat, torch::kBFloat16, torch::kDouble}) {
    const auto o = torch::TensorOptions().dtype(type);
    const auto q = torch::randn({1, 0, 2, 4}, o).requires_grad_();
    const auto k = torch::randn({1, 1, 3, 4}, o).requires_grad_(), v = torch::randn({1, 1, 3, 4}, o).requires_grad_();
    const EdgeList edges{torch::tensor({int64_t{0}, int64_t{1}, int64_t{2}}), torch::tensor({int64_t{0}, int64_t{1}})};
    const std::vector<std::pair<std::string, std::function<torch::Tensor()>>> ops = {
        {"softmax_attention", [&] { return softmax_attention(q, k, v); }},
        {"sparse_attention", [&] { return sparse_attention(q, k, v, edges); }},
        {"linear_attention", [&] { return linear_attention(q, k, v); }},
        {"clustered_attention",
         [&] { return clustered_attention(q, k, v, ClusteredAttentionFuncOptions().clusters(2)); }},
    };
    for (const auto& [name, run] : ops) {
      SCOPED_TRACE(name + " " + std::string(c10::toString(type)));
      for (int repeat = 0; repeat < 3; ++repeat) {  // garbage showed in some calls only
        const auto out = run();
        EXPECT_EQ(out.sizes(), torch::IntArrayRef({1, 0, 2, 4}));
        const auto grads = torch::autograd::grad({out}, {q, k, v}, {torch::ones_like(out)});
        EXPECT_EQ(grads[1].sizes(), k.sizes());
        EXPECT_EQ(grads[2].sizes(), v.sizes());
        EXPECT_EQ(grads[1].abs().sum().item<double>(), 0.0);
        EXPECT_EQ(grads[2].abs().sum().item<double>(), 0.0);
      }
    }
  }
}

}  // namespace
}  // namespace attnkit::testing::regressions_test
