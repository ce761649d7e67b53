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
#include <ATen/CPUGeneratorImpl.h>
#include <attnkit/models/transformer.h>
#include <attnkit/nn/registry.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>

#include "bench_util.h"
#include "commands.h"

namespace attnkit::cli {

namespace {


struct ModelConfig {
  std::vector<std::string> what = {"train", "generate", "memory"};
  std::vector<std::string> attention;  // empty: each measurement's default list
  int threads = 1;  // the targets are on one thread
  // The model.
  std::string architecture = "decoder";
  std::string positions = "sinusoidal";
  int64_t layers = 4, width = 256, heads = 4, ffn = 1024, vocab = 27;
  int64_t kv_heads = 0;  // 0: as many as heads
  double dropout = 0.1;
  // train
  int64_t context = 512, batch = 16;
  int repeats = 5;
  bool baseline = true;
  // generate
  std::vector<int64_t> contexts = {1024, 4096, 16384};
  int64_t steps = 64;
  // memory
  std::vector<int64_t> memory_contexts = {512, 1024, 2048, 4096, 8192};
  int64_t memory_batch = 1;
  uint64_t seed = 0;
  std::string json;
  // The hidden child mode of the memory measurement: "step" or "idle".
  std::string child;
  int64_t max_length = 0;  // child: the position table's length (the parent's choice)
};

bool wants(const ModelConfig& c, const std::string& what) {
  return std::find(c.what.begin(), c.what.end(), what) != c.what.end();
}

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

/// Random tokens (N, L + 1): inputs are the first L, targets the last L.
struct LmBatch {
  torch::Tensor input, target, weight;
};

LmBatch random_batch(const ModelConfig& c, int64_t batch, int64_t context, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto tokens = torch::randint(c.vocab, {batch, context + 1}, gen, torch::kLong);
  return {tokens.narrow(1, 0, context).contiguous(), tokens.narrow(1, 1, context).contiguous(),
          torch::ones({batch, context})};
}

/// The masked training loss: mean cross-entropy over the positions of weight
/// 1 (here every position).
torch::Tensor masked_cross_entropy(const torch::Tensor& logits, const LmBatch& b) {
  const int64_t V = logits.size(-1);
  auto per_position = torch::nn::functional::cross_entropy(
      logits.reshape({-1, V}), b.target.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  auto w = b.weight.reshape({-1});
  return (per_position * w).sum() / w.sum();
}

// --- FLOPs ---------------------------------------------------------------------------------

/// Model FLOPs of one training step (forward + backward), the MFU convention:
/// what the model needs, recomputation not counted.
struct StepFlops {
  double dense = 0;                       // every matrix applied per token, output layer included
  c10::optional<double> attention;        // the mechanisms' own products (q k^T, P v, ...)
  std::string attention_rule;             // how `attention` was counted, or why it was not
  double total() const { return dense + attention.value_or(0); }
};

/// Parameters of the matrices applied to every token: every 2-D parameter but
/// the token embedding (a lookup) and a learned position table (an add). A
/// tied embedding is counted once more as the output layer by the caller.
int64_t matmul_parameters(const torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.named_parameters()) {
    if (p.value().dim() != 2) continue;
    const auto& name = p.key();
    if (name == "embedding.weight" || name == "positions") continue;
    n += p.value().numel();
  }
  return n;
}

StepFlops model_step_flops(const ModelConfig& c, models::Transformer& model, const std::string& spec,
                           int64_t batch, int64_t context) {
  StepFlops f;
  const double tokens = double(batch) * context;
  // A dense layer's backward is two products of its forward's size (dx, dW):
  // 2 * params per token forward, 6 * params per token forward + backward.
  const int64_t output = model->options().tie_embeddings() ? c.vocab * c.width : 0;
  f.dense = 6.0 * double(matmul_parameters(*model) + output) * tokens;

  const auto [info, parsed] = nn::resolve_mechanism(spec);
  const bool causal = causal_model(c) && (info->supports.causal || info->always_causal);
  nn::AttentionShape s;
  s.N = batch;
  s.L = s.S = models::attention_nodes(info->name, context);  // bp-tree and star add nodes
  if (info->layer == nn::MechanismLayer::class_projections) {
    const int64_t classes = parsed.get_int("classes", 0);
    s.H = classes > 0 ? classes : c.heads;  // one head per class over width / classes
  } else {
    s.H = c.heads;
  }
  s.E = s.M = c.width / s.H;
  c10::optional<double> forward;
  if (info->flops) {
    forward = info->flops(s, causal, parsed);
    if (forward) f.attention_rule = "registry closed form, x3 for forward + backward";
  }
  if (forward) {
    f.attention = 3.0 * c.layers * *forward;
  } else {
    f.attention_rule = "no closed form: not counted (MFU covers the dense layers only)";
  }
  return f;
}

// --- The libtorch baseline ------------------------------------------------------------------

/// The pre-norm decoder (or encoder) of models::Transformer with the same
/// sizes, parameters, dropout and step, built only from libtorch: its
/// Embedding, Linear and LayerNorm, and attention as the composite
/// softmax(q k^T / sqrt(d_head) + causal mask) v on torch::matmul. It runs
/// whatever BLAS libtorch is bound to; it exists only for this benchmark.
class TorchBaselineImpl : public torch::nn::Module {
 public:
  TorchBaselineImpl(const ModelConfig& c, int64_t max_length) : c_(c) {
    const int64_t d = c.width;
    embedding_ = register_module("embedding", torch::nn::Embedding(c.vocab, d));
    {
      torch::NoGradGuard no_grad;
      embedding_->weight.normal_(0, 1.0 / std::sqrt(double(d)));
    }
    if (c.positions == "sinusoidal") {
      // PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d)).
      auto p = torch::arange(max_length, torch::kFloat).unsqueeze(1);
      auto rate = torch::exp(torch::arange(0, d, 2, torch::kFloat) * (-std::log(10000.0) / d));
      auto table = torch::zeros({max_length, d});
      table.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 2)},
                       torch::sin(p * rate));
      table.index_put_({torch::indexing::Slice(), torch::indexing::Slice(1, torch::indexing::None, 2)},
                       torch::cos(p * rate).narrow(1, 0, d / 2));
      table_ = register_buffer("sinusoidal", table);
    } else if (c.positions == "learned") {
      table_ = register_parameter("positions", torch::randn({max_length, d}) * 0.02);
    }
    for (int64_t i = 0; i < c.layers; ++i) {
      Block b;
      const std::string n = "block_" + std::to_string(i) + "_";
      b.q = register_module(n + "q", torch::nn::Linear(d, d));
      const int64_t kv_width = (c.kv_heads > 0 ? c.kv_heads : c.heads) * (d / c.heads);
      b.k = register_module(n + "k", torch::nn::Linear(d, kv_width));
      b.v = register_module(n + "v", torch::nn::Linear(d, kv_width));
      b.out = register_module(n + "out", torch::nn::Linear(d, d));
      b.ff1 = register_module(n + "ff1", torch::nn::Linear(d, c.ffn));
      b.ff2 = register_module(n + "ff2", torch::nn::Linear(c.ffn, d));
      b.norm_self = register_module(n + "norm_self", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
      b.norm_ff = register_module(n + "norm_ff", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
      blocks_.push_back(b);
    }
    norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }

  /// tokens (N, L) -> logits (N, L, vocab), the output layer tied to the embedding.
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t N = tokens.size(0), L = tokens.size(1), d = c_.width, H = c_.heads, dh = d / H;
    const double p = c_.dropout;
    auto x = embedding_(tokens) * std::sqrt(double(d));
    if (table_.defined()) x = x + table_.narrow(0, 0, L);
    x = torch::dropout(x, p, is_training());
    torch::Tensor mask;  // 0 where a query sees the key, -inf above the diagonal
    if (causal_model(c_))
      mask = torch::full({L, L}, -std::numeric_limits<float>::infinity()).triu(1);
    auto heads = [&](const torch::Tensor& t) { return t.view({N, L, H, dh}).transpose(1, 2); };
    // Grouped-query heads: each key/value head repeated over its group.
    const int64_t Hk = c_.kv_heads > 0 ? c_.kv_heads : H;
    auto kv_heads = [&](const torch::Tensor& t) {
      return t.view({N, L, Hk, dh}).transpose(1, 2).repeat_interleave(H / Hk, 1);
    };
    for (auto& b : blocks_) {
      auto h = b.norm_self(x);
      auto scores = torch::matmul(heads(b.q(h)), kv_heads(b.k(h)).transpose(-2, -1)) / std::sqrt(double(dh));
      if (mask.defined()) scores = scores + mask;
      auto a = torch::matmul(torch::softmax(scores, -1), kv_heads(b.v(h)));
      x = x + torch::dropout(b.out(a.transpose(1, 2).reshape({N, L, d})), p, is_training());
      x = x + torch::dropout(b.ff2(torch::relu(b.ff1(b.norm_ff(x)))), p, is_training());
    }
    return torch::matmul(norm_(x), embedding_->weight.t());
  }

