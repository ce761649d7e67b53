// `attnkit-experiments node-classify`: trains a graph attention network
// (models/graph_attention.h) on a node-classification dataset
// (tasks/node_graph.h; scripts/package-graph writes one) into a run directory:
//   OUT/checkpoint-<epoch>.ckpt  the newest two (train/checkpoint.h's container;
//                                the header holds the run's settings and the
//                                early-stopping state)
//   OUT/metrics.jsonl            one record per --eval-every epochs: training
//                                loss and accuracy, validation and test loss
//                                and accuracy, the structure's edges per node
//                                and the share of its edges that join nodes of
//                                one class, SAC's reward and baseline
//   OUT/result.json              at the end: the test accuracy at the epoch of
//                                the best validation accuracy, and the settings
// Training is transductive and full-batch, as in GAT: an epoch is one optimiser
// step on the whole graph, scored on the train nodes' labels; the same
// evaluation forward scores the valid and the test nodes; the run stops after
// --epochs or when the validation accuracy has not improved (ties broken by
// the lower validation loss) for --patience epochs.
// --resume continues from the newest checkpoint: flags not given are taken from
// it, flags given must match it (except --epochs, --patience, --threads and
// --eval-every). Runs written before --structure existed (their settings hold
// the structure in "attention") resume too.
#include <attnkit/nn/registry.h>
#include <attnkit/runtime.h>
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/clock.h>
#include <attnkit/train/loop.h>
#include <attnkit/train/progress.h>
#include <attnkit/train/run_directory.h>
#include <attnkit/train/signals.h>
#include <attnkit/train/trainer.h>

#include <ATen/Parallel.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "models/graph_attention.h"
#include "run_util.h"
#include "tasks/node_graph.h"

namespace attnkit::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kCommand = "node-classify";
/// What the checkpoints' header says wrote them, so that --resume refuses
/// another program's run.
constexpr const char* kNodeClassifyKind = "attnkit-node-classify";

struct NodeFlags {
  // --structure: the edges attended over; --attention: empty (over the
  // structure's edges) or a mechanism that replaces them (full, sac).
  std::string data, structure = "input", attention, out;
  std::string init_from;  // a run whose network weights start this one (a warm start)
  int64_t epochs = 200, width = 64, heads = 8, layers = 2, samples = 1, patience = 100, eval_every = 1;
  double dropout = 0.6, lr = 0.005, weight_decay = 5e-4, clip = 5.0;
  uint64_t seed = 1;
  int threads = 0;
  bool resume = false, residual = false;
  bool structure_in_attention = false;  // given as --attention input|input+random (the old form)
};

// The settings that define a run, stored in its checkpoints. Keys are the flag
// names without "--" and with '_' for '-'.
json settings(const NodeFlags& f) {
  return json{{"data", f.data},       {"structure", f.structure}, {"attention", f.attention}, {"width", f.width},
              {"heads", f.heads},     {"layers", f.layers},       {"samples", f.samples},
              {"dropout", f.dropout}, {"lr", f.lr},               {"weight_decay", f.weight_decay},
              {"clip", f.clip},       {"seed", f.seed},           {"residual", f.residual},
              {"init_from", f.init_from}};
}

/// A spec of --attention that names a structure (the old form of --structure).
bool names_structure(const std::string& spec) {
  const auto name = spec.substr(0, spec.find(':'));
  return name == "input" || name == "input+random";
}

/// Settings stored before --structure existed hold the structure in
/// "attention" ("input", "input+random:..."; "full" and "sac:..." attended over
/// the input graph): the one place that reads them, as the current settings.
json with_current_names(json s) {
  if (s.contains("structure")) return s;
  const auto attention = s.at("attention").get<std::string>();
  const bool structure = names_structure(attention);
  s["structure"] = structure ? attention : "input";
  s["attention"] = structure ? "" : attention;
  return s;
}

