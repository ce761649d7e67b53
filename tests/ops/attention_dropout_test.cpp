// Attention dropout inside the exact softmax kernel
// (SoftmaxAttentionFuncOptions::dropout_p and dropout_seed; the draw is
// defined in src/kernels/common/dropout.h). Checked:
// - the keep mask of attnkit::attention_dropout_mask: its keep rate (overall
//   and per vector lane), no correlation between neighbours along keys (at
//   lags 1, 16 and 1024: one vector, one draw chunk), queries, heads, batch
//   entries and seeds, balanced XORs of 2 x 2 squares, and equality with the
//   scalar definition (reference::attention_dropout_keep) on awkward sizes,
//   extreme probabilities and negative seeds;
// - the float32 kernel against the float64 reference with the same seed,
//   values and the gradients of q, k, v and a bias, on awkward shapes and
//   with every feature of the kernel, on each of its paths (tiles, windows,
//   the forward's key split, the backward's key parts, the shared-bias
//   gradient pass, decoding with grouped heads); the float64 op (the
//   composite) against the same reference;
// - forward and backward draw the mask attention_dropout_mask returns (with
//   v = I the output is the weights themselves, and with dout = I so is dv);
// - bitwise results: 1 and 2 threads, two calls with one seed, p = 0 with a
//   seed against no dropout; different seeds differ;
// - an unset seed comes from torch's default generator (and only then is the
//   generator consumed), and the backward reuses the forward's;
// - varlen_attention: sequence b draws batch entry b's mask (against the
//   padded batch), float32 against float64;
// - scaled_dot_product_attention's dropout_p, bfloat16 inputs, the refusals,
//   and nn::MultiheadAttention's dropout option.
#include <attnkit/models/transformer.h>
#include <attnkit/nn/multihead.h>
#include <attnkit/nn/registry.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/dropout.h"
#include "kernels/softmax_attention.h"
#include "ops/softmax_attention_cases.h"
#include "ops/varlen_cases.h"
#include "reference/reference.h"
#include "test_util.h"

