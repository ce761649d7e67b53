// Runtime settings and the counting CPU allocator (include/attnkit/runtime.h).
#include <attnkit/dispatch.h>
#include <attnkit/runtime.h>
#include <ATen/Context.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <ctime>
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>

#include <fstream>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "base/memory.h"
#include "runtime/allocator_compat.h"
#include "kernels/common/gemm.h"
#include "kernels/gemm_bf16.h"
#include "kernels/common/isa.h"
#include "kernels/common/threading.h"
#include "kernels/peak.h"

namespace attnkit {

namespace {

// Torch's own bf16 products (matmul, linear, convolution) run on the same
// oneDNN as ours (Debian links both to libdnnl.so.2) whenever the CPU has
// AVX-512: torch asks the CPU, not oneDNN, whether oneDNN can take bf16. A cap
// below avx512 (ATTNKIT_MAX_ISA=avx2, or the user's ONEDNN_MAX_CPU_ISA) leaves
// oneDNN without bf16 matmul, and torch would throw "could not create a
// primitive descriptor iterator" at its first bf16 product. So once the level
// is decided, torch is kept off such a oneDNN: it takes its own kernels, as
// it does on a CPU without AVX-512. (On such a CPU nothing is changed: torch
// still uses oneDNN for float32 convolutions there.)
void keep_torch_off_a_onednn_without_bf16() {
  const auto machine = kernels::isa::machine();
  if (machine && *machine >= kernels::isa::Level::avx512 && !kernels::onednn_runs_bf16_matmul())
    at::globalContext().setUserEnabledMkldnn(false);
}

[[maybe_unused]] const bool g_torch_follows_the_cap =
    (kernels::isa::on_decision(keep_torch_off_a_onednn_without_bf16), true);

}  // namespace

std::string version() { return ATTNKIT_VERSION; }

std::string isa() { return kernels::isa::name(kernels::isa::current()); }
std::string isa_description() { return kernels::isa::describe(); }
std::string machine_isa() {
  const auto level = kernels::isa::machine();
  return level ? kernels::isa::name(*level) : "below baseline";
}
std::string cpu_model() { return kernels::isa::cpu_model(); }

Dispatch Dispatch::kernel(std::string how) { return {Backend::kernel, std::move(how), attnkit::isa()}; }

std::string Dispatch::describe() const {
  std::string details = uses_kernel() ? isa : reason;
  if (uses_kernel() && !reason.empty()) details += "; " + reason;
  return std::string(to_string(backend)) + (details.empty() ? "" : " (" + details + ")");
}
bool set_max_isa(const std::string& level) {
  const auto cap = kernels::isa::parse(level);
  TORCH_CHECK(cap, "set_max_isa: level must be one of baseline, avx2, avx512, avx512_bf16, amx; got '",
              level, "'");
  return kernels::isa::set_max(*cap);
}
int num_threads() { return kernels::num_threads(); }
void set_num_threads(int threads) { kernels::set_num_threads(threads); }
double sgemm_peak_gflops(int64_t size, int repeats) { return kernels::sgemm_peak_gflops(size, repeats); }

namespace {

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

double sgemm_peak_gflops(Clock clock, int64_t size, int repeats) {
  TORCH_CHECK(size >= 1 && repeats >= 1, "sgemm_peak_gflops: size and repeats must be >= 1, got ",
              size, " and ", repeats);
  if (clock == Clock::wall) return sgemm_peak_gflops(size, repeats);
  TORCH_CHECK(num_threads() == 1,
              "sgemm_peak_gflops: Clock::thread_cpu counts the calling thread only and needs "
              "num_threads() == 1, got ",
              num_threads(), " (call set_num_threads(1) first)");
  const auto n2 = static_cast<std::size_t>(size * size);
  std::vector<float> a(n2), b(n2), c(n2);
  for (std::size_t i = 0; i < n2; ++i) {
    a[i] = static_cast<float>((i * 7 + 3) % 17) / 17.f - 0.5f;
    b[i] = static_cast<float>((i * 5 + 1) % 13) / 13.f - 0.5f;
  }
  kernels::ThreadScope scope;  // oneDNN runs on this thread alone
  auto product = [&] {
    kernels::sgemm(false, false, size, size, size, 1.f, a.data(), size, b.data(), size, 0.f,
                   c.data(), size);
  };
  product();  // warm-up: oneDNN's JIT
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = thread_cpu_seconds();
    product();
    const double seconds = thread_cpu_seconds() - t0;
    if (seconds > 0) best = std::max(best, 2.0 * size * size * size / seconds / 1e9);
  }
  return best;
}

std::string torch_blas_library() {
  // libtorch calls the Fortran symbol sgemm_; the dynamic linker binds it to
  // the first loaded library that defines it (Debian's alternatives choose
  // libblas.so.3: netlib, OpenBLAS, BLIS, ...). Ask where that symbol lives.
  void* symbol = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (!symbol || !dladdr(symbol, &info) || !info.dli_fname) return "unknown";
  char resolved[PATH_MAX];
  return realpath(info.dli_fname, resolved) ? std::string(resolved) : std::string(info.dli_fname);
}

namespace memory {
namespace {

/// Wraps torch's default CPU allocator and reports every block to the
/// process-wide counters in base/memory.h.
///
/// Blocks are the base allocator's raw allocations, handed out with the data
/// pointer as the DataPtr's context: what c10::Allocator::raw_allocate
/// requires (context == data, and a raw_deleter), and libtorch uses it:
/// ideep's allocator (to_mkldnn, oneDNN tensors) allocates and frees through
/// raw_allocate / raw_deallocate of the *current* CPU allocator. (A wrapper
/// whose context was a heap record holding the base's DataPtr, as this one
/// once was, failed c10's internal assert there once installed.) The sizes
/// live in a table keyed by the data pointer, not in a header in front of the
/// data: a block the base allocated before this wrapper was installed may
/// come back through raw_deallocate afterwards, and is then recognised (not
/// in the table) and handed to the base's deleter untouched. The table is
/// sharded by address so that concurrent calls rarely share a lock.
class CountingAllocator final : public AllocatorBase {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {
    g_base_deleter = base->raw_deleter();
    TORCH_CHECK(g_base_deleter != nullptr,
                "install_counting_allocator: torch's CPU allocator does not support raw "
                "allocation (no raw_deleter), which the counting wrapper needs");
  }