void apply_settings(const json& s, NodeFlags& f) {
  s.at("data").get_to(f.data);
  s.at("structure").get_to(f.structure);
  s.at("attention").get_to(f.attention);
  s.at("width").get_to(f.width);
  s.at("heads").get_to(f.heads);
  s.at("layers").get_to(f.layers);
  s.at("samples").get_to(f.samples);
  s.at("dropout").get_to(f.dropout);
  s.at("lr").get_to(f.lr);
  s.at("weight_decay").get_to(f.weight_decay);
  s.at("clip").get_to(f.clip);
  s.at("seed").get_to(f.seed);
  f.residual = s.value("residual", false);
  f.init_from = s.value("init_from", std::string());
}

experiments::GraphAttentionOptions model_options(const NodeFlags& f, const experiments::NodeGraph& graph) {
  return experiments::GraphAttentionOptions(graph.features.size(1), static_cast<int64_t>(graph.classes.size()))
      .width(f.width)
      .heads(f.heads)
      .layers(f.layers)
      .dropout(f.dropout)
      .structure(f.structure)
      .attention(f.attention)
      .samples(f.samples)
      .residual(f.residual);
}

/// --init-from: the network's weights (all but an edge predictor's) from the
/// newest checkpoint of another node-classify run on the same graph with the
/// same width, heads and layers: SAC warm-started from a trained GAT, as the
/// SAC paper does. torch's generator is left as this run's seed set it.
void warm_start(experiments::GraphAttentionNetwork& model, const NodeFlags& f, const experiments::NodeGraph& graph) {
  const auto checkpoint = train::read_newest_checkpoint(f.init_from);
  TORCH_CHECK(checkpoint.kind() == kNodeClassifyKind, kCommand, ": --init-from: ", checkpoint.path(),
              " is not a checkpoint of `attnkit-experiments node-classify` (kind '", checkpoint.kind(), "')");
  NodeFlags source;
  apply_settings(with_current_names(json::parse(checkpoint.header()).at("settings")), source);
  TORCH_CHECK(source.width == f.width && source.heads == f.heads && source.layers == f.layers, kCommand,
              ": --init-from: ", f.init_from, " has width ", source.width, ", heads ", source.heads, ", layers ",
              source.layers, "; this run ", f.width, ", ", f.heads, ", ", f.layers);
  experiments::GraphAttentionNetwork trained(model_options(source, graph));
  checkpoint.restore(*trained, nullptr, /*restore_generator=*/false);
  const auto weights = trained->named_parameters();
  torch::NoGradGuard no_grad;
  int64_t copied = 0;
  for (auto& p : model->named_parameters()) {
    if (p.key().rfind("edge_predictor.", 0) == 0) continue;
    const auto* q = weights.find(p.key());
    TORCH_CHECK(q && q->sizes() == p.value().sizes(), kCommand, ": --init-from: ", f.init_from, " has ",
                q ? "another shape for" : "no", " parameter '", p.key(), "'");
    p.value().copy_(*q);
    ++copied;
  }
  std::printf("warm start: %lld tensors of the network from %s (epoch %lld)\n", static_cast<long long>(copied),
              checkpoint.path().c_str(), static_cast<long long>(checkpoint.step()));
}

/// What a structure looks like: edges per node (self-edges included), and the
/// share of the edges between two different nodes that join nodes of one class
/// (homophily; the input graph's own share is the reference).
struct StructureSummary {
  double edges_per_node = 0, same_class = 0;
};

