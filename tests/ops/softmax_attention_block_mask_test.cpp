// A block mask inside exact attention (SoftmaxAttentionFuncOptions::
// block_mask): the kernel visits only the mask's non-empty blocks, applies
// nothing inside full ones and hides the clear bits of partial ones. Checked:
// - against the float64 reference (which masks with the mask's dense form,
//   itself checked against the mask function in tests/edges/
//   block_mask_test.cpp), values and the gradients of q, k, v and a bias,
//   for each named builder and for random masks with empty, full and partial
//   blocks and fully masked rows; at blocks of 128, of sizes that divide
//   nothing (16 x 24, 7 x 520) and wider than the kernels' tiles
//   (200 x 300); L != S both ways, lengths that are not multiples of a
//   block, L = 1; combined with causal, a window, key lengths, grouped heads,
//   ALiBi and rotary positions, dropout, strided views, a bias per head (its
//   gradient inline) and one shared by the heads (its gradient's second
//   pass, whose tiles cross the mask's blocks), and shapes that take the
//   backward's key parts;
// - the mask as a -inf bias instead (to rounding), and the mask that hides
//   nothing as no mask (to rounding: its tiles are the mask's blocks);
// - bitwise the same on 1 and 2 threads;
// - the dispatch's reason for bfloat16 and the refusals.
#include <attnkit/block_mask.h>
#include <attnkit/ops.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "ops/softmax_attention_cases.h"
#include "test_util.h"

