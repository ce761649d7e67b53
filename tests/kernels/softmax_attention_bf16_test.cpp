// Exact attention on bfloat16 inputs: the AMX kernel (and the float32
// conversion path the op takes without it) against float64, by the
// FlashAttention accuracy rule of issue 17: on the same bf16 inputs, the error
// of our output and of each gradient against float64 is at most 2x the error
// of libtorch's composite computed in bf16 (reference::softmax_attention on
// bf16 tensors, and its autograd) against the same float64 result.
//
// The composite rounds the scores, the probabilities and every product to
// bf16; the kernel keeps scores, softmax and accumulators in float32 and
// rounds only P, dS and the results. Both errors are dominated by the final
// rounding to bf16, so the ratio is about 1. Measured here, worst over the
// cases, outputs and gradients, on 1 and 2 threads (printed by the tests):
//   AMX kernel           1.00 (dv at scale 0, where P is uniform; 0.99 elsewhere)
//   float32 conversion   0.95
// The bound is the rule's 2, not these numbers.
//
// Shapes: one query and key, lengths off the 32 / 64 / 128 blocks, L != S,
// E != M, E and M of 128, negative and zero scales, causal with L > S (rows
// that see nothing), key lengths including 0, row- and column-strided views,
// heads split into key parts (N H < 8) and not; results bitwise equal on 1
// and 2 threads.
//
// ctest runs these also with ATTNKIT_MAX_ISA capped below amx
// (tests/CMakeLists.txt), where the op must take the float32 conversion path
// by itself.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <iostream>
#include <string>
#include <vector>

#include "kernels/gemm_bf16.h"
#include "kernels/softmax_attention_bf16.h"
#include "reference/reference.h"
#include "test_util.h"

