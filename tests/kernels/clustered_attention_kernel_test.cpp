// The clustered-attention primitives (src/kernels/{hashing,kmeans,
// clustered_attention}) against integer and float64 references: hash bits,
// K-means labels, top keys, and every quantity the attention kernel computes
// (centroid log-sum-exps, top keys, masses, background values, outputs and
// gradients) given the labels.
#include <attnkit/runtime.h>

#include "kernels/clustered_attention.h"
#include "kernels/hashing.h"
#include "kernels/kmeans.h"
#include "reference/masking.h"
#include "reference/reference.h"
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace attnkit::testing::clustered_attention_kernel_test {
namespace {

// The float32 kernel against float64 evaluation of the same float32 inputs:
// rounding (6e-8 per operation) accumulated over the sums of these small
// shapes (at most ~100 members or keys per sum) and an exp; measured errors
// are below 8e-7 (probed with a 1e-9 bound), so 1e-5 leaves a 10x margin.
constexpr double kF32Tol = 1e-5;

void strides_of(const torch::Tensor& t, int64_t* stride) {
  for (int64_t d = 0; d < t.dim(); ++d) stride[d] = t.stride(d);
}

/// A (N, H, R, X) float32 tensor with non-contiguous strides: a (N, R, H, X)
/// tensor viewed as (N, H, R, X), or with X as the slowest dimension when
/// `columns_strided` (so the kernels must pack it before an sgemm).
torch::Tensor strided_randn(int64_t N, int64_t H, int64_t R, int64_t X, bool columns_strided) {
  if (columns_strided) return torch::randn({N, H, X, R}, f32()).transpose(2, 3);
  return torch::randn({N, R, H, X}, f32()).transpose(1, 2);
}

// ---------------------------------------------------------------------------
// Hashing
// ---------------------------------------------------------------------------

torch::Tensor kernel_planes(int64_t B, int64_t E, int64_t seed, bool bias) {
  auto planes = torch::empty({B, E + 1}, f32());
  kernels::hash_planes(B, E, seed, bias, planes.data_ptr<float>());
  return planes;
}

torch::Tensor kernel_hashes(const torch::Tensor& q, const torch::Tensor& planes) {
  auto hashes = torch::empty({q.size(0), q.size(1), q.size(2)}, torch::kLong);
  kernels::HashParams p;
  p.q = q.data_ptr<float>();
  strides_of(q, p.q_stride);
  p.planes = planes.data_ptr<float>();
  p.hashes = hashes.data_ptr<int64_t>();
  p.N = q.size(0), p.H = q.size(1), p.L = q.size(2), p.E = q.size(3), p.B = planes.size(0);
  kernels::hash_queries(p);
  return hashes;
}

TEST(ClusteredHashing, PlanesAreTheReferencePlanesRoundedToFloat) {
  for (bool bias : {true, false})
    for (int64_t seed : {0, 7, -3}) {
      auto expected = reference::hash_planes(63, 17, seed, bias).to(torch::kFloat);
      EXPECT_TRUE(torch::equal(kernel_planes(63, 17, seed, bias), expected)) << "seed " << seed;
    }
}

TEST(ClusteredHashing, BitsExactOnIntegerInputs) {
  // Small integers (|q|, |P| <= 4, E <= 64) make every float32 product and sum
  // exact, so the kernel's bits must equal the float64 reference's bit for bit.
  // Half-integer thresholds test the threshold column; zero thresholds
  // (hash_bias = false) put many projections exactly on the plane, where the
  // strict comparison must give 0.
  torch::manual_seed(100);
  for (int64_t B : {1, 17, 63})
    for (int64_t E : {1, 5, 64})
      for (bool bias : {true, false})
        for (bool columns_strided : {false, true}) {
          SCOPED_TRACE("B " + std::to_string(B) + " E " + std::to_string(E) + " bias " +
                       std::to_string(bias) + " strided " + std::to_string(columns_strided));
          const int64_t N = 2, H = 3, L = 300;  // L crosses the kernel's 256-query block
          auto q = strided_randn(N, H, L, E, columns_strided);
          q.copy_(torch::randint(-4, 5, {N, H, L, E}, f32()));
          auto planes = torch::randint(-4, 5, {B, E + 1}, f32());
          if (bias) planes.select(1, E).add_(0.5);
          else planes.select(1, E).zero_();
          auto expected = reference::pack_bits(
              reference::hash_bits(q.to(torch::kDouble), planes.to(torch::kDouble)));
          EXPECT_TRUE(torch::equal(kernel_hashes(q, planes), expected));
        }
}

TEST(ClusteredHashing, BitsAgreeWithFloat64WhereFloat32CanDecide) {
  // Random inputs: a bit may differ from the float64 sign only where the
  // projection is within float32 rounding of the threshold. The bound is the
  // classic dot-product error |fl(x.y) - x.y| <= gamma_E sum |x_e y_e|,
  // gamma_E = E u / (1 - E u), u = 2^-24, plus the threshold's own rounding.
  torch::manual_seed(101);
  const int64_t N = 2, H = 2, L = 500, E = 64, B = 63;
  auto q = torch::randn({N, H, L, E}, f32());
  auto planes = kernel_planes(B, E, 5, true);
  auto hashes = kernel_hashes(q, planes);
  auto q64 = q.to(torch::kDouble), p64 = planes.to(torch::kDouble);
  auto projections = torch::matmul(q64, p64.narrow(1, 0, E).t());          // (N,H,L,B)
  auto magnitude = torch::matmul(q64.abs(), p64.narrow(1, 0, E).abs().t());
  const double u = std::ldexp(1.0, -24), gamma = E * u / (1 - E * u);
  auto undecidable = (projections - p64.select(1, E)).abs() <= gamma * magnitude;
  auto exact_bits = projections > p64.select(1, E);
  auto weights = torch::pow(2, torch::arange(B, torch::kLong));
  auto kernel_bits = (hashes.unsqueeze(-1).bitwise_and(weights)) != 0;
  auto differ = kernel_bits != exact_bits;
  EXPECT_FALSE((differ & undecidable.logical_not()).any().item<bool>())
      << "a bit differs from float64 although float32 rounding cannot reach the threshold";
  EXPECT_LT(differ.sum().item<int64_t>(), 5) << "nearly every bit is far from its threshold";
}

TEST(ClusteredHashing, UnusedHighBitsAreZero) {
  torch::manual_seed(102);
  auto q = torch::randn({1, 2, 40, 8}, f32()) * 100;
  auto hashes = kernel_hashes(q, kernel_planes(5, 8, 1, false));
  EXPECT_EQ(hashes.ge(32).sum().item<int64_t>(), 0);
  EXPECT_GT(hashes.gt(0).sum().item<int64_t>(), 0);
}

// ---------------------------------------------------------------------------
// K-means
// ---------------------------------------------------------------------------

torch::Tensor kernel_kmeans(const torch::Tensor& hashes, int64_t C, int64_t B, int64_t iterations,
                            int64_t seed, const torch::Tensor& query_lengths) {
  auto labels = torch::empty_like(hashes);
  kernels::KMeansParams p;
  p.hashes = hashes.data_ptr<int64_t>();
  p.labels = labels.data_ptr<int64_t>();
  p.query_lengths = query_lengths.defined() ? query_lengths.data_ptr<int64_t>() : nullptr;
  p.N = hashes.size(0), p.H = hashes.size(1), p.L = hashes.size(2);
  p.clusters = C, p.bits = B, p.iterations = iterations, p.seed = seed;
  kernels::hamming_kmeans(p);
  return labels;
}

/// Random B-bit hashes: uniform, or noisy copies (flip probability 1/16) of
/// `centres` random hashes when centres > 0.
torch::Tensor random_hashes(int64_t N, int64_t H, int64_t L, int64_t B, int64_t centres,
                            std::mt19937_64& rng) {
  const uint64_t mask = (uint64_t{1} << B) - 1;
  std::vector<uint64_t> c(std::max<int64_t>(centres, 1));
  for (auto& x : c) x = rng() & mask;
  auto hashes = torch::empty({N, H, L}, torch::kLong);
  auto* h = hashes.data_ptr<int64_t>();
  for (int64_t i = 0; i < hashes.numel(); ++i) {
    uint64_t x = rng() & mask;
    if (centres > 0) x = c[rng() % centres] ^ (x & rng() & rng() & rng());
    h[i] = static_cast<int64_t>(x);
  }
  return hashes;
}

TEST(ClusteredKMeans, LabelsEqualReference) {
  std::mt19937_64 rng(200);
  struct Case {
    int64_t L, C, B, centres, iterations;
  };
  // Uniform hashes; noisy copies of a few centres (clusters empty out and get
  // refilled by the farthest-query rule); few distinct values (duplicate
  // initial centroids guarantee empty clusters); B = 1 (distances 0 or 1, ties
  // everywhere); a single query.
  for (const Case& c : {Case{300, 17, 63, 0, 10}, Case{300, 40, 63, 3, 10}, Case{257, 12, 6, 0, 3},
                        Case{100, 30, 2, 0, 5}, Case{64, 5, 1, 0, 4}, Case{50, 50, 63, 0, 10},
                        Case{1, 1, 63, 0, 10}, Case{300, 17, 63, 4, 0}, Case{300, 17, 63, 4, 1}}) {
    SCOPED_TRACE("L " + std::to_string(c.L) + " C " + std::to_string(c.C) + " B " +
                 std::to_string(c.B) + " centres " + std::to_string(c.centres) + " iterations " +
                 std::to_string(c.iterations));
    auto hashes = random_hashes(2, 3, c.L, c.B, c.centres, rng);
    for (int64_t seed : {0, 11}) {
      auto expected = reference::hamming_kmeans(hashes, c.C, c.B, c.iterations, seed, {});
      EXPECT_TRUE(torch::equal(kernel_kmeans(hashes, c.C, c.B, c.iterations, seed, {}), expected));
    }
  }
}

TEST(ClusteredKMeans, QueryLengthsAndFewerValidQueriesThanClusters) {
  std::mt19937_64 rng(201);
  const int64_t L = 90, C = 10, B = 20;
  auto hashes = random_hashes(4, 2, L, B, 3, rng);
  auto lengths = torch::tensor({int64_t{90}, int64_t{7}, int64_t{0}, int64_t{1}});
  auto labels = kernel_kmeans(hashes, C, B, 10, 3, lengths);
  EXPECT_TRUE(torch::equal(labels, reference::hamming_kmeans(hashes, C, B, 10, 3, lengths)));
  for (int64_t n = 0; n < 4; ++n) {
    const int64_t valid = lengths[n].item<int64_t>();
    auto seq = labels[n];
    EXPECT_TRUE(seq.narrow(1, valid, L - valid).eq(-1).all().item<bool>()) << "padded: -1";
    if (valid > 0) {
      auto used = seq.narrow(1, 0, valid);
      EXPECT_GE(used.min().item<int64_t>(), 0);
      EXPECT_LT(used.max().item<int64_t>(), std::min(C, valid)) << "min(C, valid) clusters";
    }
  }
}

// ---------------------------------------------------------------------------
// Top keys
// ---------------------------------------------------------------------------

/// The rule spelled out: sort valid keys by score (descending, stable so ties
/// keep the lower index first), take k', append padded keys, sort by index.
std::vector<int64_t> obvious_top(const std::vector<float>& scores, int64_t valid, int64_t S,
                                 int64_t k) {
  std::vector<int64_t> order(valid);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return scores[a] > scores[b]; });
  for (int64_t j = valid; j < S; ++j) order.push_back(j);
  order.resize(std::min(k, S));
  std::sort(order.begin(), order.end());
  return order;
}

