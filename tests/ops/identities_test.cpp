// Identities that tie the mechanisms together (DESIGN.md, Tests), checked on the
// public ops in float64 and float32 over many shapes, including awkward ones
// (L = 1, S = 1, L != S, E != M, sizes that are multiples of nothing).
#include <attnkit/ops.h>

#include "reference/reference.h"
#include "test_util.h"

#include <random>
#include <set>

namespace attnkit::testing::identities_test {
namespace {

// Two float64 evaluations of the same quantity by different formulas on O(1)
// values: rounding error ~1e-15 relative, so 1e-12 leaves room for sums of ~100 terms.
constexpr double kF64Tol = 1e-12;
// A float32 op against float64 evaluation of the same float32 inputs: float32
// rounding (~6e-8) accumulated over sums of < 20 terms and an exp.
constexpr double kF32Tol = 1e-5;

struct Shape {
  int64_t N, H, L, S, E, M;
};

std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "(N=" << s.N << ", H=" << s.H << ", L=" << s.L << ", S=" << s.S << ", E=" << s.E
            << ", M=" << s.M << ")";
}

/// Hand-picked awkward shapes plus reproducible random ones.
std::vector<Shape> shapes() {
  std::vector<Shape> out = {{1, 1, 1, 1, 1, 1}, {1, 1, 1, 7, 3, 2}, {2, 1, 7, 1, 2, 5},
                            {2, 3, 5, 9, 4, 2}, {1, 2, 9, 4, 5, 7}, {1, 1, 6, 6, 8, 1},
                            {3, 2, 11, 13, 3, 3}};
  std::mt19937 gen(2024);
  auto draw = [&](int lo, int hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); };
  for (int i = 0; i < 5; ++i)
    out.push_back({draw(1, 2), draw(1, 3), draw(1, 10), draw(1, 10), draw(1, 6), draw(1, 6)});
  return out;
}

const std::vector<torch::Dtype> kDtypes = {torch::kDouble, torch::kFloat};

double tol_for(torch::Dtype d) { return d == torch::kDouble ? kF64Tol : kF32Tol; }

/// Random normal tensor in dtype `d` (oracles use its exact float64 copy).
torch::Tensor rand_in(std::vector<int64_t> shape, torch::Dtype d) {
  return torch::randn(shape, f64()).to(d);
}

torch::Tensor random_lengths(int64_t N, int64_t limit) {
  return torch::randint(0, limit + 1, {N}, torch::kLong);
}

void expect_close(const torch::Tensor& actual, const torch::Tensor& expected, double tol,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(all_finite(actual)) << what;
  EXPECT_LE(rel_err(actual, expected), tol) << what;
}

std::string label(const Shape& s, torch::Dtype d, const std::string& extra = "") {
  std::ostringstream os;
  os << s << " " << c10::toString(d) << " " << extra;
  return os.str();
}

/// True when every (n, h) sequence has pairwise different LSH hashes under the
/// planes the op will draw (so clusters = L puts each query alone).
bool hashes_distinct(const torch::Tensor& q, int64_t bits, int64_t seed, bool hash_bias) {
  auto planes = reference::hash_planes(bits, q.size(3), seed, hash_bias);
  auto h = reference::pack_bits(reference::hash_bits(q, planes)).flatten(0, 1);
  auto acc = h.accessor<int64_t, 2>();
  for (int64_t s = 0; s < h.size(0); ++s) {
    std::set<int64_t> seen;
    for (int64_t i = 0; i < h.size(1); ++i) seen.insert(acc[s][i]);
    if (static_cast<int64_t>(seen.size()) != h.size(1)) return false;
  }
  return true;
}

