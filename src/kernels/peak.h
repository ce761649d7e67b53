// The GEMM peak that benchmarks compare against, measured in the process that
// runs the benchmark, at the thread count the kernels use.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

/// Best sustained float32 GEMM throughput in GFLOP/s with num_threads()
/// threads: the better of (a) one size x size x size sgemm threaded by oneDNN
/// (how the dense layers use the cores) and (b) one such sgemm per thread,
/// concurrently (how the attention kernels use them: one head per thread).
/// Each is warmed up first and timed over `repeats` runs; the best run counts.
double sgemm_peak_gflops(int64_t size = 1024, int repeats = 5);

}  // namespace attnkit::kernels
