// What the benchmark subcommands share: the machine header (CPU, threads,
// GEMM peak, libtorch's BLAS, load), clocks, timing with warm-up, medians,
// number formatting, comma lists, mechanism specs written out, and atomic
// file writes.
#pragma once

#include <attnkit/nn/registry.h>
#include <attnkit/train/clock.h>

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace attnkit::cli {

/// The 1-minute load average (-1 if unknown): train/clock.h's.
using train::load_average;

/// Milliseconds since an arbitrary origin on three clocks: steady wall time;
/// the CPU time of all the process's threads (waiting for a core that other
/// jobs hold does not count); the calling thread's CPU time (valid for work
/// that runs on the calling thread alone, i.e. one thread).
double wall_now_ms();
double process_cpu_now_ms();
double thread_cpu_now_ms();

/// The machine a benchmark ran on, measured in this process at the current
/// thread count: the best sgemm peak seen so far and libtorch's torch.mm.
struct MachineRecord {
  std::string cpu;
  std::string isa;              // the kernels' level (runtime.h: isa())
  std::string isa_description;  // and how it was chosen
  int threads = 1;
  double sgemm_gflops = 0;     // best of every measurement so far
  std::string torch_version;   // libtorch's (TORCH_VERSION)
  std::string torch_blas;      // the library behind libtorch's matmul
  double torch_mm_gflops = 0;  // torch::mm of 1024^3 float32 through it

  /// Measures everything (about a second); without peaks, the sgemm peak and
  /// torch.mm are left at 0 (not measured).
  static MachineRecord measure(bool with_peaks = true);
  /// Measures the sgemm peak again and keeps the best (benchmarks call it
  /// between rows: a busy core lowers one measurement, never the best).
  void remeasure_peak();
  /// Two lines for the top of a table.
  std::string header() const;
  nlohmann::json to_json() const;
};

/// Times `body` in milliseconds: untimed warm-up calls until two consecutive
/// calls agree within 10% (at most `max_warmup` calls and about 3 s; at least
/// one unless max_warmup is 0), then `repeats` timed calls. `between` runs
/// after every call, untimed (e.g. to clear gradients).
std::vector<double> time_ms(const std::function<void()>& body, int repeats,
                            const std::function<void()>& between = [] {}, int max_warmup = 5);

/// The upper median (x[n / 2] of the sorted values); x must not be empty.
double median(std::vector<double> x);
std::string fmt(double x, int precision);

/// Replaces `path` with `text` atomically and durably
/// (train::write_file_atomically): a reader, an interrupted run or a power
/// cut leaves the old file or the new one, never half of one.
void write_text_atomically(const std::string& path, const std::string& text);
void write_json_atomically(const std::string& path, const nlohmann::json& doc);
/// The end of a run: when `path` is not empty (a --json option was given),
/// writes `doc` there atomically and says so on stdout.
void write_json_report(const std::string& path, const nlohmann::json& doc);

/// The non-empty items of a comma list.
std::vector<std::string> split_list(const std::string& s);
/// A comma list of mechanism specs, keeping "name:k=v,k2=v2" together: a
/// piece with '=' but no ':' continues the previous spec.
std::vector<std::string> split_specs(const std::string& s);
/// A comma list of positive integers; anything else is refused with a
/// CLI::ValidationError naming `option` and the item.
std::vector<int64_t> parse_positive_list(const std::string& option, const std::string& list);
/// Refuses a value of `got` that is not in `allowed` with a
/// CLI::ValidationError naming `option`, the value and the allowed ones.
void check_choices(const std::string& option, const std::vector<std::string>& got,
                   const std::vector<std::string>& allowed);

/// Resolves every spec of a --attention list; a bad one is refused with a
/// CLI::ValidationError naming `option` and the registry's message.
std::vector<std::pair<const nn::MechanismInfo*, nn::MechanismSpec>> resolve_specs(
    const std::string& option, const std::vector<std::string>& specs);
/// The value `key` has in a call of `spec`: the spec's, else the registry's
/// default; empty when the mechanism has no such option.
std::string option_value(const nn::MechanismInfo& info, const nn::MechanismSpec& spec,
                         const std::string& key);
/// The spec with every option of the mechanism written out (given or
/// default), e.g. "clustered:clusters=100,bits=63,...", for reports.
std::string spec_with_defaults(const nn::MechanismInfo& info, const nn::MechanismSpec& spec);

}  // namespace attnkit::cli
