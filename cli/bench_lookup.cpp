// `attnkit bench-lookup`: the cheap-linear-attention paper's promise, measured. A document of n
// hidden states of size k is queried m times:
//   softmax lookups over the stored H (n x k):  R = softmax(Q H^T) H,  4 m n k FLOPs
//   DocumentMemory lookups over C = H^T H:      R = Q C^T,             2 m k^2 FLOPs
// The paper predicts a speed-up of n k m / (m k^2) = n / k (7.5 for its n = 750,
// k = 100); counting both products of the softmax form the FLOP ratio is 2 n / k.
//
// The softmax side is the library's exact attention (softmax_attention with
// keys = values = H and scale 1, float32: the tiled kernel), the memory side
// DocumentMemory::lookup, both as a user calls them.
#include <attnkit/document_memory.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "kernels/common/gemm.h"
#include "kernels/threading.h"

namespace attnkit::cli {

namespace {

struct LookupConfig {
  int64_t n = 750, k = 100;  // the paper's CNN setup
  std::vector<int64_t> queries{4, 64, 256, 1024, 4096};
  int threads = 0;
  int repeats = 21;
  bool cpu_clock = false;  // time the calling thread's CPU time (--threads 1 only)
  std::string json;
};

struct Timing {
  double median_ms, best_ms;
};

/// Milliseconds on the chosen clock: wall time, or the calling thread's CPU
/// time, which a shared machine's other processes cannot inflate (valid when
/// all the work runs on the calling thread, i.e. one thread).
double now_ms(bool cpu_clock) {
  if (cpu_clock) {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
  }
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Median and best milliseconds of `repeats` samples after a warm-up; each
/// sample runs `f` often enough to last about a millisecond (tiny batches take
/// microseconds). On a loaded machine long calls are preempted more often than
/// short ones, which biases wall-clock ratios: use the CPU clock there.
template <typename F>
Timing time_ms(F f, int repeats, bool cpu_clock) {
  f();
  double t0 = now_ms(cpu_clock);
  f();
  const int inner = std::max(1, static_cast<int>(1.0 / std::max(now_ms(cpu_clock) - t0, 1e-6)));
  std::vector<double> samples;
  for (int r = 0; r < repeats; ++r) {
    t0 = now_ms(cpu_clock);
    for (int i = 0; i < inner; ++i) f();
    samples.push_back((now_ms(cpu_clock) - t0) / inner);
  }
  std::sort(samples.begin(), samples.end());
  return {samples[repeats / 2], samples.front()};
}

/// The sgemm peak on the chosen clock: the library's measurement (wall clock),
/// or the same 1024^3 product timed on the CPU clock.
double sgemm_peak(bool cpu_clock) {
  if (!cpu_clock) return kernels::measure_sgemm_gflops();
  constexpr int64_t size = 1024;
  const auto a = torch::randn({size, size}), b = torch::randn({size, size});
  auto c = torch::empty({size, size});
  kernels::ThreadScope threads;
  const Timing t = time_ms(
      [&] {
        kernels::sgemm(false, false, size, size, size, 1.f, a.data_ptr<float>(), size,
                       b.data_ptr<float>(), size, 0.f, c.data_ptr<float>(), size);
      },
      7, /*cpu_clock=*/true);
  return 2.0 * size * size * size / t.median_ms / 1e6;
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  in >> one;
  return in ? one : "unknown";
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
    out << doc.dump(2) << "\n";
    if (!out.flush()) throw std::runtime_error("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot rename " + tmp + " to " + path);
}

void run_lookup_bench(const LookupConfig& c) {
  set_num_threads(c.threads);
  const std::string load_before = load_average();
  const double peak = sgemm_peak(c.cpu_clock);
  torch::manual_seed(0);
  // Unit-norm states and queries: softmax weights neither uniform nor one-hot.
  const auto H = torch::nn::functional::normalize(
      torch::randn({c.n, c.k}), torch::nn::functional::NormalizeFuncOptions().dim(1));
  const Timing encode = time_ms(
      [&] {
        DocumentMemory fresh(c.k);
        fresh.append(H);
      },
      c.repeats, c.cpu_clock);
  DocumentMemory memory(c.k);
  memory.append(H);
  torch::NoGradGuard no_grad;
  const auto keys = H.view({1, 1, c.n, c.k});
  const auto softmax_lookup = [&](const torch::Tensor& Q) {
    return softmax_attention(Q.view({1, 1, Q.size(0), c.k}), keys, keys,
                             SoftmaxAttentionOptions().scale(1.0));
  };

  const double predicted = double(c.n) / double(c.k), flop_ratio = 2.0 * c.n / c.k;
  const double encode_flops = 2.0 * c.n * c.k * c.k;
  std::cout << "sgemm peak (this process, " << num_threads() << " thread(s)): " << fmt(peak, 1)
            << " GFLOP/s; load average " << load_before << "\n"
            << "document: n = " << c.n << " states of size k = " << c.k
            << "; encoding C = H^T H: " << fmt(encode.median_ms, 3) << " ms ("
            << fmt(encode_flops / encode.median_ms / 1e6, 1) << " GFLOP/s)\n"
            << "the cheap-linear-attention paper's predicted speed-up n/k = " << fmt(predicted, 2)
            << " (FLOP ratio 2n/k = " << fmt(flop_ratio, 2) << ")\n"
            << "times (" << (c.cpu_clock ? "thread CPU" : "wall") << " clock): median / best of "
            << c.repeats << "; GFLOP/s and %peak from the median\n\n"
            << std::right << std::setw(7) << "m" << std::setw(20) << "softmax ms" << std::setw(9)
            << "GFLOP/s" << std::setw(20) << "memory ms" << std::setw(9) << "GFLOP/s"
            << std::setw(7) << "%peak" << std::setw(16) << "speed-up"
            << "\n";

  nlohmann::json doc;
  doc["machine"] = {{"threads", num_threads()}, {"sgemm_gflops", peak}};
  doc["clock"] = c.cpu_clock ? "thread_cpu" : "wall";
  doc["n"] = c.n;
  doc["k"] = c.k;
  doc["encode_ms"] = encode.median_ms;
  doc["predicted_speedup"] = predicted;
  doc["flop_ratio"] = flop_ratio;
  doc["results"] = nlohmann::json::array();
  for (int64_t m : c.queries) {
    const auto Q = torch::randn({m, c.k});
    const Timing soft = time_ms([&] { softmax_lookup(Q); }, c.repeats, c.cpu_clock);
    const Timing mem = time_ms([&] { memory.lookup(Q); }, c.repeats, c.cpu_clock);
    const double soft_gflops = 4.0 * m * c.n * c.k / soft.median_ms / 1e6;
    const double mem_gflops = 2.0 * m * c.k * c.k / mem.median_ms / 1e6;
    std::cout << std::setw(7) << m << std::setw(20)
              << fmt(soft.median_ms, 4) + " / " + fmt(soft.best_ms, 4) << std::setw(9)
              << fmt(soft_gflops, 1) << std::setw(20)
              << fmt(mem.median_ms, 4) + " / " + fmt(mem.best_ms, 4) << std::setw(9)
              << fmt(mem_gflops, 1) << std::setw(7) << fmt(100 * mem_gflops / peak, 0)
              << std::setw(16)
              << fmt(soft.median_ms / mem.median_ms, 2) + " / " + fmt(soft.best_ms / mem.best_ms, 2)
              << "\n";
    doc["results"].push_back({{"m", m},
                              {"softmax_ms", soft.median_ms},
                              {"softmax_best_ms", soft.best_ms},
                              {"softmax_gflops", soft_gflops},
                              {"memory_ms", mem.median_ms},
                              {"memory_best_ms", mem.best_ms},
                              {"memory_gflops", mem_gflops},
                              {"memory_fraction_of_peak", mem_gflops / peak},
                              {"speedup", soft.median_ms / mem.median_ms},
                              {"speedup_best", soft.best_ms / mem.best_ms}});
  }
  const std::string load_after = load_average();
  doc["load_average"] = {{"before", load_before}, {"after", load_after}};
  std::cout << "load average after: " << load_after << "\n";
  if (!c.json.empty()) {
    write_json_atomically(c.json, doc);
    std::cout << "wrote " << c.json << "\n";
  }
}

}  // namespace

void add_bench_lookup_command(CLI::App& app) {
  auto config = std::make_shared<LookupConfig>();
  auto queries = std::make_shared<std::string>();
  auto clock_name = std::make_shared<std::string>("wall");
  auto* cmd = app.add_subcommand(
      "bench-lookup",
      "Time m attention lookups into one document: softmax over the stored states H "
      "(O(n k) per query) vs a DocumentMemory (O(k^2) per query)");
  cmd->add_option("--n", config->n, "Document length n (hidden states)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--k", config->k, "Hidden state size k")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--queries", *queries,
                  "Comma list of query counts m (default: 4,64,256,1024,4096)");
  cmd->add_option("--threads", config->threads, "Threads (default: all cores)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--repeats", config->repeats, "Timed samples after a warm-up (median reported)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--clock", *clock_name,
                  "wall (default) or cpu: the calling thread's CPU time, immune to "
                  "other processes on a shared machine; needs --threads 1")
      ->check(CLI::IsMember({"wall", "cpu"}));
  cmd->add_option("--json", config->json, "Also write the results to this JSON file");
  cmd->callback([=] {
    LookupConfig c = *config;
    c.cpu_clock = *clock_name == "cpu";
    if (c.cpu_clock && c.threads != 1)
      throw CLI::ValidationError("--clock",
                                 "cpu measures the calling thread only; add --threads 1");
    if (!queries->empty()) {
      c.queries.clear();
      std::stringstream ss(*queries);
      for (std::string item; std::getline(ss, item, ',');) {
        size_t used = 0;
        int64_t m = 0;
        try {
          m = std::stoll(item, &used);
        } catch (const std::exception&) {
        }
        if (m <= 0 || used != item.size())
          throw CLI::ValidationError("--queries", "'" + item + "' is not a positive integer");
        c.queries.push_back(m);
      }
    }
    run_lookup_bench(c);
  });
}

}  // namespace attnkit::cli
