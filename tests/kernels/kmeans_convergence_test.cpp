// Hamming K-means stops at convergence (issue 15: `iterations = 10**9` ran for
// minutes): an assignment that changes no label ends the loop in the kernel and
// in the float64 reference alike, and no label differs from running the full
// count. The op bounds `iterations`.
#include <attnkit/ops.h>

#include "kernels/kmeans.h"
#include "reference/reference.h"
#include "test_util.h"

#include <random>

namespace attnkit::testing::kmeans_convergence_test {
namespace {

struct KMeansRun {
  torch::Tensor labels;  // (N, H, L)
  torch::Tensor rounds;  // (N, H): the iterations run
};

KMeansRun run_kmeans(const torch::Tensor& hashes, int64_t C, int64_t B, int64_t iterations,
                     int64_t seed, const torch::Tensor& query_lengths = {}) {
  KMeansRun r{torch::empty_like(hashes), torch::empty({hashes.size(0), hashes.size(1)}, torch::kLong)};
  kernels::KMeansParams p;
  p.hashes = hashes.data_ptr<int64_t>();
  p.labels = r.labels.data_ptr<int64_t>();
  p.query_lengths = query_lengths.defined() ? query_lengths.data_ptr<int64_t>() : nullptr;
  p.N = hashes.size(0), p.H = hashes.size(1), p.L = hashes.size(2);
  p.clusters = C, p.bits = B, p.iterations = iterations, p.seed = seed;
  p.rounds = r.rounds.data_ptr<int64_t>();
  kernels::hamming_kmeans(p);
  return r;
}

/// Noisy copies (each bit flipped with probability 1/8) of `centres` random B-bit hashes.
torch::Tensor clustered_hashes(int64_t N, int64_t H, int64_t L, int64_t B, int64_t centres,
                               std::mt19937_64& rng) {
  const uint64_t mask = (uint64_t{1} << B) - 1;
  std::vector<uint64_t> c(centres);
  for (auto& x : c) x = rng() & mask;
  auto hashes = torch::empty({N, H, L}, torch::kLong);
  auto* h = hashes.data_ptr<int64_t>();
  for (int64_t i = 0; i < hashes.numel(); ++i)
    h[i] = static_cast<int64_t>(c[rng() % centres] ^ (rng() & rng() & rng() & mask));
  return hashes;
}

TEST(KMeansConvergence, StopsWhenNoLabelChangesWithTheLabelsOfTheFullCount) {
  std::mt19937_64 rng(1500);
  const int64_t N = 2, H = 3, L = 200, C = 9, B = 40;
  auto hashes = clustered_hashes(N, H, L, B, 6, rng);
  auto lengths = torch::tensor({int64_t{200}, int64_t{57}});
  for (int64_t seed : {0, 5}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const auto bounded = run_kmeans(hashes, C, B, 1000, seed, lengths);
    // These inputs converge within a few iterations on every head.
    EXPECT_LT(bounded.rounds.max().item<int64_t>(), 50);
    EXPECT_GE(bounded.rounds.min().item<int64_t>(), 1);
    // The float64 reference runs the same rule and gets the same labels.
    EXPECT_TRUE(torch::equal(bounded.labels,
                             reference::hamming_kmeans(hashes, C, B, 1000, seed, lengths)));
    // Running exactly the reported count per head (no early stop possible
    // before it) gives the same labels, so stopping changed nothing.
    for (int64_t nh = 0; nh < N * H; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      const int64_t r = bounded.rounds[n][h].item<int64_t>();
      const auto exact = run_kmeans(hashes, C, B, r, seed, lengths);
      EXPECT_EQ(exact.rounds[n][h].item<int64_t>(), r);
      EXPECT_TRUE(torch::equal(exact.labels[n][h], bounded.labels[n][h])) << "head " << nh;
      // And so does the count the op used before (10) wherever it converged in time.
      if (r <= 10) {
        EXPECT_TRUE(torch::equal(run_kmeans(hashes, C, B, 10, seed, lengths).labels[n][h],
                                 bounded.labels[n][h]));
      }
    }
  }
}

TEST(KMeansConvergence, EveryIterationCountAgreesWithTheReference) {
  std::mt19937_64 rng(1501);
  // Few bits: ties and empty clusters (refilled by the farthest-query rule).
  auto hashes = clustered_hashes(2, 2, 120, 5, 4, rng);
  for (int64_t it = 0; it <= 12; ++it) {
    SCOPED_TRACE("iterations " + std::to_string(it));
    const auto k = run_kmeans(hashes, 11, 5, it, 3);
    EXPECT_TRUE(torch::equal(k.labels, reference::hamming_kmeans(hashes, 11, 5, it, 3, {})));
    EXPECT_LE(k.rounds.max().item<int64_t>(), it);
  }
}

TEST(KMeansConvergence, RoundsOfEmptySequencesAreZero) {
  auto hashes = torch::zeros({2, 2, 0}, torch::kLong);
  const auto r = run_kmeans(hashes, 1, 8, 10, 0);
  EXPECT_TRUE(r.rounds.eq(0).all().item<bool>());
  auto some = torch::zeros({2, 1, 4}, torch::kLong);
  const auto padded = run_kmeans(some, 2, 8, 10, 0, torch::tensor({int64_t{0}, int64_t{4}}));
  EXPECT_EQ(padded.rounds[0][0].item<int64_t>(), 0);
  EXPECT_EQ(padded.labels[0][0].eq(-1).all().item<bool>(), true);
}

TEST(KMeansConvergence, OpBoundsIterations) {
  // Issue 15: clusters = 1 and iterations = 10**9 ran for minutes.
  auto q = torch::randn({1, 1, 6, 4}, f32());
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    auto x = q.to(dtype);
    expect_error([&] {
      clustered_attention(x, x, x, ClusteredAttentionFuncOptions().clusters(1).iterations(1000000000));
    }, {"clustered_attention", "option 'iterations'", "[0, 1000]", "1000000000"});
    expect_error([&] {
      clustered_attention(x, x, x, ClusteredAttentionFuncOptions().clusters(1).iterations(1001));
    }, {"clustered_attention", "option 'iterations'", "1001"});
    // The bound itself is accepted, and with one cluster converges at once.
    auto out = clustered_attention(x, x, x, ClusteredAttentionFuncOptions().clusters(1).iterations(1000));
    auto ten = clustered_attention(x, x, x, ClusteredAttentionFuncOptions().clusters(1).iterations(10));
    EXPECT_TRUE(torch::equal(out, ten));
  }
}

}  // namespace
}  // namespace attnkit::testing::kmeans_convergence_test