namespace attention_dropout_test {

namespace {

using attnkit::ScaledDotProductAttentionFuncOptions;
using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::expect_error;
using attnkit::testing::f32;
using attnkit::testing::f64;
using attnkit::testing::rel_err;
using attnkit::testing::ThreadsGuard;
using namespace attnkit::testing::softmax;  // Case, Inputs, make_inputs, run, relative_error, ...

// float32 kernel against float64: max |op - reference| / max(max |reference|,
// 1), as for the kernel's other features (tests/ops/softmax_attention_gqa_test.cpp):
// N(0, 1) inputs and cotangent, O(1) terms, float32 rounding over <= 5000
// keys below sqrt(S) u = 4e-6 of that scale. Dropout zeroes terms and scales
// the kept ones by 1 / (1 - p) <= 2, which at most doubles that: 2e-5 still
// leaves room for the exponentials. Two float32 runs that differ only in
// their tiling (packed against padded) are each within it of the exact
// values; 2e-5 holds for their difference as well.
constexpr double kTolerance = 2e-5;

// Statistical checks: each passes when the statistic is within 5 standard
// deviations of its expectation, a chance of 6e-7 for a sound draw. The
// masks are pure functions of their seeds, so each check gives the same
// answer on every run and machine.
constexpr double kSigmas = 5.0;

// ---------------------------------------------------------------------------
// The mask
// ---------------------------------------------------------------------------

/// Keep rate within kSigmas binomial standard deviations of 1 - p.
void expect_keep_rate(const torch::Tensor& keep, double p, const std::string& what) {
  const double count = static_cast<double>(keep.numel());
  const double rate = keep.to(torch::kDouble).mean().item<double>();
  const double sigma = std::sqrt(p * (1 - p) / count);
  EXPECT_LT(std::abs(rate - (1 - p)), kSigmas * sigma)
      << what << ": keep rate " << rate << " over " << count << " draws, p = " << p;
}

/// Pearson correlation of the keep indicators a and b (same shape, entry by
/// entry): for independent draws about N(0, 1 / count).
void expect_uncorrelated(const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const auto x = a.to(torch::kDouble).reshape({-1}), y = b.to(torch::kDouble).reshape({-1});
  const double count = static_cast<double>(x.numel());
  const auto dx = x - x.mean(), dy = y - y.mean();
  const double r = ((dx * dy).sum() / (dx.square().sum() * dy.square().sum()).sqrt()).item<double>();
  EXPECT_LT(std::abs(r), kSigmas / std::sqrt(count)) << what << ": correlation " << r << " over " << count << " pairs";
}

// 2 x 4 x 128 x 2048 = 2.1 million draws (S > 1024: two draw chunks per row);
// 5 sigma is then 0.0035 on a correlation.
constexpr int64_t kN = 2, kH = 4, kL = 128, kS = 2048;

TEST(AttentionDropoutMask, KeepRateIsOneMinusP) {
  for (double p : {0.1, 0.5, 0.9}) {
    const auto keep = attnkit::attention_dropout_mask(kN, kH, kL, kS, p, 1234);
    ASSERT_EQ(keep.sizes(), (std::vector<int64_t>{kN, kH, kL, kS}));
    ASSERT_EQ(keep.scalar_type(), torch::kBool);
    expect_keep_rate(keep, p, "all");
    // Per lane of a 16-key vector (keys j with j % 16 = c): a lane the
    // vectorised draw gets wrong shows here before it shows in the mean.
    const auto lanes = keep.reshape({-1, 16});
    for (int64_t c = 0; c < 16; ++c) expect_keep_rate(lanes.select(1, c), p, "lane " + std::to_string(c));
  }
}

TEST(AttentionDropoutMask, NeighboursAreUncorrelated) {
  const int64_t seed = -77;
  for (double p : {0.5, 0.1}) {
    SCOPED_TRACE("p " + std::to_string(p));
    const auto z = attnkit::attention_dropout_mask(kN, kH, kL, kS, p, seed);
    expect_uncorrelated(z.narrow(3, 0, kS - 1), z.narrow(3, 1, kS - 1), "keys j, j + 1");
    expect_uncorrelated(z.narrow(3, 0, kS - 16), z.narrow(3, 16, kS - 16), "keys j, j + 16");
    expect_uncorrelated(z.narrow(3, 0, kS - 1024), z.narrow(3, 1024, kS - 1024), "keys j, j + 1024");
    expect_uncorrelated(z.narrow(2, 0, kL - 1), z.narrow(2, 1, kL - 1), "queries i, i + 1");
    expect_uncorrelated(z.narrow(2, 0, kL - 1).narrow(3, 0, kS - 1), z.narrow(2, 1, kL - 1).narrow(3, 1, kS - 1),
                        "diagonal (i, j), (i + 1, j + 1)");
    expect_uncorrelated(z.narrow(1, 0, kH - 1), z.narrow(1, 1, kH - 1), "heads h, h + 1");
    expect_uncorrelated(z.narrow(0, 0, kN - 1), z.narrow(0, 1, kN - 1), "batch entries n, n + 1");
    expect_uncorrelated(z, attnkit::attention_dropout_mask(kN, kH, kL, kS, p, seed + 1), "seeds s, s + 1");
  }
}

TEST(AttentionDropoutMask, XorsOfTwoByTwoSquaresAreBalanced) {
  // p = 0.5: each draw is a fair bit, and the XOR of four independent ones
  // is fair too; a draw whose rows and keys interact (e.g. Z(i, j) = a_i ^
  // b_j) makes every XOR 0.
  const auto z = attnkit::attention_dropout_mask(kN, kH, kL, kS, 0.5, 99);
  const auto expect_balanced = [](const torch::Tensor& x, const std::string& what) {
    const double count = static_cast<double>(x.numel());
    const double ones = x.to(torch::kDouble).mean().item<double>();
    EXPECT_LT(std::abs(ones - 0.5), kSigmas * 0.5 / std::sqrt(count)) << what << ": " << ones << " over " << count;
  };
  // Random quadruples Z(i, j), Z(i, j'), Z(i', j), Z(i', j') of one (n, h),
  // i != i' and j != j'.
  torch::manual_seed(5);
  const int64_t count = int64_t{1} << 20;
  const auto r = torch::randint(kN * kH, {count}, torch::kLong);
  const auto i = torch::randint(kL, {count}, torch::kLong), j = torch::randint(kS, {count}, torch::kLong);
  const auto i2 = (i + 1 + torch::randint(kL - 1, {count}, torch::kLong)).remainder(kL);
  const auto j2 = (j + 1 + torch::randint(kS - 1, {count}, torch::kLong)).remainder(kS);
  const auto flat = z.reshape({-1});
  const auto at = [&](const torch::Tensor& row, const torch::Tensor& key) {
    return flat.index_select(0, (r * kL + row) * kS + key);
  };
  expect_balanced(
      torch::logical_xor(torch::logical_xor(at(i, j), at(i, j2)), torch::logical_xor(at(i2, j), at(i2, j2))),
      "random quadruples");
  // Every square of neighbours (i, i + 1) x (j, j + 1).
  const auto a = z.narrow(2, 0, kL - 1), b = z.narrow(2, 1, kL - 1);
  const auto square = torch::logical_xor(torch::logical_xor(a.narrow(3, 0, kS - 1), a.narrow(3, 1, kS - 1)),
                                         torch::logical_xor(b.narrow(3, 0, kS - 1), b.narrow(3, 1, kS - 1)));
  expect_balanced(square, "adjacent squares");
}

TEST(AttentionDropoutMask, EqualsTheScalarDefinition) {
  struct Size {
    int64_t N, H, L, S;
  };
  // S below one vector, not a multiple of 16, exactly one draw chunk (1024),
  // one key past it, and several chunks with a ragged last one.
  const Size sizes[] = {{2, 3, 5, 1},    {1, 2, 3, 17},   {1, 1, 4, 1024},
                        {1, 1, 3, 1025}, {2, 2, 3, 1030}, {1, 2, 2, 2100}};
  const int64_t seeds[] = {
      0, 1, -1, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), -0x123456789abcdefLL};
  // 0.5: the threshold 2^15 (the draws' top bit); 1 - 2^-17: the largest
  // threshold, 2^16 - 1 (only the draw 0xffff kept); 1e-10: rounds to none.
  const double ps[] = {0.1, 0.37, 0.5, 0.9, 1 - 0x1p-17, 1e-10};
  for (const auto& s : sizes)
    for (int64_t seed : seeds)
      for (double p : ps) {
        SCOPED_TRACE("(" + std::to_string(s.N) + ", " + std::to_string(s.H) + ", " + std::to_string(s.L) + ", " +
                     std::to_string(s.S) + "), seed " + std::to_string(seed) + ", p " + std::to_string(p));
        const auto got = attnkit::attention_dropout_mask(s.N, s.H, s.L, s.S, p, seed);
        const auto want = attnkit::reference::attention_dropout_keep(s.N, s.H, s.L, s.S, p, seed);
        ASSERT_EQ(got.sizes(), want.sizes());
        EXPECT_TRUE(torch::equal(got, want)) << (got != want).sum().item<int64_t>() << " entries differ";
      }
}

TEST(AttentionDropoutMask, MatchesValuesComputedApart) {
  // The first 64 keys of four rows, bit j = key j kept, computed by a
  // separate Python transcription of docs/MATH.md's definition (splitmix64
  // row keys, two lowbias32 rounds per word, 16-bit draws against
  // round(p 2^16)): a change of the draw, which would change every mask users
  // get for a seed, fails here even though the kernel and the reference
  // share the code.
  struct Golden {
    int64_t seed;
    double p;
    int64_t n, h, i;
    uint64_t bits;
  };
  const Golden golden[] = {{123, 0.3, 0, 0, 0, 0xde20ee0ff65dbe9cULL},
                           {123, 0.3, 1, 2, 3, 0xf7efa93fee777dd8ULL},
                           {-7, 0.5, 0, 1, 1000, 0xd033f177b1ac38feULL},
                           {std::numeric_limits<int64_t>::max(), 0.1, 4, 0, 2, 0xffdffffffffdeffdULL}};
  for (const auto& g : golden) {
    const auto mask = attnkit::attention_dropout_mask(g.n + 1, g.h + 1, g.i + 1, 64, g.p, g.seed)[g.n][g.h][g.i];
    uint64_t bits = 0;
    for (int64_t j = 0; j < 64; ++j)
      if (mask[j].item<bool>()) bits |= uint64_t{1} << j;
    EXPECT_EQ(bits, g.bits) << "seed " << g.seed << ", row (" << g.n << ", " << g.h << ", " << g.i << ")";
  }
}

TEST(AttentionDropoutMask, KeepBitsFromAnyFirstKey) {
  // Tiles of a window start at any key: keep_bits realigns the 32-key groups
  // it draws. Every start within a group, and lengths around the vector and
  // group sizes and up to the widest tile, against the scalar definition.
  // (This build's own level; the kernel tests reach the vector levels' draws
  // through windowed tiles.)
  const attnkit::kernels::AttentionDropout dropout(0.4, 77, 0);
  const uint64_t row = dropout.row(0, 1, 2);
  uint16_t bits[attnkit::kernels::AttentionDropout::kMaxKeys / 16];
  for (int64_t base : {int64_t{0}, int64_t{4096}})
    for (int64_t offset = 0; offset < 32; ++offset)
      for (int64_t n : {1, 15, 16, 17, 31, 32, 33, 1000, 1023, 1024}) {
        const int64_t j0 = base + offset;
        dropout.keep_bits(row, j0, n, bits);
        int64_t wrong = 0;
        for (int64_t c = 0; c < n; ++c) wrong += ((bits[c / 16] >> (c % 16)) & 1) != dropout.kept(row, j0 + c);
        EXPECT_EQ(wrong, 0) << "j0 " << j0 << ", n " << n;
      }
}

TEST(AttentionDropoutMask, ZeroKeepsEverythingAndSeedsDecide) {
  EXPECT_TRUE(attnkit::attention_dropout_mask(2, 3, 40, 300, 0.0, 5).all().item<bool>());
  // The probability is rounded to a multiple of 2^-16: 1e-10 is none.
  EXPECT_TRUE(attnkit::attention_dropout_mask(2, 3, 40, 300, 1e-10, 5).all().item<bool>());
  const auto a = attnkit::attention_dropout_mask(2, 3, 40, 300, 0.2, 5);
  EXPECT_TRUE(torch::equal(a, attnkit::attention_dropout_mask(2, 3, 40, 300, 0.2, 5)));
  EXPECT_FALSE(torch::equal(a, attnkit::attention_dropout_mask(2, 3, 40, 300, 0.2, 6)));
  EXPECT_FALSE(torch::equal(a, attnkit::attention_dropout_mask(2, 3, 40, 300, 0.2, -5)));
  // A row's mask is a function of (seed, n, h, i) alone: the first entries of
  // a larger call are the smaller call's.
  const auto larger = attnkit::attention_dropout_mask(3, 4, 50, 333, 0.2, 5);
  EXPECT_TRUE(torch::equal(a, larger.narrow(0, 0, 2).narrow(1, 0, 3).narrow(2, 0, 40).narrow(3, 0, 300)));
  // Empty sizes are allowed.
  EXPECT_EQ(attnkit::attention_dropout_mask(0, 3, 4, 5, 0.2, 5).numel(), 0);
  EXPECT_EQ(attnkit::attention_dropout_mask(1, 1, 4, 0, 0.2, 5).numel(), 0);
}

TEST(AttentionDropoutMask, BatchOffsetsAndThreads) {
  // The reference's batch offset (a packed batch's sequence b is batch b)
  // draws the later batch entries of the mask.
  const auto five = attnkit::attention_dropout_mask(5, 2, 7, 40, 0.3, 8);
  EXPECT_TRUE(torch::equal(attnkit::reference::attention_dropout_keep(2, 2, 7, 40, 0.3, 8, /*batch_offset=*/3),
                           five.narrow(0, 3, 2)));
  torch::Tensor one, two;
  {
    ThreadsGuard threads(1);
    one = attnkit::attention_dropout_mask(2, 4, 64, 1030, 0.3, 8);
  }
  {
    ThreadsGuard threads(2);
    two = attnkit::attention_dropout_mask(2, 4, 64, 1030, 0.3, 8);
  }
  EXPECT_TRUE(torch::equal(one, two));
}

// ---------------------------------------------------------------------------
// The kernel against the float64 reference
// ---------------------------------------------------------------------------

struct DropoutCase : Case {
  int64_t window = 0;
  bool alibi = false;
  int64_t rotary_dim = 0;
  bool key_split = false;  // the shape must take the forward's key split
  bool parts = false;      // the shape must take the backward's key parts (N H < 8, no bias)
};

DropoutCase dropout_case(Case shape, int64_t window = 0, bool alibi = false, int64_t rotary_dim = 0) {
  DropoutCase c;
  static_cast<Case&>(c) = std::move(shape);
  c.window = window;
  c.alibi = alibi;
  c.rotary_dim = rotary_dim;
  return c;
}

std::vector<DropoutCase> cases() {
  std::vector<DropoutCase> c;
  // Case: name, N, H, Hkv, L, S, E, M, causal, key_lengths, bias_shape, strided.
  c.push_back(dropout_case({"L = 1 over 300 keys", 2, 4, 4, 1, 300, 16, 16, false, {}, {}, false}));
  c.push_back(dropout_case({"129 x 257, E != M", 2, 4, 4, 129, 257, 16, 24, false, {}, {}, false}));
  c.push_back(dropout_case(
      {"causal 300 x 129 (L > S: the first rows see nothing)", 2, 4, 4, 300, 129, 32, 16, true, {}, {}, false}));
  c.push_back(dropout_case({"causal 129 x 300 (L < S)", 2, 4, 4, 129, 300, 16, 16, true, {}, {}, false}));
  c.push_back(dropout_case({"key lengths with an empty row", 2, 4, 4, 130, 257, 16, 16, false, {200, 0}, {}, false}));
  c.push_back(dropout_case({"causal window 50", 1, 8, 8, 300, 300, 16, 16, true, {}, {}, false}, 50));
  c.push_back(dropout_case(
      {"symmetric window 50, L < S, key lengths", 2, 4, 4, 129, 300, 16, 16, false, {300, 77}, {}, false}, 50));
  c.push_back(dropout_case({"ALiBi, causal", 2, 4, 4, 129, 257, 16, 16, true, {}, {}, false}, 0, true));
  c.push_back(dropout_case({"rotary on 8 of 16, L > S", 2, 4, 4, 257, 129, 16, 16, false, {}, {}, false}, 0, false, 8));
  c.push_back(dropout_case({"grouped-query heads 8 -> 2, causal", 2, 8, 2, 129, 130, 16, 16, true, {}, {}, false}));
  // L = 1 with grouped heads: without dropout, decoding attends each group's
  // query heads as the rows of one block; dropout's mask is per query head.
  c.push_back(
      dropout_case({"multi-query decoding, key lengths", 2, 4, 1, 1, 300, 32, 32, true, {300, 123}, {}, false}));
  c.push_back(
      dropout_case({"a bias per head with its gradient", 2, 4, 4, 129, 257, 16, 16, false, {}, {1, 4, 1, 257}, false}));
  c.push_back(dropout_case(
      {"a full bias with its gradient, causal", 2, 4, 4, 65, 130, 16, 16, true, {}, {2, 4, 65, 130}, false}));
  // Heads sharing a bias slice: its gradient comes from a second pass that
  // recomputes P and dP.
  c.push_back(dropout_case(
      {"a bias shared by the heads with its gradient", 2, 4, 4, 129, 257, 16, 16, true, {}, {2, 1, 129, 257}, false}));
  c.push_back(dropout_case({"strided (N, L, H, E) views", 2, 4, 4, 129, 257, 16, 24, false, {257, 100}, {}, true}));
  // N H ceil(L / 128) < 64 and S >= 2048: the forward splits the keys; N H < 8
  // without a bias: the backward splits each head's keys into parts.
  auto split = dropout_case({"key split: N = H = L = 1, S = 5000", 1, 1, 1, 1, 5000, 32, 32, false, {}, {}, false});
  split.key_split = split.parts = true;
  c.push_back(split);
  auto split_positions = dropout_case(
      {"key split, causal, ALiBi and rotary: L = 3, S = 2100", 1, 2, 2, 3, 2100, 16, 16, true, {}, {}, false}, 0, true,
      16);
  split_positions.key_split = split_positions.parts = true;
  c.push_back(split_positions);
  auto parts = dropout_case({"backward parts: causal 300 x 700", 1, 2, 2, 300, 700, 16, 16, true, {}, {}, false});
  parts.parts = true;
  c.push_back(parts);
  auto parts_window = dropout_case(
      {"backward parts with a window, rotary, grouped heads, strided", 1, 4, 2, 257, 600, 16, 16, false, {}, {}, true},
      100, false, 8);
  parts_window.parts = true;
  c.push_back(parts_window);
  // Grouped heads, ALiBi, rotary positions, a window, key lengths and strided views together.
  c.push_back(dropout_case({"all at once", 2, 4, 2, 200, 260, 32, 16, true, {260, 0}, {}, true}, 64, true, 16));
  return c;
}

Inputs make(const DropoutCase& c) { return make_inputs(c, 41); }

SoftmaxAttentionFuncOptions features(const DropoutCase& c, double p, c10::optional<int64_t> seed) {
  auto o = SoftmaxAttentionFuncOptions().dropout_p(p).dropout_seed(seed).window(c.window).rotary_dim(c.rotary_dim);
  if (c.alibi) o.alibi_slopes(attnkit::alibi_slopes(c.H).to(torch::kDouble));
  return o;
}

/// Seeds of every sign, one per case and probability.
int64_t seed_of(size_t index, double p) {
  const auto base = static_cast<int64_t>(index) * 1000003 + 17;
  return p < 0.3 ? base : -base * 0x9E3779B9LL;
}

int64_t key_chunks(const Case& c) {
  attnkit::kernels::SoftmaxAttentionParams p;
  p.N = c.N, p.H = c.H, p.L = c.L, p.S = c.S, p.E = c.E, p.M = c.M;
  return attnkit::kernels::softmax_attention_forward_key_chunks(p);
}

TEST(AttentionDropoutKernel, TheCasesTakeTheirPaths) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    if (c.key_split)
      EXPECT_GT(key_chunks(c), 1) << "the case must take the split forward";
    else
      EXPECT_EQ(key_chunks(c), 1);
    // kernels/softmax_attention.h: the backward splits the keys into parts
    // when N H < 8 and there is no bias.
    EXPECT_EQ(c.parts, c.N * c.H < 8 && c.bias_shape.empty());
  }
}

