// Runtime settings and the counting CPU allocator (include/attnkit/runtime.h).
#include <attnkit/runtime.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>

#include <fstream>

#include "kernels/memory.h"
#include "kernels/peak.h"
#include "kernels/threading.h"

namespace attnkit {

std::string version() { return ATTNKIT_VERSION; }
int num_threads() { return kernels::num_threads(); }
void set_num_threads(int threads) { kernels::set_num_threads(threads); }
double sgemm_peak_gflops(int64_t size, int repeats) { return kernels::sgemm_peak_gflops(size, repeats); }

std::string torch_blas_library() {
  // libtorch links libblas.so.3 (Debian's alternatives pick netlib, OpenBLAS,
  // BLIS, ...): the mapped file's resolved path names the implementation.
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    if (path.find("libblas.so") != std::string::npos || path.find("libopenblas") != std::string::npos ||
        path.find("libblis") != std::string::npos || path.find("libmkl") != std::string::npos)
      return path;
  }
  return "unknown";
}

namespace memory {
namespace {

/// Wraps torch's default CPU allocator and reports every block to the
/// process-wide counters in kernels/memory.h.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t bytes) const override {
    auto* block = new Block{base_->allocate(bytes), bytes};
    kernels::memory::note_alloc(bytes);
    return {block->inner.get(), block, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
  };
  static void release(void* ctx) {
    auto* block = static_cast<Block*>(ctx);
    kernels::memory::note_free(block->bytes);
    delete block;  // frees the inner DataPtr through the base allocator
  }
  c10::Allocator* base_;
};

std::atomic<bool> g_installed{false};

}  // namespace

void install_counting_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: tensors may outlive every static destructor.
    static auto* counting = new CountingAllocator(c10::GetDefaultCPUAllocator());
    c10::SetCPUAllocator(counting, /*priority=*/100);
    g_installed = true;
  });
}
bool counting_allocator_installed() { return g_installed; }
int64_t current_bytes() { return kernels::memory::current_bytes(); }
int64_t peak_bytes() { return kernels::memory::peak_bytes(); }
void reset_peak() { kernels::memory::reset_peak(); }

}  // namespace memory
}  // namespace attnkit
