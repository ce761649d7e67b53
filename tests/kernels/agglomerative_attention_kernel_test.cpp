// The float32 agglomerative_attention op (kernels/agglomerative.*) against the
// float64 reference: values and every input gradient, full and causal, equal
// and unequal lengths, the clip, strided inputs, thread counts, and the
// one-class identity (a (causal) mean of the values).
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include <tuple>

#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::agglomerative_attention_kernel_test {
namespace {

using testing::expect_error;
using testing::f32;
using testing::f64;
using testing::rel_err;

// Float32 against float64, relative to the largest reference entry. Each
// value is a scan of at most 64 + S/64 float32 additions (one block plus the
// block carries) and a product or two: ~70 roundings of 6e-8 for S <= 300;
// dcr adds the cancellation of v_t . dsums against dcount. Measured maxima:
// 4e-7 for out, dcq and dv, 2.2e-6 for dcr. A wrong index, block boundary or
// gradient term shows up at 1e-2 or more.
constexpr double kFloatTol = 1e-5;
// Two float32 runs with the same arithmetic in a different memory layout: only
// the compiler's choice of fused multiply-adds per loop version may differ.
constexpr double kLayoutTol = 1e-6;
// Finite differences of the float64 reference at eps = 1e-6 (test_util's defaults).
constexpr double kFdEps = 1e-6;

struct Inputs {
  torch::Tensor cq, cr, v;  // float64, (N,H,L), (N,H,S), (N,H,S,M)
};

/// Class weights as the layer makes them: softmax over H classes of random
/// logits, so each weight is in (0, 1) and a key's weights sum to 1.
Inputs make_inputs(int64_t N, int64_t H, int64_t L, int64_t S, int64_t M, uint64_t seed) {
  torch::manual_seed(seed);
  Inputs in;
  in.cq = torch::softmax(torch::randn({N, L, H}, f64()), -1).permute({0, 2, 1}).contiguous();
  in.cr = torch::softmax(torch::randn({N, S, H}, f64()), -1).permute({0, 2, 1}).contiguous();
  in.v = torch::randn({N, H, S, M}, f64());
  return in;
}

struct Result {
  torch::Tensor out, dcq, dcr, dv;
};

/// out and the gradients of sum(out * cotangent), with the op on inputs cast to `dtype`.
Result run(const Inputs& in, const torch::Tensor& cotangent, bool causal, torch::Dtype dtype,
           bool use_reference = false) {
  // Fresh leaves each call, so gradients never accumulate across runs.
  auto leaf = [&](const torch::Tensor& x) { return x.detach().to(dtype).requires_grad_(); };
  auto cq = leaf(in.cq), cr = leaf(in.cr), v = leaf(in.v);
  const auto o = AgglomerativeAttentionFuncOptions().causal(causal);
  auto out = use_reference ? reference::agglomerative_attention(cq, cr, v, o)
                           : agglomerative_attention(cq, cr, v, o);
  (out * cotangent.to(dtype)).sum().backward();
  return {out.detach(), cq.grad(), cr.grad(), v.grad()};
}

void expect_float_matches_reference(const Inputs& in, bool causal, const std::string& label) {
  SCOPED_TRACE(label);
  const int64_t N = in.cq.size(0), H = in.cq.size(1), L = in.cq.size(2), M = in.v.size(3);
  auto cotangent = torch::randn({N, H, L, M}, f64());
  const Result fast = run(in, cotangent, causal, torch::kFloat);
  const Result ref = run(in, cotangent, causal, torch::kDouble, /*use_reference=*/true);
  ASSERT_EQ(fast.out.scalar_type(), torch::kFloat);
  EXPECT_LT(rel_err(fast.out, ref.out), kFloatTol);
  EXPECT_LT(rel_err(fast.dcq, ref.dcq), kFloatTol);
  EXPECT_LT(rel_err(fast.dv, ref.dv), kFloatTol);
  if (in.cr.size(2) == 1) {
    // With one key every average is that key's value whatever its weight, so
    // dcr is zero in exact arithmetic: what is left is the rounding of the two
    // terms that cancel, v . dsums and dcount, each |v| |g| cq / cr <= ~10
    // here (measured: 2.2e-6).
    EXPECT_LT(testing::max_abs(fast.dcr), kFloatTol);
  } else {
    EXPECT_LT(rel_err(fast.dcr, ref.dcr), kFloatTol);
  }
  // Per entry against the sum of |terms| of each (testing::scaled_err): a
  // query with a small class weight cq_ih has a small output and dv share,
  // which the tensor-wide checks above see only in absolute terms. (The
  // denominator is a sum of positive terms, so it at most doubles the bound's
  // rounding count.) dcr is a difference (v_t minus the average) and has no
  // such scale.
  const auto o = AgglomerativeAttentionFuncOptions().causal(causal);
  const auto mag = testing::term_magnitudes(
      [&](const std::vector<torch::Tensor>& x) {
        return reference::agglomerative_attention(x[0], x[1], x[2], o);
      },
      {in.cq, in.cr, in.v}, cotangent);
  EXPECT_LT(testing::scaled_err(fast.out, ref.out, mag[0]), kFloatTol);
  EXPECT_LT(testing::scaled_err(fast.dcq, ref.dcq, mag[1]), kFloatTol);
  EXPECT_LT(testing::scaled_err(fast.dv, ref.dv, mag[3]), kFloatTol);
}

TEST(AgglomerativeKernel, MatchesReferenceFullAndCausal) {
  for (bool causal : {false, true})
    for (int64_t L : {1, 2, 63, 64, 65, 300})
      for (int64_t M : {5, 64}) {  // a tail-only row and whole vectors
        const auto in = make_inputs(2, 3, L, L, M, 1000 + L);
        expect_float_matches_reference(in, causal, "causal " + std::to_string(causal) + " L = S = " +
                                                       std::to_string(L) + " M " + std::to_string(M));
      }
}

TEST(AgglomerativeKernel, MatchesReferenceWithUnequalLengths) {
  // Full: every query reads all S keys. Causal (bottom-right aligned): L < S
  // puts keys before the first query; L > S leaves the first L - S queries
  // with no key, which output zeros.
  for (bool causal : {false, true})
    for (auto [L, S] : {std::pair<int64_t, int64_t>{1, 2}, {2, 1}, {63, 130}, {130, 63}, {300, 65},
                        {65, 300}}) {
      const auto in = make_inputs(2, 2, L, S, 7, 2000 + L + S);
      expect_float_matches_reference(in, causal, "causal " + std::to_string(causal) + " L " +
                                                     std::to_string(L) + " S " + std::to_string(S));
    }
}

TEST(AgglomerativeKernel, ClipActiveHasZeroGradientThere) {
  const auto base = make_inputs(2, 2, 70, 70, 6, 3);
  // Reference weights far below the clip except at key 40: the causal
  // prefixes before it stay under 1e-3, so their denominator is the clip.
  Inputs in = base;
  in.cr = base.cr * 1e-5;
  in.cr.select(2, 40).fill_(0.5);
  for (bool causal : {false, true})
    expect_float_matches_reference(in, causal, "causal " + std::to_string(causal));

  // All weights tiny: the full count stays under the clip, the average is
  // sums / clip, linear in cr, and the count passes no gradient, so
  // d sum(out) / d cr_t = (sum_i cq_i / clip) (sum_m v_tm).
  auto cr = (base.cr * 1e-5).to(torch::kFloat).requires_grad_();
  agglomerative_attention(base.cq.to(torch::kFloat), cr, base.v.to(torch::kFloat)).sum().backward();
  const double clip = AgglomerativeAttentionFuncOptions().clip();
  auto expected = base.cq.sum(2, /*keepdim=*/true) / clip * base.v.sum(-1);
  EXPECT_LT(rel_err(cr.grad(), expected), kFloatTol);
}

TEST(AgglomerativeKernel, ReferenceGradientsMatchFiniteDifferences) {
  // Ties the oracle to the maths, the clip's zero gradient included.
  auto in = make_inputs(1, 2, 4, 5, 3, 4);
  in.cr.select(2, 0).mul_(1e-4);  // the first causal prefix is clipped
  for (bool causal : {false, true}) {
    SCOPED_TRACE("causal " + std::to_string(causal));
    testing::expect_gradients_match(
        [&](const std::vector<torch::Tensor>& x) {
          return agglomerative_attention(x[0], x[1], x[2], AgglomerativeAttentionFuncOptions().causal(causal));
        },
        {in.cq, in.cr, in.v}, kFdEps);
  }
}

TEST(AgglomerativeKernel, OneClassIsTheMeanOfTheValues) {
  // One class: softmax gives every weight 1, so full attention returns the
  // mean of all values and causal attention the mean of the visible prefix.
  const int64_t N = 2, L = 65, M = 9;
  auto ones = torch::ones({N, 1, L}, f32());
  auto v = torch::randn({N, 1, L, M}, f32());
  auto full = agglomerative_attention(ones, ones, v);
  EXPECT_LT(rel_err(full, v.to(torch::kDouble).mean(2, /*keepdim=*/true).expand({N, 1, L, M})), kFloatTol);
  auto causal = agglomerative_attention(ones, ones, v, AgglomerativeAttentionFuncOptions().causal(true));
  auto counts = torch::arange(1, L + 1, f64()).view({1, 1, L, 1});
  EXPECT_LT(rel_err(causal, v.to(torch::kDouble).cumsum(2) / counts), kFloatTol);
}

TEST(AgglomerativeKernel, ResultsAreBitwiseTheSameForOneAndTwoThreads) {
  // Block totals are combined in sequence order whoever computes them. One
  // (batch, class) pair makes the two threads split the sequence itself.
  const int previous = num_threads();
  for (auto [N, H] : {std::pair<int64_t, int64_t>{1, 1}, {1, 3}, {3, 2}}) {
    const auto in = make_inputs(N, H, 300, 300, 17, 5);
    auto cotangent = torch::randn({N, H, 300, 17}, f64());
    for (bool causal : {false, true}) {
      SCOPED_TRACE("N " + std::to_string(N) + " H " + std::to_string(H) + " causal " +
                   std::to_string(causal));
      set_num_threads(1);
      const Result one = run(in, cotangent, causal, torch::kFloat);
      set_num_threads(2);
      const Result two = run(in, cotangent, causal, torch::kFloat);
      EXPECT_TRUE(torch::equal(one.out, two.out));
      EXPECT_TRUE(torch::equal(one.dcq, two.dcq));
      EXPECT_TRUE(torch::equal(one.dcr, two.dcr));
      EXPECT_TRUE(torch::equal(one.dv, two.dv));
    }
  }
  set_num_threads(previous);
}

TEST(AgglomerativeKernel, StridedInputsGiveTheContiguousResult) {
  const int64_t N = 2, H = 4, L = 70, S = 90, M = 16;
  const auto in = make_inputs(N, H, L, S, M, 6);
  for (bool causal : {false, true}) {
    SCOPED_TRACE("causal " + std::to_string(causal));
    auto cotangent = torch::randn({N, H, L, M}, f32());
    // Contiguous float32 inputs.
    auto cq = in.cq.to(torch::kFloat).requires_grad_(), cr = in.cr.to(torch::kFloat).requires_grad_(),
         v = in.v.to(torch::kFloat).requires_grad_();
    auto out = agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().causal(causal));
    (out * cotangent).sum().backward();
    // The same values as the layer's views: classes last for cq and cr,
    // (N, S, H, M) storage for v; and v with a non-unit last stride.
    auto cq_t = cq.detach().transpose(1, 2).contiguous().requires_grad_();  // (N, L, H)
    auto cr_t = cr.detach().transpose(1, 2).contiguous().requires_grad_();  // (N, S, H)
    auto v_rows = v.detach().transpose(1, 2).contiguous().requires_grad_();  // (N, S, H, M)
    auto v_cols = v.detach().transpose(2, 3).contiguous().requires_grad_();  // (N, H, M, S)
    for (bool rows : {true, false}) {
      SCOPED_TRACE(rows ? "v as (N, S, H, M)" : "v as (N, H, M, S)");
      auto v_view = rows ? v_rows.transpose(1, 2) : v_cols.transpose(2, 3);
      auto out_view = agglomerative_attention(cq_t.transpose(1, 2), cr_t.transpose(1, 2), v_view,
                                              AgglomerativeAttentionFuncOptions().causal(causal));
      (out_view * cotangent.transpose(2, 3).contiguous().transpose(2, 3)).sum().backward();
      EXPECT_LT(rel_err(out_view, out), kLayoutTol);
      EXPECT_LT(rel_err(cq_t.grad().transpose(1, 2), cq.grad()), kLayoutTol);
      EXPECT_LT(rel_err(cr_t.grad().transpose(1, 2), cr.grad()), kLayoutTol);
      auto dv = rows ? v_rows.grad().transpose(1, 2) : v_cols.grad().transpose(2, 3);
      EXPECT_LT(rel_err(dv, v.grad()), kLayoutTol);
      cq_t.mutable_grad().reset();
      cr_t.mutable_grad().reset();
    }
    // A broadcast (stride 0) query weight.
    auto cq_b = torch::rand({N, H, 1}, f32());
    auto broadcast = agglomerative_attention(cq_b.expand({N, H, L}), cr.detach(), v.detach(),
                                             AgglomerativeAttentionFuncOptions().causal(causal));
    auto dense = agglomerative_attention(cq_b.expand({N, H, L}).contiguous(), cr.detach(), v.detach(),
                                         AgglomerativeAttentionFuncOptions().causal(causal));
    EXPECT_LT(rel_err(broadcast, dense), kLayoutTol);
  }
}

