// Process-wide runtime settings and measurements of attnkit.
#pragma once

#include <cstdint>
#include <string>

namespace attnkit {

/// The library version, e.g. "0.1.0".
std::string version();

/// Threads used by attnkit's kernels (and by oneDNN inside them). Default:
/// omp_get_max_threads(). Values < 1 restore the default. Results do not
/// depend on this beyond float rounding.
int num_threads();
void set_num_threads(int threads);

/// The best float32 GEMM throughput (GFLOP/s) this process reaches with
/// num_threads() threads, measured now: the better of one size^3 sgemm
/// threaded by oneDNN and one such sgemm per thread at once. Takes about
/// 2 * repeats products; benchmarks call it several times and keep the best.
double sgemm_peak_gflops(int64_t size = 1024, int repeats = 5);

/// The clock a measurement is timed on.
enum class Clock {
  /// Steady wall time.
  wall,
  /// The calling thread's CPU time: other processes on a shared machine cannot
  /// inflate it, but it counts only work done on the calling thread, so it
  /// needs num_threads() == 1.
  thread_cpu,
};

/// The sgemm peak on `clock`. Clock::wall is sgemm_peak_gflops(size, repeats).
/// Clock::thread_cpu times one size^3 sgemm on the calling thread: the best of
/// `repeats` products after a warm-up. It requires num_threads() == 1 and says
/// so otherwise (other threads' work would be invisible to the clock).
double sgemm_peak_gflops(Clock clock, int64_t size = 1024, int repeats = 5);

/// The BLAS library that libtorch's own matmul uses in this process (the
/// shared object mapped as libblas.so.3, e.g. ".../openblas-openmp/libblas.so.3"),
/// or "unknown".
std::string torch_blas_library();

namespace memory {
/// Routes torch's CPU allocations through a counting wrapper so that
/// peak_bytes() sees tensors as well as kernel scratch. Idempotent; call it
/// before allocating the tensors you want counted.
void install_counting_allocator();
bool counting_allocator_installed();
/// Bytes currently held / the most held since the last reset_peak().
int64_t current_bytes();
int64_t peak_bytes();
void reset_peak();
}  // namespace memory

}  // namespace attnkit
