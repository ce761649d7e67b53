// `attnkit-experiments figure-agglomerative`: Figure 1 of the agglomerative-attention paper
// with our layers. Times
// the forward pass of one whole self-attention layer, projections included,
// for nn::AgglomerativeAttention and nn::MultiheadAttention (mechanism "full",
// the exact kernel), without and with the causal mask, over doubling lengths,
// by default as in the paper: batch 32, d = 512, 8 heads / classes, one thread.
//
// `--part attention` times the attention alone instead, on the inputs the
// layers give it (the registry's "agglomerative" against the multi-head
// layer's "full" mechanism), which separates the mechanisms from the
// projections both layers share.
//
// Times are process CPU time by default (`--clock`): on a machine shared with
// other jobs it leaves out the waits for a core they hold, which wall time
// counts; with one thread on an idle machine the two agree. The JSON keeps
// both clocks for every call.
//
// Each (mask, length) row is printed as soon as both layers are timed, and the
// JSON and CSV files are rewritten atomically after every row, so an
// interrupted run keeps everything it measured. experiments/plot-figure turns the
// CSV into the log-log plot.
#include <attnkit/nn/agglomerative_attention.h>
#include <attnkit/nn/multihead.h>
#include <attnkit/nn/registry.h>
#include <attnkit/runtime.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "bench_util.h"
#include "commands.h"