  int64_t parameter_count() const {
    int64_t n = 0;
    for (const auto& t : parameters()) n += t.numel();
    return n;
  }

 private:
  struct Block {
    torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, out{nullptr}, ff1{nullptr}, ff2{nullptr};
    torch::nn::LayerNorm norm_self{nullptr}, norm_ff{nullptr};
  };
  ModelConfig c_;
  torch::nn::Embedding embedding_{nullptr};
  torch::Tensor table_;
  std::vector<Block> blocks_;
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(TorchBaseline);

/// One training step of `model` on `batch`: forward, loss, backward, AdamW.
template <typename Model>
std::function<void()> train_step(Model& model, torch::optim::AdamW& optimizer, const LmBatch& batch) {
  return [&model, &optimizer, &batch] {
    auto loss = masked_cross_entropy(model->forward(batch.input), batch);
    loss.backward();
    optimizer.step();
  };
}

torch::optim::AdamW make_optimizer(torch::nn::Module& model) {
  return torch::optim::AdamW(model.parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
}

std::string millions(int64_t n) { return fmt(n / 1e6, 2) + "M"; }

std::string model_line(const ModelConfig& c) {
  std::ostringstream o;
  o << "model: " << c.architecture << ", " << c.layers << " layers, width " << c.width << ", " << c.heads
    << " heads" << (c.kv_heads > 0 ? " (" + std::to_string(c.kv_heads) + " key/value heads)" : "") << ", ffn " << c.ffn << ", vocab " << c.vocab << ", dropout " << c.dropout << ", "
    << c.positions << " positions\n";
  return o.str();
}

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

// --- memory --------------------------------------------------------------------------------

/// The value of `key` ("VmHWM", "RssAnon", ...) of /proc/self/status in KiB, -1 if absent.
int64_t proc_status_kib(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  return -1;
}

/// The child process: builds the model and its optimizer, runs one step at a
/// context of one token so that gradients and AdamW's state exist (and
/// libtorch, oneDNN and the OpenMP pool are loaded), then - for "step" - one
/// training step at the requested context. Prints one JSON line: its own peak
/// RSS (VmHWM) and the counting allocator's peak of tensor bytes during the
/// step above what it held before.
void run_child(const ModelConfig& c) {
  memory::install_counting_allocator();
  const std::string& spec = c.attention.at(0);
  torch::manual_seed(c.seed);
  models::Transformer model(model_options(c, spec, c.max_length));
  model->train();
  auto optimizer = make_optimizer(*model);
  const auto prime = random_batch(c, c.memory_batch, 1, c.seed);
  train_step(model, optimizer, prime)();
  optimizer.zero_grad();
  const int64_t held = memory::current_bytes();
  memory::reset_peak();
  if (c.child == "step") {
    const auto batch = random_batch(c, c.memory_batch, c.context, c.seed);
    train_step(model, optimizer, batch)();
  }
  const nlohmann::json report = {{"vm_hwm_kib", proc_status_kib("VmHWM")},
                                 {"held_bytes", held},
                                 {"tensor_peak_bytes", memory::peak_bytes() - held}};
  std::cout << report.dump() << std::endl;
}

std::string self_executable() {
  char buffer[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  if (n <= 0) throw std::runtime_error(std::string("bench-model: cannot read /proc/self/exe: ") + std::strerror(errno));
  return std::string(buffer, n);
}

struct ChildReport {
  nlohmann::json report;  // what the child printed
  int64_t ru_maxrss_kib = 0;
};

/// Runs this binary with `args`, its stdout into a pipe; returns what it
/// printed and wait4()'s peak RSS. A child that fails is an error naming it.
ChildReport spawn_child(const std::vector<std::string>& args) {
  const std::string exe = self_executable();
  std::vector<std::string> all{exe};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::string command;
  for (const auto& a : all) command += (command.empty() ? "" : " ") + a;

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("bench-model: pipe failed: " + std::string(std::strerror(errno)));
  std::cout.flush();
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("bench-model: fork failed: " + std::string(std::strerror(errno)));
  if (pid == 0) {  // only async-signal-safe calls until exec
    dup2(fds[1], STDOUT_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  std::string text;
  char buffer[4096];
  for (;;) {
    const ssize_t n = read(fds[0], buffer, sizeof(buffer));
    if (n > 0) {
      text.append(buffer, n);
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  close(fds[0]);
  int status = 0;
  rusage usage{};
  while (wait4(pid, &status, 0, &usage) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("bench-model: the memory measurement '" + command + "' failed (" +
                             (WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                                : "signal " + std::to_string(WTERMSIG(status))) +
                             ")");
  ChildReport r;
  try {
    r.report = nlohmann::json::parse(text);
  } catch (const std::exception&) {
    throw std::runtime_error("bench-model: '" + command + "' printed '" + text + "', not its JSON report");
  }
  r.ru_maxrss_kib = usage.ru_maxrss;  // KiB on Linux
  return r;
}

std::vector<std::string> child_args(const ModelConfig& c, const std::string& mode, const std::string& spec,
                                    int64_t context, int64_t max_length) {
  std::ostringstream dropout;
  dropout << std::setprecision(17) << c.dropout;
  return {"bench-model",     "--child",         mode,
          "--attention",     spec,              "--context",
          std::to_string(context), "--memory-batch", std::to_string(c.memory_batch),
          "--architecture",  c.architecture,    "--positions",
          c.positions,       "--layers",        std::to_string(c.layers),
          "--width",         std::to_string(c.width), "--heads",
          std::to_string(c.heads), "--kv-heads", std::to_string(c.kv_heads),
          "--ffn",           std::to_string(c.ffn),
          "--vocab",         std::to_string(c.vocab), "--dropout",
          dropout.str(),     "--max-length",    std::to_string(max_length),
          "--threads",       std::to_string(num_threads()), "--seed",
          std::to_string(c.seed)};
}

double mib_of_kib(int64_t kib) { return kib / 1024.0; }

nlohmann::json run_memory(const ModelConfig& c, const std::vector<std::string>& specs) {
  const int64_t longest = *std::max_element(c.memory_contexts.begin(), c.memory_contexts.end());
  std::cout << "== memory: the peak of one training step, batch " << c.memory_batch
            << ", each in a fresh process\n" << model_line(c);
  std::cout << std::left << std::setw(34) << "attention" << std::right << std::setw(9) << "context"
            << std::setw(11) << "step MiB" << std::setw(13) << "tensors MiB" << std::setw(12)
            << "peak MiB" << std::setw(12) << "idle MiB" << "\n";
  nlohmann::json out;
  out["batch"] = c.memory_batch;
  out["results"] = nlohmann::json::array();
  for (const auto& spec : specs) {
    // The reference: the same process without the step (model, gradients,
    // AdamW state, libraries); one position table length for every context.
    const auto idle = spawn_child(child_args(c, "idle", spec, 1, longest));
    const int64_t idle_kib = idle.report.at("vm_hwm_kib").get<int64_t>();
    for (const int64_t context : c.memory_contexts) {
      const auto step = spawn_child(child_args(c, "step", spec, context, longest));
      const int64_t peak_kib = step.report.at("vm_hwm_kib").get<int64_t>();
      const double step_mib = mib_of_kib(peak_kib - idle_kib);
      const double tensor_mib = step.report.at("tensor_peak_bytes").get<int64_t>() / 1048576.0;
      std::cout << std::left << std::setw(34) << spec << std::right << std::setw(9) << context
                << std::setw(11) << fmt(step_mib, 1) << std::setw(13) << fmt(tensor_mib, 1) << std::setw(12)
                << fmt(mib_of_kib(peak_kib), 1) << std::setw(12) << fmt(mib_of_kib(idle_kib), 1) << "\n";
      out["results"].push_back({{"attention", spec},
                                {"context", context},
                                {"step_mib", step_mib},
                                {"tensor_peak_mib", tensor_mib},
                                {"peak_rss_mib", mib_of_kib(peak_kib)},
                                {"idle_rss_mib", mib_of_kib(idle_kib)},
                                {"ru_maxrss_mib", mib_of_kib(step.ru_maxrss_kib)},
                                {"idle_ru_maxrss_mib", mib_of_kib(idle.ru_maxrss_kib)}});
    }
  }
  std::cout << "step MiB: the step's peak RSS minus that of the same process without the step (idle:\n"
               "libraries, model, gradients, AdamW state; both primed by a one-token step); peak RSS is\n"
               "the child's VmHWM. tensors MiB: the counting allocator's peak of tensor and kernel\n"
               "scratch bytes during the step above what was held before it.\n\n";
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

void check_choices(const std::string& option, const std::vector<std::string>& values,
                   const std::vector<std::string>& allowed) {
  for (const auto& v : values)
    if (std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
      std::string list;
      for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
      throw CLI::ValidationError(option, "'" + v + "' is not one of " + list);
    }
}

}  // namespace

void add_bench_model_command(CLI::App& app) {
  auto c = std::make_shared<ModelConfig>();
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
    if (c->child.empty() && wants(*c, "generate") && c->architecture != "decoder")
      throw CLI::ValidationError("--what", "generate needs --architecture decoder");
    if (!c->child.empty() && (c->attention.size() != 1 || c->max_length == 0))
      throw CLI::ValidationError("--child", "needs one --attention and --max-length");
    // The builder's own checks (a mechanism a decoder cannot use, ...) before any work.
    for (const auto& spec : c->attention.empty() ? nn::default_specs(nn::DefaultSpecs::model_train) : c->attention)
      models::validate(model_options(*c, spec, std::max<int64_t>(c->context, 1)));
    run_model_bench(*c);
  });
}

}  // namespace attnkit::cli