/// Case `index` against the float64 reference at each rate, with its seeds.
void expect_case_matches_reference(const std::vector<DropoutCase>& all, size_t index,
                                   std::initializer_list<double> rates) {
  const auto& c = all[index];
  for (double p : rates) {
    SCOPED_TRACE(c.name + ", p " + std::to_string(p));
    expect_matches_reference(c, make(c), features(c, p, seed_of(index, p)), kTolerance);
  }
}

TEST(AttentionDropoutKernel, MatchesTheFloat64Reference) {
  const auto all = cases();
  for (size_t index = 0; index < all.size(); ++index) expect_case_matches_reference(all, index, {0.1, 0.5});
}

TEST(AttentionDropoutKernel, HighRatesMatchTheReference) {
  // Most weights dropped, the survivors scaled by 10 and 100: the same
  // comparison on two cases, tiles and a window. The factor multiplies the
  // kept terms' rounding as well; their count falls with it, so the error
  // relative to the largest entry stays within the tolerance.
  const auto all = cases();
  for (size_t index : {size_t{1}, size_t{5}}) expect_case_matches_reference(all, index, {0.9, 0.99});
}

TEST(AttentionDropoutKernel, DropoutChangesTheResult) {
  // So that the comparisons above are of dropout and not of its absence:
  // with the same inputs, dropout moves every case's output and gradients
  // (by a fair part of their largest entry: rel_err, scale-free, since the
  // gradients of 5000 keys are ~1e-3).
  const auto all = cases();
  for (size_t index = 0; index < all.size(); ++index) {
    const auto& c = all[index];
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
    const auto with = run(c, x, features(c, 0.5, seed_of(index, 0.5)), torch::kFloat, cot, false);
    const auto without = run(c, x, features(c, 0.0, c10::nullopt), torch::kFloat, cot, false);
    for (size_t i = 0; i < with.size(); ++i) EXPECT_GT(rel_err(with[i], without[i]), 1e-2) << i;
  }
}

