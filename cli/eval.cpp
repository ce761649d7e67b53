// `attnkit eval`: a trained run's metric on a split, with its own attention or
// with another mechanism swapped into every block (or one per block) behind
// the same trained weights.
#include <attnkit/nn/registry.h>
#include <attnkit/runtime.h>
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/trainer.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.h"

namespace attnkit::cli {

namespace {

struct EvalFlags {
  std::string run, split = "valid", json;
  std::vector<std::string> attention;
  int64_t batch = 0, context = 0, max_batches = 0;
  int threads = 0;
};

}  // namespace

void add_eval_command(CLI::App& app) {
  auto f = std::make_shared<EvalFlags>();
  auto* cmd = app.add_subcommand("eval", "Evaluate a trained run (its newest checkpoint) on a split, "
                                         "optionally with another attention mechanism swapped in");
  cmd->add_option("--run", f->run, "Run directory (attnkit train --out)")->required();
  cmd->add_option("--attention", f->attention,
                  "Mechanism spec for every block instead of the trained one; repeat once per block "
                  "for one spec per block")
      ->allow_extra_args(false);
  cmd->add_option("--split", f->split, "valid or test")->check(CLI::IsMember({"valid", "test"}))->capture_default_str();
  cmd->add_option("--batch", f->batch, "Sequences per batch (default: the run's)")->check(CLI::PositiveNumber);
  cmd->add_option("--context", f->context, "Tokens per sequence (default: the run's)")->check(CLI::PositiveNumber);
  cmd->add_option("--max-batches", f->max_batches, "Evaluate only the first N batches (0: the whole split)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--threads", f->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", f->json, "Also write the result to this JSON file (atomically)");
  cmd->callback([f] {
    if (f->threads > 0) {
      set_num_threads(f->threads);
      at::set_num_threads(f->threads);
    }
    auto run = train::load_run(f->run);
    const auto trained = run.model_options.attention();
    if (!f->attention.empty()) run.model->set_attention(f->attention);
    const int64_t batch = f->batch > 0 ? f->batch : run.trainer.batch();
    const int64_t context = f->context > 0 ? f->context : run.trainer.context();
    const auto split = tasks::split_from_string(f->split);
    const auto start = std::chrono::steady_clock::now();
    train::StructureStats structure;
    const bool sac = static_cast<bool>(run.model->edge_predictor());
    const auto m = train::evaluate(run.model, *run.task, split, batch, context, f->max_batches,
                                   sac ? &structure : nullptr);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto positions = static_cast<int64_t>(m.positions);
    const auto& used = f->attention.empty() ? trained : f->attention;
    std::string attention;
    for (const auto& s : used) attention += (attention.empty() ? "" : " | ") + s;
    std::printf("%s (step %lld), attention %s%s: %s %s %.4f (loss %.4f nats over %.0f scored tokens)\n",
                run.checkpoint.c_str(), static_cast<long long>(run.step), attention.c_str(),
                f->attention.empty() ? " (trained)" : " (swapped in)", f->split.c_str(),
                run.task->metric_name().c_str(), run.task->metric(m), m.loss(), m.scored);
    std::printf("%.2f s for %lld positions: %.2f us per position\n", seconds,
                static_cast<long long>(positions), 1e6 * seconds / static_cast<double>(positions));
    // A fixed sparse pattern: its edges per node over the sequence (and the
    // nodes the pattern adds), for comparisons at equal edge counts.
    double pattern_edges_per_node = 0;
    const auto [info, spec] = nn::resolve_mechanism(used.front());
    if (!sac && used.size() == 1 && info->edges) {
      const int64_t nodes = models::attention_nodes(info->name, run.task->sequence_length(context));
      const auto edges = info->edges(nodes, spec);
      pattern_edges_per_node = static_cast<double>(edges.num_edges()) / static_cast<double>(nodes);
      std::printf("pattern %s: %.2f edges per node over %lld nodes\n", info->name.c_str(), pattern_edges_per_node,
                  static_cast<long long>(nodes));
    }
    const bool partners = structure.partner_rows > 0;
    if (sac) {
      std::printf("SAC structures (%s): %.2f edges per node (self-edges included)",
                  run.model->sac_options().decode == "sample" ? "sampled" : "beam search", structure.edges_per_node());
      if (partners)
        std::printf("; %.1f%% of the scored positions see their partner, %.1f%% of their predicted edges "
                    "point at it",
                    100 * structure.partner_recall(), 100 * structure.partner_precision());
      std::printf("\n");
    }
    if (!f->json.empty()) {
      nlohmann::json doc = {{"run", f->run},
                            {"checkpoint", run.checkpoint},
                            {"step", run.step},
                            {"task", run.task->name()},
                            {"split", f->split},
                            {"trained_attention", trained},
                            {"attention", used},
                            {"swapped", !f->attention.empty()},
                            {"batch", batch},
                            {"context", context},
                            {"metric", run.task->metric_name()},
                            {"value", run.task->metric(m)},
                            {"loss", m.loss()},
                            {"bpc", m.bits()},
                            {"accuracy", m.accuracy()},
                            {"scored", m.scored},
                            {"seconds", seconds},
                            {"positions", positions},
                            {"threads", num_threads()}};
      if (pattern_edges_per_node > 0) doc["structure"] = {{"edges_per_node", pattern_edges_per_node}};
      if (sac) {
        doc["structure"] = {{"edges_per_node", structure.edges_per_node()},
                            {"decode", run.model->sac_options().decode}};
        if (partners) {
          doc["structure"]["partner_recall"] = structure.partner_recall();
          doc["structure"]["partner_precision"] = structure.partner_precision();
        }
      }
      train::write_file_atomically(f->json, doc.dump(2) + "\n");
    }
  });
}

}  // namespace attnkit::cli