  c10::DataPtr allocate_block(size_t bytes) const override {
    void* data = base_->raw_allocate(bytes);
    if (data != nullptr) {
      Shard& shard = shard_of(data);
      std::lock_guard<std::mutex> lock(shard.mutex);
      shard.bytes.emplace(data, bytes);
    }
    kernels::memory::note_alloc(bytes);
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

 private:
  struct Shard {
    std::mutex mutex;
    std::unordered_map<const void*, size_t> bytes;
  };
  static constexpr size_t kShards = 16;
  static Shard& shard_of(const void* data) {
    static Shard shards[kShards];
    // Blocks are at least 16-byte aligned: skip the bits that are always zero.
    return shards[(reinterpret_cast<std::uintptr_t>(data) >> 6) % kShards];
  }

  static void release(void* data) {
    if (data == nullptr) return;
    {
      Shard& shard = shard_of(data);
      std::lock_guard<std::mutex> lock(shard.mutex);
      const auto it = shard.bytes.find(data);
      if (it != shard.bytes.end()) {
        kernels::memory::note_free(it->second);
        shard.bytes.erase(it);
      }
      // Not found: allocated by the base before the wrapper was installed,
      // never counted; the base frees it all the same.
    }
    g_base_deleter(data);
  }

  static inline c10::DeleterFnPtr g_base_deleter = nullptr;  // set once, before any block
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