StructureSummary summarize(const EdgeList& edges, const torch::Tensor& labels) {
  StructureSummary s;
  if (!edges.offsets.defined()) return s;
  const auto off = edges.offsets.reshape({-1, edges.num_queries() + 1}).contiguous();
  const auto col = edges.columns.contiguous();
  const int64_t* c = col.data_ptr<int64_t>();
  const int64_t* y = labels.data_ptr<int64_t>();
  double rows = 0, all = 0, between = 0, same = 0;
  for (int64_t h = 0; h < off.size(0); ++h) {
    const int64_t* o = off[h].data_ptr<int64_t>();
    for (int64_t i = 0; i < edges.num_queries(); ++i) {
      rows += 1;
      all += static_cast<double>(o[i + 1] - o[i]);
      for (int64_t e = o[i]; e < o[i + 1]; ++e) {
        if (c[e] == i) continue;
        between += 1;
        same += y[c[e]] == y[i];
      }
    }
  }
  s.edges_per_node = rows > 0 ? all / rows : 0;
  s.same_class = between > 0 ? same / between : 0;
  return s;
}

struct Evaluation {
  tasks::Metrics valid, test;
  StructureSummary structure;
};

Evaluation evaluate(experiments::GraphAttentionNetwork& model, const experiments::NodeGraph& graph,
                    const torch::Tensor& distances) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto logits = model->forward(graph.features, graph.edges, distances);
  Evaluation e;
  e.valid = tasks::score(logits, graph.batch(tasks::Split::valid));
  e.test = tasks::score(logits, graph.batch(tasks::Split::test));
  const auto& structures = model->structures();
  e.structure = structures.empty() ? StructureSummary{static_cast<double>(graph.nodes()), 0}
                                   : summarize(structures[0], graph.labels);
  if (structures.empty()) {  // full attention: every pair
    const auto counts = torch::bincount(graph.labels).to(torch::kFloat64);
    const double n = static_cast<double>(graph.nodes());
    e.structure.same_class = ((counts * (counts - 1)).sum().item<double>()) / (n * (n - 1));
  }
  model->train();
  return e;
}

/// The early-stopping state, kept in the checkpoints.
struct Best {
  int64_t epoch = 0;
  double valid_accuracy = -1, valid_loss = 0, test_accuracy = 0, test_loss = 0;
  StructureSummary structure;

  bool improved_by(const Evaluation& e) const {
    return e.valid.accuracy() > valid_accuracy ||
           (e.valid.accuracy() == valid_accuracy && e.valid.loss() < valid_loss);
  }
  json to_json() const {
    return json{{"epoch", epoch},
                {"valid_accuracy", valid_accuracy},
                {"valid_loss", valid_loss},
                {"test_accuracy", test_accuracy},
                {"test_loss", test_loss},
                {"edges_per_node", structure.edges_per_node},
                {"same_class", structure.same_class}};
  }
  static Best from_json(const json& j) {
    Best b;
    j.at("epoch").get_to(b.epoch);
    j.at("valid_accuracy").get_to(b.valid_accuracy);
    j.at("valid_loss").get_to(b.valid_loss);
    j.at("test_accuracy").get_to(b.test_accuracy);
    j.at("test_loss").get_to(b.test_loss);
    j.at("edges_per_node").get_to(b.structure.edges_per_node);
    j.at("same_class").get_to(b.structure.same_class);
    return b;
  }
};