TEST(Identities, ClusteredWithOneQueryPerClusterIsExact) {
  torch::manual_seed(1);
  for (const auto& s : shapes())
    for (auto d : kDtypes)
      for (bool padded : {false, true}) {
        auto k = rand_in({s.N, s.H, s.S, s.E}, d), v = rand_in({s.N, s.H, s.S, s.M}, d);
        auto q = rand_in({s.N, s.H, s.L, s.E}, d);
        for (int tries = 0; tries < 20 && !hashes_distinct(q, 63, 9, true); ++tries)
          q = rand_in({s.N, s.H, s.L, s.E}, d);
        ASSERT_TRUE(hashes_distinct(q, 63, 9, true)) << s;
        auto lengths = padded ? random_lengths(s.N, s.S) : torch::Tensor();
        auto out = clustered_attention(
            q, k, v, ClusteredAttentionFuncOptions().clusters(s.L).seed(9).iterations(3).key_lengths(lengths));
        auto exact = reference::softmax_attention(q.to(torch::kDouble), k.to(torch::kDouble),
                                                  v.to(torch::kDouble),
                                                  SoftmaxAttentionFuncOptions().key_lengths(lengths));
        expect_close(out, exact, tol_for(d), label(s, d, padded ? "key_lengths" : ""));
      }
}

TEST(Identities, ImprovedClusteredWithAllKeysIsExact) {
  torch::manual_seed(2);
  std::mt19937 gen(3);
  for (const auto& s : shapes())
    for (auto d : kDtypes)
      for (bool padded : {false, true}) {
        auto q = rand_in({s.N, s.H, s.L, s.E}, d), k = rand_in({s.N, s.H, s.S, s.E}, d),
             v = rand_in({s.N, s.H, s.S, s.M}, d);
        const int64_t clusters = std::uniform_int_distribution<int64_t>(1, s.L)(gen);
        auto lengths = padded ? random_lengths(s.N, s.S) : torch::Tensor();
        auto o = ClusteredAttentionFuncOptions().clusters(clusters).bits(17).topk(s.S).key_lengths(lengths);
        auto out = clustered_attention(q, k, v, o);
        auto exact = softmax_attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                                       SoftmaxAttentionFuncOptions().key_lengths(lengths));
        expect_close(out, exact, tol_for(d),
                     label(s, d, "clusters " + std::to_string(clusters) + (padded ? " key_lengths" : "")));
      }
}

TEST(Identities, SparseWithFullEdgesIsExactAndCausalEdgesIsCausalExact) {
  torch::manual_seed(4);
  for (const auto& s : shapes())
    for (auto d : kDtypes) {
      auto q = rand_in({s.N, s.H, s.L, s.E}, d), k = rand_in({s.N, s.H, s.S, s.E}, d),
           v = rand_in({s.N, s.H, s.S, s.M}, d);
      auto q64 = q.to(torch::kDouble), k64 = k.to(torch::kDouble), v64 = v.to(torch::kDouble);
      expect_close(sparse_attention(q, k, v, edges::full(s.L, s.S)),
                   reference::softmax_attention(q64, k64, v64, {}), tol_for(d), label(s, d, "full"));
      expect_close(sparse_attention(q, k, v, edges::causal(s.L, s.S)),
                   reference::softmax_attention(q64, k64, v64, SoftmaxAttentionFuncOptions().causal(true)),
                   tol_for(d), label(s, d, "causal"));
      // The same lists given once per head, with a custom scale on both sides.
      auto full = edges::full(s.L, s.S);
      EdgeList per_head{full.offsets.unsqueeze(0).repeat({s.H, 1}), full.columns};
      expect_close(sparse_attention(q, k, v, per_head, SparseAttentionFuncOptions().scale(0.7)),
                   reference::softmax_attention(q64, k64, v64, SoftmaxAttentionFuncOptions().scale(0.7)),
                   tol_for(d), label(s, d, "per-head full"));
    }
}

