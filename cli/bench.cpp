// `attnkit bench`: time any set of mechanisms and implementations over a list of
// lengths; print a table and optionally write the results as JSON.
//
// Implementations: `fast` is the attnkit op a user calls; `reference` is the
// float-generic composite of src/reference; `torch` is the plain libtorch
// matmul-softmax-matmul a user would write (exact attention only).
#include <attnkit/nn/multihead.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "commands.h"
#include "kernels/common/gemm.h"
#include "reference/reference.h"

namespace attnkit::cli {

namespace {

struct BenchConfig {
  std::vector<std::string> attention{"full", "linear", "causal-linear", "agglomerative",
                                     "clustered", "improved-clustered", "sparse-local"};
  std::vector<std::string> impl{"fast", "torch"};
  std::vector<std::string> pass{"forward"};
  std::vector<int64_t> lengths{256, 1024};
  int64_t batch = 1, heads = 8, dim = 64;
  bool causal = false;
  int threads = 0;
  int repeats = 3;
  int64_t clusters = 100, bits = 63, topk = 32, pattern_param = 32;
  int64_t exact_check_limit = int64_t{1} << 25;  // N*H*L*S up to which rel_err is computed
  std::string json;
};

struct Inputs {
  torch::Tensor q, k, v;          // (N,H,L,E), (N,H,S,E), (N,H,S,M)
  torch::Tensor cq, cr;           // agglomerative class weights (N,H,L), (N,H,S)
  torch::Tensor alpha, beta;      // gated-linear (N,H,L)
};

struct Result {
  std::string attention, impl, pass;
  int64_t N, H, L, S, E, M;
  bool causal;
  int threads;
  double ms = 0;
  c10::optional<double> gflops;
  int64_t peak_bytes = 0;
  c10::optional<double> rel_err;
  std::string note;  // non-empty: the run did not happen (why)
};

const std::vector<std::string>& known_attention() {
  static const std::vector<std::string> names = [] {
    // The registry's names plus the two bench-only ones, each once.
    std::vector<std::string> n{"gated-linear", "agglomerative"};
    for (const auto& m : nn::mechanism_names())
      if (std::find(n.begin(), n.end(), m) == n.end()) n.push_back(m);
    return n;
  }();
  return names;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

bool uses_qkv(const std::string& a) { return a != "agglomerative" && a != "gated-linear"; }

Inputs make_inputs(const BenchConfig& c, const std::string& attention, int64_t L) {
  torch::manual_seed(0);
  const int64_t N = c.batch, H = c.heads, E = c.dim, S = L;
  Inputs in;
  if (attention == "agglomerative") {
    in.cq = torch::softmax(torch::randn({N, L, H}), -1).permute({0, 2, 1});
    in.cr = torch::softmax(torch::randn({N, S, H}), -1).permute({0, 2, 1});
    in.v = torch::randn({N, H, S, E});
  } else if (attention == "gated-linear") {
    // The seed's form: alpha = beta = 1, f = sigmoid(gate) * h, read out by q.
    in.k = torch::sigmoid(torch::randn({N, H, L, E})) * torch::randn({N, H, L, E}) / std::sqrt(double(E));
    in.q = torch::randn({N, H, L, E}) / std::sqrt(double(E));
    in.alpha = torch::ones({N, H, L});
    in.beta = torch::ones({N, H, L});
  } else {
    in.q = torch::randn({N, H, L, E});
    in.k = torch::randn({N, H, S, E});
    in.v = torch::randn({N, H, S, E});
  }
  return in;
}

/// The plain libtorch composite a user would write for exact attention.
torch::Tensor torch_composite(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, bool causal) {
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  if (causal) {
    const int64_t L = q.size(2), S = k.size(2);
    auto mask = torch::ones({L, S}, torch::kBool).triu(S - L + 1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  return torch::matmul(torch::softmax(scores, -1), v);
}

/// Runs one mechanism with one implementation; undefined tensor if unsupported.
torch::Tensor run(const BenchConfig& c, const std::string& a, const std::string& impl,
                  const Inputs& in, std::string* why_not) {
  const bool causal = c.causal;
  if (impl == "torch") {
    if (a == "full") return torch_composite(in.q, in.k, in.v, causal);
    *why_not = "torch composite exists for full only";
    return {};
  }
  const bool ref = impl == "reference";
  if (a == "agglomerative") {
    auto o = AgglomerativeOptions().causal(causal);
    return ref ? reference::agglomerative_attention(in.cq, in.cr, in.v, o)
               : agglomerative_attention(in.cq, in.cr, in.v, o);
  }
  if (a == "gated-linear") {
    auto o = GatedLinearAttentionOptions().causal(causal);
    return ref ? reference::gated_linear_attention(in.k, in.q, in.alpha, in.beta, o)
               : gated_linear_attention(in.k, in.q, in.alpha, in.beta, o);
  }
  if ((a == "clustered" || a == "improved-clustered") && causal) {
    *why_not = "no causal form";
    return {};
  }
  if (a.rfind("sparse-", 0) == 0 && causal) {
    *why_not = "causal flag not applicable (choose a causal pattern)";
    return {};
  }
  auto m = nn::MechanismOptions()
               .name(a)
               .clusters(c.clusters)
               .bits(c.bits)
               .topk(c.topk)
               .pattern_param(c.pattern_param)
               .feature_map(FeatureMap::elu)
               .normalize(true);
  if (!ref) return nn::attend(m, in.q, in.k, in.v, causal);
  // The reference of each registry mechanism, with the settings attend() uses.
  const int64_t L = in.q.size(2), S = in.k.size(2);
  if (a == "full")
    return reference::softmax_attention(in.q, in.k, in.v, SoftmaxAttentionOptions().causal(causal));
  if (a == "linear" || a == "causal-linear")
    return reference::linear_attention(
        in.q, in.k, in.v,
        LinearAttentionOptions().feature_map(FeatureMap::elu).normalize(true).causal(causal || a == "causal-linear"));
  if (a == "clustered" || a == "improved-clustered")
    return reference::clustered_attention(
        in.q, in.k, in.v,
        ClusteredAttentionOptions().clusters(std::min(c.clusters, L)).bits(c.bits)
            .topk(a == "clustered" ? 0 : std::min(c.topk, S)));
  return reference::sparse_attention(in.q, in.k, in.v, nn::pattern_edges(a.substr(7), L, c.pattern_param),
                                     SparseAttentionOptions());
}

c10::optional<double> flops(const std::string& a, const std::string& pass, int64_t N, int64_t H,
                            int64_t L, int64_t S, int64_t E, int64_t M, bool causal) {
  double f;
  if (a == "full") {
    f = 2.0 * N * H * L * S * (E + M) * (causal ? 0.5 : 1.0);  // 4 L S E per head when E = M
  } else if (a == "linear" || a == "causal-linear") {
    f = 2.0 * N * H * (S * E * M + L * E * M);
  } else {
    return c10::nullopt;
  }
  return pass == "forward" ? f : 3.5 * f;  // backward counted as 2.5x forward
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

Result measure(const BenchConfig& c, const std::string& a, const std::string& impl,
               const std::string& pass, int64_t L) {
  Result r{a, impl, pass, c.batch, c.heads, L, L, c.dim, c.dim, c.causal, num_threads()};
  Inputs in = make_inputs(c, a, L);
  const bool backward = pass == "forward_backward";
  auto prepare = [&](torch::Tensor& t) {
    if (t.defined()) t = t.detach().requires_grad_(backward);
  };
  for (auto* t : {&in.q, &in.k, &in.v, &in.cq, &in.cr}) prepare(*t);

  std::vector<double> times;
  torch::Tensor out;
  const int64_t held_before = memory::current_bytes();
  int64_t peak = 0;
  try {
    for (int rep = 0; rep <= c.repeats; ++rep) {  // rep 0 warms up
      memory::reset_peak();
      const auto t0 = std::chrono::steady_clock::now();
      std::string why_not;
      {
        torch::AutoGradMode grad_mode(backward);
        out = run(c, a, impl, in, &why_not);
        if (!out.defined()) {
          r.note = why_not;
          return r;
        }
        if (backward) out.backward(torch::ones_like(out));
      }
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      peak = std::max(peak, memory::peak_bytes() - held_before);
      if (rep > 0) times.push_back(ms);
      for (auto* t : {&in.q, &in.k, &in.v, &in.cq, &in.cr})
        if (t->defined() && t->grad().defined()) t->mutable_grad().reset();
      if (rep < c.repeats) out.reset();
    }
  } catch (const std::bad_alloc&) {
    r.note = "out of memory";
    return r;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    r.note = msg.find("alloc") != std::string::npos ? "out of memory" : "error: " + msg.substr(0, 120);
    return r;
  }
  r.ms = median(times);
  r.peak_bytes = peak;
  if (auto f = flops(a, pass, r.N, r.H, r.L, r.S, r.E, r.M, r.causal)) r.gflops = *f / (r.ms * 1e6);
  // Relative error of the output against exact attention in float64 on the same inputs.
  if (uses_qkv(a) && r.N * r.H * r.L * r.S <= c.exact_check_limit) {
    torch::NoGradGuard no_grad;
    auto exact = reference::softmax_attention(in.q.detach().to(torch::kDouble), in.k.detach().to(torch::kDouble),
                                              in.v.detach().to(torch::kDouble),
                                              SoftmaxAttentionOptions().causal(c.causal));
    r.rel_err = ((out.detach().to(torch::kDouble) - exact).norm() / exact.norm()).item<double>();
  }
  return r;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

void check_choices(const char* option, const std::vector<std::string>& got,
                   const std::vector<std::string>& allowed) {
  for (const auto& g : got) {
    if (std::find(allowed.begin(), allowed.end(), g) != allowed.end()) continue;
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    throw CLI::ValidationError(option, "unknown value '" + g + "'; expected one of: " + list);
  }
}

std::string fmt(double x, int precision) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(precision) << x;
  return o.str();
}

void print_header(double peak) {
  std::cout << "sgemm peak (this process, " << num_threads() << " thread(s)): " << fmt(peak, 1)
            << " GFLOP/s\n\n"
            << std::left << std::setw(20) << "attention" << std::setw(10) << "impl" << std::setw(18)
            << "pass" << std::right << std::setw(7) << "L" << std::setw(11) << "ms" << std::setw(10)
            << "GFLOP/s" << std::setw(8) << "%peak" << std::setw(11) << "peak MiB" << std::setw(11)
            << "rel_err" << "\n";
}

void print_row(const Result& r, double peak) {
  std::cout << std::left << std::setw(20) << r.attention << std::setw(10) << r.impl << std::setw(18)
            << r.pass << std::right << std::setw(7) << r.L;
  if (!r.note.empty()) {
    std::cout << "   skipped: " << r.note << "\n";
    return;
  }
  std::cout << std::setw(11) << fmt(r.ms, 2) << std::setw(10) << (r.gflops ? fmt(*r.gflops, 1) : "-")
            << std::setw(8) << (r.gflops ? fmt(100.0 * *r.gflops / peak, 0) : "-") << std::setw(11)
            << fmt(r.peak_bytes / 1048576.0, 1) << std::setw(11)
            << (r.rel_err ? fmt(*r.rel_err, 6) : "-") << "\n";
}

nlohmann::json to_json(const Result& r) {
  nlohmann::json j{{"attention", r.attention}, {"impl", r.impl}, {"pass", r.pass},
                   {"N", r.N}, {"H", r.H}, {"L", r.L}, {"S", r.S}, {"E", r.E}, {"M", r.M},
                   {"causal", r.causal}, {"threads", r.threads}, {"ms", r.ms},
                   {"peak_bytes", r.peak_bytes}};
  j["gflops"] = r.gflops ? nlohmann::json(*r.gflops) : nlohmann::json(nullptr);
  j["rel_err_vs_exact"] = r.rel_err ? nlohmann::json(*r.rel_err) : nlohmann::json(nullptr);
  return j;
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

void run_bench(const BenchConfig& c) {
  memory::install_counting_allocator();
  set_num_threads(c.threads);
  at::set_num_threads(num_threads());  // the torch composite gets the same threads
  const double peak = kernels::measure_sgemm_gflops();
  print_header(peak);

  nlohmann::json doc;
  doc["machine"] = {{"cpu", cpu_name()}, {"threads", num_threads()}, {"sgemm_gflops", peak}};
  doc["results"] = nlohmann::json::array();
  for (int64_t L : c.lengths)
    for (const auto& a : c.attention)
      for (const auto& impl : c.impl)
        for (const auto& pass : c.pass) {
          if (impl == "torch" && a != "full") continue;  // nothing to compare
          Result r = measure(c, a, impl, pass, L);
          print_row(r, peak);
          if (r.note.empty()) doc["results"].push_back(to_json(r));
          if (!c.json.empty()) write_json_atomically(c.json, doc);  // nothing lost on interrupt
        }
  if (!c.json.empty()) std::cout << "\nwrote " << c.json << "\n";
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto config = std::make_shared<BenchConfig>();
  auto attention = std::make_shared<std::string>();
  auto impl = std::make_shared<std::string>();
  auto pass = std::make_shared<std::string>();
  auto lengths = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand("bench", "Time attention mechanisms over sequence lengths");
  std::string names;
  for (const auto& n : known_attention()) names += (names.empty() ? "" : ", ") + n;
  cmd->add_option("--attention", *attention,
                  "Comma list of mechanisms (default: full,linear,causal-linear,agglomerative,"
                  "clustered,improved-clustered,sparse-local). Known: " + names);
  cmd->add_option("--impl", *impl, "Comma list of fast, reference, torch (default: fast,torch)");
  cmd->add_option("--pass", *pass, "Comma list of forward, forward_backward (default: forward)");
  cmd->add_option("--lengths", *lengths, "Comma list of sequence lengths L = S (default: 256,1024)");
  cmd->add_option("--batch", config->batch, "Batch size N")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", config->heads, "Heads H")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--dim", config->dim, "Head dimension E = M")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_flag("--causal", config->causal, "Causal masking");
  cmd->add_option("--threads", config->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--repeats", config->repeats, "Timed repeats after one warm-up (median reported)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--clusters", config->clusters, "Clusters for clustered mechanisms")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--topk", config->topk, "Top keys for improved-clustered")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--pattern-param", config->pattern_param, "Span / segment / stride of sparse patterns")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--json", config->json, "Also write the results to this JSON file");
  cmd->callback([=] {
    BenchConfig c = *config;
    if (!attention->empty()) c.attention = split_list(*attention);
    if (!impl->empty()) c.impl = split_list(*impl);
    if (!pass->empty()) c.pass = split_list(*pass);
    if (!lengths->empty()) {
      c.lengths.clear();
      for (const auto& s : split_list(*lengths)) {
        int64_t L = 0;
        try {
          size_t used = 0;
          L = std::stoll(s, &used);
          if (used != s.size()) L = 0;
        } catch (const std::exception&) {
        }
        if (L <= 0) throw CLI::ValidationError("--lengths", "'" + s + "' is not a positive integer");
        c.lengths.push_back(L);
      }
    }
    check_choices("--attention", c.attention, known_attention());
    check_choices("--impl", c.impl, {"fast", "reference", "torch"});
    check_choices("--pass", c.pass, {"forward", "forward_backward"});
    run_bench(c);
  });
}

}  // namespace attnkit::cli
