// Gradients of every op w.r.t. every floating input against float64 central
// differences (test_util.h: expect_gradients_match, eps 1e-6, |diff| <= 1e-6 +
// 1e-5 |numeric|, which fits smooth float64 functions of O(1) values). Sizes are
// tiny because each element is perturbed twice.
#include <attnkit/ops.h>

#include "test_util.h"

namespace attnkit::testing::gradients_test {
namespace {

using Inputs = std::vector<torch::Tensor>;

torch::Tensor rnd(std::vector<int64_t> shape) { return torch::randn(shape, f64()); }

/// Autograd gradients of sum(f(inputs) * cot) for every input (float64).
std::vector<torch::Tensor> grads_of(const std::function<torch::Tensor(const Inputs&)>& f, Inputs inputs,
                                    torch::Tensor* cot_out = nullptr) {
  for (auto& x : inputs) x = x.detach().clone().requires_grad_(true);
  auto out = f(inputs);
  auto cot = torch::randn(out.sizes(), f64());
  if (cot_out) *cot_out = cot;
  return torch::autograd::grad({(out * cot).sum()}, inputs, {}, false, false, /*allow_unused=*/true);
}

// ---------------------------------------------------------------------------
// softmax_attention
// ---------------------------------------------------------------------------

void check_softmax(int64_t N, int64_t H, int64_t L, int64_t S, int64_t E, int64_t M,
                   const SoftmaxAttentionFuncOptions& o) {
  expect_gradients_match(
      [&](const Inputs& x) { return softmax_attention(x[0], x[1], x[2], o); },
      {rnd({N, H, L, E}), rnd({N, H, S, E}), rnd({N, H, S, M})});
}

TEST(GradientSoftmax, Plain) {
  torch::manual_seed(100);
  check_softmax(1, 2, 3, 4, 3, 2, {});
}

TEST(GradientSoftmax, CausalFewerQueriesThanKeys) {
  torch::manual_seed(101);
  check_softmax(1, 1, 2, 4, 3, 2, SoftmaxAttentionFuncOptions().causal(true));
}

TEST(GradientSoftmax, CausalMoreQueriesThanKeys) {
  // L = 4, S = 2: queries 0 and 1 see no key (output 0, gradient 0).
  torch::manual_seed(102);
  check_softmax(1, 1, 4, 2, 2, 3, SoftmaxAttentionFuncOptions().causal(true));
  auto g = grads_of([](const Inputs& x) { return softmax_attention(x[0], x[1], x[2], SoftmaxAttentionFuncOptions().causal(true)); },
                    {rnd({1, 1, 4, 2}), rnd({1, 1, 2, 2}), rnd({1, 1, 2, 3})});
  EXPECT_TRUE(torch::equal(g[0][0][0].narrow(0, 0, 2), torch::zeros({2, 2}, f64())));
}

TEST(GradientSoftmax, CustomScale) {
  torch::manual_seed(103);
  check_softmax(2, 1, 3, 3, 2, 2, SoftmaxAttentionFuncOptions().scale(0.37));
}

TEST(GradientSoftmax, KeyLengthsIncludingZeroGiveZeroNotNaN) {
  torch::manual_seed(104);
  auto o = SoftmaxAttentionFuncOptions().key_lengths(i64({2, 0, 3}));
  check_softmax(3, 1, 2, 3, 2, 2, o);
  auto g = grads_of([&](const Inputs& x) { return softmax_attention(x[0], x[1], x[2], o); },
                    {rnd({3, 1, 2, 2}), rnd({3, 1, 3, 2}), rnd({3, 1, 3, 2})});
  for (const auto& gi : g) {
    ASSERT_TRUE(gi.defined());
    EXPECT_TRUE(all_finite(gi));
    EXPECT_EQ(max_abs(gi[1]), 0.0) << "batch with key_lengths 0 must get zero gradients";
  }
  // Batch 0 sees keys 0, 1 only: the hidden key gets no gradient.
  EXPECT_EQ(max_abs(g[1][0][0][2]), 0.0);
  EXPECT_EQ(max_abs(g[2][0][0][2]), 0.0);
}

TEST(GradientSoftmax, BiasGetsItsGradientToo) {
  // bias (N, 1, L, S) broadcast over heads, so its gradient sums over H.
  torch::manual_seed(105);
  expect_gradients_match(
      [](const Inputs& x) { return softmax_attention(x[0], x[1], x[2], SoftmaxAttentionFuncOptions().bias(x[3])); },
      {rnd({2, 2, 3, 2}), rnd({2, 2, 4, 2}), rnd({2, 2, 4, 3}), rnd({2, 1, 3, 4})});
}

TEST(GradientSoftmax, BiasWithMinusInfinityAndCausalMask) {
  // A -inf bias entry hides key 1 from query 2 (zero gradient there); row 1 is
  // fully hidden (output 0, zero gradients).
  torch::manual_seed(106);
  auto bias = rnd({1, 1, 3, 3});
  bias[0][0][2][1] = -std::numeric_limits<double>::infinity();
  bias[0][0][1].fill_(-std::numeric_limits<double>::infinity());
  auto f = [](const Inputs& x) {
    return softmax_attention(x[0], x[1], x[2], SoftmaxAttentionFuncOptions().bias(x[3]).causal(true));
  };
  Inputs in{rnd({1, 1, 3, 2}), rnd({1, 1, 3, 2}), rnd({1, 1, 3, 2}), bias};
  expect_gradients_match(f, in);
  auto g = grads_of(f, in);
  for (const auto& gi : g) EXPECT_TRUE(all_finite(gi));
  EXPECT_EQ(max_abs(g[0][0][0][1]), 0.0) << "fully hidden row: zero query gradient";
  EXPECT_EQ(max_abs(g[3][0][0][1]), 0.0) << "fully hidden row: zero bias gradient";
  EXPECT_EQ(g[3][0][0][2][1].item<double>(), 0.0) << "-inf bias entry: zero gradient";
  // Key 1 is visible to no query (causal hides it from query 0, the bias from 1 and 2).
  EXPECT_EQ(max_abs(g[1][0][0][1]), 0.0) << "invisible key: zero gradient";
  EXPECT_EQ(max_abs(g[2][0][0][1]), 0.0) << "invisible value: zero gradient";
}

// ---------------------------------------------------------------------------
// linear_attention
// ---------------------------------------------------------------------------

TEST(GradientLinear, EveryFeatureMapNormalizationAndMask) {
  torch::manual_seed(200);
  for (auto map : {FeatureMap::identity, FeatureMap::elu})
    for (bool normalize : {false, true})
      for (bool causal : {false, true})
        for (const auto& ls : {std::pair<int64_t, int64_t>{3, 4}, {4, 2}}) {
          const int64_t L = ls.first, S = ls.second;
          if (!causal && L == 4) continue;  // one non-causal shape is enough
          SCOPED_TRACE(to_string(map) + (normalize ? " normalize" : "") + (causal ? " causal" : "") +
                       " L=" + std::to_string(L) + " S=" + std::to_string(S));
          auto o = LinearAttentionFuncOptions().feature_map(map).normalize(normalize).causal(causal);
          // Identity + normalisation divides by q.z: keep q and k positive so the
          // denominator stays away from 0 (the function is smooth there).
          auto draw = [&](std::vector<int64_t> shape) {
            return (map == FeatureMap::identity && normalize) ? torch::rand(shape, f64()) + 0.5 : rnd(shape);
          };
          expect_gradients_match([&](const Inputs& x) { return linear_attention(x[0], x[1], x[2], o); },
                                 {draw({1, 2, L, 2}), draw({1, 2, S, 2}), rnd({1, 2, S, 3})});
        }
}

// ---------------------------------------------------------------------------
// gated_linear_attention
// ---------------------------------------------------------------------------

TEST(GradientGated, AllInputsCausalAndNot) {
  torch::manual_seed(300);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    auto o = GatedLinearAttentionFuncOptions().causal(causal);
    expect_gradients_match(
        [&](const Inputs& x) { return gated_linear_attention(x[0], x[1], x[2], x[3], o); },
        {rnd({1, 2, 3, 2}), rnd({1, 2, 3, 2}), torch::rand({1, 2, 3}, f64()) + 0.25, rnd({1, 2, 3})});
  }
}

TEST(GradientGated, EmptySequenceStaysInTheGraphOfEveryInput) {
  // L = 0: the output is empty, but it must depend on whichever inputs
  // require grad, on both paths (float64: the composite; float32: the
  // kernel), so that autograd treats it like any other output. Once the
  // float64 composite started from a fresh zeros matrix and returned an output
  // without grad_fn when q did not require grad.
  for (auto dtype : {torch::kDouble, torch::kFloat})
    for (bool causal : {false, true})
      for (int mask = 1; mask < 16; ++mask) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + (causal ? " causal" : "") +
                     ", inputs requiring grad (bits f q alpha beta): " + std::to_string(mask));
        const auto o = torch::TensorOptions().dtype(dtype);
        Inputs x{torch::randn({1, 2, 0, 3}, o), torch::randn({1, 2, 0, 3}, o),
                 torch::rand({1, 2, 0}, o), torch::rand({1, 2, 0}, o)};
        Inputs wanted;
        for (int i = 0; i < 4; ++i)
          if (mask & (1 << i)) wanted.push_back(x[i].requires_grad_(true));
        auto out = gated_linear_attention(x[0], x[1], x[2], x[3],
                                          GatedLinearAttentionFuncOptions().causal(causal));
        ASSERT_TRUE(out.requires_grad());
        EXPECT_EQ(out.sizes(), x[1].sizes());
        auto g = torch::autograd::grad({out.sum()}, wanted, {}, false, false, /*allow_unused=*/true);
        for (size_t i = 0; i < g.size(); ++i) {
          // An unused input's gradient may come back undefined; a defined one is empty zeros.
          if (g[i].defined()) EXPECT_EQ(g[i].sizes(), wanted[i].sizes()) << i;
        }
      }
}

