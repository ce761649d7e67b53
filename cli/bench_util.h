// What the benchmark subcommands share: the machine header (CPU, threads,
// GEMM peak, libtorch's BLAS), timing with warm-up, medians, number
// formatting, and atomic JSON writes.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace attnkit::cli {

std::string cpu_name();

/// The machine a benchmark ran on, measured in this process at the current
/// thread count: the best sgemm peak seen so far and libtorch's torch.mm.
struct MachineRecord {
  std::string cpu;
  int threads = 1;
  double sgemm_gflops = 0;     // best of every measurement so far
  std::string torch_blas;      // the library behind libtorch's matmul
  double torch_mm_gflops = 0;  // torch::mm of 1024^3 float32 through it

  /// Measures everything (about a second).
  static MachineRecord measure();
  /// Measures the sgemm peak again and keeps the best (benchmarks call it
  /// between rows: a busy core lowers one measurement, never the best).
  void remeasure_peak();
  /// Two lines for the top of a table.
  std::string header() const;
  nlohmann::json to_json() const;
};

/// Times `body` in milliseconds: untimed warm-up calls until two consecutive
/// calls agree within 10% (at most 5 calls and about 3 s; at least one), then
/// `repeats` timed calls. `between` runs after every call, untimed (e.g. to
/// clear gradients).
std::vector<double> time_ms(const std::function<void()>& body, int repeats,
                            const std::function<void()>& between = [] {});

double median(std::vector<double> x);
std::string fmt(double x, int precision);
void write_json_atomically(const std::string& path, const nlohmann::json& doc);

}  // namespace attnkit::cli