void run(NodeFlags f, CLI::App* cmd) {
  const OpenedRun opened(kCommand, kNodeClassifyKind, f.out, f.resume);
  const std::string resumed_from = opened.resumed_from();
  if (opened.resumed()) {
    const json stored = with_current_names(opened.settings());
    const char* may_change = "--epochs, --patience, --threads and --eval-every";
    check_resume_flags(kCommand, stored, settings(f), *cmd, may_change);
    TORCH_CHECK(!f.structure_in_attention || stored.at("structure") == f.structure, kCommand,
                ": --resume: --structure: checkpoint ", stored.at("structure").dump(), ", now \"", f.structure,
                "\" (only ", may_change, " may change)");
    apply_settings(stored, f);
  }
  TORCH_CHECK(!f.data.empty(), kCommand, ": --data (a dataset directory, e.g. from scripts/package-graph) is required");
  set_threads(f.threads);
  const std::string load_start = train::loadavg_line();
  const double wall_start = train::steady_seconds();

  const auto graph = experiments::load_node_graph(f.data);
  torch::manual_seed(f.seed);
  experiments::GraphAttentionNetwork model(model_options(f, graph));
  if (nn::MechanismSpec::parse(f.structure).name == "input+oracle") model->set_labels(graph.labels);
  // A resumed run's checkpoint holds the weights the warm start gave it, trained since.
  if (!f.init_from.empty() && !opened.resumed()) warm_start(model, f, graph);
  auto& predictor = model->edge_predictor();
  const bool sac = static_cast<bool>(predictor);
  const auto distances = sac && model->sac_options().max_distance > 0
                             ? edges::hop_distances(graph.edges, model->sac_options().max_distance)
                             : torch::Tensor();
  // Adam with L2 weight decay, as GAT trains.
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(f.lr).weight_decay(f.weight_decay));
  std::vector<torch::Tensor> network_params, predictor_params;
  for (const auto& item : model->named_parameters())
    (item.key().rfind("edge_predictor.", 0) == 0 ? predictor_params : network_params).push_back(item.value());

  const int64_t start_epoch = opened.restore(*model, &optimizer);
  const double elapsed_before = opened.elapsed_before();
  Best best = opened.resumed() ? Best::from_json(opened.header().at("best")) : Best{};
  train::RunDirectory dir(f.out, resumed_from, start_epoch);
  const auto metrics = dir.open_log("metrics.jsonl");

  const auto counts = [&](tasks::Split s) { return static_cast<int64_t>(graph.mask(s).sum().item<double>()); };
  std::printf("node-classify: %s, structure %s, attention %s, seed %llu; %lld nodes, %lld edges, %lld features, "
              "%zu classes; train/valid/test %lld/%lld/%lld nodes; %lld parameters; epochs %lld, threads %d%s\n",
              f.data.c_str(), f.structure.c_str(), f.attention.empty() ? "over the structure" : f.attention.c_str(),
              static_cast<unsigned long long>(f.seed),
              static_cast<long long>(graph.nodes()), static_cast<long long>(graph.undirected_edges),
              static_cast<long long>(graph.features.size(1)), graph.classes.size(),
              static_cast<long long>(counts(tasks::Split::train)), static_cast<long long>(counts(tasks::Split::valid)),
              static_cast<long long>(counts(tasks::Split::test)), static_cast<long long>(model->parameter_count()),
              static_cast<long long>(f.epochs), attnkit::num_threads(),
              resumed_from.empty() ? "" : (", resuming " + resumed_from + " at epoch " +
                                            std::to_string(start_epoch)).c_str());
  std::fflush(stdout);

  auto save = [&](int64_t epoch, double elapsed) {
    const json stored{{"kind", kNodeClassifyKind}, {"elapsed", elapsed}, {"settings", settings(f)}, {"best", best.to_json()}};
    return dir.write_checkpoint(epoch, stored.dump(), *model, &optimizer);
  };

  const auto train_batch = graph.batch(tasks::Split::train, sac ? f.samples : 1);
  const double session_start = train::steady_seconds();
  bool early_stop = start_epoch - best.epoch >= f.patience && best.valid_accuracy >= 0;
  tasks::Metrics interval;
  double interval_reward = 0, interval_baseline = 0;
  int64_t interval_steps = 0;
  std::string last_checkpoint;
  train::LoopHooks hooks;
  hooks.finished = [&] { return early_stop; };
  hooks.step = [&](int64_t) {
    const auto logits = model->forward(graph.features, graph.edges, distances);
    auto loss = tasks::loss(logits, train_batch);
    interval += tasks::score(logits.detach(), train_batch);
    if (sac) {
      const auto r = train::sac_reinforce(*predictor, model->sac_structures(), logits.detach(), train_batch,
                                          model->sac_options());
      if (r.surrogate.defined()) loss = loss + r.surrogate;
      interval_reward += r.mean_reward;
      interval_baseline += r.baseline;
    }
    optimizer.zero_grad();
    loss.backward();
    if (f.clip > 0) {
      torch::nn::utils::clip_grad_norm_(network_params, f.clip);
      if (sac) torch::nn::utils::clip_grad_norm_(predictor_params, f.clip);
    }
    optimizer.step();
    ++interval_steps;
    return train::stop_requested();
  };
  // Evaluation, a metrics record and a checkpoint every eval_every epochs, at
  // the end and on a stop; patience counts from the best validation.
  hooks.after_step = [&](const train::StepDone& d) {
    const int64_t epoch = d.done;
    if (epoch % f.eval_every != 0 && !d.last && !d.stopping) return;
    const auto e = evaluate(model, graph, distances);
    if (best.improved_by(e)) {
      best.epoch = epoch;
      best.valid_accuracy = e.valid.accuracy();
      best.valid_loss = e.valid.loss();
      best.test_accuracy = e.test.accuracy();
      best.test_loss = e.test.loss();
      best.structure = e.structure;
    }
    early_stop = epoch - best.epoch >= f.patience;
    const double elapsed = elapsed_before + d.session_seconds;
    json rec{{"step", epoch},
             {"loss", interval.loss()},
             {"accuracy", interval.accuracy()},
             {"valid_loss", e.valid.loss()},
             {"valid_accuracy", e.valid.accuracy()},
             {"test_loss", e.test.loss()},
             {"test_accuracy", e.test.accuracy()},
             {"edges_per_node", e.structure.edges_per_node},
             {"same_class", e.structure.same_class},
             {"elapsed", elapsed}};
    if (sac) {
      rec["sac_reward"] = interval_reward / static_cast<double>(interval_steps);
      rec["sac_baseline"] = interval_baseline / static_cast<double>(interval_steps);
    }
    metrics->append(rec.dump());
    last_checkpoint = save(epoch, elapsed);
    std::printf("epoch %lld/%lld  loss %.4f  train acc %.4f  valid loss %.4f  valid acc %.4f  edges/node %.2f  "
                "same-class %.3f  %s  ETA %s\n",
                static_cast<long long>(epoch), static_cast<long long>(f.epochs), interval.loss(),
                interval.accuracy(), e.valid.loss(), e.valid.accuracy(), e.structure.edges_per_node,
                e.structure.same_class, train::format_duration(elapsed).c_str(),
                train::format_duration(d.eta_seconds).c_str());
    std::fflush(stdout);
    interval = {};
    interval_reward = interval_baseline = 0;
    interval_steps = 0;
  };
  const auto end = train::run_loop(start_epoch, f.epochs, hooks);
  const int64_t epoch = end.done;
  if (end.interrupted && !early_stop) {
    std::printf("%s: stopped by signal %d at epoch %lld; checkpoint %s; the same command with --resume "
                "continues\n",
                kCommand, end.signal, static_cast<long long>(epoch), last_checkpoint.c_str());
    return;
  }
  const double elapsed = elapsed_before + (train::steady_seconds() - session_start);
  const auto input = summarize(graph.edges, graph.labels);
  json result{{"structure", f.structure},
              {"attention", f.attention},
              {"seed", f.seed},
              {"settings", settings(f)},
              {"epochs_run", epoch},
              {"stopped_early", early_stop},
              {"parameters", model->parameter_count()},
              {"nodes", graph.nodes()},
              {"classes", graph.classes},
              {"best", best.to_json()},
              {"test_accuracy", best.test_accuracy},
              {"input_graph", {{"edges_per_node", input.edges_per_node}, {"same_class", input.same_class}}},
              {"train_seconds", elapsed},
              {"seconds_per_epoch", epoch > 0 ? elapsed / static_cast<double>(epoch) : 0.0},
              {"session", session_record(resumed_from, "start_epoch", start_epoch, wall_start, load_start)}};
  const auto result_path = (fs::path(f.out) / "result.json").string();
  train::write_file_atomically(result_path, result.dump(2) + "\n");
  std::printf("%s after %lld epochs%s: best valid accuracy %.4f at epoch %lld, test accuracy there %.4f; %s\n",
              kCommand, static_cast<long long>(epoch), early_stop ? " (early stop)" : "", best.valid_accuracy,
              static_cast<long long>(best.epoch), best.test_accuracy, result_path.c_str());
}

}  // namespace