// ---------------------------------------------------------------------------
// agglomerative_attention
// ---------------------------------------------------------------------------

TEST(GradientAgglomerative, FullAndCausal) {
  torch::manual_seed(400);
  for (bool causal : {false, true})
    for (const auto& ls : {std::pair<int64_t, int64_t>{3, 3}, {2, 4}, {4, 2}}) {
      const int64_t L = ls.first, S = ls.second;
      SCOPED_TRACE(std::string(causal ? "causal" : "full") + " L=" + std::to_string(L) + " S=" + std::to_string(S));
      auto o = AgglomerativeAttentionFuncOptions().causal(causal);
      // Class weights are softmax outputs in practice: positive, sums well above the clip.
      expect_gradients_match(
          [&](const Inputs& x) { return agglomerative_attention(x[0], x[1], x[2], o); },
          {torch::rand({1, 2, L}, f64()), torch::rand({1, 2, S}, f64()) + 0.1, rnd({1, 2, S, 3})});
    }
}

TEST(GradientAgglomerative, ActiveClipHasNoDenominatorGradient) {
  // cr ~ 1e-4: every (prefix) sum is below the clip 1e-3, so
  // out_i = cq_i * sum_t cr_t v_t / 1e-3 and d loss / d cr_t = sum_{i,m} cot_im cq_i v_tm / 1e-3.
  torch::manual_seed(401);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    auto o = AgglomerativeAttentionFuncOptions().causal(causal);
    auto f = [&](const Inputs& x) { return agglomerative_attention(x[0], x[1], x[2], o); };
    Inputs in{torch::rand({1, 1, 3}, f64()), (torch::rand({1, 1, 3}, f64()) + 0.5) * 1e-4, rnd({1, 1, 3, 2})};
    expect_gradients_match(f, in);
    torch::Tensor cot;
    auto g = grads_of(f, in, &cot);
    // Hand formula: query i uses keys t <= i (L = S = 3) when causal, all otherwise.
    auto expected = torch::zeros({3}, f64());
    for (int64_t t = 0; t < 3; ++t)
      for (int64_t i = 0; i < 3; ++i)
        if (!causal || t <= i)
          expected[t] += (cot[0][0][i] * in[0][0][0][i] * in[2][0][0][t]).sum() / 1e-3;
    EXPECT_LE(rel_err(g[1].view({3}), expected), 1e-12);  // float64, a few terms
  }
}

