// Issue 3 acceptance: exact attention never holds an L x S matrix. At
// N = 1, H = 8, L = S = 16384, E = 64 the composite would need 8 GiB for the
// scores alone; the tiled forward must stay below 64 MiB of extra memory
// (its output is 32 MiB of that).
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace attnkit::softmax_attention_memory_test {
namespace {

TEST(SoftmaxAttentionMemory, ForwardAt16kStaysBelow64MiB) {
  constexpr int64_t kLength = 16384;
  constexpr int64_t kLimitBytes = int64_t{64} << 20;
  memory::install_counting_allocator();
  torch::NoGradGuard no_grad;
  auto q = torch::randn({1, 8, kLength, 64}), k = torch::randn({1, 8, kLength, 64}),
       v = torch::randn({1, 8, kLength, 64});
  const int64_t before = memory::current_bytes();
  memory::reset_peak();
  auto out = softmax_attention(q, k, v);
  const int64_t extra = memory::peak_bytes() - before;
  EXPECT_LT(extra, kLimitBytes) << "peak extra bytes " << extra;
  EXPECT_GE(extra, out.numel() * int64_t{sizeof(float)}) << "the counter must see the output";
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
}

}  // namespace
}  // namespace attnkit::softmax_attention_memory_test
