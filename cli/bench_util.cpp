#include "bench_util.h"

#include <attnkit/runtime.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace attnkit::cli {

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

namespace {

double elapsed_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double measure_torch_mm_gflops() {
  const int64_t n = 1024;
  auto a = torch::randn({n, n}), b = torch::randn({n, n});
  auto run = [&] { torch::mm(a, b); };
  const auto times = time_ms(run, 3);
  return 2.0 * n * n * n / (*std::min_element(times.begin(), times.end()) * 1e6);
}

}  // namespace

MachineRecord MachineRecord::measure() {
  MachineRecord m;
  m.cpu = cpu_name();
  m.threads = num_threads();
  m.sgemm_gflops = sgemm_peak_gflops();
  m.torch_blas = torch_blas_library();
  m.torch_mm_gflops = measure_torch_mm_gflops();
  return m;
}

void MachineRecord::remeasure_peak() { sgemm_gflops = std::max(sgemm_gflops, sgemm_peak_gflops()); }

std::string MachineRecord::header() const {
  std::ostringstream o;
  o << "cpu: " << cpu << ", " << threads << " thread(s); sgemm peak (oneDNN, this process): "
    << fmt(sgemm_gflops, 1) << " GFLOP/s\n"
    << "libtorch matmul (the `torch` rows): " << torch_blas << ", torch.mm " << fmt(torch_mm_gflops, 1)
    << " GFLOP/s\n";
  return o.str();
}

nlohmann::json MachineRecord::to_json() const {
  return {{"cpu", cpu},
          {"threads", threads},
          {"sgemm_gflops", sgemm_gflops},
          {"torch_blas", torch_blas},
          {"torch_mm_gflops", torch_mm_gflops}};
}

std::vector<double> time_ms(const std::function<void()>& body, int repeats,
                            const std::function<void()>& between) {
  // Warm-up: oneDNN JITs its kernels per shape and the OpenMP pool starts on
  // first use; both would otherwise land in the first timed calls.
  double previous = -1, spent = 0;
  for (int call = 0; call < 5; ++call) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    const double ms = elapsed_ms(t0);
    between();
    spent += ms;
    if (previous > 0 && std::abs(ms - previous) <= 0.1 * std::max(ms, previous)) break;
    if (spent > 3000) break;
    previous = ms;
  }
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    times.push_back(elapsed_ms(t0));
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

void write_json_atomically(const std::string& path, const nlohmann::json& doc) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) throw std::runtime_error("cannot write " + tmp);
    out << doc.dump(2) << "\n";
    if (!out.flush()) throw std::runtime_error("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot rename " + tmp + " to " + path);
}

}  // namespace attnkit::cli
