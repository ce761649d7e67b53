// `attnkit-experiments approx`: how far mechanisms of the registry are from full (exact
// softmax) attention, on random queries and on queries with cluster
// structure. By default the clustered-attention paper's question: clustered
// and improved-clustered attention as the clusters C and top keys k vary.
//
// Two measures per mechanism, both against full attention's float64
// definition (the registry's `reference` of "full"): the relative Frobenius
// error of the output, and the mean L1 distance of the attention rows, which
// are the mechanism's output for v = I (0 = identical rows, 2 = disjoint).
//
// With --run, the same measures also on a trained model's real inputs: the
// queries, keys and values that each layer's multi-head self-attention
// receives on the first sequences of a split, next to random inputs of the
// model's shape (heads, head width, context).
#include <attnkit/nn/registry.h>
#include <attnkit/runtime.h>
#include <attnkit/train/trainer.h>

#include <algorithm>
#include <array>
#include <functional>
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
  int64_t length = 1024, heads = 4, head_dim = 64, centres = 10;
  std::vector<std::string> attention;  // empty: the sweep below
  std::vector<int64_t> clusters{10, 25, 50, 100};
  std::vector<int64_t> topk{8, 16, 32, 64};
  int64_t seed = 0;
  int threads = 0;
  std::string json;
  // --run: a trained model's inputs, from its first `sequences` sequences of `split`.
  std::string run, split = "test";
  int64_t sequences = 8;
};

/// The per-head q, k, v of every multi-head self-attention layer of a trained
/// run on its first `sequences` sequences of `split` (eval mode, no autograd).
struct LayerInputs {
  int64_t layer;
  torch::Tensor q, k, v;
};

std::vector<LayerInputs> model_inputs(const ApproxConfig& c, train::LoadedRun& run) {
  const auto split = tasks::split_from_string(c.split);
  const auto batches = run.task->eval_batches(split, c.sequences, run.trainer.context());
  if (batches.empty()) throw CLI::ValidationError("--split", "the run's " + c.split + " split is empty");
  std::vector<LayerInputs> layers;
  run.model->set_attention_probe(
      [&](int64_t layer, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
        // Grouped-query heads reach a grouped mechanism as they are; the
        // mechanisms compared here may not read groups: full heads for all.
        const int64_t group = q.size(1) / k.size(1);
        auto full_heads = [group](const torch::Tensor& x) {
          return (group > 1 ? x.repeat_interleave(group, 1) : x).contiguous();
        };
        layers.push_back({layer, q.contiguous(), full_heads(k), full_heads(v)});
      });
  run.model->eval();
  run.model->forward(batches.front().input);
  run.model->set_attention_probe({});
  if (layers.empty())
    throw CLI::ValidationError("--run", "'" + c.run + "' has no multi-head self-attention layer "
                                        "(relative-position and agglomerative blocks are not compared)");
  return layers;
}

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
  const int64_t N = 1, H = c.heads, L = c.length, E = c.head_dim;
  if (inputs == "random") return torch::randn({N, H, L, E});
  auto centres = torch::randn({c.centres, E});
  return centres.index({torch::randint(0, c.centres, {N, H, L}, torch::kLong)}) +
         0.1 * torch::randn({N, H, L, E});
}

