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
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "commands.h"

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
double now_ms(bool cpu_clock) { return cpu_clock ? thread_cpu_now_ms() : wall_now_ms(); }

/// Median and best milliseconds of `repeats` samples after a warm-up; each
/// sample runs `f` often enough to last about a millisecond (tiny batches take
/// microseconds). On a loaded machine long calls are preempted more often than
/// short ones, which biases wall-clock ratios: use the CPU clock there.
template <typename F>
Timing sample_ms(F f, int repeats, bool cpu_clock) {
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

void run_lookup_bench(const LookupConfig& c) {
  set_num_threads(c.threads);
  const double load_before = load_average();
  // The peak on the same clock as the lookups (sgemm_peak_gflops: best of
  // repeated 1024^3 products).
  const double peak = sgemm_peak_gflops(c.cpu_clock ? Clock::thread_cpu : Clock::wall);
  torch::manual_seed(0);
  // Unit-norm states and queries: softmax weights neither uniform nor one-hot.
  const auto H = torch::nn::functional::normalize(
      torch::randn({c.n, c.k}), torch::nn::functional::NormalizeFuncOptions().dim(1));
  const Timing encode = sample_ms(
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
                             SoftmaxAttentionFuncOptions().scale(1.0));
  };

  const double predicted = double(c.n) / double(c.k), flop_ratio = 2.0 * c.n / c.k;
  const double encode_flops = 2.0 * c.n * c.k * c.k;
  std::cout << "sgemm peak (this process, " << num_threads() << " thread(s)): " << fmt(peak, 1)
            << " GFLOP/s; load average " << fmt(load_before, 2) << "\n"
            << "document: n = " << c.n << " states of size k = " << c.k
            << "; encoding C = H^T H: " << fmt(encode.median_ms, 3) << " ms ("
            << fmt(encode_flops / encode.median_ms / 1e6, 1) << " GFLOP/s)\n"
            << "the cheap-linear-attention paper's predicted speed-up n/k = " << fmt(predicted, 2)
            << " (FLOP ratio 2n/k = " << fmt(flop_ratio, 2) << ")\n"
            << "times (" << (c.cpu_clock ? "thread CPU" : "wall") << " clock): median / best of "
            << c.repeats << "; GFLOP/s and %peak from the median\n\n"
            << std::right << std::setw(7) << "m" << std::setw(20) << "softmax ms" << std::setw(9)
            << "GFLOP/s" << std::setw(20) << "memory ms" << std::setw(9) << "GFLOP/s"
            << std::setw(7) << "%peak" << std::setw(22) << "speed-up"
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
    const Timing soft = sample_ms([&] { softmax_lookup(Q); }, c.repeats, c.cpu_clock);
    const Timing mem = sample_ms([&] { memory.lookup(Q); }, c.repeats, c.cpu_clock);
    const double soft_gflops = 4.0 * m * c.n * c.k / soft.median_ms / 1e6;
    const double mem_gflops = 2.0 * m * c.k * c.k / mem.median_ms / 1e6;
    std::cout << std::setw(7) << m << std::setw(20)
              << fmt(soft.median_ms, 4) + " / " + fmt(soft.best_ms, 4) << std::setw(9)
              << fmt(soft_gflops, 1) << std::setw(20)
              << fmt(mem.median_ms, 4) + " / " + fmt(mem.best_ms, 4) << std::setw(9)
              << fmt(mem_gflops, 1) << std::setw(7) << fmt(100 * mem_gflops / peak, 0)
              << std::setw(22)  // wide enough for two four-digit ratios
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
  const double load_after = load_average();
  doc["load_average"] = {{"before", load_before}, {"after", load_after}};
  std::cout << "load average after: " << fmt(load_after, 2) << "\n";
  write_json_report(c.json, doc);
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
    if (!queries->empty()) c.queries = parse_positive_list("--queries", *queries);
    run_lookup_bench(c);
  });
}

}  // namespace attnkit::cli
