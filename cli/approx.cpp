// `attnkit approx`: how far mechanisms of the registry are from full (exact
// softmax) attention, on random queries and on queries with cluster
// structure. By default the clustered-attention paper's question: clustered
// and improved-clustered attention as the clusters C and top keys k vary.
//
// Two measures per mechanism, both against full attention's float64
// definition (the registry's `reference` of "full"): the relative Frobenius
// error of the output, and the mean L1 distance of the attention rows, which
// are the mechanism's output for v = I (0 = identical rows, 2 = disjoint).
#include <attnkit/nn/registry.h>
#include <attnkit/runtime.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "commands.h"

namespace attnkit::cli {

namespace {

using Mechanism = std::pair<const nn::MechanismInfo*, nn::MechanismSpec>;

struct ApproxConfig {
  int64_t length = 1024, heads = 4, dim = 64, centres = 10;
  std::vector<std::string> attention;  // empty: the sweep below
  std::vector<int64_t> clusters{10, 25, 50, 100};
  std::vector<int64_t> topk{8, 16, 32, 64};
  int64_t seed = 0;
  int threads = 0;
  std::string json;
};

/// The default sweep as specs: for every C <= L, clustered with C clusters and
/// improved-clustered with C clusters and each k <= L top keys.
std::vector<std::string> sweep_specs(const ApproxConfig& c) {
  std::vector<std::string> specs;
  for (int64_t C : c.clusters) {
    if (C > c.length) continue;
    specs.push_back("clustered:clusters=" + std::to_string(C));
    for (int64_t k : c.topk)
      if (k <= c.length)
        specs.push_back("improved-clustered:clusters=" + std::to_string(C) + ",topk=" + std::to_string(k));
  }
  return specs;
}

/// Refuses mechanisms approx cannot compare: it needs the functional form on
/// q, k, v and values of another width than the keys (v = I gives the rows).
void check_comparable(const Mechanism& m) {
  const auto& [info, spec] = m;
  if (info->inputs != std::vector<std::string>{"q", "k", "v"} || !info->supports.value_dim)
    throw CLI::ValidationError("--attention", "'" + spec.str() +
                                                  "': approx compares mechanisms on q, k, v with "
                                                  "values of any width (v = I gives the rows)");
}

struct Error {
  double relative;  // ||out - full||_F / ||full||_F
  double row_l1;    // mean over queries of ||A'_i - A_i||_1
};

Error error_of(const Mechanism& m, const torch::Tensor& q, const torch::Tensor& k,
               const torch::Tensor& v, const torch::Tensor& full_out, const torch::Tensor& full_rows) {
  const auto& [info, spec] = m;
  auto out = info->run({q, k, v}, {}, spec).to(torch::kDouble);
  auto eye = torch::eye(k.size(2)).expand({q.size(0), q.size(1), k.size(2), k.size(2)});
  auto rows = info->run({q, k, eye}, {}, spec).to(torch::kDouble);
  return {((out - full_out).norm() / full_out.norm()).item<double>(),
          (rows - full_rows).abs().sum(-1).mean().item<double>()};
}

/// The table's name of a mechanism: its spec without the options that have
/// columns of their own (clusters, topk).
std::string row_name(const nn::MechanismSpec& spec) {
  nn::MechanismSpec shown{spec.name, {}};
  for (const auto& kv : spec.options)
    if (kv.first != "clusters" && kv.first != "topk") shown.options.push_back(kv);
  return shown.str();
}

/// The queries of one input set: i.i.d. N(0, 1), or a few centres ~ N(0, 1)
/// plus N(0, 0.1^2) noise.
torch::Tensor queries(const ApproxConfig& c, const std::string& inputs) {
  const int64_t N = 1, H = c.heads, L = c.length, E = c.dim;
  if (inputs == "random") return torch::randn({N, H, L, E});
  auto centres = torch::randn({c.centres, E});
  return centres.index({torch::randint(0, c.centres, {N, H, L}, torch::kLong)}) +
         0.1 * torch::randn({N, H, L, E});
}

void run_approx(const ApproxConfig& c) {
  torch::NoGradGuard no_grad;
  set_num_threads(c.threads);
  const std::vector<Mechanism> mechanisms =
      resolve_specs("--attention", c.attention.empty() ? sweep_specs(c) : c.attention);
  for (const auto& m : mechanisms) check_comparable(m);
  const auto& full = nn::find_mechanism("full");
  const nn::MechanismSpec full_spec{"full", {}};

  int width = 20;  // of the attention column
  for (const auto& m : mechanisms)
    width = std::max(width, static_cast<int>(row_name(m.second).size()) + 2);

  const int64_t N = 1, H = c.heads, L = c.length, E = c.dim;
  std::cout << "approximation of full attention, N = 1, H = " << H << ", L = S = " << L
            << ", E = M = " << E
            << "; relative error of the output (Frobenius) and mean L1 distance of the "
               "attention rows (0..2); options not shown take the registry's defaults "
               "(attnkit mechanisms)\n";
  nlohmann::json doc;
  doc["config"] = {{"H", H}, {"L", L}, {"E", E}, {"centres", c.centres}, {"seed", c.seed}};
  doc["rows"] = nlohmann::json::array();
  for (const std::string inputs : {"random", "clustered-structure"}) {
    torch::manual_seed(c.seed);
    const auto q = queries(c, inputs);
    const auto k = torch::randn({N, H, L, E}), v = torch::randn({N, H, L, E});
    // Full attention in float64: its output, and its rows as its output for v = I.
    const auto q64 = q.to(torch::kDouble), k64 = k.to(torch::kDouble);
    const auto eye64 = torch::eye(L, torch::kDouble).expand({N, H, L, L});
    const auto full_out = full.reference({q64, k64, v.to(torch::kDouble)}, {}, full_spec);
    const auto full_rows = full.reference({q64, k64, eye64}, {}, full_spec);
    std::cout << "\ninputs: " << inputs << "\n"
              << std::left << std::setw(width) << "attention" << std::right << std::setw(6) << "C"
              << std::setw(6) << "k" << std::setw(12) << "rel_err" << std::setw(12) << "row L1"
              << std::endl;
    for (const auto& m : mechanisms) {
      const auto& [info, spec] = m;
      const Error e = error_of(m, q, k, v, full_out, full_rows);
      const std::string clusters = option_value(*info, spec, "clusters");
      const std::string topk = option_value(*info, spec, "topk");
      std::cout << std::left << std::setw(width) << row_name(spec) << std::right << std::setw(6)
                << (clusters.empty() ? "-" : clusters) << std::setw(6) << (topk.empty() ? "-" : topk)
                << std::setw(12) << fmt(e.relative, 4) << std::setw(12) << fmt(e.row_l1, 4)
                << std::endl;
      // topk 0: no top keys (clustered); clusters null: not a clustered mechanism.
      doc["rows"].push_back(
          {{"inputs", inputs},
           {"attention", info->name},
           {"spec", spec_with_defaults(*info, spec)},
           {"clusters", clusters.empty() ? nlohmann::json(nullptr) : nlohmann::json(std::stoll(clusters))},
           {"topk", topk.empty() ? int64_t{0} : std::stoll(topk)},
           {"rel_err", e.relative},
           {"row_l1", e.row_l1}});
    }
  }
  if (!c.json.empty()) std::cout << "\n";
  write_json_report(c.json, doc);
}

}  // namespace

void add_approx_command(CLI::App& app) {
  auto c = std::make_shared<ApproxConfig>();
  auto attention = std::make_shared<std::string>();
  auto clusters = std::make_shared<std::string>(), topk = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand(
      "approx",
      "Relative output error and attention-row L1 distance of clustered and improved-clustered "
      "attention (or any --attention specs) vs full attention, on random and "
      "clustered-structure inputs, as C and k vary");
  cmd->add_option("--length", c->length, "Length L = S")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", c->heads, "Heads H")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--dim", c->dim, "Head dimension E = M")->check(CLI::PositiveNumber)->capture_default_str();
  auto* specs = cmd->add_option(
      "--attention", *attention,
      "Comma list of mechanism specs NAME[:key=value,...] to compare with full attention "
      "(default: the sweep of --clusters and --topk)");
  cmd->add_option("--clusters", *clusters,
                  "Sweep: comma list of cluster counts C of clustered:clusters=C and "
                  "improved-clustered:clusters=C,topk=k (default: 10,25,50,100)")
      ->excludes(specs);
  cmd->add_option("--topk", *topk, "Sweep: comma list of top-key counts k (default: 8,16,32,64)")
      ->excludes(specs);
  cmd->add_option("--centres", c->centres, "Centres of the clustered-structure queries")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--seed", c->seed,
                  "Seed of the inputs (the clustering's seed is the spec's option seed, default 0)")
      ->capture_default_str();
  cmd->add_option("--threads", c->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", c->json, "Also write the results to this JSON file");
  cmd->callback([=] {
    ApproxConfig config = *c;
    if (!attention->empty()) config.attention = split_specs(*attention);
    if (!clusters->empty()) config.clusters = parse_positive_list("--clusters", *clusters);
    if (!topk->empty()) config.topk = parse_positive_list("--topk", *topk);
    if (config.attention.empty() && sweep_specs(config).empty())
      throw CLI::ValidationError("--clusters", "every cluster count exceeds --length " +
                                                   std::to_string(config.length));
    run_approx(config);
  });
}

}  // namespace attnkit::cli