void run_approx(const ApproxConfig& config) {
  torch::NoGradGuard no_grad;
  set_num_threads(config.threads);

  // A trained model's inputs, per layer; the random inputs then take its shape.
  ApproxConfig c = config;
  std::vector<LayerInputs> layers;
  nlohmann::json model_doc;
  if (!c.run.empty()) {
    auto run = train::load_run(c.run);
    layers = model_inputs(c, run);
    const auto& q = layers.front().q;
    c.heads = q.size(1);
    c.length = q.size(2);
    c.head_dim = q.size(3);
    model_doc = {{"run", c.run}, {"checkpoint", run.checkpoint}, {"step", run.step},
                 {"task", run.task->name()}, {"trained_attention", run.model_options.attention()},
                 {"split", c.split}, {"sequences", q.size(0)}};
  }

  const std::vector<Mechanism> mechanisms =
      resolve_specs("--attention", c.attention.empty() ? sweep_specs(c) : c.attention);
  for (const auto& m : mechanisms) check_comparable(m);
  const auto& full = nn::find_mechanism("full");
  const nn::MechanismSpec full_spec{"full", {}};

  int width = 20;  // of the attention column
  for (const auto& m : mechanisms)
    width = std::max(width, static_cast<int>(row_name(m.second).size()) + 2);

  // Input sets: (name, a function making q, k, v); random ones from the seed.
  std::vector<std::pair<std::string, std::function<std::array<torch::Tensor, 3>()>>> sets;
  for (const std::string inputs : {"random", "clustered-structure"}) {
    sets.emplace_back(inputs, [&c, inputs] {
      torch::manual_seed(c.seed);
      auto q = queries(c, inputs);
      auto k = torch::randn({1, c.heads, c.length, c.head_dim}), v = torch::randn({1, c.heads, c.length, c.head_dim});
      return std::array<torch::Tensor, 3>{q, k, v};
    });
  }
  for (const auto& l : layers)
    sets.emplace_back("layer " + std::to_string(l.layer),
                      [&l] { return std::array<torch::Tensor, 3>{l.q, l.k, l.v}; });

  const int64_t N = 1, H = c.heads, L = c.length, E = c.head_dim;
  if (!c.run.empty())
    std::cout << "trained model " << c.run << " (" << model_doc["checkpoint"].get<std::string>()
              << "): the inputs of its self-attention layers on the first "
              << layers.front().q.size(0) << " sequences of its " << c.split << " split\n";
  std::cout << "approximation of full attention, N = 1, H = " << H << ", L = S = " << L
            << ", E = M = " << E
            << "; relative error of the output (Frobenius) and mean L1 distance of the "
               "attention rows (0..2); options not shown take the registry's defaults "
               "(attnkit mechanisms)\n";
  nlohmann::json doc;
  doc["config"] = {{"H", H}, {"L", L}, {"E", E}, {"centres", c.centres}, {"seed", c.seed}};
  if (!c.run.empty()) doc["model"] = model_doc;
  doc["rows"] = nlohmann::json::array();
  for (const auto& [inputs, make] : sets) {
    const auto [q, k, v] = make();
    // Full attention in float64: its output, and its rows as its output for v = I.
    const auto q64 = q.to(torch::kDouble), k64 = k.to(torch::kDouble);
    const auto eye64 = torch::eye(k.size(2), torch::kDouble).expand({q.size(0), q.size(1), k.size(2), k.size(2)});
    const auto full_out = full.reference({q64, k64, v.to(torch::kDouble)}, {}, full_spec);
    const auto full_rows = full.reference({q64, k64, eye64}, {}, full_spec);
    std::cout << "\ninputs: " << inputs << (q.size(0) > 1 ? " (" + std::to_string(q.size(0)) + " sequences)" : "") << "\n"
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
  cmd->add_option("--head-dim", c->head_dim, "Head dimension E = M")->check(CLI::PositiveNumber)->capture_default_str();
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
  auto* run = cmd->add_option("--run", c->run,
                              "Also compare on a trained run's real inputs (attnkit train --out): the "
                              "q, k, v of each multi-head self-attention layer; --length, --heads and "
                              "--head-dim then come from the run");
  for (const char* shape : {"--length", "--heads", "--head-dim"}) cmd->get_option(shape)->excludes(run);
  cmd->add_option("--split", c->split, "--run: the split whose first sequences are used")
      ->check(CLI::IsMember({"valid", "test"}))->capture_default_str();
  cmd->add_option("--sequences", c->sequences, "--run: how many sequences")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->callback([=] {
    ApproxConfig config = *c;
    if (!attention->empty()) config.attention = split_specs(*attention);
    if (!clusters->empty()) config.clusters = parse_positive_list("--clusters", *clusters);
    if (!topk->empty()) config.topk = parse_positive_list("--topk", *topk);
    if (config.run.empty() && config.attention.empty() && sweep_specs(config).empty())
      throw CLI::ValidationError("--clusters", "every cluster count exceeds --length " +
                                                   std::to_string(config.length));
    run_approx(config);
  });
}

}  // namespace attnkit::cli
