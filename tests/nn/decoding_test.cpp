// Decoding states (include/attnkit/nn/decoding.h): the key/value cache's
// contents, views and memory bound; the cached softmax state against exact
// attention over the same keys.
#include <attnkit/nn/decoding.h>
#include <attnkit/ops.h>

#include "test_util.h"

namespace attnkit::nn::decoding_test {
namespace {

using attnkit::testing::expect_error;
using attnkit::testing::rel_err;

TEST(KeyValueCache, HoldsWhatWasAppendedAsStridedViews) {
  KeyValueCache cache;
  auto k = torch::randn({2, 3, 40, 5}), v = torch::randn({2, 3, 40, 7});
  for (int64_t t = 0; t < 40; ++t) cache.append(k.select(2, t), v.select(2, t));
  EXPECT_EQ(cache.size(), 40);
  EXPECT_TRUE(torch::equal(cache.keys(), k));
  EXPECT_TRUE(torch::equal(cache.values(13), v.narrow(2, 13, 27)));
  EXPECT_GE(cache.capacity(), 40);
}

TEST(KeyValueCache, AWindowKeepsMemoryBounded) {
  KeyValueCache cache;
  auto k = torch::randn({1, 2, 5000, 4});
  for (int64_t t = 0; t < 5000; ++t) {
    cache.append(k.select(2, t), k.select(2, t));
    cache.forget_before(t - 9);  // a window of 10 positions
    ASSERT_TRUE(torch::equal(cache.keys(std::max<int64_t>(0, t - 9)),
                             k.narrow(2, std::max<int64_t>(0, t - 9), std::min<int64_t>(t + 1, 10))));
  }
  EXPECT_LE(cache.capacity(), 32);
  expect_error([&] { cache.keys(100); }, {"position 100 is not held"});
}

TEST(KeyValueCache, RefusesAChangeOfShape) {
  KeyValueCache cache;
  cache.append(torch::randn({1, 2, 4}), torch::randn({1, 2, 3}));
  expect_error([&] { cache.append(torch::randn({1, 3, 4}), torch::randn({1, 3, 3})); },
               {"KeyValueCache::append", "the cache holds keys"});
  expect_error([&] { cache.append(torch::randn({1, 2, 4}), torch::randn({2, 2, 3})); },
               {"'v'", "batch size N"});
}

TEST(CachedSoftmaxState, EqualsCausalExactAttention) {
  // Tolerance 1e-12 in float64: the same softmax over the same keys.
  auto q = torch::randn({2, 3, 50, 6}, torch::kDouble), k = torch::randn({2, 3, 50, 6}, torch::kDouble);
  auto v = torch::randn({2, 3, 50, 4}, torch::kDouble);
  CachedSoftmaxState state([](int64_t) { return int64_t{0}; });
  std::vector<torch::Tensor> out;
  for (int64_t t = 0; t < 50; ++t) out.push_back(state.step(q.select(2, t), k.select(2, t), v.select(2, t)));
  auto expected = softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true));
  EXPECT_LE(rel_err(torch::stack(out, 2), expected), 1e-12);
  EXPECT_EQ(state.steps(), 50);
}

}  // namespace
}  // namespace attnkit::nn::decoding_test