namespace softmax_attention_block_mask_test {

namespace {

using attnkit::BlockMask;
using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::f64;
using namespace attnkit::testing::softmax;
namespace masks = attnkit::masks;

// float32 kernel against float64, as without a mask
// (tests/ops/softmax_attention_window_test.cpp): 2e-5. A mask only removes
// terms from the sums.
constexpr double kTolerance = 2e-5;

struct MaskCase : Case {
  /// The mask's function of (L, S) and its batch and head counts (1: broadcast).
  std::function<attnkit::MaskFunction(int64_t L, int64_t S)> mask;
  int64_t mask_batch = 1, mask_heads = 1, q_block = 128, kv_block = 128;
  int64_t window = 0;
  bool positions = false;  // ALiBi slopes and rotary positions too
  double dropout_p = 0.0;
};

/// A random mask per (batch, head) of density `density`, with whole blocks
/// of 64 x 64 left out or kept (so that blocks of most sizes come out empty,
/// full and partial) and query rows 3 and L - 1 hidden from everything.
std::function<attnkit::MaskFunction(int64_t, int64_t)> random_mask(int64_t batch, int64_t heads, double density,
                                                                    uint64_t seed) {
  return [=](int64_t L, int64_t S) {
    torch::manual_seed(seed);
    auto visible = torch::rand({batch, heads, L, S}) < density;
    const auto coarse = torch::randint(0, 3, {batch, heads, (L + 63) / 64, (S + 63) / 64});
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t qb = 0; qb < coarse.size(2); ++qb)
          for (int64_t kb = 0; kb < coarse.size(3); ++kb) {
            const int64_t kind = coarse[b][h][qb][kb].item<int64_t>();
            if (kind == 2) continue;  // random bits
            visible[b][h].slice(0, 64 * qb, 64 * qb + 64).slice(1, 64 * kb, 64 * kb + 64).fill_(kind == 1);
          }
    visible.select(2, std::min<int64_t>(3, L - 1)).fill_(false);
    visible.select(2, L - 1).fill_(false);
    const auto table = visible.contiguous();
    return attnkit::MaskFunction([table, L, S](int64_t b, int64_t h, int64_t q, int64_t kv) {
      return table.data_ptr<bool>()[((b * table.size(1) + h) * L + q) * S + kv];
    });
  };
}

std::vector<MaskCase> cases() {
  std::vector<MaskCase> c;
  const auto add = [&](Case shape, std::function<attnkit::MaskFunction(int64_t, int64_t)> mask) -> MaskCase& {
    MaskCase m;
    static_cast<Case&>(m) = std::move(shape);
    m.mask = std::move(mask);
    c.push_back(std::move(m));
    return c.back();
  };
  const auto causal = [](int64_t L, int64_t S) { return masks::causal(L, S); };
  add({"causal as a mask, 300 x 300", 1, 2, 2, 300, 300, 16, 8}, causal);
  add({"causal as a mask, L = 1 over 77 keys", 2, 2, 2, 1, 77, 8, 8}, causal);
  add({"causal mask, L > S, blocks 16 x 24", 1, 2, 2, 129, 100, 8, 5}, causal).q_block = 16;
  c.back().kv_block = 24;
  add({"sliding window 40 as a mask, causal", 1, 2, 2, 300, 300, 8, 8},
      [](int64_t L, int64_t S) { return masks::sliding_window(L, S, 40, true); });
  add({"eight causal documents (L = S = 520)", 1, 2, 2, 520, 520, 8, 8}, [](int64_t L, int64_t) {
    return masks::documents(torch::tensor(std::vector<int64_t>{0, 10, 75, 140, 200, 330, 331, 400, L}), true);
  });
  add({"documents, not causal", 1, 2, 2, 260, 260, 8, 4}, [](int64_t L, int64_t) {
    return masks::documents(torch::tensor(std::vector<int64_t>{0, 100, 101, L}), false);
  });
  add({"prefix-LM, prefix 70, L < S", 1, 2, 2, 200, 330, 8, 8},
      [](int64_t L, int64_t S) { return masks::prefix_lm(L, S, 70); });
  add({"global 16 + window 50, causal", 1, 2, 2, 400, 400, 8, 8},
      [](int64_t L, int64_t S) { return masks::global_window(L, S, 16, 50, true); });
  add({"global 5 + window 20, not causal", 1, 2, 2, 150, 150, 8, 8},
      [](int64_t L, int64_t S) { return masks::global_window(L, S, 5, 20, false); });
  add({"dilated 4, causal", 1, 2, 2, 300, 300, 8, 8},
      [](int64_t L, int64_t S) { return masks::dilated(L, S, 4, true); });
  add({"random per batch and head, fully masked rows", 2, 3, 3, 300, 270, 8, 6}, random_mask(2, 3, 0.3, 1))
      .mask_batch = 2;
  c.back().mask_heads = 3;
  add({"random, blocks 200 x 300 (wider than the tiles)", 1, 2, 2, 700, 650, 8, 8}, random_mask(1, 2, 0.4, 2))
      .mask_heads = 2;
  c.back().q_block = 200, c.back().kv_block = 300;
  add({"random, blocks 7 x 520, L < S", 1, 2, 2, 40, 600, 8, 8}, random_mask(1, 1, 0.5, 3)).q_block = 7;
  c.back().kv_block = 520;
  add({"random with causal and key lengths", 2, 2, 2, 260, 300, 8, 4, true, {300, 150}},
      random_mask(1, 1, 0.6, 4));
  add({"random with a window", 1, 2, 2, 300, 300, 8, 8}, random_mask(1, 1, 0.6, 5)).window = 60;
  add({"grouped heads, a mask per query head", 1, 6, 2, 200, 200, 8, 8}, random_mask(1, 6, 0.5, 6)).mask_heads = 6;
  add({"ALiBi and rotary positions", 1, 4, 4, 260, 260, 8, 4, true}, random_mask(1, 1, 0.5, 7)).positions = true;
  add({"dropout", 1, 2, 2, 200, 200, 8, 8, true}, random_mask(1, 1, 0.5, 8)).dropout_p = 0.2;
  add({"strided views", 2, 2, 2, 150, 170, 8, 8, false, {}, {}, true}, random_mask(1, 1, 0.5, 9));
  add({"a bias per head with its gradient", 1, 2, 2, 150, 170, 8, 8, false, {}, {1, 2, 150, 170}},
      random_mask(1, 2, 0.5, 10))
      .mask_heads = 2;
  add({"a bias shared by the heads with its gradient", 2, 2, 2, 300, 330, 8, 8, false, {}, {1, 1, 300, 330}},
      random_mask(2, 1, 0.5, 11))
      .mask_batch = 2;
  return c;
}

BlockMask block_mask_of(const MaskCase& c) {
  return attnkit::create_block_mask(c.mask(c.L, c.S), c.mask_batch, c.mask_heads, c.L, c.S, c.q_block, c.kv_block);
}

SoftmaxAttentionFuncOptions masked(const MaskCase& c) {
  auto o = SoftmaxAttentionFuncOptions().block_mask(block_mask_of(c)).window(c.window);
  if (c.positions) o.alibi_slopes(attnkit::alibi_slopes(c.H).to(torch::kDouble)).rotary_dim(c.E);
  if (c.dropout_p > 0) o.dropout_p(c.dropout_p).dropout_seed(17);
  return o;
}

Inputs make(const MaskCase& c) { return make_inputs(c, 31); }

TEST(SoftmaxAttentionBlockMask, MatchesTheFloat64Reference) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_matches_reference(c, make(c), masked(c), kTolerance);
  }
}