TEST(Identities, AgglomerativeWithOneClassIsAMeanOfValues) {
  torch::manual_seed(5);
  for (const auto& s : shapes())
    for (auto d : kDtypes) {
      auto v = rand_in({s.N, 1, s.S, s.M}, d);
      auto cq = torch::ones({s.N, 1, s.L}, d), cr = torch::ones({s.N, 1, s.S}, d);
      auto v64 = v.to(torch::kDouble);
      // Full: every row is the mean over all S values.
      auto mean = v64.mean(2, /*keepdim=*/true).expand({s.N, 1, s.L, s.M});
      expect_close(agglomerative_attention(cq, cr, v), mean, tol_for(d), label(s, d, "full"));
      // Causal: row i is the mean of values 0 .. i + S - L (no value: 0).
      auto causal = torch::zeros({s.N, 1, s.L, s.M}, f64());
      for (int64_t i = 0; i < s.L; ++i) {
        const int64_t last = i + s.S - s.L;
        if (last >= 0) causal.select(2, i).copy_(v64.narrow(2, 0, last + 1).mean(2));
      }
      expect_close(agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().causal(true)), causal,
                   tol_for(d), label(s, d, "causal"));
    }
}

TEST(Identities, LinearAttentionIsHTransposeHTimesQ) {
  torch::manual_seed(6);
  for (const auto& s : shapes())
    for (auto d : kDtypes) {
      auto h = rand_in({s.N, s.H, s.S, s.E}, d), q = rand_in({s.N, s.H, s.L, s.E}, d);
      auto h64 = h.to(torch::kDouble), q64 = q.to(torch::kDouble);
      // C = H^T H (E x E, symmetric), R = C q for every query.
      auto C = torch::matmul(h64.transpose(-2, -1), h64);
      expect_close(linear_attention(q, h, h), torch::matmul(q64, C), tol_for(d), label(s, d, "full"));
      // Causal: query i uses C_i = sum_{t <= i + S - L} h_t h_t^T.
      auto causal = torch::zeros({s.N, s.H, s.L, s.E}, f64());
      for (int64_t i = 0; i < s.L; ++i) {
        const int64_t last = i + s.S - s.L;
        if (last < 0) continue;
        auto hp = h64.narrow(2, 0, last + 1);
        auto Ci = torch::matmul(hp.transpose(-2, -1), hp);
        causal.select(2, i).copy_(torch::matmul(Ci, q64.select(2, i).unsqueeze(-1)).squeeze(-1));
      }
      expect_close(linear_attention(q, h, h, LinearAttentionFuncOptions().causal(true)), causal, tol_for(d),
                   label(s, d, "causal"));
    }
}

TEST(Identities, ImprovedClusteredIsCloserToExactThanClustered) {
  // Proposition 2 of the clustered-attention paper (docs/MATH.md, "Improved
  // clustered attention"): ||At_i - A_i||_1 <= ||Ac_c - A_i||_1 for every query.
  // The slack only absorbs float64 rounding of sums of S terms.
  constexpr double kSlack = 1e-12;
  torch::manual_seed(7);
  std::mt19937 gen(8);
  int trials = 0, strictly_better = 0;
  for (const auto& s : shapes())
    for (int rep = 0; rep < 3; ++rep) {
      auto q = torch::randn({s.N, s.H, s.L, s.E}, f64()) * 2, k = torch::randn({s.N, s.H, s.S, s.E}, f64()) * 2,
           v = torch::randn({s.N, s.H, s.S, s.M}, f64());
      const int64_t clusters = std::uniform_int_distribution<int64_t>(1, s.L)(gen);
      const int64_t topk = std::uniform_int_distribution<int64_t>(1, s.S)(gen);
      auto lengths = rep == 2 ? random_lengths(s.N, s.S) : torch::Tensor();
      const double scale = 1.0 / std::sqrt(static_cast<double>(s.E));
      auto planes = reference::hash_planes(10, s.E, rep, true);
      auto labels = reference::hamming_kmeans(reference::pack_bits(reference::hash_bits(q, planes)),
                                              clusters, 10, 5, rep, {});
      torch::Tensor A, Ac, At;
      reference::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().key_lengths(lengths), &A);
      reference::clustered_attention_given_labels(q, k, v, labels, clusters, 0, scale, lengths, &Ac);
      reference::clustered_attention_given_labels(q, k, v, labels, clusters, topk, scale, lengths, &At);
      auto improved = (At - A).abs().sum(-1), plain = (Ac - A).abs().sum(-1);
      EXPECT_TRUE((improved <= plain + kSlack).all().item<bool>())
          << s << " clusters " << clusters << " topk " << topk << "\nimproved:\n" << improved
          << "\nplain:\n" << plain;
      // Both approximations keep each row's total mass (1, or 0 with no visible key).
      expect_close(At.sum(-1), A.sum(-1), kF64Tol, "At row sums");
      ++trials;
      strictly_better += (improved < plain - 1e-6).any().item<bool>();
    }
  EXPECT_GE(trials, 36);
  // Not vacuous: in some trials the improvement is real (topk < S, shared clusters).
  EXPECT_GT(strictly_better, 5);
}