TEST(AgglomerativeKernel, OutputFollowsTheLayoutOfV) {
  // v as a view of (N, S, H, M) storage gives an output stored (N, L, H, M),
  // so the layer's concatenation of classes is free.
  auto v = torch::randn({2, 5, 4, 3}, f32()).transpose(1, 2);  // (N, H, S, M) view
  auto out = agglomerative_attention(torch::rand({2, 4, 6}, f32()), torch::rand({2, 4, 5}, f32()), v);
  EXPECT_TRUE(out.transpose(1, 2).is_contiguous());
  auto plain = agglomerative_attention(torch::rand({2, 4, 6}, f32()), torch::rand({2, 4, 5}, f32()),
                                       v.contiguous());
  EXPECT_TRUE(plain.is_contiguous());
}

TEST(AgglomerativeKernel, InferenceAndTrainingPathsAgree) {
  // Without gradients the op skips autograd and saves nothing; the arithmetic
  // is the same.
  const auto in = make_inputs(2, 3, 65, 65, 8, 7);
  for (bool causal : {false, true}) {
    const auto o = AgglomerativeAttentionFuncOptions().causal(causal);
    auto cq = in.cq.to(torch::kFloat), cr = in.cr.to(torch::kFloat), v = in.v.to(torch::kFloat);
    torch::Tensor plain;
    {
      torch::NoGradGuard no_grad;
      plain = agglomerative_attention(cq, cr, v, o);
    }
    auto tracked = agglomerative_attention(cq, cr, v.clone().requires_grad_(), o);
    EXPECT_TRUE(tracked.requires_grad());
    EXPECT_TRUE(torch::equal(plain, tracked.detach()));
  }
}

