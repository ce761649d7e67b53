// Traced score modifiers in the exact kernel (kernels/common/score_program.h,
// kernels/score_mod.h), through the kernel ops _softmax_attention_forward and
// _softmax_attention_backward with programs written here by hand, checked
// against the float64 composite (softmax_attention of float64 inputs) given
// the same modifier as a scale and a dense bias:
// - a relative-position table read by gathers, 0.5 s + table[h, min(|i - j|, 7)],
//   values and the gradients of q, k, v and the table, on the sgemm tiles,
//   the forward's key split (L = 1 over 2100 keys) and the backward's key
//   parts, with causal, key lengths and grouped heads;
// - a modifier that is -inf or NaN at the pairs the causal mask hides,
//   s + log(i - j + 1): hidden pairs reach neither the values nor the
//   gradients;
// - bitwise the same on 1 and 2 threads, the table's gradient included;
// - an index out of range at run time, and programs the op refuses.
// python/attnkit/score_mods.py traces Python functions into such programs;
// tests/python/test_score_mods.py checks that side.
#include <attnkit/ops.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

#include "test_util.h"

namespace softmax_attention_score_mod_test {

namespace {

using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::expect_error;
using attnkit::testing::f32;
using attnkit::testing::f64;
using attnkit::testing::relative_error;

// float32 kernel against float64, as for the exact kernel's other features: 2e-5.
constexpr double kTolerance = 2e-5;

// The opcodes used here (kernels/common/score_program.h, ScoreOp).
enum Op : int32_t {
  kScore = 0, kHead = 2, kQuery = 3, kKey = 4, kConst = 5, kAbs = 11, kLog = 13,
  kAdd = 30, kSub = 31, kMul = 32, kClampMax = 40, kIndex = 70, kGather = 71,
};

struct Program {
  std::vector<int32_t> code;  // (n, 4)
  std::vector<float> values;