TEST(Identities, ClusteredIsDeterministicPerSeed) {
  torch::manual_seed(9);
  auto q = torch::randn({2, 2, 40, 6}, f64()), k = torch::randn({2, 2, 13, 6}, f64()),
       v = torch::randn({2, 2, 13, 5}, f64());
  for (int64_t topk : {0, 4}) {
    auto o = ClusteredAttentionFuncOptions().clusters(5).bits(31).iterations(5).topk(topk);
    auto a = clustered_attention(q, k, v, o.seed(3));
    EXPECT_TRUE(torch::equal(a, clustered_attention(q, k, v, o.seed(3))));
    auto q32 = q.to(torch::kFloat), k32 = k.to(torch::kFloat), v32 = v.to(torch::kFloat);
    EXPECT_TRUE(torch::equal(clustered_attention(q32, k32, v32, o.seed(3)),
                             clustered_attention(q32, k32, v32, o.seed(3))));
    // Different seeds draw different planes and initial centroids: over four
    // other seeds, at least one clustering (hence output) must differ.
    bool any_differs = false;
    for (int64_t seed = 4; seed < 8; ++seed)
      any_differs |= !torch::equal(a, clustered_attention(q, k, v, o.seed(seed)));
    EXPECT_TRUE(any_differs) << "topk " << topk;
  }
}

TEST(Identities, ClusteredPaddedQueriesOutputExactlyZero) {
  torch::manual_seed(10);
  for (const auto& s : shapes())
    for (auto d : kDtypes)
      for (int64_t topk : {int64_t{0}, s.S}) {
        auto q = rand_in({s.N, s.H, s.L, s.E}, d), k = rand_in({s.N, s.H, s.S, s.E}, d),
             v = rand_in({s.N, s.H, s.S, s.M}, d);
        auto qlen = random_lengths(s.N, s.L);
        auto out = clustered_attention(
            q, k, v, ClusteredAttentionFuncOptions().clusters(std::min<int64_t>(3, s.L)).bits(12).topk(topk)
                         .query_lengths(qlen));
        ASSERT_TRUE(all_finite(out)) << label(s, d);
        for (int64_t n = 0; n < s.N; ++n) {
          const int64_t valid = qlen[n].item<int64_t>();
          auto pad = out[n].narrow(1, valid, s.L - valid);
          EXPECT_TRUE(torch::equal(pad, torch::zeros_like(pad))) << label(s, d) << " n " << n;
          // Valid rows are attention averages of v: non-zero for random inputs.
          if (valid > 0) EXPECT_GT(max_abs(out[n].narrow(1, 0, valid)), 0.0) << label(s, d);
        }
        // With topk = S the valid rows are exact attention; padding does not
        // perturb them.
        if (topk == s.S && s.S > 0) {
          auto exact = reference::softmax_attention(q.to(torch::kDouble), k.to(torch::kDouble),
                                                    v.to(torch::kDouble), {});
          auto valid = (torch::arange(s.L).view({1, 1, s.L, 1}) < qlen.view({s.N, 1, 1, 1})).to(torch::kDouble);
          expect_close(out.to(torch::kDouble), exact * valid, tol_for(d), label(s, d, "topk = S"));
        }
      }
}

}  // namespace
}  // namespace attnkit::testing::identities_test
