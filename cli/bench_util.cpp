#include "bench_util.h"

#include <attnkit/runtime.h>
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/clock.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace attnkit::cli {

double wall_now_ms() { return 1e3 * train::steady_seconds(); }

namespace {

double clock_ms(clockid_t id) {
  timespec t{};
  clock_gettime(id, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

}  // namespace

double process_cpu_now_ms() { return clock_ms(CLOCK_PROCESS_CPUTIME_ID); }
double thread_cpu_now_ms() { return clock_ms(CLOCK_THREAD_CPUTIME_ID); }

namespace {

double measure_torch_mm_gflops() {
  const int64_t n = 1024;
  auto a = torch::randn({n, n}), b = torch::randn({n, n});
  auto run = [&] { torch::mm(a, b); };
  const auto times = time_ms(run, 3);
  return 2.0 * n * n * n / (*std::min_element(times.begin(), times.end()) * 1e6);
}

}  // namespace

MachineRecord MachineRecord::measure(bool with_peaks) {
  MachineRecord m;
  m.cpu = cpu_model();
  m.isa = attnkit::isa();
  m.isa_description = attnkit::isa_description();
  m.threads = num_threads();
  m.sgemm_gflops = with_peaks ? sgemm_peak_gflops() : 0;
  m.torch_version = TORCH_VERSION;
  m.torch_blas = torch_blas_library();
  m.torch_mm_gflops = with_peaks ? measure_torch_mm_gflops() : 0;
  return m;
}

void MachineRecord::remeasure_peak() { sgemm_gflops = std::max(sgemm_gflops, sgemm_peak_gflops()); }

std::string MachineRecord::header() const {
  std::ostringstream o;
  // 0: not measured (bench --no-peak).
  const auto rate = [](double gflops) { return gflops > 0 ? fmt(gflops, 1) + " GFLOP/s" : "not measured"; };
  o << "cpu: " << cpu << ", " << threads << " thread(s), isa " << isa_description
    << "; sgemm peak (oneDNN, this process): " << rate(sgemm_gflops) << "\n"
    << "libtorch " << torch_version << ", its matmul (the `torch` rows): " << torch_blas << ", torch.mm "
    << rate(torch_mm_gflops)
    << "\n";
  return o.str();
}

nlohmann::json MachineRecord::to_json() const {
  return {{"cpu", cpu},
          {"isa", isa},
          {"isa_description", isa_description},
          {"threads", threads},
          {"sgemm_gflops", sgemm_gflops},
          {"torch_version", torch_version},
          {"torch_blas", torch_blas},
          {"torch_mm_gflops", torch_mm_gflops}};
}

std::vector<double> time_ms(const std::function<void()>& body, int repeats,
                            const std::function<void()>& between, int max_warmup) {
  // Warm-up: oneDNN JITs its kernels per shape and the OpenMP pool starts on
  // first use; both would otherwise land in the first timed calls.
  double previous = -1, spent = 0;
  for (int call = 0; call < max_warmup; ++call) {
    const double t0 = wall_now_ms();
    body();
    const double ms = wall_now_ms() - t0;
    between();
    spent += ms;
    if (previous > 0 && std::abs(ms - previous) <= 0.1 * std::max(ms, previous)) break;
    if (spent > 3000) break;
    previous = ms;
  }
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = wall_now_ms();
    body();
    times.push_back(wall_now_ms() - t0);
    between();
  }
  return times;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

std::string fmt(double x, int precision) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(precision) << x;
  return o.str();
}

void write_text_atomically(const std::string& path, const std::string& text) {
  attnkit::train::write_file_atomically(path, text);
}

void write_json_atomically(const std::string& path, const nlohmann::json& doc) {
  write_text_atomically(path, doc.dump(2) + "\n");
}

void write_json_report(const std::string& path, const nlohmann::json& doc) {
  if (path.empty()) return;
  write_json_atomically(path, doc);
  std::cout << "wrote " << path << "\n";
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<std::string> split_specs(const std::string& s) {
  std::vector<std::string> out;
  for (const auto& item : split_list(s)) {
    if (!out.empty() && item.find('=') != std::string::npos && item.find(':') == std::string::npos)
      out.back() += "," + item;
    else
      out.push_back(item);
  }
  return out;
}

std::vector<int64_t> parse_positive_list(const std::string& option, const std::string& list) {
  std::vector<int64_t> out;
  for (const auto& item : split_list(list)) {
    int64_t x = 0;
    try {
      size_t used = 0;
      x = std::stoll(item, &used);
      if (used != item.size()) x = 0;
    } catch (const std::exception&) {
    }
    if (x <= 0) throw CLI::ValidationError(option, "'" + item + "' is not a positive integer");
    out.push_back(x);
  }
  if (out.empty()) throw CLI::ValidationError(option, "'" + list + "' names no value");
  return out;
}

void check_choices(const std::string& option, const std::vector<std::string>& got,
                   const std::vector<std::string>& allowed) {
  for (const auto& g : got) {
    if (std::find(allowed.begin(), allowed.end(), g) != allowed.end()) continue;
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    throw CLI::ValidationError(option, "unknown value '" + g + "'; expected one of: " + list);
  }
}

std::vector<std::pair<const nn::MechanismInfo*, nn::MechanismSpec>> resolve_specs(
    const std::string& option, const std::vector<std::string>& specs) {
  std::vector<std::pair<const nn::MechanismInfo*, nn::MechanismSpec>> out;
  for (const auto& text : specs) {
    try {
      out.push_back(nn::resolve_mechanism(text));
    } catch (const c10::Error& e) {
      throw CLI::ValidationError(option, e.what_without_backtrace());
    }
  }
  if (out.empty()) throw CLI::ValidationError(option, "names no mechanism");
  return out;
}

std::string option_value(const nn::MechanismInfo& info, const nn::MechanismSpec& spec,
                         const std::string& key) {
  for (const auto& o : info.options)
    if (o.key == key) return spec.get(key, o.default_value);
  return "";
}

std::string spec_with_defaults(const nn::MechanismInfo& info, const nn::MechanismSpec& spec) {
  nn::MechanismSpec full{info.name, {}};
  for (const auto& o : info.options) full.options.emplace_back(o.key, spec.get(o.key, o.default_value));
  return full.str();
}

}  // namespace attnkit::cli