TEST(AgglomerativeKernel, DispatchNamesTheBackendThatRuns) {
  const auto in = make_inputs(1, 3, 7, 5, 2, 12);
  const auto o = AgglomerativeAttentionFuncOptions().causal(true);
  auto cq = in.cq.to(torch::kFloat).requires_grad_(), cr = in.cr.to(torch::kFloat),
       v = in.v.to(torch::kFloat);
  testing::expect_kernel(agglomerative_attention_dispatch(cq, cr, v, o));
  EXPECT_NE(testing::grad_fn_name(agglomerative_attention(cq, cr, v, o))
                .find("AgglomerativeFunction"),
            std::string::npos);
  testing::expect_composite(agglomerative_attention_dispatch(in.cq, in.cr, in.v, o),
                            "cq is float64; the kernel is float32 only");
  EXPECT_TRUE(torch::equal(agglomerative_attention(in.cq, in.cr, in.v, o),
                           reference::agglomerative_attention(in.cq, in.cr, in.v, o)));
  testing::expect_composite(agglomerative_attention_dispatch(cq, in.cr, v, o),
                            "cr is float64; the kernel is float32 only");
}

TEST(AgglomerativeKernel, EmptySequences) {
  for (bool causal : {false, true}) {
    const auto o = AgglomerativeAttentionFuncOptions().causal(causal);
    // No keys: every query reads an empty average and outputs zeros.
    auto cq = torch::rand({1, 2, 3}, f32()).requires_grad_();
    auto cr = torch::rand({1, 2, 0}, f32()).requires_grad_();
    auto v = torch::rand({1, 2, 0, 4}, f32()).requires_grad_();
    auto out = agglomerative_attention(cq, cr, v, o);
    EXPECT_TRUE(torch::equal(out, torch::zeros({1, 2, 3, 4}, f32())));
    out.sum().backward();
    EXPECT_TRUE(torch::equal(cq.grad(), torch::zeros_like(cq)));
    // No queries: nothing to read, nothing flows back.
    auto cq0 = torch::rand({1, 2, 0}, f32()), cr0 = torch::rand({1, 2, 5}, f32()).requires_grad_();
    auto v0 = torch::rand({1, 2, 5, 4}, f32()).requires_grad_();
    auto out0 = agglomerative_attention(cq0, cr0, v0, o);
    EXPECT_EQ(out0.sizes(), torch::IntArrayRef({1, 2, 0, 4}));
    out0.sum().backward();
    EXPECT_TRUE(torch::equal(cr0.grad(), torch::zeros_like(cr0)));
    EXPECT_TRUE(torch::equal(v0.grad(), torch::zeros_like(v0)));
  }
}

TEST(AgglomerativeKernel, RejectsAClipThatVanishesInFloat32) {
  auto cq = torch::rand({1, 1, 2}, f32()), cr = torch::rand({1, 1, 2}, f32());
  auto v = torch::rand({1, 1, 2, 3}, f32());
  expect_error([&] { agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().clip(1e-40)); },
               {"agglomerative_attention", "clip", "float32", "1e-40"});
  // float64 represents it: the reference runs.
  auto out = agglomerative_attention(cq.to(torch::kDouble), cr.to(torch::kDouble),
                                     v.to(torch::kDouble), AgglomerativeAttentionFuncOptions().clip(1e-40));
  EXPECT_TRUE(testing::all_finite(out));
}

}  // namespace
}  // namespace attnkit::agglomerative_attention_kernel_test
