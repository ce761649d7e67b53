// Block masks (include/attnkit/block_mask.h, src/edges/block_mask.cpp): every
// named mask function against its rule written out here pair by pair, the
// block form against a dense evaluation (kinds counted, bits, sees(), to_dense)
// on grids that are not multiples of the blocks, chunked building, and / or,
// the memory formula, and the errors of create_block_mask, check_block_mask
// and the named functions.
#include <attnkit/block_mask.h>

#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace attnkit::block_mask_test {
namespace {

using testing::expect_error;

/// `mask` evaluated on every pair: bool (B, H, L, S).
torch::Tensor dense_of(const MaskFunction& mask, int64_t B, int64_t H, int64_t L, int64_t S) {
  auto dense = torch::zeros({B, H, L, S}, torch::kBool);
  auto d = dense.accessor<bool, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t q = 0; q < L; ++q)
        for (int64_t kv = 0; kv < S; ++kv) d[b][h][q][kv] = mask(b, h, q, kv);
  return dense;
}

/// Everything a block mask promises about `dense`, the mask it was built from:
/// its well-formedness, each block's kind from counting the dense pairs, the
/// dense form, sees() at every pair, and the memory formula.
void expect_represents(const BlockMask& m, const torch::Tensor& dense) {
  const int64_t B = dense.size(0), H = dense.size(1), L = dense.size(2), S = dense.size(3);
  ASSERT_NO_THROW(check_block_mask("test", m, B, H, L, S));
  ASSERT_TRUE(torch::equal(m.to_dense(), dense));
  const int64_t QB = (L + m.q_block - 1) / m.q_block, KB = (S + m.kv_block - 1) / m.kv_block;
  ASSERT_EQ(m.kinds.sizes(), (std::vector<int64_t>{B, H, QB, KB}));
  int64_t partial = 0;
  double visited = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t qb = 0; qb < QB; ++qb)
        for (int64_t kb = 0; kb < KB; ++kb) {
          const auto block = dense[b][h].narrow(0, qb * m.q_block, std::min(m.q_block, L - qb * m.q_block))
                                 .narrow(1, kb * m.kv_block, std::min(m.kv_block, S - kb * m.kv_block));
          const int64_t set = block.sum().item<int64_t>();
          const auto want = set == 0 ? BlockKind::empty : set == block.numel() ? BlockKind::full : BlockKind::partial;
          EXPECT_EQ(m.kinds[b][h][qb][kb].item<uint8_t>(), uint8_t(want)) << b << h << " block " << qb << ", " << kb;
          partial += want == BlockKind::partial;
          if (want != BlockKind::empty) visited += block.numel();
        }
  EXPECT_EQ(m.num_partial(), partial);
  EXPECT_DOUBLE_EQ(m.visited_fraction(), L * S == 0 ? 0 : visited / (double(B) * H * L * S));
  // One byte and one int32 per block, q_block ceil(kv_block / 8) bytes per partial block.
  EXPECT_EQ(m.bytes(), B * H * QB * KB * 5 + partial * m.q_block * ((m.kv_block + 7) / 8));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t q = 0; q < L; q += 3)
        for (int64_t kv = 0; kv < S; kv += 2) EXPECT_EQ(m.sees(b, h, q, kv), dense[b][h][q][kv].item<bool>());
}

struct Named {
  std::string name;
  MaskFunction function;
  /// The pattern's rule, written out from the header's words.
  std::function<bool(int64_t q, int64_t kv)> rule;
};

