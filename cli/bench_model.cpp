// `attnkit bench-model`: the Transformer of src/models as a whole, three ways.
//
//   train     one training step (forward, masked cross-entropy over every
//             position, backward, AdamW) per mechanism: ms/step, tokens/s,
//             model FLOPs and their fraction of the in-process sgemm peak (MFU),
//             and the same model written in plain libtorch as the baseline;
//   generate  tokens/s of Transformer::step for one stream after a context of
//             1k, 4k, 16k tokens (the linear mechanisms should not slow down);
//   memory    the peak memory of one training step against the context length,
//             each measured in a fresh child process (this binary re-run with
//             the hidden --child option) so that no other measurement's heap
//             is in it.
// The FLOP counts, the libtorch baseline and the memory measurement are in
// bench_model_flops.cpp, _baseline.cpp and _memory.cpp (bench_model.h).
#include <ATen/CPUGeneratorImpl.h>
#include <attnkit/models/transformer.h>
#include <attnkit/nn/registry.h>
#include <attnkit/runtime.h>
#include <torch/torch.h>

#include <algorithm>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_model.h"
#include "bench_util.h"
#include "commands.h"

namespace attnkit::cli {

namespace bench_model {

models::TransformerOptions model_options(const ModelConfig& c, const std::string& spec,
                                         int64_t max_length) {
  return models::TransformerOptions(c.vocab)
      .architecture(models::architecture_from_string(c.architecture))
      .layers(c.layers)
      .width(c.width)
      .heads(c.heads)
      .kv_heads(c.kv_heads)
      .ffn(c.ffn)
      .dropout(c.dropout)
      .attention({spec})
      .positions(models::positions_from_string(c.positions))
      .max_length(max_length);
}

bool causal_model(const ModelConfig& c) { return c.architecture == "decoder"; }

LmBatch random_batch(const ModelConfig& c, int64_t batch, int64_t context, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto tokens = torch::randint(c.vocab, {batch, context + 1}, gen, torch::kLong);
  return {tokens.narrow(1, 0, context).contiguous(), tokens.narrow(1, 1, context).contiguous(),
          torch::ones({batch, context})};
}

torch::Tensor masked_cross_entropy(const torch::Tensor& logits, const LmBatch& b) {
  const int64_t V = logits.size(-1);
  auto per_position = torch::nn::functional::cross_entropy(
      logits.reshape({-1, V}), b.target.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  auto w = b.weight.reshape({-1});
  return (per_position * w).sum() / w.sum();
}

torch::optim::AdamW make_optimizer(torch::nn::Module& model) {
  return torch::optim::AdamW(model.parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
}

std::string model_line(const ModelConfig& c) {
  std::ostringstream o;
  o << "model: " << c.architecture << ", " << c.layers << " layers, width " << c.width << ", " << c.heads
    << " heads" << (c.kv_heads > 0 ? " (" + std::to_string(c.kv_heads) + " key/value heads)" : "") << ", ffn " << c.ffn << ", vocab " << c.vocab << ", dropout " << c.dropout << ", "
    << c.positions << " positions\n";
  return o.str();
}

namespace {

bool wants(const ModelConfig& c, const std::string& what) {
  return std::find(c.what.begin(), c.what.end(), what) != c.what.end();
}

std::string millions(int64_t n) { return fmt(n / 1e6, 2) + "M"; }

// --- train ---------------------------------------------------------------------------------

nlohmann::json run_train(const ModelConfig& c, const std::vector<std::string>& specs, MachineRecord& machine) {
  const double tokens = double(c.batch) * c.context;
  std::cout << "== train: one step (forward, masked cross-entropy, backward, AdamW); context " << c.context
            << ", batch " << c.batch << " (" << int64_t(tokens) << " tokens); median of " << c.repeats
            << "\n" << model_line(c);
  std::cout << std::left << std::setw(34) << "attention" << std::right << std::setw(9) << "params"
            << std::setw(11) << "ms/step" << std::setw(11) << "tokens/s" << std::setw(12)
            << "GFLOP/step" << std::setw(9) << "GFLOP/s" << std::setw(7) << "MFU%" << "\n";
  nlohmann::json out;
  out["context"] = c.context;
  out["batch"] = c.batch;
  out["repeats"] = c.repeats;
  out["results"] = nlohmann::json::array();
  auto row = [&](const std::string& name, int64_t params, double ms, const StepFlops& f) {
    const double gflops = f.total() / (ms * 1e6);
    std::cout << std::left << std::setw(34) << name << std::right << std::setw(9) << millions(params)
              << std::setw(11) << fmt(ms, 1) << std::setw(11) << fmt(tokens / (ms * 1e-3), 0)
              << std::setw(12) << fmt(f.total() / 1e9, 2) << std::setw(9) << fmt(gflops, 1)
              << std::setw(7) << fmt(100 * gflops / machine.sgemm_gflops, 1)
              << (f.attention ? "" : "  (attention FLOPs not counted)") << "\n";
    return nlohmann::json{{"params", params},
                          {"ms", ms},
                          {"tokens_per_s", tokens / (ms * 1e-3)},
                          {"flops", f.total()},
                          {"dense_flops", f.dense},
                          {"attention_flops", f.attention ? nlohmann::json(*f.attention) : nlohmann::json()},
                          {"attention_flops_rule", f.attention_rule},
                          {"gflops", gflops}};
  };

  double full_ms = -1;
  for (const auto& spec : specs) {
    torch::manual_seed(c.seed);
    models::Transformer model(model_options(c, spec, c.context));
    model->train();
    auto optimizer = make_optimizer(*model);
    const auto batch = random_batch(c, c.batch, c.context, c.seed);
    const auto times = time_ms(train_step(model, optimizer, batch), c.repeats, [&] { optimizer.zero_grad(); });
    const double ms = median(times);
    const auto flops = model_step_flops(c, model, spec, c.batch, c.context);
    const auto [info, parsed] = nn::resolve_mechanism(spec);
    auto r = row(spec, model->parameter_count(), ms, flops);
    r["attention"] = spec;
    r["spec"] = spec_with_defaults(*info, parsed);
    r["times_ms"] = times;
    out["results"].push_back(r);
    if (info->exact && full_ms < 0) full_ms = ms;
    machine.remeasure_peak();
  }

  if (c.baseline) {
    torch::manual_seed(c.seed);
    TorchBaseline model(c, c.context);
    model->train();
    auto optimizer = make_optimizer(*model);
    const auto batch = random_batch(c, c.batch, c.context, c.seed);
    const auto times = time_ms(train_step(model, optimizer, batch), c.repeats, [&] { optimizer.zero_grad(); });
    const double ms = median(times);
    // The same model as attnkit's exact attention: the same FLOPs.
    const auto& exact = nn::exact_mechanism().name;
    models::Transformer reference(model_options(c, exact, c.context));
    const auto flops = model_step_flops(c, reference, exact, c.batch, c.context);
    TORCH_CHECK(model->parameter_count() == reference->parameter_count(),
                "bench-model: the libtorch baseline has ", model->parameter_count(),
                " parameters but attnkit's full model has ", reference->parameter_count());
    auto r = row("torch (composite full attention)", model->parameter_count(), ms, flops);
    std::cout << "   libtorch's matmul: " << machine.torch_blas << " (torch.mm "
              << fmt(machine.torch_mm_gflops, 1) << " GFLOP/s)\n";
    r["impl"] = "torch";
    r["torch_blas"] = machine.torch_blas;
    r["times_ms"] = times;
    if (full_ms > 0) {
      r["speedup_of_full"] = ms / full_ms;
      std::cout << "attnkit with full attention is " << fmt(ms / full_ms, 2)
                << "x faster than the libtorch baseline\n";
    }
    out["baseline"] = r;
    machine.remeasure_peak();
  }
  // MFU over the best peak of the run (the table divided by the best so far).
  auto set_mfu = [&](nlohmann::json& x) { x["mfu"] = x["gflops"].get<double>() / machine.sgemm_gflops; };
  for (auto& x : out["results"]) set_mfu(x);
  if (out.contains("baseline")) set_mfu(out["baseline"]);
  std::cout << "FLOPs: dense layers 6 x (parameters of every matrix applied per token, the tied output\n"
               "layer included) x tokens; attention: the registry's forward FLOPs (sparse patterns: 2 (E + M)\n"
               "per edge) x 3 for forward + backward, no recomputation counted. MFU%: achieved GFLOP/s over\n"
               "the sgemm peak measured in this process at the same thread count (JSON: the run's best).\n\n";
  return out;
}

// --- generate ------------------------------------------------------------------------------

nlohmann::json run_generate(const ModelConfig& c, const std::vector<std::string>& specs) {
  const int64_t longest = *std::max_element(c.contexts.begin(), c.contexts.end());
  std::cout << "== generate: one stream, Transformer::step in eval mode without autograd; the context is "
            << "built by stepping (prefill), then " << c.steps << " steps are timed\n" << model_line(c);
  std::cout << std::left << std::setw(34) << "attention" << std::right << std::setw(9) << "context"
            << std::setw(14) << "prefill tok/s" << std::setw(13) << "step ms med" << std::setw(10)
            << "tokens/s" << std::setw(11) << "state MiB" << "\n";
  // The decoding state's size (the KV cache, for exact attention): tensor
  // bytes held after the context was stepped, over those held before.
  memory::install_counting_allocator();
  nlohmann::json out;
  out["steps"] = c.steps;
  out["results"] = nlohmann::json::array();
  out["flatness"] = nlohmann::json::object();
  torch::NoGradGuard no_grad;
  for (const auto& spec : specs) {
    torch::manual_seed(c.seed);
    models::Transformer model(model_options(c, spec, longest + c.steps));
    model->eval();
    std::vector<double> rates;
    for (const int64_t context : c.contexts) {
      // (context, 1): row t is the token of position t, a contiguous (1).
      auto prompt = random_batch(c, 1, context, c.seed).input.t().contiguous();
      const int64_t held_before = memory::current_bytes();
      auto state = model->start_decoding(1);
      torch::Tensor logits;
      const double t0 = wall_now_ms();
      for (int64_t t = 0; t < context; ++t) logits = model->step(prompt[t], state);
      const double prefill_ms = wall_now_ms() - t0;
      const double state_mib = double(memory::current_bytes() - held_before) / (1 << 20);
      std::vector<double> step_ms;
      for (int64_t i = 0; i < c.steps; ++i) {
        auto next = logits.argmax(-1);  // greedy: what a decoding loop feeds back
        const double s0 = wall_now_ms();
        logits = model->step(next, state);
        step_ms.push_back(wall_now_ms() - s0);
      }
      double total = 0;
      for (double ms : step_ms) total += ms;
      const double tokens_per_s = c.steps / (total * 1e-3);
      const double prefill_tokens_per_s = context / (prefill_ms * 1e-3);
      std::cout << std::left << std::setw(34) << spec << std::right << std::setw(9) << context
                << std::setw(14) << fmt(prefill_tokens_per_s, 0) << std::setw(13)
                << fmt(median(step_ms), 3) << std::setw(10) << fmt(tokens_per_s, 0) << std::setw(11)
                << fmt(state_mib, 1) << "\n";
      out["results"].push_back({{"attention", spec},
                                {"context", context},
                                {"prefill_ms", prefill_ms},
                                {"prefill_tokens_per_s", prefill_tokens_per_s},
                                {"step_ms_median", median(step_ms)},
                                {"state_mib", state_mib},
                                {"tokens_per_s", tokens_per_s}});
      rates.push_back(tokens_per_s);
    }
    // tokens/s at the last context over the first: 1 for a state of fixed size.
    out["flatness"][spec] = rates.back() / rates.front();
  }
  std::cout << "tokens/s: " << c.steps << " steps after the context over their total time; prefill tok/s: "
            << "the context's steps over theirs\ntokens/s at context " << c.contexts.back() << " over "
            << c.contexts.front() << ":";
  for (const auto& spec : specs) std::cout << " " << spec << " " << fmt(out["flatness"][spec].get<double>(), 2);
  std::cout << "\n\n";
  return out;
}
// --- the command ---------------------------------------------------------------------------

void run_model_bench(const ModelConfig& c) {
  set_num_threads(c.threads);
  at::set_num_threads(num_threads());
  if (!c.child.empty()) {
    run_child(c);
    return;
  }
  MachineRecord machine = MachineRecord::measure();
  std::cout << machine.header() << "\n";
  nlohmann::json doc;
  doc["command"] = "bench-model";
  doc["model"] = {{"architecture", c.architecture}, {"positions", c.positions}, {"layers", c.layers},
                  {"width", c.width},               {"heads", c.heads},         {"kv_heads", c.kv_heads},
                  {"ffn", c.ffn},
                  {"vocab", c.vocab},               {"dropout", c.dropout}};
  doc["load_average_start"] = load_average();
  auto save = [&] {
    doc["machine"] = machine.to_json();
    if (!c.json.empty()) write_json_atomically(c.json, doc);
  };
  auto specs = [&](const std::vector<std::string>& fallback) {
    return c.attention.empty() ? fallback : c.attention;
  };
  if (wants(c, "train")) {
    doc["train"] = run_train(c, specs(nn::default_specs(nn::DefaultSpecs::model_train)), machine);
    save();
  }
  if (wants(c, "generate")) {
    doc["generate"] = run_generate(c, specs(nn::default_specs(nn::DefaultSpecs::model_generate)));
    save();
  }
  if (wants(c, "memory")) {
    doc["memory"] = run_memory(c, specs(nn::default_specs(nn::DefaultSpecs::model_train)));
    save();
  }
  doc["load_average_end"] = load_average();
  doc["machine"] = machine.to_json();
  write_json_report(c.json, doc);
}

}  // namespace

}  // namespace bench_model

void add_bench_model_command(CLI::App& app) {
  auto c = std::make_shared<bench_model::ModelConfig>();
  auto what = std::make_shared<std::string>();
  auto attention = std::make_shared<std::vector<std::string>>();
  auto contexts = std::make_shared<std::string>();
  auto memory_contexts = std::make_shared<std::string>();
  auto no_baseline = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand(
      "bench-model", "Time a Transformer's training step (with MFU and a libtorch baseline), its "
                     "token-by-token generation, and a training step's peak memory");
  cmd->add_option("--what", *what, "Comma list of train, generate, memory (default: all three)");
  cmd->add_option("--attention", *attention,
                  "Mechanism spec(s) of the blocks, repeatable or a comma list (default: train and "
                  "memory: full, causal-linear, agglomerative, sparse-local-causal:span=64, linear; "
                  "generate: full, causal-linear, agglomerative)");
  cmd->add_option("--threads", c->threads, "Threads (0: all cores)")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--architecture", c->architecture, "decoder or encoder (generate: decoder only)")
      ->check(CLI::IsMember({"decoder", "encoder"}))->capture_default_str();
  cmd->add_option("--positions", c->positions, "none, sinusoidal or learned")
      ->check(CLI::IsMember({"none", "sinusoidal", "learned"}))->capture_default_str();
  cmd->add_option("--layers", c->layers, "Blocks")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--width", c->width, "Model width")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", c->heads, "Attention heads")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--kv-heads", c->kv_heads,
                  "Key/value heads, a divisor of --heads (grouped-query attention); 0: as many as --heads")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--ffn", c->ffn, "Feed-forward hidden width")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--vocab", c->vocab, "Vocabulary size")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--dropout", c->dropout, "Dropout")->check(CLI::Range(0.0, 0.999))->capture_default_str();
  cmd->add_option("--context", c->context, "train: sequence length")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--batch", c->batch, "train: sequences per step")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--repeats", c->repeats, "train: timed steps after the warm-up (median reported)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_flag("--no-baseline", *no_baseline, "train: skip the libtorch baseline");
  cmd->add_option("--contexts", *contexts, "generate: comma list of context lengths (default: 1024,4096,16384)");
  cmd->add_option("--steps", c->steps, "generate: timed steps after the context")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--memory-contexts", *memory_contexts,
                  "memory: comma list of context lengths (default: 512,1024,2048,4096,8192)");
  cmd->add_option("--memory-batch", c->memory_batch, "memory: sequences per step")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--seed", c->seed, "Seed of the weights and tokens")->capture_default_str();
  cmd->add_option("--json", c->json, "Also write the results to this JSON file (atomically)");
  // The memory measurement's child processes (this binary re-run); not for users.
  cmd->add_option("--child", c->child, "")->check(CLI::IsMember({"step", "idle"}))->group("");
  cmd->add_option("--max-length", c->max_length, "")->check(CLI::PositiveNumber)->group("");
  cmd->callback([=] {
    if (!what->empty()) c->what = split_list(*what);
    check_choices("--what", c->what, {"train", "generate", "memory"});
    c->attention.clear();
    for (const auto& a : *attention)
      for (const auto& s : split_specs(a)) c->attention.push_back(s);
    resolve_specs("--attention", c->attention.empty() ? nn::default_specs(nn::DefaultSpecs::model_train) : c->attention);
    if (!contexts->empty()) c->contexts = parse_positive_list("--contexts", *contexts);
    if (!memory_contexts->empty()) c->memory_contexts = parse_positive_list("--memory-contexts", *memory_contexts);
    c->baseline = !*no_baseline;
    if (c->width % c->heads != 0) throw CLI::ValidationError("--width", "must be a multiple of --heads");
    if (c->kv_heads > 0 && c->heads % c->kv_heads != 0)
      throw CLI::ValidationError("--kv-heads", "must divide --heads (" + std::to_string(c->heads) + ")");
    if (c->child.empty() && bench_model::wants(*c, "generate") && c->architecture != "decoder")
      throw CLI::ValidationError("--what", "generate needs --architecture decoder");
    if (!c->child.empty() && (c->attention.size() != 1 || c->max_length == 0))
      throw CLI::ValidationError("--child", "needs one --attention and --max-length");
    // The builder's own checks (a mechanism a decoder cannot use, ...) before any work.
    for (const auto& spec : c->attention.empty() ? nn::default_specs(nn::DefaultSpecs::model_train) : c->attention)
      models::validate(bench_model::model_options(*c, spec, std::max<int64_t>(c->context, 1)));
    bench_model::run_model_bench(*c);
  });
}

}  // namespace attnkit::cli
