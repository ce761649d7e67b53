// `attnkit-experiments figure-clustered`: Figure 4 of the clustered-attention paper on the
// CPU: forward+backward time and memory per sequence element vs length, for
// mechanisms of the registry named by spec strings (default: full, clustered
// and improved-clustered with the registry's defaults, which are the paper's
// C = 100, B = 63, 10 iterations, k = 32). Each mechanism runs its functional
// form (MechanismInfo::run) on its own random inputs (MechanismInfo::sample).
#include <attnkit/nn/registry.h>
#include <attnkit/runtime.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "commands.h"

namespace attnkit::cli {

namespace {

using Mechanism = std::pair<const nn::MechanismInfo*, nn::MechanismSpec>;

struct ClusteredFigureConfig {
  std::vector<int64_t> lengths{1024, 2048, 4096, 8192, 16384, 32768};
  std::vector<std::string> attention{"full", "clustered", "improved-clustered"};
  int64_t heads = 8, head_dim = 64;
  int repeats = 5;
  int threads = 0;
  double max_seconds = 300;  // skip a run predicted to take longer
  std::string json;
};

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

struct Row {
  std::string mechanism;  // the spec as written canonically, e.g. "clustered:clusters=50"
  int64_t L = 0;
  double ms = 0;           // median forward+backward
  int64_t peak_bytes = 0;  // above the inputs
  int runs = 0;
  std::string note;  // non-empty: skipped, and why
};

/// One forward+backward: returns its seconds and the peak bytes it added.
std::pair<double, int64_t> forward_backward(const Mechanism& m, const nn::MechanismInputs& x) {
  const auto& [info, spec] = m;
  const int64_t held = memory::current_bytes();
  memory::reset_peak();
  const double t0 = wall_now_ms();
  {
    auto out = info->run(x, nn::AttendArgs{}, spec);
    out.backward(torch::ones_like(out));
  }
  const double s = (wall_now_ms() - t0) / 1e3;
  const int64_t peak = memory::peak_bytes() - held;
  for (const auto& t : x)
    if (t.grad().defined()) t.mutable_grad().reset();
  return {s, peak};
}

Row measure(const ClusteredFigureConfig& c, const Mechanism& m, int64_t L) {
  Row r{m.second.str(), L};
  torch::manual_seed(0);
  const nn::AttentionShape shape{1, c.heads, L, L, c.head_dim, c.head_dim};
  nn::MechanismInputs x = m.first->sample(shape, torch::kFloat);
  for (auto& t : x) t.requires_grad_();
  // The first run warms up; when it is long, it is also the measurement.
  auto [first, peak] = forward_backward(m, x);
  std::vector<double> times{first};
  if (first < 10.0) {
    times.clear();
    for (int rep = 0; rep < c.repeats; ++rep) {
      auto [s, p] = forward_backward(m, x);
      times.push_back(s);
      peak = std::max(peak, p);
    }
  }
  r.ms = 1e3 * median(times);
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

void print_row(const Row& r, int width) {
  std::cout << std::left << std::setw(width) << r.mechanism << std::right << std::setw(7) << r.L;
  if (!r.note.empty()) {
    std::cout << "   skipped: " << r.note << std::endl;
    return;
  }
  std::cout << std::setw(12) << fmt(r.ms, 1) << std::setw(14) << fmt(1e3 * r.ms / r.L, 2)
            << std::setw(12) << fmt(r.peak_bytes / 1048576.0, 1) << std::setw(14)
            << fmt(r.peak_bytes / 1024.0 / r.L, 2) << std::setw(6) << r.runs << std::endl;
}

/// The length at which `mechanism` becomes faster than `baseline` (full
/// attention) for good: the geometric interpolation of the two measured
/// lengths around the last sign change of log(t_mech / t_full). Text for the
/// report.
std::string crossover(const std::vector<Row>& rows, const std::string& mechanism,
                      const std::string& baseline) {
  std::vector<std::pair<int64_t, double>> ratio;  // (L, log(t_mech / t_full))
  for (const Row& m : rows) {
    if (m.mechanism != mechanism || !m.note.empty()) continue;
    for (const Row& e : rows)
      if (e.mechanism == baseline && e.L == m.L && e.note.empty())
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

/// Crossover, flatness of the cost per element from L = 4096, and speed-up at
/// L = 16384 of every mechanism against `baseline`; printed and added to doc.
void summarise(const std::vector<Mechanism>& mechanisms, const std::vector<Row>& rows,
               const std::string& baseline, int width, nlohmann::json& doc) {
  std::cout << "\nsummary (paper, GPU: clustered faster than full from about 2,000 elements, "
               "improved-clustered from about 3,000)\n";
  for (const auto& mechanism : mechanisms) {
    const std::string m = mechanism.second.str();
    if (m == baseline) continue;
    const std::string x = crossover(rows, m, baseline);
    std::cout << "  crossover " << std::left << std::setw(width) << m << x << "\n";
    doc["summary"]["crossover"][m] = x;
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
        if (r.mechanism == m && e.mechanism == baseline && r.L == 16384 && e.L == 16384 &&
            r.note.empty() && e.note.empty()) {
          std::cout << "  speed-up over " << baseline << " at L = 16384: " << fmt(e.ms / r.ms, 1) << "x\n";
          doc["summary"]["speedup_16384"][m] = e.ms / r.ms;
        }
  }
}

/// The row of (mechanism, L): measured, or skipped with a note when it would
/// take too long or need too much memory, extrapolated from the mechanism's
/// shorter lengths.
Row measure_or_skip(const ClusteredFigureConfig& c, const Mechanism& mechanism, int64_t L,
                    const std::vector<Row>& rows) {
  const std::string name = mechanism.second.str();
  std::vector<std::pair<int64_t, double>> times, bytes;
  bool gave_up = false;
  for (const Row& r : rows)
    if (r.mechanism == name) {
      gave_up |= !r.note.empty();
      times.emplace_back(r.L, r.ms / 1e3);
      bytes.emplace_back(r.L, static_cast<double>(r.peak_bytes));
    }
  Row row{name, L};
  const double free = available_bytes();
  if (gave_up) {
    row.note = "a shorter length was skipped";
  } else if (!times.empty() && extrapolate(times, L) > c.max_seconds) {
    row.note = "predicted " + fmt(extrapolate(times, L), 0) + " s per run > --max-seconds";
  } else if (!bytes.empty() && extrapolate(bytes, L) > 0.5 * free) {
    row.note = "predicted " + fmt(extrapolate(bytes, L) / 1073741824.0, 1) + " GiB > half of the " +
               fmt(free / 1073741824.0, 1) + " GiB available";
  } else {
    try {
      row = measure(c, mechanism, L);
    } catch (const std::bad_alloc&) {
      row.note = "out of memory";
    } catch (const c10::Error& e) {
      row.note = std::string("error: ") + e.what_without_backtrace();
    }
  }
  return row;
}

void run_clustered_figure(const ClusteredFigureConfig& c) {
  memory::install_counting_allocator();
  set_num_threads(c.threads);
  at::set_num_threads(num_threads());
  const std::vector<Mechanism> mechanisms = resolve_specs("--attention", c.attention);
  std::string baseline;  // the first full attention of the list: what the summary compares with
  int width = 20;        // of the attention column
  for (const auto& [info, spec] : mechanisms) {
    if (info->name == "full" && baseline.empty()) baseline = spec.str();
    width = std::max(width, static_cast<int>(spec.str().size()) + 2);
  }

  std::cout << "the clustered-attention paper, Figure 4, on the CPU: N = 1, H = " << c.heads
            << ", E = M = " << c.head_dim << ", threads " << num_threads() << ", load average "
            << fmt(load_average(), 2) << " at start\n";
  nlohmann::json doc;
  doc["config"] = {{"N", 1}, {"H", c.heads}, {"E", c.head_dim}, {"attention", nlohmann::json::array()},
                   {"threads", num_threads()}, {"load_average_at_start", load_average()}};
  for (const auto& [info, spec] : mechanisms) {
    std::cout << "  " << spec_with_defaults(*info, spec) << "\n";
    doc["config"]["attention"].push_back(spec_with_defaults(*info, spec));
  }
  std::cout << "\n"
            << std::left << std::setw(width) << "attention" << std::right << std::setw(7) << "L"
            << std::setw(12) << "fwd+bwd ms" << std::setw(14) << "us/element" << std::setw(12)
            << "peak MiB" << std::setw(14) << "KiB/element" << std::setw(6) << "runs" << std::endl;

  std::vector<Row> rows;
  doc["rows"] = nlohmann::json::array();
  std::vector<int64_t> lengths = c.lengths;
  std::sort(lengths.begin(), lengths.end());
  for (int64_t L : lengths)
    for (const auto& mechanism : mechanisms) {
      const Row row = measure_or_skip(c, mechanism, L, rows);
      rows.push_back(row);
      print_row(row, width);
      nlohmann::json j{{"attention", row.mechanism}, {"L", row.L}};
      if (row.note.empty()) {
        j.update({{"ms", row.ms}, {"us_per_element", 1e3 * row.ms / row.L},
                  {"peak_bytes", row.peak_bytes}, {"bytes_per_element", double(row.peak_bytes) / row.L},
                  {"runs", row.runs}});
      } else {
        j["skipped"] = row.note;
      }
      doc["rows"].push_back(j);
      if (!c.json.empty()) write_json_atomically(c.json, doc);  // nothing lost on interrupt
    }

  if (baseline.empty())
    std::cout << "\nno summary: --attention has no full attention to compare with\n";
  else
    summarise(mechanisms, rows, baseline, width, doc);
  std::cout << "load average at end " << fmt(load_average(), 2) << "\n";
  doc["config"]["load_average_at_end"] = load_average();
  write_json_report(c.json, doc);
}

}  // namespace

void add_figure_clustered_command(CLI::App& app) {
  auto c = std::make_shared<ClusteredFigureConfig>();
  auto lengths = std::make_shared<std::string>();
  auto attention = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand(
      "figure-clustered",
      "The clustered-attention paper, Figure 4, on the CPU: forward+backward time and "
      "memory per element vs length for full, clustered and improved-clustered attention");
  cmd->add_option("--lengths", *lengths, "Comma list of lengths L = S (default: 1024,...,32768)");
  cmd->add_option("--attention", *attention,
                  "Comma list of mechanism specs NAME[:key=value,...] (default: full,clustered,"
                  "improved-clustered, the registry's defaults = the paper's C = 100, B = 63, "
                  "10 iterations, k = 32; `attnkit mechanisms` lists the options)");
  cmd->add_option("--heads", c->heads, "Heads H")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--head-dim", c->head_dim, "Head dimension E = M")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--repeats", c->repeats, "Timed runs after a warm-up (median); a first run over 10 s is the only one")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--max-seconds", c->max_seconds, "Skip runs predicted to take longer than this")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--threads", c->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", c->json, "Also write the results to this JSON file");
  cmd->callback([=] {
    ClusteredFigureConfig config = *c;
    if (!lengths->empty()) config.lengths = parse_positive_list("--lengths", *lengths);
    if (!attention->empty()) config.attention = split_specs(*attention);
    resolve_specs("--attention", config.attention);  // refuse a bad spec before any work
    run_clustered_figure(config);
  });
}

}  // namespace attnkit::cli