TEST(AttentionDropoutKernel, BitwiseTheSameOnOneAndTwoThreads) {
  const auto all = cases();
  for (size_t index = 0; index < all.size(); ++index) {
    const auto& c = all[index];
    SCOPED_TRACE(c.name);
    expect_same_on_one_and_two_threads(c, make(c), features(c, 0.5, seed_of(index, 0.5)));
  }
}

TEST(AttentionDropoutKernel, SeedsDecideBitwise) {
  const auto all = cases();
  for (size_t index = 0; index < all.size(); ++index) {
    const auto& c = all[index];
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
    const int64_t seed = seed_of(index, 0.5);
    const auto first = run(c, x, features(c, 0.3, seed), torch::kFloat, cot, false);
    const auto again = run(c, x, features(c, 0.3, seed), torch::kFloat, cot, false);
    for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(torch::equal(first[i], again[i])) << i;
    const auto other = run(c, x, features(c, 0.3, seed + 1), torch::kFloat, cot, false);
    EXPECT_FALSE(torch::equal(first[0], other[0]));
    // dropout_p = 0 with a seed: the kernel without dropout, bitwise.
    const auto zero = run(c, x, features(c, 0.0, seed), torch::kFloat, cot, false);
    const auto none = run(c, x, features(c, 0.0, c10::nullopt), torch::kFloat, cot, false);
    for (size_t i = 0; i < zero.size(); ++i) EXPECT_TRUE(torch::equal(zero[i], none[i])) << i;
  }
}

// ---------------------------------------------------------------------------
// Forward and backward draw attention_dropout_mask's mask
// ---------------------------------------------------------------------------

struct IdentityCase {
  std::string name;
  int64_t N, H, L, S;  // M = S, and L <= S
  bool causal = false;
  int64_t window = 0;
};

std::vector<IdentityCase> identity_cases() {
  return {{"tiles, N H = 8", 2, 4, 200, 300},
          {"causal, L < S", 2, 4, 100, 300, true},
          {"window 40 (tiles from any key), backward parts", 1, 2, 200, 300, false, 40},
          {"key split and backward parts", 1, 1, 2, 2100}};
}

/// With v = I (M = S) the output is the attention weights themselves,
/// W = P o Z / (1 - p); with dout = I (L x M) the gradient of v is
/// dv[j, i] = W[i, j] for i < L: the backward's weights, mask included.
struct IdentityRun {
  torch::Tensor out, dv_t;  // (N, H, L, S): the forward's and the backward's weights
};