// ---------------------------------------------------------------------------
// clustered_attention
// ---------------------------------------------------------------------------

/// L = 6 queries in two well-separated directions (|noise| << |centre|), so that
/// perturbations of 1e-6 never move a query across a hash plane and the labels
/// (constants of the function) stay put.
torch::Tensor grouped_queries(int64_t N, int64_t H) {
  auto centres = torch::tensor({2.0, 0.5, 0.0, -0.5, 0.0, -2.0}, f64()).view({2, 3});
  auto q = centres.repeat({3, 1}).view({1, 1, 6, 3}).expand({N, H, 6, 3}).clone();
  return q + 0.05 * torch::randn({N, H, 6, 3}, f64());
}

TEST(GradientClustered, PlainAndImproved) {
  torch::manual_seed(500);
  for (int64_t topk : {0, 2, 4}) {
    SCOPED_TRACE("topk " + std::to_string(topk));
    auto o = ClusteredAttentionFuncOptions().clusters(2).bits(15).iterations(5).topk(topk).hash_bias(false).seed(1);
    expect_gradients_match([&](const Inputs& x) { return clustered_attention(x[0], x[1], x[2], o); },
                           {grouped_queries(1, 2), rnd({1, 2, 4, 3}), rnd({1, 2, 4, 2})});
  }
}

