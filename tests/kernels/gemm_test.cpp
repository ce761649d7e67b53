// The GEMM wrapper against a naive triple loop, every transpose combination,
// strided leading dimensions, beta accumulation and the degenerate K = 0.
#include "kernels/common/gemm.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace attnkit::kernels::gemm_test {
namespace {

// Naive row-major C = alpha op(A) op(B) + beta C in double.
void naive(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const std::vector<float>& a,
           int64_t lda, const std::vector<float>& b, int64_t ldb, float beta, std::vector<double>& c,
           int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p)
        s += double(ta ? a[p * lda + i] : a[i * lda + p]) * double(tb ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = alpha * s + beta * c[i * ldc + j];
    }
}

TEST(Gemm, MatchesNaiveLoopForAllTransposes) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 5, 3}, {64, 65, 63}, {33, 17, 128}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 1, ldc = n + 2;  // padded rows
        std::vector<float> a((ta ? k : m) * lda), b((tb ? n : k) * ldb), c(m * ldc);
        for (auto& x : a) x = u(gen);
        for (auto& x : b) x = u(gen);
        for (auto& x : c) x = u(gen);
        std::vector<double> expected(c.begin(), c.end());
        naive(ta, tb, m, n, k, 0.5f, a, lda, b, ldb, 2.f, expected, ldc);
        sgemm(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 2.f, c.data(), ldc);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j)
            // Worst case of float32 summation of k products with |a|,|b| <= 1 (plus
            // alpha/beta rounding): k * 2^-24 * sum|a b| <= k^2 * 6e-8, doubled.
            ASSERT_NEAR(c[i * ldc + j], expected[i * ldc + j], (k * k + 16) * 1.2e-7)
                << "m=" << m << " n=" << n << " k=" << k << " ta=" << ta << " tb=" << tb;
      }
}

TEST(Gemm, ZeroInnerDimensionScalesC) {
  std::vector<float> c{1.f, 2.f, 3.f, 4.f};
  sgemm(false, false, 2, 2, 0, 1.f, nullptr, 1, nullptr, 2, 0.5f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0.5f, 1.f, 1.5f, 2.f}));
  sgemm(false, false, 2, 2, 0, 1.f, nullptr, 1, nullptr, 2, 0.f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0.f, 0.f, 0.f, 0.f}));
}

}  // namespace
}  // namespace attnkit::kernels::gemm_test