  int32_t add(int32_t op, int32_t a = -1, int32_t b = -1, float value = 0.f) {
    code.insert(code.end(), {op, a, b, -1});
    values.push_back(value);
    return static_cast<int32_t>(values.size()) - 1;
  }
  torch::Tensor code_tensor() const {
    return torch::tensor(code, torch::kInt).view({-1, 4});
  }
  torch::Tensor values_tensor() const { return torch::tensor(values, torch::kFloat); }
};

/// 0.5 s + table[h, min(|i - j|, 7)] with table (H, 8).
Program relative_table(int64_t H) {
  Program p;
  const int32_t s = p.add(kScore), h = p.add(kHead), i = p.add(kQuery), j = p.add(kKey);
  const int32_t distance = p.add(kClampMax, p.add(kAbs, p.add(kSub, i, j)), p.add(kConst, -1, -1, 7.f));
  const int32_t row = p.add(kMul, p.add(kIndex, h, -1, static_cast<float>(H)), p.add(kConst, -1, -1, 8.f));
  const int32_t flat = p.add(kAdd, row, p.add(kIndex, distance, -1, 8.f));
  p.add(kAdd, p.add(kMul, s, p.add(kConst, -1, -1, 0.5f)), p.add(kGather, flat));
  return p;
}

/// s + log(i - j + 1): -inf on the first superdiagonal, NaN above it.
Program log_distance() {
  Program p;
  const int32_t s = p.add(kScore), i = p.add(kQuery), j = p.add(kKey);
  p.add(kAdd, s, p.add(kLog, p.add(kAdd, p.add(kSub, i, j), p.add(kConst, -1, -1, 1.f))));
  return p;
}

struct Problem {
  int64_t N = 1, H = 2, Hkv = 2, L = 40, S = 50, E = 8, M = 6;
  bool causal = false;
  std::vector<int64_t> key_lengths = {};  // empty: none
};

/// The kernel ops' results: out, lse, dq, dk, dv, dtables.
std::vector<torch::Tensor> run_kernel(const Problem& c, const Program& program, const torch::Tensor& q,
                                      const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& tables,
                                      const torch::Tensor& grad_out, double scale) {
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto forward = dispatcher.findSchemaOrThrow("attnkit::_softmax_attention_forward", "");
  const auto backward = dispatcher.findSchemaOrThrow("attnkit::_softmax_attention_backward", "");
  const c10::IValue none;
  const c10::IValue lengths = c.key_lengths.empty() ? none : c10::IValue(torch::tensor(c.key_lengths, torch::kLong));
  const std::vector<int64_t> blocks{128, 128};
  const auto code = program.code_tensor(), values = program.values_tensor();
  const c10::IValue table_value = tables.defined() ? c10::IValue(tables) : none;
  torch::jit::Stack stack{q, k, v, none, lengths, none, scale, c.causal, int64_t{0}, 10000.0, int64_t{0}, 0.0,
                          int64_t{0}, none, none, none, blocks, none, 0.0, code, values, table_value};
  forward.callBoxed(&stack);
  const auto out = stack[0].toTensor(), lse = stack[1].toTensor();
  stack = {grad_out, q, k, v, out, lse, none, lengths, none, scale, c.causal, int64_t{0}, 10000.0, int64_t{0}, 0.0,
           int64_t{0}, false, none, none, none, blocks, none, none, 0.0, code, values, table_value};
  backward.callBoxed(&stack);
  return {out, lse, stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor(), stack[5].toTensor()};
}

/// The (L, S) query and key index grids.
std::pair<torch::Tensor, torch::Tensor> grids(int64_t L, int64_t S) {
  return {torch::arange(L, torch::kLong).view({L, 1}).expand({L, S}),
          torch::arange(S, torch::kLong).view({1, S}).expand({L, S})};
}

struct RelativeCase {
  std::string name;
  Problem problem;
};

TEST(SoftmaxScoreMod, RelativeTableMatchesFloat64WithGradients) {
  const std::vector<RelativeCase> cases = {
      {"sgemm tiles, L != S", {1, 2, 2, 40, 50}},
      {"causal, key lengths with a row that sees nothing, grouped heads", {2, 4, 2, 30, 20, 8, 6, true, {20, 0}}},
      {"the forward's key split: L = 1 over 2100 keys", {1, 2, 2, 1, 2100, 8, 4, true}},
      {"the backward's key parts, 300 x 300, causal", {1, 1, 1, 300, 300, 16, 8, true}},
  };
  for (const auto& [name, c] : cases) {
    SCOPED_TRACE(name);
    torch::manual_seed(51);
    const auto q = torch::randn({c.N, c.H, c.L, c.E}, f64()), k = torch::randn({c.N, c.Hkv, c.S, c.E}, f64()),
               v = torch::randn({c.N, c.Hkv, c.S, c.M}, f64());
    const auto table = torch::randn({c.H, 8}, f64()), grad_out = torch::randn({c.N, c.H, c.L, c.M}, f64());
    const double scale = 0.4;

    const auto got = run_kernel(c, relative_table(c.H), q.to(torch::kFloat), k.to(torch::kFloat),
                                v.to(torch::kFloat), table.to(torch::kFloat).flatten(),
                                grad_out.to(torch::kFloat), scale);

    // The float64 composite with the modifier as a scale and a dense bias.
    auto leaves = std::vector<torch::Tensor>{q.clone().requires_grad_(), k.clone().requires_grad_(),
                                             v.clone().requires_grad_(), table.clone().requires_grad_()};
    const auto [i, j] = grids(c.L, c.S);
    const auto distance = (i - j).abs().clamp_max(7);
    const auto bias = leaves[3].index({torch::indexing::Slice(), distance}).unsqueeze(0);  // (1, H, L, S)
    auto options = SoftmaxAttentionFuncOptions().scale(0.5 * scale).causal(c.causal).bias(bias);
    if (!c.key_lengths.empty()) options.key_lengths(torch::tensor(c.key_lengths, torch::kLong));
    const auto [want_out, want_lse] = attnkit::softmax_attention_with_lse(leaves[0], leaves[1], leaves[2], options);
    const auto want = torch::autograd::grad({(want_out * grad_out).sum()}, leaves);

    EXPECT_LE(relative_error(got[0], want_out), kTolerance);
    const auto finite = torch::isfinite(want_lse);
    EXPECT_TRUE(torch::equal(torch::isfinite(got[1]), finite));
    EXPECT_LE(relative_error(got[1].masked_fill(~finite, 0), want_lse.masked_fill(~finite, 0)), kTolerance);
    for (int d = 0; d < 4; ++d) {
      SCOPED_TRACE("gradient " + std::to_string(d));
      EXPECT_LE(relative_error(got[2 + d].view(want[d].sizes()), want[d]), kTolerance);
    }
  }
}

TEST(SoftmaxScoreMod, ValuesAtHiddenPairsReachNothing) {
  // log(i - j + 1) is -inf or NaN wherever the causal mask hides the key.
  const Problem c{2, 2, 2, 70, 70, 8, 8, true};
  torch::manual_seed(52);
  const auto q = torch::randn({c.N, c.H, c.L, c.E}, f64()), k = torch::randn({c.N, c.H, c.S, c.E}, f64()),
             v = torch::randn({c.N, c.H, c.S, c.M}, f64()), grad_out = torch::randn({c.N, c.H, c.L, c.M}, f64());
  const auto got = run_kernel(c, log_distance(), q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat),
                              torch::Tensor(), grad_out.to(torch::kFloat), 0.3);
  auto leaves = std::vector<torch::Tensor>{q.clone().requires_grad_(), k.clone().requires_grad_(),
                                           v.clone().requires_grad_()};
  const auto [i, j] = grids(c.L, c.S);
  const auto bias = torch::log((i - j + 1).clamp_min(1).to(torch::kDouble));  // hidden pairs: any finite value
  const auto want_out = attnkit::softmax_attention(leaves[0], leaves[1], leaves[2],
                                                   SoftmaxAttentionFuncOptions().scale(0.3).causal(true).bias(bias));
  const auto want = torch::autograd::grad({(want_out * grad_out).sum()}, leaves);
  EXPECT_LE(relative_error(got[0], want_out), kTolerance);
  for (int d = 0; d < 3; ++d) {
    EXPECT_TRUE(torch::isfinite(got[2 + d]).all().item<bool>()) << d;
    EXPECT_LE(relative_error(got[2 + d], want[d]), kTolerance) << d;
  }
}

TEST(SoftmaxScoreMod, SameBitsOnOneAndTwoThreads) {
  // The backward's key parts (N H = 1) each keep a table gradient of their own.
  const Problem c{1, 1, 1, 600, 600, 16, 8, true};
  torch::manual_seed(53);
  const auto q = torch::randn({c.N, c.H, c.L, c.E}, f32()), k = torch::randn({c.N, c.H, c.S, c.E}, f32()),
             v = torch::randn({c.N, c.H, c.S, c.M}, f32()), table = torch::randn({8}, f32()),
             grad_out = torch::randn({c.N, c.H, c.L, c.M}, f32());
  std::vector<torch::Tensor> one, two;
  {
    attnkit::testing::ThreadsGuard threads(1);
    one = run_kernel(c, relative_table(1), q, k, v, table, grad_out, 0.25);
  }
  {
    attnkit::testing::ThreadsGuard threads(2);
    two = run_kernel(c, relative_table(1), q, k, v, table, grad_out, 0.25);
  }
  for (size_t d = 0; d < one.size(); ++d) EXPECT_TRUE(torch::equal(one[d], two[d])) << d;
  EXPECT_GT(one[5].abs().sum().item<float>(), 0.f);
}

TEST(SoftmaxScoreMod, IndexOutOfRangeAtRunTimeRaises) {
  // table[index(i - j, 4)] over 10 x 10: i - j reaches 9 and -9.
  Program p;
  const int32_t s = p.add(kScore), i = p.add(kQuery), j = p.add(kKey);
  p.add(kAdd, s, p.add(kGather, p.add(kIndex, p.add(kSub, i, j), -1, 4.f)));
  const Problem c{1, 1, 1, 10, 10};
  const auto q = torch::randn({1, 1, 10, 8}), v = torch::randn({1, 1, 10, 6});
  expect_error([&] { run_kernel(c, p, q, q, v, torch::zeros({4}), torch::randn({1, 1, 10, 6}), 0.3); },
               {"_softmax_attention_forward", "indexes a dimension of 4 entries out of range", "instruction 4"});
}

TEST(SoftmaxScoreMod, MalformedProgramsAreRefused) {
  const Problem c{1, 1, 1, 10, 10};
  const auto q = torch::randn({1, 1, 10, 8}), v = torch::randn({1, 1, 10, 6}), g = torch::randn({1, 1, 10, 6});
  auto refuse = [&](const Program& p, const torch::Tensor& tables, const std::vector<std::string>& fragments) {
    expect_error([&] { run_kernel(c, p, q, q, v, tables, g, 0.3); }, fragments);
  };
  Program no_opcode;
  no_opcode.add(kScore);
  no_opcode.add(99, 0);
  refuse(no_opcode, torch::Tensor(), {"score_code instruction 1 has no opcode 99"});
  Program later_operand;
  later_operand.add(kScore);
  later_operand.add(kAdd, 0, 1);  // reads itself
  refuse(later_operand, torch::Tensor(), {"instruction 1", "must read 2 earlier registers"});
  Program loose_operand;
  loose_operand.add(kScore);
  loose_operand.add(kAbs, 0, 0);  // unary with a second operand
  refuse(loose_operand, torch::Tensor(), {"mark the rest -1"});
  Program fractional_index;
  fractional_index.add(kIndex, fractional_index.add(kQuery), -1, 2.5f);
  refuse(fractional_index, torch::Tensor(), {"indexes a dimension of 2.5 entries"});
  Program gather;
  gather.add(kGather, gather.add(kQuery));
  refuse(gather, torch::Tensor(), {"reads score_tables, which hold 0 values"});
  refuse(log_distance(), torch::zeros({2, 2}), {"'score_tables' must be a contiguous float32 vector"});
  // bfloat16 inputs run on the AMX kernel, which takes no modifier.
  expect_error([&] {
    run_kernel(c, log_distance(), q.to(torch::kBFloat16), q.to(torch::kBFloat16), v.to(torch::kBFloat16),
               torch::Tensor(), g.to(torch::kBFloat16), 0.3);
  }, {"score modifier"});
}

}  // namespace

}  // namespace softmax_attention_score_mod_test
