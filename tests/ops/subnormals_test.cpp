// The exact kernel computes with subnormal floats as zero (MXCSR's FTZ and
// DAZ bits, src/kernels/common/denormals.h) and gives the caller's threads
// their floating-point mode back: after a forward and a backward, on one and
// on two threads, the calling thread's MXCSR modes (rounding, exception
// masks, FTZ, DAZ) are what they were, and code after the op still produces
// subnormals. The six sticky exception flags are not compared: any library
// the op calls (torch, oneDNN, libm) may raise or clear them, and they are
// status, not mode (a CI run saw the precision flag cleared).
#include <attnkit/ops.h>
#include <gtest/gtest.h>
#include <omp.h>
#include <torch/torch.h>

#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>

namespace subnormals_test {
namespace {

// MXCSR without its exception flags (bits 0-5): the mode a thread computes in.
unsigned mode() { return _mm_getcsr() & ~0x3Fu; }

TEST(SubnormalsAsZero, TheCallersFloatingPointModeComesBack) {
  const unsigned before = mode();
  for (int threads : {1, 2}) {
    const int saved_threads = omp_get_max_threads();
    omp_set_num_threads(threads);
    torch::manual_seed(3);
    auto q = torch::randn({1, 2, 300, 16}, torch::requires_grad());
    auto k = torch::randn({1, 2, 300, 16}, torch::requires_grad());
    auto v = torch::randn({1, 2, 300, 16}, torch::requires_grad());
    auto out = attnkit::softmax_attention(
        q, k, v, attnkit::SoftmaxAttentionFuncOptions().causal(true).alibi_slopes(attnkit::alibi_slopes(2)));
    out.sum().backward();
    omp_set_num_threads(saved_threads);
    EXPECT_EQ(mode(), before) << "threads " << threads;
  }
  volatile float tiny = std::numeric_limits<float>::min();  // the smallest normal float
  EXPECT_GT(tiny / 4.f, 0.f) << "subnormal results flush to zero after the op";
}

}  // namespace
}  // namespace subnormals_test
#endif