TEST(ClusteredTopKeys, TiesToLowerIndexAndPaddedKeysLast) {
  std::mt19937 rng(300);
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t S = 1 + rng() % 90, valid = rng() % (S + 1), k = 1 + rng() % S;
    // Few distinct integer scores: ties everywhere, in both the vector scan and
    // the scalar tail; sometimes increasing runs, so that keys keep entering.
    const int levels = 1 + rng() % 6;
    std::vector<float> scores(S);
    for (int64_t j = 0; j < S; ++j)
      scores[j] = trial % 3 == 0 ? static_cast<float>(j / 7) : static_cast<float>(rng() % levels);
    std::vector<int64_t> top(std::min(k, S));
    kernels::select_top_keys(scores.data(), valid, S, k, top.data());
    ASSERT_EQ(top, obvious_top(scores, valid, S, k))
        << "S " << S << " valid " << valid << " k " << k << " trial " << trial;
  }
}

// ---------------------------------------------------------------------------
// Attention given labels
// ---------------------------------------------------------------------------

struct KernelRun {
  torch::Tensor out, centroid_lse, background, top, mass, query_lse;  // forward
  torch::Tensor dq, dk, dv;                                           // backward
};

KernelRun run_kernel(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& labels, const torch::Tensor& key_lengths, int64_t C,
                     int64_t topk, double scale, const torch::Tensor& dout) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
  KernelRun r;
  // The outputs are written through strided views, to check the kernel's strides.
  r.out = torch::full({N, L, H, M}, NAN, f32()).transpose(1, 2);
  r.centroid_lse = torch::empty({N, H, C}, f32());
  r.background = torch::empty({N, H, C, M}, f32());
  r.top = torch::empty({N, H, C, topk}, torch::kLong);
  r.mass = torch::empty({N, H, C}, f32());
  r.query_lse = torch::empty({N, H, L}, f32());
  kernels::ClusteredAttentionBackwardParams p;
  p.q = q.data_ptr<float>();
  strides_of(q, p.q_stride);
  p.k = k.data_ptr<float>();
  strides_of(k, p.k_stride);
  p.v = v.data_ptr<float>();
  strides_of(v, p.v_stride);
  p.out = r.out.data_ptr<float>();
  strides_of(r.out, p.out_stride);
  p.labels = labels.data_ptr<int64_t>();
  p.key_lengths = key_lengths.defined() ? key_lengths.data_ptr<int64_t>() : nullptr;
  p.N = N, p.H = H, p.L = L, p.S = k.size(2), p.E = q.size(3), p.M = M, p.C = C, p.topk = topk;
  p.scale = static_cast<float>(scale);
  p.centroid_lse = r.centroid_lse.data_ptr<float>();
  p.background = r.background.data_ptr<float>();
  p.top = r.top.data_ptr<int64_t>();
  p.mass = r.mass.data_ptr<float>();
  p.query_lse = r.query_lse.data_ptr<float>();
  kernels::clustered_attention_forward(p);
  r.dq = torch::full({N, H, q.size(3), L}, NAN, f32()).transpose(2, 3);
  r.dk = torch::full(k.sizes(), NAN, f32());
  r.dv = torch::full({N, v.size(2), H, M}, NAN, f32()).transpose(1, 2);
  p.dout = dout.data_ptr<float>();
  strides_of(dout, p.dout_stride);
  p.dq = r.dq.data_ptr<float>();
  strides_of(r.dq, p.dq_stride);
  p.dk = r.dk.data_ptr<float>();
  strides_of(r.dk, p.dk_stride);
  p.dv = r.dv.data_ptr<float>();
  strides_of(r.dv, p.dv_stride);
  kernels::clustered_attention_backward(p);
  return r;
}