void add_node_classify_command(CLI::App& app) {
  auto f = std::make_shared<NodeFlags>();
  auto* cmd = app.add_subcommand(
      "node-classify",
      "Train a graph attention network on a node-classification dataset (scripts/package-graph writes one "
      "from the Debian package index) with the input graph's edges (--structure input), random extra edges "
      "(--structure input+random), full attention or SAC's learned edges (--attention full, sac), into a run "
      "directory (checkpoints, metrics.jsonl, result.json). With --resume, "
      "flags not given are taken from the newest checkpoint and flags given must match it (except --epochs, "
      "--patience, --threads and --eval-every)");
  cmd->add_option("--data", f->data, "The dataset directory (nodes.tsv, edges.tsv, vocabulary.txt, meta.json)");
  cmd->add_option("--structure", f->structure,
                  "The edges attended over: input (the graph's edges: GAT), input+random:alpha=A,seed=S (plus A "
                  "random ones per node), input+oracle:seed=S (plus one to a node of the same class: a ceiling) or "
                  "self (each node itself only: the features-only control)")
      ->capture_default_str();
  cmd->add_option("--attention", f->attention,
                  "Not given: attention over the --structure's edges; full (every pair), or sac:alpha=A,... (the "
                  "graph's edges plus the predictor's; options as in `attnkit mechanisms`)");
  cmd->add_option("--init-from", f->init_from,
                  "A node-classify run directory whose network weights (not an edge predictor's) start this run: "
                  "SAC warm-started from a trained GAT");
  cmd->add_option("--epochs", f->epochs, "Full-graph optimiser steps at most")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--patience", f->patience, "Stop when the validation accuracy has not improved for this many epochs")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--eval-every", f->eval_every, "Epochs between evaluations (records, checkpoints)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--seed", f->seed, "Seed of the initial weights, dropout and SAC's sampling")->capture_default_str();
  cmd->add_option("--threads", f->threads, "Threads (default: all cores)")->check(CLI::PositiveNumber);
  cmd->add_option("--out", f->out, "Run directory")->required();
  cmd->add_flag("--resume", f->resume, "Continue the newest checkpoint of --out");
  cmd->add_option("--width", f->width, "Hidden width (heads x per-head width)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", f->heads, "Attention heads")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--layers", f->layers, "Attention layers")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_flag("--residual", f->residual, "Add each layer's input to its output (GAT has none)");
  cmd->add_option("--samples", f->samples, "sac: structures sampled per epoch (REINFORCE's batch)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--dropout", f->dropout, "Dropout on the features and every layer's output")
      ->check(CLI::Range(0.0, 0.99))->capture_default_str();
  cmd->add_option("--lr", f->lr, "Adam learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--weight-decay", f->weight_decay, "Adam's L2 weight decay")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--clip", f->clip, "Gradient-norm bound, the network's and the predictor's separately (0: none)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->callback([f, cmd] {
    // The old form: --attention input|input+random[:...] named the structure.
    if (names_structure(f->attention)) {
      if (cmd->count("--structure") > 0)
        throw CLI::ValidationError("--attention", "'" + f->attention + "' is a structure: give it as --structure");
      std::fprintf(stderr,
                   "attnkit-experiments %s: --attention %s is deprecated, use --structure %s (same meaning)\n",
                   kCommand, f->attention.c_str(), f->attention.c_str());
      f->structure = f->attention;
      f->attention.clear();
      f->structure_in_attention = true;
    }
    run(*f, cmd);
  });
}

}  // namespace attnkit::cli