namespace attnkit::cli {

namespace {

// The length range of the linearity target (docs/PERFORMANCE.md, "Agglomerative attention").
constexpr int64_t kFitFrom = 512, kFitTo = 4096;

struct AgglomerativeFigureConfig {
  std::vector<int64_t> lengths{32, 64, 128, 256, 512, 1024, 2048, 4096};
  std::vector<std::string> masks{"full", "masked"};
  std::vector<std::string> layers{"agglomerative", "multihead"};
  std::string part = "layer";  // or "attention"
  std::string clock = "cpu";   // or "wall"
  int64_t batch = 32, width = 512, heads = 8;
  int threads = 1;
  int repeats = 5;
  std::string json, csv;
};

struct Timing {
  std::string layer, mask;
  int64_t L = 0;
  std::vector<double> wall_ms, cpu_ms;   // one per timed repeat
  double median = 0, mean = 0, sem = 0;  // of the chosen clock; sem: standard error of the mean
  double load = 0;                       // 1-minute load average after the run
};

/// One warm-up call, then `repeats` timed calls on both clocks (wall and
/// process CPU time); the summary statistics are of `clock`.
template <class Run>
Timing time_calls(const Run& run, int repeats, const std::string& clock) {
  Timing t;
  run();
  for (int r = 0; r < repeats; ++r) {
    const double cpu0 = process_cpu_now_ms(), wall0 = wall_now_ms();
    run();
    t.wall_ms.push_back(wall_now_ms() - wall0);
    t.cpu_ms.push_back(process_cpu_now_ms() - cpu0);
  }
  const std::vector<double>& ms = clock == "cpu" ? t.cpu_ms : t.wall_ms;
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  t.median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  for (double x : ms) t.mean += x / n;
  if (n > 1) {
    double var = 0;
    for (double x : ms) var += (x - t.mean) * (x - t.mean) / (n - 1);
    t.sem = std::sqrt(var / n);
  }
  t.load = load_average();
  return t;
}

const Timing* find(const std::vector<Timing>& rows, const std::string& layer, const std::string& mask,
                   int64_t L) {
  for (const auto& r : rows)
    if (r.layer == layer && r.mask == mask && r.L == L) return &r;
  return nullptr;
}

/// Least-squares slope of log(median) against log(L) over kFitFrom..kFitTo.
nlohmann::json fitted_slope(const std::vector<Timing>& rows, const std::string& layer,
                            const std::string& mask) {
  std::vector<std::pair<double, double>> pts;
  for (const auto& r : rows)
    if (r.layer == layer && r.mask == mask && r.L >= kFitFrom && r.L <= kFitTo)
      pts.emplace_back(std::log(double(r.L)), std::log(r.median));
  if (pts.size() < 2) return nullptr;
  double mx = 0, my = 0;
  for (auto [x, y] : pts) mx += x / pts.size(), my += y / pts.size();
  double sxy = 0, sxx = 0;
  for (auto [x, y] : pts) sxy += (x - mx) * (y - my), sxx += (x - mx) * (x - mx);
  return sxy / sxx;
}

/// Where the agglomerative layer overtakes the exact one for good: the last
/// measured length at which it is not faster and the next (faster) one, with
/// the crossing interpolated linearly in log-log between them.
nlohmann::json crossover(const std::vector<Timing>& rows, const AgglomerativeFigureConfig& c, const std::string& mask) {
  std::vector<std::tuple<int64_t, double>> ratio;  // (L, agglomerative / multihead)
  for (int64_t L : c.lengths) {
    const Timing* a = find(rows, "agglomerative", mask, L);
    const Timing* m = find(rows, "multihead", mask, L);
    if (a && m) ratio.emplace_back(L, a->median / m->median);
  }
  if (ratio.empty()) return nullptr;
  std::sort(ratio.begin(), ratio.end());
  nlohmann::json j;
  int64_t last_slower = -1;
  for (size_t k = 0; k < ratio.size(); ++k)
    if (std::get<1>(ratio[k]) >= 1) last_slower = static_cast<int64_t>(k);
  if (last_slower < 0) {
    j["note"] = "agglomerative faster at every measured length, from " +
                std::to_string(std::get<0>(ratio[0]));
    j["length"] = nullptr;
  } else if (last_slower + 1 == static_cast<int64_t>(ratio.size())) {
    j["note"] = "agglomerative not faster at the longest measured length";
    j["length"] = nullptr;
  } else {
    auto [La, ra] = ratio[last_slower];
    auto [Lb, rb] = ratio[last_slower + 1];
    const double la = std::log(double(La)), lb = std::log(double(Lb));
    const double f = std::log(ra) / (std::log(ra) - std::log(rb));
    j["length"] = std::exp(la + f * (lb - la));
    j["between"] = {La, Lb};
  }
  auto [Lmax, rmax] = ratio.back();
  j["speedup_at_longest"] = {{"L", Lmax}, {"speedup", 1.0 / rmax}};
  return j;
}

nlohmann::json summary(const std::vector<Timing>& rows, const AgglomerativeFigureConfig& c) {
  nlohmann::json s;
  for (const auto& mask : c.masks) {
    nlohmann::json m;
    for (const auto& layer : c.layers)
      m["slope_" + layer] = fitted_slope(rows, layer, mask);
    m["crossover"] = crossover(rows, c, mask);
    s[mask] = m;
  }
  s["fit_range"] = {kFitFrom, kFitTo};
  return s;
}

std::string joined(const std::vector<std::string>& items) {
  std::string s;
  for (const auto& x : items) s += (s.empty() ? "" : ",") + x;
  return s;
}

/// The command line that reproduces this run.
std::string command_line(const AgglomerativeFigureConfig& c) {
  std::ostringstream o;
  o << "attnkit-experiments figure-agglomerative --lengths ";
  for (size_t k = 0; k < c.lengths.size(); ++k) o << (k ? "," : "") << c.lengths[k];
  o << " --masks " << joined(c.masks) << " --layers " << joined(c.layers) << " --part " << c.part
    << " --clock " << c.clock << " --batch " << c.batch
    << " --width " << c.width << " --heads " << c.heads << " --threads " << c.threads
    << " --repeats " << c.repeats;
  if (!c.json.empty()) o << " --json " << c.json;
  if (!c.csv.empty()) o << " --csv " << c.csv;
  return o.str();
}

void write_outputs(const AgglomerativeFigureConfig& c, const std::vector<Timing>& rows) {
  if (!c.json.empty()) {
    nlohmann::json doc;
    doc["command"] = command_line(c);
    doc["machine"] = {{"cpu", cpu_model()}, {"isa", isa_description()}, {"threads", num_threads()}};
    doc["config"] = {{"part", c.part}, {"clock", c.clock}, {"batch", c.batch}, {"width", c.width}, {"heads", c.heads},
                     {"repeats", c.repeats}, {"pass", "forward, no autograd"}};
    doc["rows"] = nlohmann::json::array();
    for (const auto& r : rows)
      doc["rows"].push_back({{"layer", r.layer}, {"mask", r.mask}, {"L", r.L},
                             {"wall_ms", r.wall_ms}, {"cpu_ms", r.cpu_ms}, {"median_ms", r.median},
                             {"mean_ms", r.mean}, {"sem_ms", r.sem}, {"load_1min", r.load}});
    doc["summary"] = summary(rows, c);
    write_json_atomically(c.json, doc);
  }
  if (!c.csv.empty()) {
    std::ostringstream o;
    o << "# " << command_line(c) << "\n";
    o << "layer,mask,L,median_ms,mean_ms,sem_ms,repeats,load_1min,clock\n";
    for (const auto& r : rows)
      o << r.layer << "," << r.mask << "," << r.L << "," << r.median << "," << r.mean << "," << r.sem
        << "," << r.wall_ms.size() << "," << r.load << "," << c.clock << "\n";
    write_text_atomically(c.csv, o.str());
  }
}

std::string cell(const Timing* t) {
  if (!t) return "-";
  std::ostringstream o;
  o << std::fixed << std::setprecision(2) << t->median << " +- " << std::setprecision(2) << t->sem;
  return o.str();
}

/// What one timed call runs: a whole layer, or the attention of a layer on
/// the inputs the layer would give it.
class Subjects {
 public:
  explicit Subjects(const AgglomerativeFigureConfig& c)
      : c_(c),
        agglomerative_(nn::AgglomerativeAttentionOptions(c.width, c.heads)),
        agglomerative_attention_(nn::resolve_mechanism("agglomerative")),
        multihead_(nn::MultiheadAttentionOptions(c.width, c.heads)) {
    agglomerative_->eval();
    multihead_->eval();
  }