IdentityRun identity_run(const IdentityCase& c, const SoftmaxAttentionFuncOptions& o,
                         const std::function<void()>& between = {}) {
  torch::manual_seed(50);
  const int64_t E = 16;
  // Small scores: every visible P is far from underflow (P > 0 exactly
  // where a key is visible).
  const auto q = (0.5 * torch::randn({c.N, c.H, c.L, E})).requires_grad_();
  const auto k = (0.5 * torch::randn({c.N, c.H, c.S, E})).requires_grad_();
  const auto v = torch::eye(c.S).repeat({c.N, c.H, 1, 1}).requires_grad_();
  auto options = o;
  const auto out = attnkit::softmax_attention(q, k, v, options.causal(c.causal).window(c.window));
  if (between) between();
  out.backward(torch::eye(c.L, c.S).repeat({c.N, c.H, 1, 1}));
  return {out.detach(), v.grad().narrow(-1, 0, c.L).transpose(-1, -2)};
}

TEST(AttentionDropoutKernel, ForwardAndBackwardDrawTheMaskOfAttentionDropoutMask) {
  const double p = 0.3;
  const int64_t seed = -4242;
  for (const auto& c : identity_cases()) {
    SCOPED_TRACE(c.name);
    const auto z = attnkit::attention_dropout_mask(c.N, c.H, c.L, c.S, p, seed);
    // A bias of zeros changes no score, and keeps the forward on the sgemm
    // tiles that dropout takes (without bias, dropout or window it takes the
    // lane tiles, whose sums round differently): the same exponentials below.
    const auto zeros = torch::zeros({c.N, c.H, c.L, c.S});
    const auto plain = identity_run(c, SoftmaxAttentionFuncOptions().bias(zeros));
    const auto visible = plain.out != 0;  // P > 0 exactly where visible
    const auto kept = z & visible;
    ASSERT_GT(kept.sum().item<int64_t>(), 0);
    ASSERT_GT((visible & z.logical_not()).sum().item<int64_t>(), 0) << "nothing visible was dropped";
    const auto got = identity_run(c, SoftmaxAttentionFuncOptions().dropout_p(p).dropout_seed(seed));
    EXPECT_TRUE(torch::equal(got.out != 0, kept)) << "the forward's zeros are not the mask's";
    EXPECT_TRUE(torch::equal(got.dv_t != 0, kept)) << "the backward's zeros are not the mask's";
    // Kept weights are P / (1 - p') with p' = p rounded to a multiple of
    // 2^-16 (the rate the draw keeps exactly; 4e-6 from 1 / (1 - p) at p =
    // 0.3): the same exponentials as without dropout times one float32
    // factor, so within 2 ulp (1.2e-7) of each other; 1e-6 element by element.
    const auto want = plain.out / attnkit::kernels::AttentionDropout::keep_rate(p);
    const auto err = ((got.out - want).abs() / want.abs().clamp_min(1e-30)).masked_select(kept);
    EXPECT_LT(err.max().item<double>(), 1e-6);
    // The backward recomputes P from the saved log-sum-exp: float32
    // exponentials of the same scores, ~1e-6 relative; 1e-5 of the largest.
    EXPECT_LT(rel_err(got.dv_t, got.out), 1e-5);
  }
}

// ---------------------------------------------------------------------------
// The seed
// ---------------------------------------------------------------------------

struct Qkv {
  torch::Tensor q, k, v;
};

Qkv small_qkv(torch::TensorOptions options = f32()) {
  torch::manual_seed(60);
  return {torch::randn({2, 4, 33, 16}, options), torch::randn({2, 4, 40, 16}, options),
          torch::randn({2, 4, 40, 24}, options)};
}

TEST(AttentionDropoutSeed, AnUnsetSeedComesFromTorchsGenerator) {
  const auto x = small_qkv();
  const auto o = SoftmaxAttentionFuncOptions().dropout_p(0.3);
  const auto call = [&](uint64_t seed) {
    torch::manual_seed(seed);
    return attnkit::softmax_attention(x.q, x.k, x.v, o);
  };
  const auto a = call(7);
  EXPECT_TRUE(torch::equal(a, call(7)));
  EXPECT_FALSE(torch::equal(a, call(8)));
  // Each call draws a new seed.
  torch::manual_seed(7);
  attnkit::softmax_attention(x.q, x.k, x.v, o);
  EXPECT_FALSE(torch::equal(a, attnkit::softmax_attention(x.q, x.k, x.v, o)));
  // float64 (the composite) draws its seed the same way: the same mask.
  torch::manual_seed(7);
  const auto composite =
      attnkit::softmax_attention(x.q.to(torch::kDouble), x.k.to(torch::kDouble), x.v.to(torch::kDouble), o);
  EXPECT_LT(relative_error(a, composite), kTolerance);
  // And what it drew was dropout: the result differs from none.
  const auto none = attnkit::softmax_attention(x.q, x.k, x.v);
  EXPECT_GT(rel_err(a, none), 1e-2);
}

TEST(AttentionDropoutSeed, TheGeneratorIsConsumedOnlyWhenASeedIsDrawn) {
  const auto x = small_qkv();
  const auto fresh = [] {
    torch::manual_seed(7);
    return torch::rand({8});
  }();
  const auto draws_after = [&](const SoftmaxAttentionFuncOptions& o) {
    torch::manual_seed(7);
    attnkit::softmax_attention(x.q, x.k, x.v, o);
    return torch::rand({8});
  };
  EXPECT_TRUE(torch::equal(draws_after(SoftmaxAttentionFuncOptions()), fresh));
  EXPECT_TRUE(torch::equal(draws_after(SoftmaxAttentionFuncOptions().dropout_p(0.0)), fresh));
  EXPECT_TRUE(torch::equal(draws_after(SoftmaxAttentionFuncOptions().dropout_p(0.3).dropout_seed(3)), fresh));
  EXPECT_FALSE(torch::equal(draws_after(SoftmaxAttentionFuncOptions().dropout_p(0.3)), fresh));
}

TEST(AttentionDropoutSeed, TheBackwardReusesTheForwardsDrawnSeed) {
  // The seed is drawn once, at the forward; reseeding torch's generator
  // before the backward must not change the backward's mask.
  for (const auto& c : identity_cases()) {
    SCOPED_TRACE(c.name);
    const auto visible = identity_run(c, SoftmaxAttentionFuncOptions()).out != 0;
    const auto got = identity_run(c, SoftmaxAttentionFuncOptions().dropout_p(0.5), [] {
      torch::manual_seed(12345);
      torch::rand({16});
    });
    ASSERT_GT((visible & (got.out == 0)).sum().item<int64_t>(), 0) << "nothing visible was dropped";
    EXPECT_TRUE(torch::equal(got.out != 0, got.dv_t != 0));
    EXPECT_LT(rel_err(got.dv_t, got.out), 1e-5);  // as in ForwardAndBackwardDrawTheMaskOfAttentionDropoutMask
  }
}