TEST(GradientClustered, ImprovedWithPaddingAndHiddenKeys) {
  torch::manual_seed(501);
  auto o = ClusteredAttentionFuncOptions().clusters(2).bits(15).iterations(5).topk(2).hash_bias(false).seed(2)
               .key_lengths(i64({3, 4})).query_lengths(i64({6, 4}));
  Inputs in{grouped_queries(2, 1), rnd({2, 1, 4, 3}), rnd({2, 1, 4, 2})};
  auto f = [&](const Inputs& x) { return clustered_attention(x[0], x[1], x[2], o); };
  expect_gradients_match(f, in);
  auto g = grads_of(f, in);
  EXPECT_EQ(max_abs(g[0][1][0].narrow(0, 4, 2)), 0.0) << "padded queries get no gradient";
  EXPECT_EQ(max_abs(g[1][0][0][3]), 0.0) << "a hidden key gets no gradient";
  EXPECT_EQ(max_abs(g[2][0][0][3]), 0.0) << "a hidden value gets no gradient";
}

// ---------------------------------------------------------------------------
// sparse_attention
// ---------------------------------------------------------------------------

TEST(GradientSparse, SharedListWithAnEmptyRow) {
  // Row 0 -> {0, 2, 3}, row 1 -> {} (zero output and gradient), row 2 -> {1}.
  torch::manual_seed(600);
  EdgeList edges{i64({0, 3, 3, 4}), i64({0, 2, 3, 1})};
  auto f = [&](const Inputs& x) { return sparse_attention(x[0], x[1], x[2], edges); };
  Inputs in{rnd({1, 2, 3, 2}), rnd({1, 2, 4, 2}), rnd({1, 2, 4, 3})};
  expect_gradients_match(f, in);
  auto g = grads_of(f, in);
  for (const auto& gi : g) EXPECT_TRUE(all_finite(gi));
  EXPECT_EQ(max_abs(g[0][0].select(1, 1)), 0.0) << "a query without edges gets no gradient";
}

TEST(GradientSparse, PerHeadListsAndScale) {
  // Head 0: rows {0, 1}, {1, 2, 3}, {3}; head 1: rows {}, {0}, {0, 1, 2, 3}.
  torch::manual_seed(601);
  // Offsets per head index one flat column list: head 1 starts where head 0 ends.
  EdgeList edges{i64({0, 2, 5, 6, 6, 6, 7, 11}).view({2, 4}), i64({0, 1, 1, 2, 3, 3, 0, 0, 1, 2, 3})};
  expect_gradients_match(
      [&](const Inputs& x) { return sparse_attention(x[0], x[1], x[2], edges, SparseAttentionFuncOptions().scale(0.8)); },
      {rnd({1, 2, 3, 2}), rnd({1, 2, 4, 2}), rnd({1, 2, 4, 3})});
}

// ---------------------------------------------------------------------------
// The ops with a float32 kernel: double backward and saved tensors
// ---------------------------------------------------------------------------

struct KernelOp {
  std::string name;
  std::function<torch::Tensor(const Inputs&)> f;
  Inputs inputs;  // float64
};