std::vector<Named> named(int64_t L, int64_t S) {
  const int64_t shift = S - L;
  std::vector<Named> out = {
      {"causal", masks::causal(L, S), [=](int64_t q, int64_t kv) { return kv <= q + shift; }},
      {"window 3 causal", masks::sliding_window(L, S, 3, true),
       [=](int64_t q, int64_t kv) { return kv <= q + shift && kv > q + shift - 3; }},
      {"window 3", masks::sliding_window(L, S, 3, false),
       [=](int64_t q, int64_t kv) { return std::abs(q + shift - kv) <= 2; }},
      {"prefix 5", masks::prefix_lm(L, S, 5), [=](int64_t q, int64_t kv) { return kv < 5 || kv <= q + shift; }},
      {"globals 2 + window 4 causal", masks::global_window(L, S, 2, 4, true),
       [=](int64_t q, int64_t kv) { return kv <= q + shift && (kv < 2 || kv > q + shift - 4); }},
      {"globals 2 + window 4", masks::global_window(L, S, 2, 4, false),
       [=](int64_t q, int64_t kv) { return kv < 2 || q + shift < 2 || std::abs(q + shift - kv) < 4; }},
      {"dilated 4 causal", masks::dilated(L, S, 4, true),
       [=](int64_t q, int64_t kv) { return kv <= q + shift && (q + shift - kv) % 4 == 0; }},
      {"dilated 3", masks::dilated(L, S, 3, false),
       [=](int64_t q, int64_t kv) { return std::abs(q + shift - kv) % 3 == 0; }},
  };
  if (L == S) {
    // Documents of 7, 0, 12 and the rest of the tokens.
    const std::vector<int64_t> starts{0, std::min<int64_t>(7, L), std::min<int64_t>(7, L),
                                      std::min<int64_t>(19, L), L};
    auto doc = [starts](int64_t t) {
      int64_t d = 0;
      while (t >= starts[d + 1]) ++d;
      return d;
    };
    const auto offsets = torch::tensor(starts, torch::kLong);
    out.push_back({"documents causal", masks::documents(offsets, true),
                   [=](int64_t q, int64_t kv) { return doc(q) == doc(kv) && kv <= q; }});
    out.push_back({"documents", masks::documents(offsets, false),
                   [=](int64_t q, int64_t kv) { return doc(q) == doc(kv); }});
  }
  return out;
}

TEST(BlockMask, NamedFunctionsFollowTheirRulesAndTheirBlockFormsRepresentThem) {
  // Grids that are and are not multiples of the blocks, L != S, length 1.
  for (auto [L, S] : {std::pair<int64_t, int64_t>{37, 37}, {32, 32}, {1, 1}, {20, 45}, {45, 20}})
    for (auto [qb, kvb] : {std::pair<int64_t, int64_t>{8, 8}, {16, 4}, {5, 11}, {64, 64}})
      for (const auto& n : named(L, S)) {
        SCOPED_TRACE(n.name + " L " + std::to_string(L) + " S " + std::to_string(S) + " blocks " +
                     std::to_string(qb) + " x " + std::to_string(kvb));
        const auto dense = dense_of(n.function, 1, 1, L, S);
        for (int64_t q = 0; q < L; ++q)
          for (int64_t kv = 0; kv < S; ++kv) ASSERT_EQ(dense[0][0][q][kv].item<bool>(), n.rule(q, kv)) << q << ", " << kv;
        expect_represents(create_block_mask(n.function, 1, 1, L, S, qb, kvb), dense);
      }
}

TEST(BlockMask, FunctionsOfBatchAndHeadAndRandomMasksWithEveryKindOfBlock) {
  std::mt19937 rng(5);
  torch::manual_seed(5);
  for (int trial = 0; trial < 12; ++trial) {
    const int64_t B = 1 + trial % 2, H = 1 + trial % 3, L = 1 + rng() % 50, S = 1 + rng() % 50;
    const int64_t qb = 1 + rng() % 9, kvb = 1 + rng() % 17;
    // Whole blocks empty, whole blocks full, the rest random with density p.
    const double p = (rng() % 100) / 100.0;
    const auto pairs = torch::rand({B, H, L, S}, torch::TensorOptions().dtype(torch::kDouble)) < p;
    const auto blocks = torch::randint(0, 3, {B, H, (L + qb - 1) / qb, (S + kvb - 1) / kvb}, torch::kLong);
    auto dense = torch::zeros({B, H, L, S}, torch::kBool);
    const auto kinds = blocks.accessor<int64_t, 4>();
    const auto random = pairs.accessor<bool, 4>();
    auto d = dense.accessor<bool, 4>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t q = 0; q < L; ++q)
          for (int64_t kv = 0; kv < S; ++kv) {
            const auto kind = kinds[b][h][q / qb][kv / kvb];
            d[b][h][q][kv] = kind == 1 || (kind == 2 && random[b][h][q][kv]);
          }
    SCOPED_TRACE("trial " + std::to_string(trial));
    const auto m = create_block_mask([&](int64_t b, int64_t h, int64_t q, int64_t kv) { return d[b][h][q][kv]; },
                                     B, H, L, S, qb, kvb);
    expect_represents(m, dense);
  }
}