// ---------------------------------------------------------------------------
// varlen_attention
// ---------------------------------------------------------------------------

struct VarlenBatch {
  std::string name;
  std::vector<int64_t> q_lengths, k_lengths;
  bool self = true;  // q_lengths == k_lengths
  int64_t H = 4, Hkv = 2, E = 16, M = 8;
};

using Packed = attnkit::testing::varlen::Packed;

Packed pack(const VarlenBatch& b, uint64_t seed) {
  return attnkit::testing::varlen::pack(b.q_lengths, b.k_lengths, b.H, b.Hkv, b.E, b.M, seed);
}

const char* const kWhat[] = {"out", "dq", "dk", "dv"};

/// out, dq, dk, dv of varlen_attention in `dtype`, packed.
std::vector<torch::Tensor> run_packed(const Packed& p, const SoftmaxAttentionFuncOptions& o, torch::ScalarType dtype) {
  const auto q = p.q.detach().to(dtype).requires_grad_(), k = p.k.detach().to(dtype).requires_grad_();
  const auto v = p.v.detach().to(dtype).requires_grad_();
  const auto out = attnkit::varlen_attention(q, k, v, p.cu_q, p.cu_k, o);
  out.backward(p.dout.to(dtype));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

/// The same by the float32 op on the padded batch (sequence b as batch entry
/// b, its rows from 0, key_lengths its key counts), unpadded again.
std::vector<torch::Tensor> run_padded(const VarlenBatch& b, const Packed& p, const SoftmaxAttentionFuncOptions& o) {
  const auto B = static_cast<int64_t>(b.q_lengths.size());
  const int64_t Lmax = *std::max_element(b.q_lengths.begin(), b.q_lengths.end());
  const int64_t Smax = *std::max_element(b.k_lengths.begin(), b.k_lengths.end());
  const auto pad = [B](const torch::Tensor& packed, const std::vector<int64_t>& cu, int64_t rows) {
    auto t = torch::zeros({B, packed.size(1), rows, packed.size(2)}, packed.options());
    for (int64_t n = 0; n < B; ++n)
      t[n].narrow(1, 0, cu[n + 1] - cu[n]).copy_(packed.narrow(0, cu[n], cu[n + 1] - cu[n]).permute({1, 0, 2}));
    return t.to(torch::kFloat);
  };
  const auto unpad = [B](const torch::Tensor& t, const std::vector<int64_t>& cu) {
    std::vector<torch::Tensor> rows;
    for (int64_t n = 0; n < B; ++n) rows.push_back(t[n].narrow(1, 0, cu[n + 1] - cu[n]).permute({1, 0, 2}));
    return torch::cat(rows, 0);
  };
  const auto q = pad(p.q, p.offsets_q, Lmax).requires_grad_(), k = pad(p.k, p.offsets_k, Smax).requires_grad_();
  const auto v = pad(p.v, p.offsets_k, Smax).requires_grad_();
  auto options = o;
  const auto out = attnkit::softmax_attention(q, k, v, options.key_lengths(torch::tensor(b.k_lengths, torch::kLong)));
  out.backward(pad(p.dout, p.offsets_q, Lmax));
  return {unpad(out.detach(), p.offsets_q), unpad(q.grad(), p.offsets_q), unpad(k.grad(), p.offsets_k),
          unpad(v.grad(), p.offsets_k)};
}

std::vector<VarlenBatch> varlen_batches() {
  return {{"self-attention with an empty and a one-row sequence", {5, 130, 1, 0, 257}, {5, 130, 1, 0, 257}},
          {"self-attention, multi-query", {64, 3, 200}, {64, 3, 200}, true, 4, 1, 16, 16},
          {"cross, empty sequences on either side", {5, 1, 0, 130, 7, 3}, {5, 3, 4, 130, 0, 9}, false},
          // Sequence 0 (L = 1 over 2100 keys) takes the forward's key split.
          {"cross, one query over a long sequence", {1, 200, 2}, {2100, 200, 3}, false}};
}

std::vector<std::pair<std::string, SoftmaxAttentionFuncOptions>> varlen_variants(const VarlenBatch& b, double p,
                                                                                 int64_t seed) {
  const auto o = SoftmaxAttentionFuncOptions().dropout_p(p).dropout_seed(seed);
  std::vector<std::pair<std::string, SoftmaxAttentionFuncOptions>> v{{"plain", o}};
  // Causal masks and positions count from each sequence's own L - S:
  // the padded batch's (Lmax - Smax) only when every sequence has L = S.
  if (b.self) {
    auto causal = o;
    v.emplace_back("causal", causal.causal(true));
    auto positions = o;
    v.emplace_back("causal, window 20, rotary, ALiBi",
                   positions.causal(true).window(20).rotary_dim(8).alibi_slopes(attnkit::alibi_slopes(b.H)));
  }
  return v;
}

TEST(AttentionDropoutVarlen, SequenceBDrawsBatchEntryB) {
  const auto batches = varlen_batches();
  for (size_t index = 0; index < batches.size(); ++index) {
    const auto& b = batches[index];
    const auto p = pack(b, 70 + index);
    for (double rate : {0.1, 0.5})
      for (const auto& variant : varlen_variants(b, rate, seed_of(index, rate))) {
        SCOPED_TRACE(b.name + ", " + variant.first + ", p " + std::to_string(rate));
        const auto got = run_packed(p, variant.second, torch::kFloat);
        const auto padded = run_padded(b, p, variant.second);
        for (int i = 0; i < 4; ++i) EXPECT_LT(relative_error(got[i], padded[i]), kTolerance) << kWhat[i];
        // float64 takes the composite, which draws the same masks.
        const auto composite = run_packed(p, variant.second, torch::kDouble);
        for (int i = 0; i < 4; ++i) EXPECT_LT(relative_error(got[i], composite[i]), kTolerance) << kWhat[i];
      }
  }
}

TEST(AttentionDropoutVarlen, SequenceZeroIsTheOpOnItsViewBitwise) {
  // The op on one sequence's (1, H, L, E) view draws batch 0's mask: the
  // packed batch's sequence 0 only.
  const VarlenBatch b{"two sequences", {37, 20}, {37, 20}};
  const auto p = pack(b, 77);
  const auto o = SoftmaxAttentionFuncOptions().causal(true).dropout_p(0.4).dropout_seed(9);
  const auto packed = run_packed(p, o, torch::kFloat)[0];
  const auto view = [](const torch::Tensor& t, int64_t begin, int64_t end) {
    return t.narrow(0, begin, end - begin).permute({1, 0, 2}).unsqueeze(0).to(torch::kFloat);
  };
  const auto first = attnkit::softmax_attention(view(p.q, 0, 37), view(p.k, 0, 37), view(p.v, 0, 37), o);
  EXPECT_TRUE(torch::equal(packed.narrow(0, 0, 37), first.squeeze(0).permute({1, 0, 2})));
  const auto second = attnkit::softmax_attention(view(p.q, 37, 57), view(p.k, 37, 57), view(p.v, 37, 57), o);
  EXPECT_FALSE(torch::equal(packed.narrow(0, 37, 20), second.squeeze(0).permute({1, 0, 2})));
}

// ---------------------------------------------------------------------------
// scaled_dot_product_attention, bfloat16
// ---------------------------------------------------------------------------

TEST(AttentionDropoutSdpa, DropoutIsSoftmaxAttentionsWithTheGeneratorsSeed) {
  const auto x = small_qkv();
  const auto cot = torch::randn({2, 4, 33, 24});
  const auto grads =
      [&](const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>& f) {
        const auto q = x.q.clone().requires_grad_(), k = x.k.clone().requires_grad_(), v = x.v.clone().requires_grad_();
        torch::manual_seed(21);
        const auto out = f(q, k, v);
        out.backward(cot);
        return std::vector<torch::Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
      };
  const auto sdpa = grads([](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return attnkit::scaled_dot_product_attention(q, k, v, ScaledDotProductAttentionFuncOptions().dropout_p(0.2));
  });
  const auto ours = grads([](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().dropout_p(0.2));
  });
  const auto none = grads([](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return attnkit::softmax_attention(q, k, v);
  });
  for (int i = 0; i < 4; ++i) {
    // The same call of the same kernel with the same drawn seed: bitwise.
    EXPECT_TRUE(torch::equal(sdpa[i], ours[i])) << kWhat[i];
    EXPECT_GT(rel_err(sdpa[i], none[i]), 1e-2) << kWhat[i];
  }
}

