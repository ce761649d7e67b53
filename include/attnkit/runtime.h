// Process-wide runtime settings and measurements of attnkit.
#pragma once

#include <cstdint>
#include <string>

namespace attnkit {

/// The library version, e.g. "0.1.0".
std::string version();

/// The instruction-set level attnkit's kernels run at: "baseline" (x86-64-v2),
/// "avx2" (x86-64-v3), "avx512" (x86-64-v4), "avx512_bf16" or "amx". The
/// library holds a build of its kernels for each level and runs the best one
/// the CPU and operating system support, lowered by the cap (set_max_isa or
/// the environment variable ATTNKIT_MAX_ISA). Decided at the first kernel
/// call (or the first call of these functions), then fixed for the process.
/// Throws when the CPU lacks even the baseline, naming what is missing.
std::string isa();
/// How the level was decided: the CPU's best level, the cap and where it came
/// from, and oneDNN's cap, e.g. "avx2 (CPU: avx2)" or "avx2 (capped by
/// ATTNKIT_MAX_ISA=avx2; CPU: amx; oneDNN capped to avx2)".
std::string isa_description();
/// The best level this CPU and operating system support (no cap), or
/// "below baseline".
std::string machine_isa();
/// Caps the level, as ATTNKIT_MAX_ISA does (and replacing it), oneDNN's with
/// it: a machine then runs exactly what a CPU of that level runs. Works only
/// before the level is decided (by the first kernel call, sgemm, `*_dispatch`
/// call or isa query), like oneDNN's dnnl_set_max_cpu_isa: returns true when
/// taken, false when the level was already decided. An unknown name throws. A
/// cap above the machine's level changes nothing. oneDNN is one library per
/// process: the cap also lowers libtorch's own oneDNN ops (Debian's libtorch
/// links the same libdnnl), and is not applied to oneDNN when something used
/// oneDNN before the decision (isa_description() then says so).
bool set_max_isa(const std::string& level);

/// The CPU's model name as CPUID reports it (its brand string), or "unknown".
std::string cpu_model();

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