  /// New random inputs of length L.
  void prepare(int64_t L) {
    const int64_t N = c_.batch, H = c_.heads, w = c_.width / c_.heads;
    x_ = torch::randn({N, L, c_.width});
    if (c_.part == "layer") return;
    // The layers' layouts: classes / heads interleaved within each row.
    auto classes = [&] { return torch::softmax(torch::randn({N, L, H}), -1).transpose(1, 2); };
    auto heads = [&] { return torch::randn({N, L, H, w}).transpose(1, 2); };
    cq_ = classes();
    cr_ = classes();
    q_ = heads();
    k_ = heads();
    v_ = heads();
  }

  void run(const std::string& layer, bool causal) {
    if (c_.part == "layer") {
      if (layer == "agglomerative")
        agglomerative_->forward(x_, {}, causal);
      else
        multihead_->forward(x_, x_, x_, {}, causal);
    } else if (layer == "agglomerative") {
      const auto& [info, spec] = agglomerative_attention_;
      info->run({cq_, cr_, v_}, nn::AttendArgs{causal, {}}, spec);
    } else {
      multihead_->attention->forward(q_, k_, v_, nn::AttendArgs{causal, {}});
    }
  }

 private:
  const AgglomerativeFigureConfig& c_;
  nn::AgglomerativeAttention agglomerative_;
  std::pair<const nn::MechanismInfo*, nn::MechanismSpec> agglomerative_attention_;
  nn::MultiheadAttention multihead_;
  torch::Tensor x_, cq_, cr_, q_, k_, v_;
};

void run_agglomerative_figure(const AgglomerativeFigureConfig& c) {
  set_num_threads(c.threads);
  at::set_num_threads(num_threads());  // the layers' projections get the same threads
  torch::NoGradGuard no_grad;          // the paper times the layer output alone
  torch::manual_seed(0);
  Subjects subjects(c);

  std::cout << command_line(c) << "\n"
            << "cpu: " << cpu_model() << ", isa: " << isa_description() << ", threads: " << num_threads() << ", load: " << load_average()
            << "\nforward " << c.clock << " ms of the " << c.part << " (median +- standard error of "
            << c.repeats << " repeats)\n\n"
            << std::left << std::setw(8) << "mask" << std::right << std::setw(7) << "L" << std::setw(22)
            << "agglomerative" << std::setw(22) << "multihead (full)" << std::setw(10) << "speed-up"
            << std::setw(7) << "load" << std::endl;
  std::vector<Timing> rows;
  for (int64_t L : c.lengths) {
    subjects.prepare(L);
    for (const auto& mask : c.masks) {
      const bool causal = mask == "masked";
      for (const auto& layer : c.layers) {
        Timing t = time_calls([&] { subjects.run(layer, causal); }, c.repeats, c.clock);
        t.layer = layer;
        t.mask = mask;
        t.L = L;
        rows.push_back(t);
        write_outputs(c, rows);
      }
      const Timing* a = find(rows, "agglomerative", mask, L);
      const Timing* m = find(rows, "multihead", mask, L);
      std::ostringstream speedup;
      if (a && m) speedup << std::fixed << std::setprecision(2) << m->median / a->median << "x";
      std::cout << std::left << std::setw(8) << mask << std::right << std::setw(7) << L << std::setw(22)
                << cell(a) << std::setw(22) << cell(m) << std::setw(10) << (a && m ? speedup.str() : "-")
                << std::setw(7) << std::setprecision(2) << std::fixed << rows.back().load << std::endl;
    }
  }
  std::cout << "\nsummary (slopes of log time vs log L over " << kFitFrom << ".." << kFitTo
            << "):\n" << summary(rows, c).dump(2) << "\n";
  if (!c.json.empty()) std::cout << "wrote " << c.json << "\n";
  if (!c.csv.empty()) std::cout << "wrote " << c.csv << "\n";
}

}  // namespace

void add_figure_agglomerative_command(CLI::App& app) {
  auto c = std::make_shared<AgglomerativeFigureConfig>();
  auto* cmd = app.add_subcommand(
      "figure-agglomerative",
      "The agglomerative-attention paper, Figure 1: whole-layer forward time of "
      "agglomerative vs exact multi-head attention over sequence lengths");
  cmd->add_option("--lengths", c->lengths, "Comma list of sequence lengths")
      ->delimiter(',')->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--masks", c->masks, "Comma list of full, masked (causal)")
      ->delimiter(',')->check(CLI::IsMember({"full", "masked"}))->capture_default_str();
  cmd->add_option("--layers", c->layers, "Comma list of agglomerative, multihead")
      ->delimiter(',')->check(CLI::IsMember({"agglomerative", "multihead"}))->capture_default_str();
  cmd->add_option("--part", c->part,
                  "What to time: the whole layer, or its attention alone on the layer's inputs")
      ->check(CLI::IsMember({"layer", "attention"}))->capture_default_str();
  cmd->add_option("--clock", c->clock,
                  "Time to report: cpu (process CPU time: waiting for a core that other jobs hold "
                  "does not count; for one thread on an idle machine it equals wall) or wall")
      ->check(CLI::IsMember({"cpu", "wall"}))->capture_default_str();
  cmd->add_option("--batch", c->batch, "Batch size")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--width", c->width, "Model width d")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", c->heads, "Heads of the exact layer = classes of the agglomerative one")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--threads", c->threads, "Threads (the paper: one CPU core)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--repeats", c->repeats, "Timed repeats after one warm-up")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--json", c->json, "Write the results and summary to this JSON file");
  cmd->add_option("--csv", c->csv, "Write one line per (layer, mask, length) to this CSV file");
  cmd->callback([c] {
    if (c->width % c->heads != 0)
      throw CLI::ValidationError("--width",
                                 "must be a multiple of --heads (" + std::to_string(c->heads) + ")");
    run_agglomerative_figure(*c);
  });
}

}  // namespace attnkit::cli