TEST(BlockMask, ChunksOfRowsGiveTheBlocksOfTheWhole) {
  // mask_blocks over a chunk of rows numbers its partial blocks from
  // first_partial and gives the whole mask's blocks for those rows.
  const int64_t L = 40, S = 30, qb = 8, kvb = 8;
  const auto dense = dense_of(masks::sliding_window(L, S, 5, true), 1, 1, L, S);
  const auto whole = mask_blocks(dense, qb, kvb);
  const auto first = mask_blocks(dense.narrow(2, 0, 16), qb, kvb);
  const auto second = mask_blocks(dense.narrow(2, 16, 24), qb, kvb, first.bits.size(0));
  EXPECT_TRUE(torch::equal(torch::cat({first.kinds, second.kinds}, 2), whole.kinds));
  EXPECT_TRUE(torch::equal(torch::cat({first.partial_index, second.partial_index}, 2), whole.partial_index));
  EXPECT_TRUE(torch::equal(torch::cat({first.bits, second.bits}), whole.bits));
  expect_error([&] { mask_blocks(dense.to(torch::kInt), qb, kvb); }, {"mask_blocks", "bool tensor"});
  expect_error([&] { mask_blocks(dense, 0, kvb); }, {"mask_blocks", "block sizes must be >= 1"});
}

TEST(BlockMask, AndOrMatchTheDenseMasksWithBroadcastAndRecomputedKinds) {
  const int64_t L = 29, S = 29, qb = 8, kvb = 8;
  const auto causal = create_block_mask(masks::causal(L, S), 1, 1, L, S, qb, kvb);
  const auto window = create_block_mask(masks::sliding_window(L, S, 6, false), 1, 1, L, S, qb, kvb);
  auto per_head = [](int64_t, int64_t h, int64_t q, int64_t kv) { return (q + kv + h) % 3 != 0; };
  const auto heads = create_block_mask(per_head, 2, 3, L, S, qb, kvb);
  expect_represents(block_mask_and(causal, window), causal.to_dense() & window.to_dense());
  expect_represents(block_mask_or(causal, window), causal.to_dense() | window.to_dense());
  expect_represents(block_mask_and(causal, heads), causal.to_dense() & heads.to_dense());
  expect_represents(block_mask_or(heads, window), heads.to_dense() | window.to_dense());
  // Complementary partial blocks: and gives empty blocks, or full ones.
  auto upper = [](int64_t, int64_t, int64_t q, int64_t kv) { return kv > q; };
  const auto strict = create_block_mask(upper, 1, 1, L, S, qb, kvb);
  const auto none = block_mask_and(causal, strict), all = block_mask_or(causal, strict);
  EXPECT_EQ(none.kinds.max().item<uint8_t>(), uint8_t(BlockKind::empty));
  EXPECT_EQ(all.kinds.min().item<uint8_t>(), uint8_t(BlockKind::full));
  EXPECT_EQ(none.num_partial() + all.num_partial(), 0);
  const auto other = create_block_mask(masks::causal(L, S), 1, 1, L, S, qb, 4);
  expect_error([&] { block_mask_and(causal, other); }, {"block_mask_and", "same grid", "blocks of 8 x 8", "8 x 4"});
  const auto three = create_block_mask(per_head, 3, 1, L, S, qb, kvb);
  expect_error([&] { block_mask_or(heads, three); }, {"block_mask_or", "batch sizes", "2 and 3"});
}