TEST(AttentionDropoutSdpa, DropoutOneGivesZeros) {
  const auto x = small_qkv();
  const auto q = x.q.clone().requires_grad_(), k = x.k.clone().requires_grad_(), v = x.v.clone().requires_grad_();
  const auto out =
      attnkit::scaled_dot_product_attention(q, k, v, ScaledDotProductAttentionFuncOptions().dropout_p(1.0));
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{2, 4, 33, 24}));
  EXPECT_EQ(out.count_nonzero().item<int64_t>(), 0);
  out.backward(torch::randn(out.sizes()));
  for (const auto& g : {q.grad(), k.grad(), v.grad()}) {
    ASSERT_TRUE(g.defined());
    EXPECT_EQ(g.count_nonzero().item<int64_t>(), 0);
  }
}

TEST(AttentionDropoutBf16, TakesTheFloat32KernelAndRoundsOnce) {
  const auto x = small_qkv();
  const auto o = SoftmaxAttentionFuncOptions().dropout_p(0.2).dropout_seed(17);
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  EXPECT_EQ(attnkit::softmax_attention_dispatch(bf(x.q), bf(x.k), bf(x.v), o).reason,
            "bf16 converted to float32 (attention dropout)");
  const auto cot = torch::randn({2, 4, 33, 24}).to(torch::kBFloat16);
  const auto qb = bf(x.q).requires_grad_(), kb = bf(x.k).requires_grad_(), vb = bf(x.v).requires_grad_();
  const auto out = attnkit::softmax_attention(qb, kb, vb, o);
  ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
  out.backward(cot);
  // The float32 kernel on the converted inputs, with the same mask, each
  // result rounded once to bfloat16: bitwise.
  const auto q = qb.detach().to(torch::kFloat).requires_grad_(), k = kb.detach().to(torch::kFloat).requires_grad_();
  const auto v = vb.detach().to(torch::kFloat).requires_grad_();
  const auto converted = attnkit::softmax_attention(q, k, v, o);
  converted.backward(cot.to(torch::kFloat));
  EXPECT_TRUE(torch::equal(out, converted.to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(qb.grad(), q.grad().to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(kb.grad(), k.grad().to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(vb.grad(), v.grad().to(torch::kBFloat16)));
  // Against float32 on the unrounded inputs: bf16's rounding of q, k, v
  // (u = 2^-9) moves each score by ~2 u sqrt(E) |q| |k| / sqrt(E) ~ 0.01
  // and the output by its rounding, 2^-9 of it; 3e-2 of max(|out|, 1).
  EXPECT_LT(relative_error(out, attnkit::softmax_attention(x.q, x.k, x.v, o)), 3e-2);
  // An unset seed is drawn once, by the bfloat16 call: the same as the
  // float32 call's after the same manual_seed.
  const auto unset = SoftmaxAttentionFuncOptions().dropout_p(0.2);
  torch::manual_seed(3);
  const auto drawn = attnkit::softmax_attention(qb.detach(), kb.detach(), vb.detach(), unset);
  torch::manual_seed(3);
  EXPECT_TRUE(
      torch::equal(drawn, attnkit::softmax_attention(q.detach(), k.detach(), v.detach(), unset).to(torch::kBFloat16)));
}

// ---------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------

TEST(AttentionDropoutErrors, ProbabilitiesOutsideZeroToOneAreRefused) {
  const auto x = small_qkv();
  const auto packed_q = torch::randn({5, 2, 8}), packed_kv = torch::randn({6, 2, 8});
  const auto cu_q = torch::tensor({int64_t{0}, int64_t{5}}), cu_k = torch::tensor({int64_t{0}, int64_t{6}});
  for (double p : {-0.1, 1.0, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    SCOPED_TRACE("p " + std::to_string(p));
    const auto o = SoftmaxAttentionFuncOptions().dropout_p(p).dropout_seed(1);
    expect_error([&] { attnkit::softmax_attention(x.q, x.k, x.v, o); },
                 {"softmax_attention", "option 'dropout_p' must be in [0, 1)"});
    expect_error([&] { attnkit::softmax_attention_dispatch(x.q, x.k, x.v, o); }, {"softmax_attention", "'dropout_p'"});
    expect_error(
        [&] { attnkit::softmax_attention(x.q.to(torch::kDouble), x.k.to(torch::kDouble), x.v.to(torch::kDouble), o); },
        {"softmax_attention", "'dropout_p'"});
    expect_error(
        [&] {
          attnkit::softmax_attention(x.q.to(torch::kBFloat16), x.k.to(torch::kBFloat16), x.v.to(torch::kBFloat16), o);
        },
        {"softmax_attention", "'dropout_p'"});
    expect_error([&] { attnkit::varlen_attention(packed_q, packed_kv, packed_kv, cu_q, cu_k, o); },
                 {"varlen_attention", "'dropout_p'"});
    expect_error([&] { attnkit::attention_dropout_mask(1, 1, 2, 3, p, 0); }, {"attention_dropout_mask", "'dropout_p'"});
  }
  // scaled_dot_product_attention takes 1 (zeros), as torch's, but no more.
  for (double p : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    SCOPED_TRACE("sdpa p " + std::to_string(p));
    expect_error(
        [&] {
          attnkit::scaled_dot_product_attention(x.q, x.k, x.v, ScaledDotProductAttentionFuncOptions().dropout_p(p));
        },
        {"scaled_dot_product_attention", "dropout_p"});
  }
}

TEST(AttentionDropoutErrors, NegativeMaskSizesAreRefused) {
  expect_error([] { attnkit::attention_dropout_mask(-1, 1, 2, 3, 0.1, 0); },
               {"attention_dropout_mask", "sizes must be >= 0"});
  expect_error([] { attnkit::attention_dropout_mask(1, -1, 2, 3, 0.1, 0); },
               {"attention_dropout_mask", "sizes must be >= 0"});
  expect_error([] { attnkit::attention_dropout_mask(1, 1, -2, 3, 0.1, 0); },
               {"attention_dropout_mask", "sizes must be >= 0"});
  expect_error([] { attnkit::attention_dropout_mask(1, 1, 2, -3, 0.1, 0); },
               {"attention_dropout_mask", "sizes must be >= 0"});
}

// ---------------------------------------------------------------------------
// The module and the registry
// ---------------------------------------------------------------------------

TEST(AttentionDropoutModule, MultiheadAttentionDropsInTrainingOnly) {
  using attnkit::nn::MultiheadAttention;
  using attnkit::nn::MultiheadAttentionOptions;
  torch::manual_seed(80);
  MultiheadAttention with(MultiheadAttentionOptions(32, 4).dropout(0.3));
  MultiheadAttention without(MultiheadAttentionOptions(32, 4));
  {
    torch::NoGradGuard no_grad;
    const auto source = with->named_parameters();
    for (auto& parameter : without->named_parameters()) parameter.value().copy_(source[parameter.key()]);
  }
  const auto x = torch::randn({2, 10, 32});
  const auto lengths = torch::tensor({int64_t{10}, int64_t{6}});
  with->eval();
  without->eval();
  EXPECT_TRUE(torch::equal(with->forward(x, x, x), without->forward(x, x, x)));
  EXPECT_TRUE(torch::equal(with->forward(x, x, x, lengths, true), without->forward(x, x, x, lengths, true)));
  with->train();
  without->train();
  const auto reference = without->forward(x, x, x);
  EXPECT_TRUE(torch::equal(reference, without->forward(x, x, x)));  // dropout 0: nothing to draw
  torch::manual_seed(81);
  const auto trained = with->forward(x, x, x);
  EXPECT_GT(rel_err(trained, reference), 1e-2);
  torch::manual_seed(81);  // the seed comes from torch's generator
  EXPECT_TRUE(torch::equal(trained, with->forward(x, x, x)));
}

TEST(AttentionDropoutModule, MechanismsWithoutDropoutRefuseIt) {
  using attnkit::nn::MultiheadAttention;
  using attnkit::nn::MultiheadAttentionOptions;
  expect_error([] { MultiheadAttention m(MultiheadAttentionOptions(32, 4).attention("linear").dropout(0.3)); },
               {"MultiheadAttention", "dropout", "'linear'"});
  expect_error([] { MultiheadAttention m(MultiheadAttentionOptions(32, 4).dropout(1.0)); },
               {"MultiheadAttention", "option 'dropout' must be in [0, 1)"});
  expect_error([] { MultiheadAttention m(MultiheadAttentionOptions(32, 4).dropout(-0.1)); },
               {"MultiheadAttention", "option 'dropout' must be in [0, 1)"});
  MultiheadAttention linear(MultiheadAttentionOptions(32, 4).attention("linear"));  // no dropout: fine
  EXPECT_EQ(linear->options.dropout(), 0.0);

  // The registry: "full" passes dropout to softmax_attention; "linear" refuses it.
  torch::manual_seed(82);
  const auto q = torch::randn({1, 2, 6, 8}), k = torch::randn({1, 2, 9, 8}), v = torch::randn({1, 2, 9, 8});
  attnkit::nn::AttendArgs args;
  args.dropout_p = 0.25;
  args.dropout_seed = 11;
  EXPECT_TRUE(torch::equal(
      attnkit::nn::attend("full", q, k, v, args),
      attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().dropout_p(0.25).dropout_seed(11))));
  expect_error([&] { attnkit::nn::attend("linear", q, k, v, args); }, {"no attention dropout"});
}

TEST(AttentionDropoutModule, TheBuilderDropsInTrainingAndRoundTrips) {
  using attnkit::models::Positions;
  using attnkit::models::Transformer;
  using attnkit::models::TransformerOptions;
  // The JSON writes the key only when set (older checkpoints read as none).
  EXPECT_EQ(TransformerOptions(7).to_json().find("attention_dropout"), std::string::npos);
  const auto options = TransformerOptions(7).layers(1).width(16).heads(2).ffn(24).dropout(0).attention_dropout(0.4);
  const auto back = TransformerOptions::from_json(options.to_json());
  EXPECT_EQ(back.attention_dropout(), 0.4);
  EXPECT_EQ(back.to_json(), options.to_json());

  // Every block's attention drops in training, not in evaluation.
  torch::manual_seed(3);
  Transformer with(options);
  Transformer without(TransformerOptions(options).attention_dropout(0));
  {
    torch::NoGradGuard no_grad;
    const auto from = with->named_parameters();
    for (auto& item : without->named_parameters()) item.value().copy_(from[item.key()]);
  }
  const auto tokens = torch::randint(0, 7, {2, 9}, torch::kLong);
  with->train();
  without->train();
  EXPECT_FALSE(torch::allclose(with->forward(tokens), without->forward(tokens)));
  with->eval();
  without->eval();
  EXPECT_TRUE(torch::equal(with->forward(tokens), without->forward(tokens)));

  // Refusals: a mechanism without dropout (self- or cross-attention),
  // relative positions (their blocks are not the kernel's), out of range.
  expect_error([&] { Transformer(TransformerOptions(options).attention({"linear"})); },
               {"attention_dropout", "'linear' does not", "full"});
  expect_error(
      [&] {
        Transformer(TransformerOptions(options)
                        .architecture(attnkit::models::Architecture::encoder_decoder)
                        .source_vocab_size(5)
                        .cross_attention("linear"));
      },
      {"attention_dropout", "cross-attention 'linear'"});
  expect_error([&] { Transformer(TransformerOptions(options).positions(Positions::relative)); },
               {"attention_dropout", "relative-position blocks"});
  expect_error([&] { Transformer(TransformerOptions(options).attention_dropout(1.0)); },
               {"attention_dropout must be in [0, 1)"});
}

}  // namespace

}  // namespace attention_dropout_test
