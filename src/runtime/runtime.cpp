// Runtime settings and the counting CPU allocator (include/attnkit/runtime.h).
#include <attnkit/dispatch.h>
#include <attnkit/runtime.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <ctime>
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>

#include <fstream>
#include <mutex>
#include <new>
#include <vector>

#include "kernels/common/gemm.h"
#include "kernels/common/isa.h"
#include "kernels/memory.h"
#include "kernels/peak.h"
#include "kernels/threading.h"

namespace attnkit {

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
/// process-wide counters in kernels/memory.h.
///
/// Each block is one raw allocation of the base allocator with a header in
/// front: the data pointer is also the DataPtr's context, and the header
/// (found at a fixed offset before it) holds the size and the base's deleter.
/// That is what c10::Allocator::raw_allocate requires (context == data and a
/// raw_deleter), and libtorch uses it: ideep's allocator (to_mkldnn, oneDNN
/// tensors) allocates through raw_allocate of the current CPU allocator. A
/// wrapper whose context differed from its data (a heap record holding the
/// base's DataPtr, as this one once was) failed c10's internal assert there
/// once installed.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base), base_deleter_(base->raw_deleter()) {
    TORCH_CHECK(base_deleter_ != nullptr,
                "install_counting_allocator: torch's CPU allocator does not support raw "
                "allocation (no raw_deleter), which the counting wrapper needs");
  }

  c10::DataPtr allocate(size_t bytes) const override {
    auto* start = static_cast<char*>(base_->raw_allocate(bytes + kHeaderBytes));
    new (start) Header{bytes, base_deleter_};
    void* data = start + kHeaderBytes;
    kernels::memory::note_alloc(bytes);
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

 private:
  struct Header {
    size_t bytes;
    c10::DeleterFnPtr base_deleter;
  };
  // A whole alignment unit, so the data keeps the base allocator's alignment.
  static constexpr size_t kHeaderBytes = c10::gAlignment;
  static_assert(sizeof(Header) <= kHeaderBytes, "the header must fit in front of the data");

  static void release(void* data) {
    if (data == nullptr) return;
    char* start = static_cast<char*>(data) - kHeaderBytes;
    const Header header = *reinterpret_cast<Header*>(start);
    kernels::memory::note_free(header.bytes);
    header.base_deleter(start);
  }

  c10::Allocator* base_;
  c10::DeleterFnPtr base_deleter_;
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
