// Threading with per-thread scratch, shared by the kernels: one counted buffer
// is allocated before the parallel region (so an allocation failure throws to
// the caller instead of terminating inside OpenMP) and sliced per thread.
//
// Determinism: these helpers decide only which thread runs a work item, never
// what an item computes. A kernel whose items each write their own outputs, in
// an order fixed by the item alone, gives bitwise the same result for any
// thread count.
#pragma once

#include <omp.h>

#include <cstdint>

#include "base/memory.h"
#include "kernels/common/isa.h"
#include "kernels/common/threading.h"

ATTNKIT_KERNELS_BEGIN

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// Work items a kernel makes at least, when it can split a (batch, head) into
/// parts whose number depends on the shape alone (the exact and sparse
/// backward passes): enough for 8 threads even at N H = 1, so results stay
/// the same on any thread count while every core has work.
constexpr int64_t kMinSplitItems = 8;

/// a rounded up to a multiple of 16 floats (64 bytes: one cache line).
inline int64_t round_up16(int64_t a) { return ceil_div(a, 16) * 16; }

/// Hands out consecutive 64-byte aligned slices of one thread's scratch. With a
/// null base it only counts, to size the buffer.
class Slicer {
 public:
  explicit Slicer(float* base) : base_(base) {}
  float* take(int64_t count) {
    float* slice = base_ ? base_ + used_ : nullptr;
    used_ += round_up16(count);
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
  const int64_t stride = round_up16(floats_per_thread);  // no false sharing between slices
  Buffer<float> scratch(static_cast<std::size_t>(threads * stride));
#pragma omp parallel num_threads(threads)
  {
    // oneDNN, called inside, must run on this thread alone. In a team of one
    // omp_in_parallel() is false and oneDNN would fork its own threads, making
    // the rounding depend on the thread count; this setting lasts for the region.
    omp_set_num_threads(1);
    body(scratch.data() + omp_get_thread_num() * stride);
  }
}

/// Runs body(item, scratch) for item in [0, items), dynamically scheduled one
/// item at a time, each thread with `floats_per_thread` floats of scratch.
template <typename Body>
void parallel_for(int64_t items, int64_t floats_per_thread, Body body) {
  if (items <= 0) return;
  parallel_with_scratch(floats_per_thread, [&](float* scratch) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < items; ++t) body(t, scratch);
  });
}

/// As parallel_for, with the scratch laid out by a struct: make_scratch(slicer)
/// takes its slices from a Slicer (called once with a counting Slicer to size
/// the buffer, then once per thread), and body(item, const Scratch&) runs.
template <typename MakeScratch, typename Body>
void parallel_for_scratch(int64_t items, MakeScratch make_scratch, Body body) {
  if (items <= 0) return;
  Slicer sizer(nullptr);
  make_scratch(sizer);
  parallel_with_scratch(sizer.used(), [&](float* base) {
    Slicer slicer(base);
    const auto scratch = make_scratch(slicer);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < items; ++t) body(t, scratch);
  });
}

ATTNKIT_KERNELS_END