namespace attnkit::softmax_attention_bf16_test {
namespace {

struct Case {
  std::string name;
  int64_t N, H, L, S, E, M;
  bool causal = false;
  std::vector<int64_t> key_lengths = {};  // empty: none
  // 1: q, k, v, dout as (N, L, H, X) transposed views (rows strided);
  // 2: as (N, H, X, L) transposed views (columns strided)
  int strided = 0;
  c10::optional<double> scale = c10::nullopt;  // unset: 1 / sqrt(E)
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all{
      {"one query, one key", 1, 1, 1, 1, 8, 8},
      {"lengths off the blocks, E != M", 1, 2, 37, 45, 40, 24},
      {"L != S, causal", 2, 1, 70, 300, 64, 48, true},
      {"causal, L > S: early rows see nothing", 1, 2, 150, 60, 32, 32, true},
      {"decode: one query, many keys", 1, 1, 1, 500, 64, 64},
      {"key lengths 0, 45, 200", 3, 1, 50, 200, 64, 64, false, {0, 45, 200}},
      {"key lengths, causal", 2, 2, 129, 129, 64, 64, true, {129, 70}},
      {"row-strided views", 2, 3, 65, 97, 64, 32, false, {}, 1},
      {"column-strided views", 1, 2, 50, 70, 40, 24, true, {}, 2},
      {"N H >= 8: one part per head", 2, 5, 257, 257, 64, 64, true},
      {"one head in key parts", 1, 1, 1000, 1000, 64, 64, true},
      {"E = M = 128", 1, 2, 130, 260, 128, 128},
      {"negative scale", 1, 2, 40, 300, 32, 32, true, {}, 0, -0.3},
      {"zero scale: uniform weights", 1, 1, 20, 30, 16, 16, false, {}, 0, 0.0},
  };
  return all;
}

using testing::ThreadsGuard;

/// The case's inputs, rounded to bf16 and held in float32 (every computation
/// sees the same values); dout likewise.
struct Inputs {
  torch::Tensor q, k, v, dout, key_lengths;
};

Inputs make_inputs(const Case& c, uint64_t seed) {
  torch::manual_seed(seed);
  auto draw = [&](int64_t rows, int64_t cols) {
    // Strided: drawn as (N, rows, H, cols) or (N, H, cols, rows) and viewed
    // as (N, H, rows, cols).
    auto t = c.strided == 1   ? torch::randn({c.N, rows, c.H, cols}).transpose(1, 2)
             : c.strided == 2 ? torch::randn({c.N, c.H, cols, rows}).transpose(2, 3)
                              : torch::randn({c.N, c.H, rows, cols});
    return t.to(torch::kBFloat16).to(torch::kFloat);
  };
  Inputs in;
  in.q = draw(c.L, c.E);
  in.k = draw(c.S, c.E);
  in.v = draw(c.S, c.M);
  in.dout = draw(c.L, c.M);
  if (!c.key_lengths.empty()) in.key_lengths = torch::tensor(c.key_lengths, torch::kLong);
  return in;
}

/// out, dq, dk, dv (as float64) of one way of computing: ours (the op) or the
/// composite, in `dtype`.
std::vector<torch::Tensor> run(const Inputs& in, const Case& c, torch::ScalarType dtype, bool ours) {
  // .to() keeps the strides of a strided view (preserve_format), so the op sees them.
  auto leaf = [&](const torch::Tensor& t) { return t.to(dtype).detach().requires_grad_(); };
  auto q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
  auto options =
      SoftmaxAttentionFuncOptions().causal(c.causal).key_lengths(in.key_lengths).scale(c.scale);
  auto out = ours ? softmax_attention(q, k, v, options) : reference::softmax_attention(q, k, v, options);
  out.backward(in.dout.to(dtype));
  std::vector<torch::Tensor> result;
  for (const auto& t : {out, q.grad(), k.grad(), v.grad()}) result.push_back(t.detach().to(torch::kDouble));
  return result;
}

double max_abs_err(const torch::Tensor& got, const torch::Tensor& want) {
  if (want.numel() == 0) return 0.0;
  return (got - want).abs().max().item<double>();
}

const char* const kNames[] = {"out", "dq", "dk", "dv"};

/// Checks the rule on every case (1 and 2 threads, which must agree bitwise)
/// and returns the worst ratio of our error to the composite's.
double check_rule(const std::string& path) {
  double worst = 0;
  std::string where;
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto in = make_inputs(c, 17);
    const auto exact = run(in, c, torch::kDouble, false);
    const auto theirs = run(in, c, torch::kBFloat16, false);
    std::vector<torch::Tensor> first;
    for (int threads : {1, 2}) {
      ThreadsGuard guard(threads);
      const auto ours = run(in, c, torch::kBFloat16, true);
      for (size_t i = 0; i < exact.size(); ++i) {
        const double e_ours = max_abs_err(ours[i], exact[i]);
        const double e_torch = max_abs_err(theirs[i], exact[i]);
        EXPECT_LE(e_ours, 2 * e_torch) << path << ", " << kNames[i] << ", " << threads
                                       << " threads: our error " << e_ours << ", the composite's "
                                       << e_torch;
        if (e_torch > 0 && e_ours / e_torch > worst) {
          worst = e_ours / e_torch;
          where = c.name + ", " + kNames[i];
        }
        if (threads == 1)
          first.push_back(ours[i]);
        else
          EXPECT_TRUE(torch::equal(ours[i], first[i])) << kNames[i] << " differs between 1 and 2 threads";
      }
    }
  }
  std::cout << "[ measured ] " << path << ": worst error ratio to the bf16 composite " << worst << " ("
            << where << ")\n";
  return worst;
}

TEST(SoftmaxAttentionBf16, MeetsTheFlashAttentionRuleOnThePathThisMachineTakes) {
  const auto q = torch::zeros({1, 1, 1, 8}, torch::kBFloat16);
  const auto d = softmax_attention_dispatch(q, q, q);
  ASSERT_TRUE(d.uses_kernel());
  check_rule(d.reason);
}

TEST(SoftmaxAttentionBf16, MeetsTheFlashAttentionRuleOnTheFloat32ConversionPath) {
  const bool previous = kernels::force_bf16_float32(true);
  const auto q = torch::zeros({1, 1, 1, 8}, torch::kBFloat16);
  EXPECT_EQ(softmax_attention_dispatch(q, q, q).reason, "bf16 converted to float32 (ATTNKIT_BF16_GEMM=float32)");
  check_rule("float32 conversion");
  kernels::force_bf16_float32(previous);
}

TEST(SoftmaxAttentionBf16, DispatchNamesThePath) {
  const auto q = torch::zeros({1, 2, 3, 8}, torch::kBFloat16);
  const auto d = softmax_attention_dispatch(q, q, q);
  EXPECT_TRUE(d.uses_kernel());
  if (kernels::softmax_attention_bf16_available() && !kernels::bf16_float32_forced())
    EXPECT_EQ(d.reason, "bf16 on AMX tiles");
  else
    EXPECT_EQ(d.reason.rfind("bf16 converted to float32 (", 0), 0u) << d.reason;
  // A bias always goes through float32.
  const auto bias = torch::zeros({3, 3}, torch::kBFloat16);
  EXPECT_EQ(softmax_attention_dispatch(q, q, q, SoftmaxAttentionFuncOptions().bias(bias)).reason,
            "bf16 converted to float32 (a bias)");
  // float64 takes the composite.
  const auto q64 = q.to(torch::kDouble);
  EXPECT_FALSE(softmax_attention_dispatch(q64, q64, q64).uses_kernel());
}

TEST(SoftmaxAttentionBf16, WithABiasMatchesTheFloat32KernelRounded) {
  // The conversion path is the float32 kernel on the same values: its output
  // is that kernel's, rounded once to bf16, and so are its gradients.
  torch::manual_seed(3);
  auto q = torch::randn({1, 2, 20, 16}).to(torch::kBFloat16).requires_grad_();
  auto k = torch::randn({1, 2, 30, 16}).to(torch::kBFloat16).requires_grad_();
  auto v = torch::randn({1, 2, 30, 8}).to(torch::kBFloat16).requires_grad_();
  auto bias = torch::randn({20, 30}).to(torch::kBFloat16).requires_grad_();
  const auto options = SoftmaxAttentionFuncOptions().bias(bias).causal(true);
  auto out = softmax_attention(q, k, v, options);
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  out.sum().backward();

  auto f = [](const torch::Tensor& t) { return t.detach().to(torch::kFloat).requires_grad_(); };
  auto q32 = f(q), k32 = f(k), v32 = f(v), b32 = f(bias);
  auto out32 = softmax_attention(q32, k32, v32, SoftmaxAttentionFuncOptions().bias(b32).causal(true));
  out32.sum().backward();
  EXPECT_TRUE(torch::equal(out, out32.to(torch::kBFloat16)));
  for (auto [ours, want] : {std::pair{q.grad(), q32.grad()}, {k.grad(), k32.grad()},
                            {v.grad(), v32.grad()}, {bias.grad(), b32.grad()}}) {
    EXPECT_EQ(ours.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(ours, want.to(torch::kBFloat16)));
  }
}

TEST(SoftmaxAttentionBf16, EmptySizesGiveEmptyOrZeroResults) {
  for (auto [L, S, E, M] : std::vector<std::array<int64_t, 4>>{{0, 5, 8, 8}, {4, 0, 8, 8}}) {
    auto q = torch::randn({1, 1, L, E}).to(torch::kBFloat16).requires_grad_();
    auto k = torch::randn({1, 1, S, E}).to(torch::kBFloat16).requires_grad_();
    auto v = torch::randn({1, 1, S, M}).to(torch::kBFloat16).requires_grad_();
    auto out = softmax_attention(q, k, v);
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{1, 1, L, M}));
    EXPECT_EQ(out.count_nonzero().item<int64_t>(), 0);  // no key: out 0
    out.sum().backward();
    for (const auto& g : {q.grad(), k.grad(), v.grad()})
      EXPECT_EQ(g.count_nonzero().item<int64_t>(), 0);
  }
}

}  // namespace
}  // namespace attnkit::softmax_attention_bf16_test
