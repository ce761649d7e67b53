// Clustered attention tools (the clustered-attention paper):
//   `attnkit figure-clustered`  Figure 4 of the paper on the CPU: forward+backward
//                               time and memory per sequence element vs length
//                               for exact, clustered and improved-clustered.
//   `attnkit approx`            how far clustered and improved-clustered are
//                               from exact attention as C and k vary.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"

namespace attnkit::cli {

namespace {

std::string fmt(double x, int precision) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(precision) << x;
  return o.str();
}

std::vector<int64_t> parse_lengths(const std::string& option, const std::string& list) {
  std::vector<int64_t> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
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
  return out;
}

/// The 1-minute load average, to record how busy the machine was.
double load_average() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

/// MemAvailable of /proc/meminfo in bytes (0 if unknown).
double available_bytes() {
  std::ifstream in("/proc/meminfo");
  for (std::string key; in >> key;) {
    double kib = 0;
    in >> kib;
    if (key == "MemAvailable:") return kib * 1024;
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

void write_json(const std::string& path, const nlohmann::json& doc) {
  std::ofstream out(path);
  if (!(out << doc.dump(2) << "\n")) throw std::runtime_error("cannot write " + path);
}

// ---------------------------------------------------------------------------
// figure-clustered
// ---------------------------------------------------------------------------

struct FigureConfig {
  std::vector<int64_t> lengths{1024, 2048, 4096, 8192, 16384, 32768};
  int64_t heads = 8, dim = 64, clusters = 100, bits = 63, iterations = 10, topk = 32;
  int repeats = 5;
  int threads = 0;
  double max_seconds = 300;  // skip a run predicted to take longer
  std::string json;
};

const std::vector<std::string> kMechanisms{"exact", "clustered", "improved-clustered"};

torch::Tensor attend(const FigureConfig& c, const std::string& mechanism, const torch::Tensor& q,
                     const torch::Tensor& k, const torch::Tensor& v) {
  if (mechanism == "exact") return softmax_attention(q, k, v);
  return clustered_attention(q, k, v,
                             ClusteredAttentionOptions()
                                 .clusters(std::min(c.clusters, q.size(2)))
                                 .bits(c.bits)
                                 .iterations(c.iterations)
                                 .topk(mechanism == "clustered" ? 0 : std::min(c.topk, k.size(2))));
}

struct Row {
  std::string mechanism;
  int64_t L = 0;
  double ms = 0;          // median forward+backward
  int64_t peak_bytes = 0; // above the inputs
  int runs = 0;
  std::string note;       // non-empty: skipped, and why
};

/// One forward+backward: returns its seconds and the peak bytes it added.
std::pair<double, int64_t> forward_backward(const FigureConfig& c, const std::string& mechanism,
                                            const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v) {
  const int64_t held = memory::current_bytes();
  memory::reset_peak();
  const auto t0 = std::chrono::steady_clock::now();
  {
    auto out = attend(c, mechanism, q, k, v);
    out.backward(torch::ones_like(out));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t peak = memory::peak_bytes() - held;
  for (const auto* t : {&q, &k, &v}) t->mutable_grad().reset();
  return {s, peak};
}

Row measure(const FigureConfig& c, const std::string& mechanism, int64_t L) {
  Row r{mechanism, L};
  torch::manual_seed(0);
  const int64_t H = c.heads, E = c.dim;
  auto q = torch::randn({1, H, L, E}).requires_grad_();
  auto k = torch::randn({1, H, L, E}).requires_grad_();
  auto v = torch::randn({1, H, L, E}).requires_grad_();
  // The first run warms up; when it is long, it is also the measurement.
  auto [first, peak] = forward_backward(c, mechanism, q, k, v);
  std::vector<double> times{first};
  if (first < 10.0) {
    times.clear();
    for (int rep = 0; rep < c.repeats; ++rep) {
      auto [s, p] = forward_backward(c, mechanism, q, k, v);
      times.push_back(s);
      peak = std::max(peak, p);
    }
  }
  std::sort(times.begin(), times.end());
  r.ms = 1e3 * times[times.size() / 2];
  r.peak_bytes = peak;
  r.runs = static_cast<int>(times.size());
  return r;
}

/// Extrapolates values measured at increasing lengths (pairs L, value) to length
/// L by the growth factor of the last step, per doubling (one point: 4x per
/// doubling, the quadratic worst case).
double extrapolate(const std::vector<std::pair<int64_t, double>>& points, int64_t L) {
  const auto [last_L, last] = points.back();
  double per_doubling = 4.0;
  if (points.size() >= 2) {
    const auto [prev_L, prev] = points[points.size() - 2];
    per_doubling = std::max(1.0, std::pow(last / prev, 1.0 / std::log2(double(last_L) / prev_L)));
  }
  return last * std::pow(per_doubling, std::log2(double(L) / last_L));
}

void print_row(const Row& r) {
  std::cout << std::left << std::setw(20) << r.mechanism << std::right << std::setw(7) << r.L;
  if (!r.note.empty()) {
    std::cout << "   skipped: " << r.note << std::endl;
    return;
  }
  std::cout << std::setw(12) << fmt(r.ms, 1) << std::setw(14) << fmt(1e3 * r.ms / r.L, 2)
            << std::setw(12) << fmt(r.peak_bytes / 1048576.0, 1) << std::setw(14)
            << fmt(r.peak_bytes / 1024.0 / r.L, 2) << std::setw(6) << r.runs << std::endl;
}

/// The length at which `mechanism` becomes faster than exact for good: the
/// geometric interpolation of the two measured lengths around the last sign
/// change of log(t_mech / t_exact). Text for the report.
std::string crossover(const std::vector<Row>& rows, const std::string& mechanism) {
  std::vector<std::pair<int64_t, double>> ratio;  // (L, log(t_mech / t_exact))
  for (const Row& m : rows) {
    if (m.mechanism != mechanism || !m.note.empty()) continue;
    for (const Row& e : rows)
      if (e.mechanism == "exact" && e.L == m.L && e.note.empty())
        ratio.emplace_back(m.L, std::log(m.ms / e.ms));
  }
  if (ratio.empty()) return "no length with both measured";
  if (ratio.back().second >= 0) return "not reached by L = " + std::to_string(ratio.back().first);
  size_t i = ratio.size() - 1;
  while (i > 0 && ratio[i - 1].second < 0) --i;
  if (i == 0) return "below the shortest length measured (" + std::to_string(ratio[0].first) + ")";
  const auto [l0, r0] = ratio[i - 1];
  const auto [l1, r1] = ratio[i];
  const double t = r0 / (r0 - r1);  // log-linear interpolation in log L
  const double at = std::exp(std::log(double(l0)) + t * (std::log(double(l1)) - std::log(double(l0))));
  return "about L = " + std::to_string(static_cast<int64_t>(std::lround(at))) + " (between " +
         std::to_string(l0) + " and " + std::to_string(l1) + ")";
}

void run_figure(const FigureConfig& c) {
  memory::install_counting_allocator();
  set_num_threads(c.threads);
  at::set_num_threads(num_threads());
  std::cout << "the clustered-attention paper, Figure 4, on the CPU: N = 1, H = " << c.heads
            << ", E = M = " << c.dim
            << ", clustered C = " << c.clusters << ", B = " << c.bits << ", " << c.iterations
            << " iterations, improved k = " << c.topk << "\n"
            << "threads " << num_threads() << ", load average " << fmt(load_average(), 2)
            << " at start\n\n"
            << std::left << std::setw(20) << "attention" << std::right << std::setw(7) << "L"
            << std::setw(12) << "fwd+bwd ms" << std::setw(14) << "us/element" << std::setw(12)
            << "peak MiB" << std::setw(14) << "KiB/element" << std::setw(6) << "runs" << std::endl;

  std::vector<Row> rows;
  nlohmann::json doc;
  doc["config"] = {{"N", 1}, {"H", c.heads}, {"E", c.dim}, {"clusters", c.clusters},
                   {"bits", c.bits}, {"iterations", c.iterations}, {"topk", c.topk},
                   {"threads", num_threads()}, {"load_average_at_start", load_average()}};
  doc["rows"] = nlohmann::json::array();
  std::vector<int64_t> lengths = c.lengths;
  std::sort(lengths.begin(), lengths.end());
  for (int64_t L : lengths)
    for (const auto& mechanism : kMechanisms) {
      // Skip (with a note) what would take too long or need too much memory,
      // extrapolated from this mechanism's shorter lengths.
      std::vector<std::pair<int64_t, double>> times, bytes;
      bool gave_up = false;
      for (const Row& r : rows)
        if (r.mechanism == mechanism) {
          gave_up |= !r.note.empty();
          times.emplace_back(r.L, r.ms / 1e3);
          bytes.emplace_back(r.L, static_cast<double>(r.peak_bytes));
        }
      Row row{mechanism, L};
      const double free = available_bytes();
      if (gave_up) {
        row.note = "a shorter length was skipped";
      } else if (!times.empty() && extrapolate(times, L) > c.max_seconds) {
        row.note = "predicted " + fmt(extrapolate(times, L), 0) + " s per run > --max-seconds";
      } else if (!bytes.empty() && extrapolate(bytes, L) > 0.5 * free) {
        row.note = "predicted " + fmt(extrapolate(bytes, L) / 1073741824.0, 1) +
                   " GiB > half of the " + fmt(free / 1073741824.0, 1) + " GiB available";
      } else {
        try {
          row = measure(c, mechanism, L);
        } catch (const std::bad_alloc&) {
          row.note = "out of memory";
        } catch (const c10::Error& e) {
          row.note = std::string("error: ") + e.what_without_backtrace();
        }
      }
      rows.push_back(row);
      print_row(row);
      nlohmann::json j{{"attention", row.mechanism}, {"L", row.L}};
      if (row.note.empty()) {
        j.update({{"ms", row.ms}, {"us_per_element", 1e3 * row.ms / row.L},
                  {"peak_bytes", row.peak_bytes}, {"bytes_per_element", double(row.peak_bytes) / row.L},
                  {"runs", row.runs}});
      } else {
        j["skipped"] = row.note;
      }
      doc["rows"].push_back(j);
      if (!c.json.empty()) write_json(c.json, doc);  // nothing lost on interrupt
    }

  std::cout << "\nsummary (paper, GPU: clustered faster than full from about 2,000 elements, "
               "improved-clustered from about 3,000)\n";
  for (const std::string m : {"clustered", "improved-clustered"}) {
    const std::string x = crossover(rows, m);
    std::cout << "  crossover " << std::left << std::setw(20) << m << x << "\n";
    doc["summary"]["crossover"][m] = x;
    // Flatness of the cost per element over 4096..32768.
    double lo_t = INFINITY, hi_t = 0, lo_m = INFINITY, hi_m = 0;
    for (const Row& r : rows)
      if (r.mechanism == m && r.note.empty() && r.L >= 4096) {
        lo_t = std::min(lo_t, r.ms / r.L), hi_t = std::max(hi_t, r.ms / r.L);
        lo_m = std::min(lo_m, double(r.peak_bytes) / r.L), hi_m = std::max(hi_m, double(r.peak_bytes) / r.L);
      }
    if (hi_t > 0) {
      std::cout << "  per-element spread (max/min - 1) from L = 4096: time "
                << fmt(100 * (hi_t / lo_t - 1), 0) << "%, memory " << fmt(100 * (hi_m / lo_m - 1), 0)
                << "%\n";
      doc["summary"]["spread_from_4096"][m] = {{"time", hi_t / lo_t - 1}, {"memory", hi_m / lo_m - 1}};
    }
    for (const Row& r : rows)
      for (const Row& e : rows)
        if (r.mechanism == m && e.mechanism == "exact" && r.L == 16384 && e.L == 16384 &&
            r.note.empty() && e.note.empty()) {
          std::cout << "  speed-up over exact at L = 16384: " << fmt(e.ms / r.ms, 1) << "x\n";
          doc["summary"]["speedup_16384"][m] = e.ms / r.ms;
        }
  }
  std::cout << "load average at end " << fmt(load_average(), 2) << "\n";
  doc["config"]["load_average_at_end"] = load_average();
  if (!c.json.empty()) {
    write_json(c.json, doc);
    std::cout << "wrote " << c.json << "\n";
  }
}

// ---------------------------------------------------------------------------
// approx
// ---------------------------------------------------------------------------

struct ApproxConfig {
  int64_t length = 1024, heads = 4, dim = 64, centres = 10, bits = 63, iterations = 10;
  std::vector<int64_t> clusters{10, 25, 50, 100};
  std::vector<int64_t> topk{8, 16, 32, 64};
  int64_t seed = 0;
  int threads = 0;
  std::string json;
};

struct Error {
  double relative;  // ||out - exact||_F / ||exact||_F
  double row_l1;    // mean over queries of ||A'_i - A_i||_1
};

/// The op's attention rows are its output for v = I; its output for v is the other measure.
Error error_of(const ApproxConfig& c, const torch::Tensor& q, const torch::Tensor& k,
               const torch::Tensor& v, const torch::Tensor& exact_out,
               const torch::Tensor& exact_rows, int64_t clusters, int64_t topk) {
  auto o = ClusteredAttentionOptions().clusters(clusters).bits(c.bits).iterations(c.iterations)
               .topk(topk).seed(c.seed);
  auto out = clustered_attention(q, k, v, o).to(torch::kDouble);
  auto eye = torch::eye(k.size(2)).expand({q.size(0), q.size(1), k.size(2), k.size(2)});
  auto rows = clustered_attention(q, k, eye, o).to(torch::kDouble);
  return {((out - exact_out).norm() / exact_out.norm()).item<double>(),
          (rows - exact_rows).abs().sum(-1).mean().item<double>()};
}

void run_approx(const ApproxConfig& c) {
  torch::NoGradGuard no_grad;
  set_num_threads(c.threads);
  const int64_t N = 1, H = c.heads, L = c.length, E = c.dim;
  std::cout << "approximation of exact attention, N = 1, H = " << H << ", L = S = " << L
            << ", E = M = " << E << ", B = " << c.bits << ", " << c.iterations
            << " iterations; relative error of the output (Frobenius) and mean L1 distance of the "
               "attention rows (0..2)\n";
  nlohmann::json doc;
  doc["config"] = {{"H", H}, {"L", L}, {"E", E}, {"bits", c.bits}, {"iterations", c.iterations},
                   {"centres", c.centres}, {"seed", c.seed}};
  doc["rows"] = nlohmann::json::array();
  for (const std::string inputs : {"random", "clustered-structure"}) {
    torch::manual_seed(c.seed);
    torch::Tensor q;
    if (inputs == "random") {
      q = torch::randn({N, H, L, E});
    } else {  // queries drawn around a few centres
      auto centres = torch::randn({c.centres, E});
      q = centres.index({torch::randint(0, c.centres, {N, H, L}, torch::kLong)}) +
          0.1 * torch::randn({N, H, L, E});
    }
    auto k = torch::randn({N, H, L, E}), v = torch::randn({N, H, L, E});
    auto scores = torch::matmul(q.to(torch::kDouble), k.to(torch::kDouble).transpose(-2, -1)) /
                  std::sqrt(double(E));
    auto exact_rows = torch::softmax(scores, -1);
    auto exact_out = torch::matmul(exact_rows, v.to(torch::kDouble));
    std::cout << "\ninputs: " << inputs << "\n"
              << std::left << std::setw(20) << "attention" << std::right << std::setw(6) << "C"
              << std::setw(6) << "k" << std::setw(12) << "rel_err" << std::setw(12) << "row L1"
              << std::endl;
    for (int64_t C : c.clusters) {
      if (C > L) continue;
      std::vector<int64_t> ks{0};
      for (int64_t k_ : c.topk)
        if (k_ <= L) ks.push_back(k_);
      for (int64_t topk : ks) {
        const Error e = error_of(c, q, k, v, exact_out, exact_rows, C, topk);
        const std::string name = topk == 0 ? "clustered" : "improved-clustered";
        std::cout << std::left << std::setw(20) << name << std::right << std::setw(6) << C
                  << std::setw(6) << (topk ? std::to_string(topk) : "-") << std::setw(12)
                  << fmt(e.relative, 4) << std::setw(12) << fmt(e.row_l1, 4) << std::endl;
        doc["rows"].push_back({{"inputs", inputs}, {"attention", name}, {"clusters", C},
                               {"topk", topk}, {"rel_err", e.relative}, {"row_l1", e.row_l1}});
      }
    }
  }
  if (!c.json.empty()) {
    write_json(c.json, doc);
    std::cout << "\nwrote " << c.json << "\n";
  }
}

}  // namespace

void add_figure_clustered_command(CLI::App& app) {
  auto c = std::make_shared<FigureConfig>();
  auto lengths = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand(
      "figure-clustered",
      "The clustered-attention paper, Figure 4, on the CPU: forward+backward time and "
      "memory per element vs length for exact, clustered and improved-clustered attention");
  cmd->add_option("--lengths", *lengths, "Comma list of lengths L = S (default: 1024,...,32768)");
  cmd->add_option("--heads", c->heads, "Heads H")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--dim", c->dim, "Head dimension E = M")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--clusters", c->clusters, "Clusters C")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--bits", c->bits, "Hash bits B")->check(CLI::Range(1, 63))->capture_default_str();
  cmd->add_option("--iterations", c->iterations, "K-means iterations")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--topk", c->topk, "Top keys k of improved-clustered")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--repeats", c->repeats, "Timed runs after a warm-up (median); a first run over 10 s is the only one")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--max-seconds", c->max_seconds, "Skip runs predicted to take longer than this")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--threads", c->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", c->json, "Also write the results to this JSON file");
  cmd->callback([=] {
    FigureConfig config = *c;
    if (!lengths->empty()) config.lengths = parse_lengths("--lengths", *lengths);
    run_figure(config);
  });
}

void add_approx_command(CLI::App& app) {
  auto c = std::make_shared<ApproxConfig>();
  auto clusters = std::make_shared<std::string>(), topk = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand(
      "approx",
      "Relative output error and attention-row L1 distance of clustered and improved-clustered "
      "attention vs exact, on random and clustered-structure inputs, as C and k vary");
  cmd->add_option("--length", c->length, "Length L = S")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", c->heads, "Heads H")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--dim", c->dim, "Head dimension E = M")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--clusters", *clusters, "Comma list of cluster counts (default: 10,25,50,100)");
  cmd->add_option("--topk", *topk, "Comma list of top-key counts (default: 8,16,32,64)");
  cmd->add_option("--centres", c->centres, "Centres of the clustered-structure queries")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--seed", c->seed, "Seed of the inputs and of the clustering")->capture_default_str();
  cmd->add_option("--threads", c->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", c->json, "Also write the results to this JSON file");
  cmd->callback([=] {
    ApproxConfig config = *c;
    if (!clusters->empty()) config.clusters = parse_lengths("--clusters", *clusters);
    if (!topk->empty()) config.topk = parse_lengths("--topk", *topk);
    run_approx(config);
  });
}

}  // namespace attnkit::cli