TEST(BlockMask, MemoryIsBlocksPlusPartialBits) {
  // A causal mask at L = S = 4096 in blocks of 128: 1024 blocks (5 bytes
  // each) and 32 partial blocks on the diagonal (2 KiB each).
  const auto m = create_block_mask(masks::causal(4096, 4096), 1, 1, 4096, 4096);
  EXPECT_EQ(m.num_partial(), 32);
  EXPECT_EQ(m.bytes(), 1024 * 5 + 32 * 128 * 16);
  EXPECT_NEAR(m.visited_fraction(), (32.0 * 33 / 2) / 1024, 1e-12);
}

TEST(BlockMask, ErrorsNameTheProblem) {
  const auto m = create_block_mask(masks::causal(20, 20), 1, 1, 20, 20, 8, 8);
  expect_error([] { create_block_mask({}, 1, 1, 4, 4); }, {"create_block_mask", "no mask function"});
  expect_error([] { create_block_mask(masks::causal(4, 4), 0, 1, 4, 4); }, {"create_block_mask", "batch and heads"});
  expect_error([] { create_block_mask(masks::causal(4, 4), 1, 1, -1, 4); }, {"create_block_mask", "lengths"});
  expect_error([&] { check_block_mask("op", m, 1, 1, 20, 21); }, {"op", "covers 20 x 20", "20 x 21"});
  // A batch of 2 fits a mask of 1 (broadcast); a mask of 2 needs a batch of 2.
  EXPECT_NO_THROW(check_block_mask("op", m, 2, 3, 20, 20));
  const auto two = create_block_mask(masks::causal(20, 20), 2, 1, 20, 20, 8, 8);
  expect_error([&] { check_block_mask("op", two, 3, 1, 20, 20); }, {"op", "batch size is 2", "inputs' is 3"});
  auto broken = [&](const std::function<void(BlockMask&)>& change, std::vector<std::string> words) {
    BlockMask copy{m.q_len, m.kv_len, m.q_block, m.kv_block, m.kinds.clone(), m.partial_index.clone(),
                   m.bits.clone()};
    change(copy);
    expect_error([&] { check_block_mask("op", copy, 1, 1, 20, 20); }, words);
  };
  broken([](BlockMask& c) { c.kinds = c.kinds.to(torch::kInt); }, {"op", "kinds", "Byte"});
  broken([](BlockMask& c) { c.kinds = c.kinds.narrow(3, 0, 2); }, {"op", "3 x 3 blocks"});
  broken([](BlockMask& c) { c.kinds[0][0][0][2] = 3; }, {"op", "kinds hold 3"});
  broken([](BlockMask& c) { c.partial_index[0][0][0][0] = 99; }, {"op", "partial_index is 99", "outside [0, 3)"});
  broken([](BlockMask& c) { c.partial_index[0][0][0][1] = 0; }, {"op", "not partial", "must be -1"});
  broken([](BlockMask& c) { c.bits = c.bits.narrow(1, 0, 4); }, {"op", "(P, q_block, ceil(kv_block / 8))"});
  // The last diagonal block (rows 16..19, keys 16..19) with a bit past S = 20.
  broken([](BlockMask& c) { c.bits[2][0][0] = 0xFF; }, {"op", "bits set outside the 20 x 20 grid"});
  expect_error([] { masks::sliding_window(4, 4, 0, true); }, {"sliding_window", "window must be >= 1"});
  expect_error([] { masks::dilated(4, 4, 0, true); }, {"dilated", "dilation must be >= 1"});
  expect_error([] { masks::documents(torch::tensor({1, 3}, torch::kLong), true); }, {"documents", "start at 0"});
  expect_error([] { masks::documents(torch::tensor({0, 3}, torch::kInt), true); }, {"documents", "int64"});
  const auto docs = masks::documents(torch::tensor({0, 3}, torch::kLong), true);
  expect_error([&] { create_block_mask(docs, 1, 1, 5, 5); }, {"documents", "is past the documents' 3 tokens"});
}

}  // namespace
}  // namespace attnkit::block_mask_test