struct Shape {
  int64_t N, H, L, S, E, M, C, topk;
};

TEST(ClusteredKernel, EveryQuantityMatchesFloat64GivenLabels) {
  torch::manual_seed(400);
  // Labels are drawn at random (not by K-means), so clusters come in every
  // size, some empty; queries past query_lengths get -1; S > 256 crosses the
  // backward's key block, L > 128 the member block of the sparse products and
  // C > 128 the centroid panel (there with topk in {0, S}: hundreds of
  // clusters would make a near-tie at the top-k boundary likely).
  const std::vector<Shape> shapes{{2, 2, 37, 29, 8, 5, 5, 4},    {1, 3, 300, 270, 16, 7, 3, 9},
                                  {2, 1, 20, 50, 4, 4, 20, 50},  {1, 2, 1, 1, 3, 2, 1, 1},
                                  {2, 2, 33, 17, 6, 3, 7, 0},    {1, 1, 140, 300, 8, 8, 2, 0},
                                  {2, 1, 400, 60, 4, 3, 150, 60}, {1, 2, 300, 40, 4, 3, 130, 0}};
  int checked = 0;
  for (const Shape& s : shapes)
    for (bool strided : {false, true}) {
      SCOPED_TRACE("L " + std::to_string(s.L) + " S " + std::to_string(s.S) + " C " +
                   std::to_string(s.C) + " topk " + std::to_string(s.topk) + " strided " +
                   std::to_string(strided));
      auto q = strided ? strided_randn(s.N, s.H, s.L, s.E, true) : torch::randn({s.N, s.H, s.L, s.E}, f32());
      auto k = strided ? strided_randn(s.N, s.H, s.S, s.E, true) : torch::randn({s.N, s.H, s.S, s.E}, f32());
      auto v = strided ? strided_randn(s.N, s.H, s.S, s.M, false) : torch::randn({s.N, s.H, s.S, s.M}, f32());
      auto dout = torch::randn({s.N, s.H, s.L, s.M}, f32());
      auto labels = torch::randint(0, s.C, {s.N, s.H, s.L}, torch::kLong);
      torch::Tensor key_lengths;
      if (s.N == 2) {
        // Batch 1: fewer keys than topk (padded top keys), and some padded queries.
        key_lengths = torch::tensor({s.S, std::max<int64_t>(1, std::min(s.S, s.topk) / 2)});
        labels[1].narrow(1, s.L * 2 / 3, s.L - s.L * 2 / 3).fill_(-1);
      }
      const double scale = 1.0 / std::sqrt(static_cast<double>(s.E));
      auto r = run_kernel(q, k, v, labels, key_lengths, s.C, s.topk, scale, dout);

      // Float64 quantities from the same float32 values.
      auto q64 = q.to(torch::kDouble).requires_grad_(), k64 = k.to(torch::kDouble).requires_grad_(),
           v64 = v.to(torch::kDouble).requires_grad_();
      auto out64 = reference::clustered_attention_given_labels(q64, k64, v64, labels, s.C, s.topk,
                                                               scale, key_lengths);
      out64.backward(dout.to(torch::kDouble));
      EXPECT_LE(rel_err(r.out, out64), kF32Tol);
      EXPECT_LE(rel_err(r.dq, q64.grad()), kF32Tol);
      EXPECT_LE(rel_err(r.dk, k64.grad()), kF32Tol);
      EXPECT_LE(rel_err(r.dv, v64.grad()), kF32Tol);

      torch::NoGradGuard no_grad;
      auto member = torch::one_hot(labels.clamp_min(0), s.C).to(torch::kDouble) *
                    labels.ge(0).unsqueeze(-1).to(torch::kDouble);                   // (N,H,L,C)
      auto qc = torch::matmul(member.transpose(-2, -1), q64) /
                member.sum(2).clamp_min(1).unsqueeze(-1);                            // (N,H,C,E)
      auto visible = detail::visibility(s.N, s.C, s.S, false, key_lengths);          // (N,1,C,S)
      auto scores = (torch::matmul(qc, k64.transpose(-2, -1)) * scale)
                        .masked_fill(visible.logical_not(), -INFINITY);
      EXPECT_LE(rel_err(r.centroid_lse.masked_fill(r.centroid_lse.isinf(), 0),
                        torch::logsumexp(scores, -1).masked_fill(torch::logsumexp(scores, -1).isinf(), 0)),
                kF32Tol);
      EXPECT_TRUE(torch::equal(r.centroid_lse.isinf(), torch::logsumexp(scores, -1).isinf()));
      auto ac = detail::masked_softmax(scores, visible);
      if (s.topk == 0) {
        EXPECT_LE(rel_err(r.background, torch::matmul(ac, v64)), kF32Tol);
        ++checked;
        continue;
      }
      // Top keys: the float64 ranking, provided float32 cannot reorder the
      // boundary (the k'-th and next score differ by far more than rounding).
      auto sorted = std::get<0>(scores.sort(-1, /*descending=*/true));
      if (s.topk < s.S) {
        auto kth = sorted.narrow(-1, s.topk - 1, 1), next = sorted.narrow(-1, s.topk, 1);
        // Empty clusters (centroid 0) score every key exactly 0 in both precisions.
        auto gap = (kth - next).masked_fill(next.isinf(), 1.0)
                       .masked_fill(member.sum(2).eq(0).unsqueeze(-1), 1.0);
        ASSERT_GT(gap.min().item<double>(), 1e-4) << "test inputs too close to a tie";
      }
      auto order = std::get<1>(scores.sort(/*stable=*/true, -1, /*descending=*/true));
      auto top64 = std::get<0>(order.narrow(-1, 0, s.topk).sort(-1));
      EXPECT_TRUE(torch::equal(r.top, top64));
      auto in_top = torch::zeros_like(ac, torch::kBool).scatter(-1, top64, true);
      EXPECT_LE(rel_err(r.mass, ac.masked_fill(in_top.logical_not(), 0).sum(-1)), kF32Tol);
      EXPECT_LE(rel_err(r.background, torch::matmul(ac.masked_fill(in_top, 0), v64)), kF32Tol);
      ++checked;
    }
  EXPECT_EQ(checked, 16);
}

TEST(ClusteredKernel, NoVisibleKeyGivesZerosNotNaN) {
  torch::manual_seed(401);
  for (int64_t topk : {0, 3}) {
    auto q = torch::randn({2, 2, 9, 4}, f32()), k = torch::randn({2, 2, 6, 4}, f32()),
         v = torch::randn({2, 2, 6, 3}, f32()), dout = torch::randn({2, 2, 9, 3}, f32());
    auto labels = torch::randint(0, 3, {2, 2, 9}, torch::kLong);
    auto r = run_kernel(q, k, v, labels, torch::tensor({int64_t{0}, int64_t{6}}), 3, topk, 0.5, dout);
    for (const auto& t : {r.out, r.dq, r.dk, r.dv}) EXPECT_TRUE(all_finite(t));
    EXPECT_EQ(max_abs(r.out[0]), 0.0);
    EXPECT_EQ(max_abs(r.dq[0]), 0.0);
    EXPECT_EQ(max_abs(r.dk[0]), 0.0);
    EXPECT_EQ(max_abs(r.dv[0]), 0.0);
    EXPECT_GT(max_abs(r.out[1]), 0.0);
  }
}

}  // namespace
}  // namespace attnkit::testing::clustered_attention_kernel_test