TEST(SoftmaxAttentionBlockMask, EqualsTheMaskAsABias) {
  for (const auto& c : cases()) {
    if (c.positions || c.dropout_p > 0 || !c.bias_shape.empty()) continue;
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto q = x.q.to(torch::kFloat), k = x.k.to(torch::kFloat), v = x.v.to(torch::kFloat);
    const auto mask = block_mask_of(c);
    const auto bias = torch::zeros({mask.batch(), mask.heads(), c.L, c.S})
                          .masked_fill(mask.to_dense().logical_not(), -std::numeric_limits<float>::infinity());
    const auto plain = SoftmaxAttentionFuncOptions().causal(c.causal).key_lengths(x.key_lengths).window(c.window);
    auto with_bias = plain, with_mask = plain;
    const auto want = attnkit::softmax_attention(q, k, v, with_bias.bias(bias));
    EXPECT_LE(relative_error(attnkit::softmax_attention(q, k, v, with_mask.block_mask(mask)), want), 1e-6);
  }
}

TEST(SoftmaxAttentionBlockMask, AMaskThatHidesNothingIsNoMask) {
  for (const int64_t L : {1, 130, 300}) {
    torch::manual_seed(L);
    const auto q = torch::randn({1, 2, L, 16}), k = torch::randn({1, 2, 290, 16}), v = torch::randn({1, 2, 290, 8});
    const auto everything = attnkit::create_block_mask(
        [](int64_t, int64_t, int64_t, int64_t) { return true; }, 1, 1, L, 290, 64, 96);
    const auto none = attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true));
    const auto all = attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true).block_mask(everything));
    EXPECT_LE(relative_error(all, none), 1e-6) << "L " << L;
  }
}

TEST(SoftmaxAttentionBlockMask, BitwiseTheSameOnOneAndTwoThreads) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_same_on_one_and_two_threads(c, make(c), masked(c));
  }
}

TEST(SoftmaxAttentionBlockMask, DispatchAndRefusals) {
  const auto q = torch::randn({2, 4, 3, 8}), k = torch::randn({2, 4, 5, 8}), v = torch::randn({2, 4, 5, 8});
  const auto mask = attnkit::create_block_mask(masks::causal(3, 5), 1, 1, 3, 5);
  const auto o = SoftmaxAttentionFuncOptions().block_mask(mask);
  EXPECT_TRUE(attnkit::softmax_attention_dispatch(q, k, v, o).uses_kernel());
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  EXPECT_EQ(attnkit::softmax_attention_dispatch(bf(q), bf(k), bf(v), o).reason,
            "bf16 converted to float32 (a block mask)");
  using attnkit::testing::expect_error;
  // A mask of another grid, batch or head count.
  const auto other_grid = attnkit::create_block_mask(masks::causal(4, 5), 1, 1, 4, 5);
  expect_error([&] { attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().block_mask(other_grid)); },
               {"softmax_attention"});
  const auto three_heads = attnkit::create_block_mask(masks::causal(3, 5), 1, 3, 3, 5);
  expect_error([&] { attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().block_mask(three_heads)); },
               {"softmax_attention", "head count is 3"});
  const auto cu = torch::tensor({0, 3}, torch::kLong);
  expect_error(
      [&] {
        attnkit::varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1).slice(0, 0, 3), v[0].transpose(0, 1).slice(0, 0, 3),
                                  cu, cu, SoftmaxAttentionFuncOptions().block_mask(mask));
      },
      {"varlen_attention", "option 'block_mask' is not taken", "masks::documents"});
}

}  // namespace

}  // namespace softmax_attention_block_mask_test
