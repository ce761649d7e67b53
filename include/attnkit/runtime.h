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
