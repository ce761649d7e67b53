// Threading with per-thread scratch, shared by the kernels: one counted buffer
// is allocated before the parallel region (so an allocation failure throws to
// the caller instead of terminating inside OpenMP) and sliced per thread.
#pragma once

#include <omp.h>

#include <cstdint>

#include "kernels/memory.h"
#include "kernels/threading.h"

namespace attnkit::kernels {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// Hands out consecutive 64-byte aligned slices of one thread's scratch. With a
/// null base it only counts, to size the buffer.
class Slicer {
 public:
  explicit Slicer(float* base) : base_(base) {}
  float* take(int64_t count) {
    float* slice = base_ ? base_ + used_ : nullptr;
    used_ += ceil_div(count, 16) * 16;
    return slice;
  }
  int64_t used() const { return used_; }

 private:
  float* base_;
  int64_t used_ = 0;
};

/// Runs body(scratch) on num_threads() OpenMP threads, each with its own slice
/// of `floats_per_thread` floats. The body typically holds an `omp for`.
template <typename Body>
void parallel_with_scratch(int64_t floats_per_thread, Body body) {
  const int threads = num_threads();
  Buffer<float> scratch(static_cast<std::size_t>(threads * floats_per_thread));
#pragma omp parallel num_threads(threads)
  {
    // oneDNN, called inside, must run on this thread alone. In a team of one
    // omp_in_parallel() is false and oneDNN would fork its own threads, making
    // the rounding depend on the thread count; this setting lasts for the region.
    omp_set_num_threads(1);
    body(scratch.data() + omp_get_thread_num() * floats_per_thread);
  }
}

}  // namespace attnkit::kernels