/// Every op whose float32 path is a kernel-backed autograd Function.
std::vector<KernelOp> kernel_ops() {
  torch::manual_seed(700);
  const auto lin = LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true).causal(true);
  const auto gated = GatedLinearAttentionFuncOptions().causal(true);
  const auto agg = AgglomerativeAttentionFuncOptions().causal(true);
  const auto clu =
      ClusteredAttentionFuncOptions().clusters(2).bits(15).iterations(5).topk(2).hash_bias(false).seed(1);
  return {
      {"linear_attention", [=](const Inputs& x) { return linear_attention(x[0], x[1], x[2], lin); },
       {rnd({1, 2, 4, 3}), rnd({1, 2, 5, 3}), rnd({1, 2, 5, 2})}},
      {"gated_linear_attention",
       [=](const Inputs& x) { return gated_linear_attention(x[0], x[1], x[2], x[3], gated); },
       {rnd({1, 2, 4, 3}), rnd({1, 2, 4, 3}), torch::rand({1, 2, 4}, f64()) + 0.25, rnd({1, 2, 4})}},
      {"agglomerative_attention",
       [=](const Inputs& x) { return agglomerative_attention(x[0], x[1], x[2], agg); },
       {torch::rand({1, 2, 4}, f64()), torch::rand({1, 2, 5}, f64()) + 0.1, rnd({1, 2, 5, 3})}},
      {"clustered_attention", [=](const Inputs& x) { return clustered_attention(x[0], x[1], x[2], clu); },
       {grouped_queries(1, 2), rnd({1, 2, 4, 3}), rnd({1, 2, 4, 2})}},
  };
}

Inputs float32_leaves(const Inputs& x) {
  Inputs out;
  for (const auto& t : x) out.push_back(t.detach().to(torch::kFloat).requires_grad_(true));
  return out;
}

TEST(GradientKernels, DoubleBackwardThroughAFloat32KernelRaises) {
  // The kernels compute first-order gradients only. Under create_graph = true
  // those are still returned, equal to the plain ones, but differentiating
  // them again must fail loudly instead of silently dropping second-order terms.
  for (const auto& op : kernel_ops()) {
    SCOPED_TRACE(op.name);
    auto x = float32_leaves(op.inputs);
    auto out = op.f(x);
    auto loss = (out * torch::randn(out.sizes(), f32())).sum();
    auto first = torch::autograd::grad({loss}, x, {}, /*retain_graph=*/true, /*create_graph=*/true);
    auto plain = torch::autograd::grad({loss}, x, {}, /*retain_graph=*/true);
    for (size_t i = 0; i < first.size(); ++i) {
      if (!plain[i].defined()) continue;
      EXPECT_TRUE(torch::equal(first[i], plain[i])) << i;
      EXPECT_TRUE(first[i].requires_grad()) << i;
      expect_error([&] { torch::autograd::grad({first[i].sum()}, x, {}, true, false, true); },
                   {op.name, "double backward", "float64"});
    }
  }
}

TEST(GradientKernels, Float64CompositeSupportsSecondOrderGradients) {
  for (const auto& op : kernel_ops()) {
    SCOPED_TRACE(op.name);
    expect_second_order_gradients_match(op.f, op.inputs);
  }
}

TEST(GradientKernels, InPlaceChangeOfASavedInputBeforeBackwardRaises) {
  // Each Function keeps its tensors with save_for_backward, whose version
  // check turns a later in-place change into an error instead of a wrong
  // gradient.
  for (const auto& op : kernel_ops())
    for (size_t i = 0; i < op.inputs.size(); ++i) {
      SCOPED_TRACE(op.name + ", input " + std::to_string(i));
      auto leaves = float32_leaves(op.inputs);
      Inputs x;
      for (const auto& t : leaves) x.push_back(t * 1.0f);  // non-leaves may change in place
      auto out = op.f(x);
      {
        torch::NoGradGuard no_grad;
        x[i].mul_(0.5f);
      }
      expect_error([&] { out.sum().backward(); }, {"modified by an inplace operation"});
    }
}

TEST(GradientKernels, InPlaceChangeOfClusteredKeyLengthsBeforeBackwardRaises) {
  torch::manual_seed(701);
  auto key_lengths = i64({3, 4});
  auto o = ClusteredAttentionFuncOptions().clusters(2).bits(15).topk(2).key_lengths(key_lengths);
  auto q = grouped_queries(2, 1).to(torch::kFloat).requires_grad_(true);
  auto out = clustered_attention(q, torch::randn({2, 1, 4, 3}), torch::randn({2, 1, 4, 2}), o);
  key_lengths.fill_(1);
  expect_error([&] { out.sum().backward(); }, {"modified by an inplace operation"});
}

}  // namespace
}  // namespace attnkit::testing::gradients_test
