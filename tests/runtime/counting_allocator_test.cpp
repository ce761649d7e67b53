// The counting CPU allocator (attnkit/runtime.h, memory::install_counting_allocator)
// replaces torch's CPU allocator for the rest of the process, so everything
// libtorch allocates afterwards goes through it, including the raw allocations
// of ideep (to_mkldnn) that need a DataPtr whose context is its data.
// Installing it here also makes every test that runs after this one in the
// same process run under it (the failure once seen: BadInput*.TensorsAndSizes,
// which build mkldnn tensors, failed only after the counting-allocator tests).
#include <ATen/Context.h>
#include <attnkit/runtime.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstring>

namespace attnkit::counting_allocator_test {
namespace {

TEST(CountingAllocator, RawAllocationIsCountedAndAligned) {
  memory::install_counting_allocator();
  ASSERT_TRUE(memory::counting_allocator_installed());
  c10::Allocator* allocator = c10::GetCPUAllocator();
  ASSERT_NE(allocator->raw_deleter(), nullptr) << "raw_allocate needs a raw deleter";

  const int64_t before = memory::current_bytes();
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{100}, size_t{1} << 20}) {
    void* p = allocator->raw_allocate(bytes);  // c10 asserts context == data inside
    // Zero bytes: torch's allocator may return no block at all, as it does.
    if (bytes > 0) ASSERT_NE(p, nullptr) << bytes;
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % c10::gAlignment, 0u) << bytes;
    EXPECT_EQ(memory::current_bytes(), before + static_cast<int64_t>(bytes)) << bytes;
    if (bytes > 0) std::memset(p, 0xab, bytes);  // the whole block is writable
    allocator->raw_deallocate(p);
    EXPECT_EQ(memory::current_bytes(), before) << bytes;
  }
}

TEST(CountingAllocator, ABlockFromBeforeTheInstallIsFreedByTheBase) {
  // ideep frees through raw_deallocate of whichever allocator is current: a
  // block the default allocator made before the install comes back through
  // the counting one, which must hand it to the base untouched (and uncounted).
  c10::Allocator* base = c10::GetDefaultCPUAllocator();
  void* early = base->raw_allocate(256);
  std::memset(early, 1, 256);
  memory::install_counting_allocator();
  const int64_t before = memory::current_bytes();
  c10::GetCPUAllocator()->raw_deallocate(early);  // AddressSanitizer checks the free
  EXPECT_EQ(memory::current_bytes(), before);
}

TEST(CountingAllocator, TensorsAreCountedUntilFreed) {
  memory::install_counting_allocator();
  const int64_t before = memory::current_bytes();
  {
    auto t = torch::empty({1000}, torch::kFloat);
    EXPECT_EQ(memory::current_bytes(), before + 4000);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % c10::gAlignment, 0u);
  }
  EXPECT_EQ(memory::current_bytes(), before);
}

TEST(CountingAllocator, MkldnnTensorsWorkUnderIt) {
  if (!at::hasMKLDNN()) GTEST_SKIP() << "libtorch built without MKLDNN";
  memory::install_counting_allocator();
  const int64_t before = memory::current_bytes();
  {
    auto x = torch::arange(24, torch::kFloat).view({2, 3, 4});
    auto m = x.to_mkldnn();  // ideep allocates through raw_allocate
    EXPECT_TRUE(torch::equal(m.to_dense(), x));
  }
  EXPECT_EQ(memory::current_bytes(), before);
}

}  // namespace
}  // namespace attnkit::counting_allocator_test
