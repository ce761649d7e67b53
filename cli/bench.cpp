// `attnkit bench`: time mechanisms of the registry over a list of lengths;
// print a table and optionally write the results as JSON.
//
// What runs: `fast` is the attnkit op a user calls (the table's impl column
// says which backend it took: kernel or composite); `reference` is the
// mechanism's composite definition from src/reference, in float32; `torch`
// is what a libtorch user would pick instead for exact attention: torch 2's
// scaled_dot_product_attention (its CPU flash kernel), or on torch 1.13, which
// has no public one, `torch-composite`, the plain matmul-softmax-matmul on
// whatever BLAS libtorch loaded (both named in the header).
#include <attnkit/nn/registry.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>

#include "bench_util.h"
#include "commands.h"
#include "torch_sdpa.h"

namespace attnkit::cli {

namespace {

struct BenchConfig {
  std::vector<std::string> attention = nn::default_specs(nn::DefaultSpecs::bench);
  std::vector<std::string> impl{"fast", "torch"};
  std::vector<std::string> pass{"forward"};
  std::vector<std::string> dtypes{"float32"};  // float32 | bfloat16: the inputs' dtype
  std::vector<int64_t> lengths{256, 1024};
  int64_t queries = 0;  // 0: L = S = each length; else L = queries over S = each length keys
  int64_t batch = 1, heads = 8, head_dim = 64;
  bool causal = false;
  int threads = 0;
  int repeats = 3;
  // > 1: every row is timed once per round, the rows in turn, so that a slow
  // minute of the machine lands on all of them; a row's ms is the median of
  // its rounds' medians.
  int rounds = 1;
  // N*H*L*S up to which the float64 checks (err, approx_err) run.
  int64_t check_limit = int64_t{1} << 25;
  std::string json;
  bool measure_peak = true;  // false: no sgemm peak or torch.mm (emulators, smoke runs)
};

struct Result {
  std::string attention, run, impl, pass;  // run: fast | reference | torch | torch-composite; impl: what ran
  std::string dtype;                        // float32 | bfloat16
  std::string dispatch_reason;
  int64_t N, H, L, S, E, M;
  bool causal;
  int threads;
  double ms = 0;
  std::vector<double> round_ms;  // each round's median; ms is their median
  c10::optional<double> gflops;
  c10::optional<double> ns_per_edge;  // full, sparse-*, sac: time per attended (query, key) pair
  // What gflops and ns_per_edge divide by the time: the FLOPs (backward
  // counted 2.5x forward) and the attended pairs, when the mechanism counts them.
  c10::optional<double> flops, pairs;
  int64_t peak_bytes = 0;
  c10::optional<double> err, approx_err;
  std::string note;  // non-empty: the row did not run (why)
  std::string dispatch_isa;  // the kernel's ISA level; empty for the composite and torch

  /// Records one more round's median time: ms becomes the median of the
  /// rounds', and the rates follow it.
  void add_round(double round_median_ms) {
    round_ms.push_back(round_median_ms);
    ms = median(round_ms);
    if (flops) gflops = *flops / (ms * 1e6);
    if (pairs) ns_per_edge = ms * 1e6 / *pairs;
  }
};

/// The plain libtorch composite a user would write for exact attention.
torch::Tensor torch_composite(const nn::MechanismInputs& x, bool causal) {
  const auto &q = x[0], &k = x[1], &v = x[2];
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(q.size(-1)));
  if (causal) {
    const int64_t L = q.size(2), S = k.size(2);
    auto mask = torch::ones({L, S}, torch::kBool).triu(S - L + 1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  return torch::matmul(torch::softmax(scores, -1), v);
}

/// The rows that time what a libtorch user would run instead (exact attention only).
bool is_torch_run(const std::string& run) { return run == "torch" || run == "torch-composite"; }

/// max |a - b| / max |b| (0 when both are empty or zero).
double relative_max_error(const torch::Tensor& a, const torch::Tensor& b) {
  if (b.numel() == 0) return 0;
  auto a64 = a.detach().to(torch::kDouble), b64 = b.detach().to(torch::kDouble);
  const double scale = b64.abs().max().item<double>();
  const double diff = (a64 - b64).abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

/// One row of the table: what it runs, at which length.
struct Row {
  const nn::MechanismInfo* info;
  nn::MechanismSpec spec;
  std::string run, pass, dtype;
  int64_t length;
};

/// Times `row` once (one round): its median over c.repeats calls after at most
/// `max_warmup` untimed ones, and, with `check`, its errors against the
/// float64 references.
Result measure(const BenchConfig& c, const Row& row, int max_warmup, bool check) {
  const nn::MechanismInfo& info = *row.info;
  const nn::MechanismSpec& spec = row.spec;
  const std::string &run = row.run, &pass = row.pass, &dtype = row.dtype;
  const int64_t length = row.length;
  const int64_t L = c.queries > 0 ? c.queries : length, S = length;
  const nn::AttentionShape shape{c.batch, c.heads, L, S, c.head_dim, c.head_dim};
  // `causal` records whether what ran was causal: the flag, or a mechanism that
  // is causal by construction (causal-linear, the causal sparse patterns).
  Result r{spec.str(), run, "", pass, dtype, "", shape.N, shape.H, L, S, shape.E, shape.M,
           c.causal || info.always_causal, num_threads()};
  const bool backward = pass == "forward_backward";
  // A mechanism causal by construction runs as it is under --causal (its
  // call takes no flag).
  const nn::AttendArgs args{c.causal && !info.always_causal, {}};
  if (c.causal && !info.supports.causal && !info.always_causal) {
    r.note = info.edges ? "no causal flag (choose a causal pattern)" : "no causal form";
    return r;
  }
  const bool torch_row = is_torch_run(run);
  if (torch_row && !info.torch_baseline) {
    r.note = "no torch baseline";
    return r;
  }

  // The same float32 draw for every dtype; floating inputs converted.
  torch::manual_seed(0);
  nn::MechanismInputs inputs = info.sample(shape, torch::kFloat);
  const auto type = dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat;
  for (auto& t : inputs) {
    if (t.is_floating_point()) t = t.to(type);
    t = t.detach().requires_grad_(backward && t.is_floating_point());
  }

  // What the row runs, and which backend that is.
  std::function<torch::Tensor()> call;
  if (run == "torch" && torch_has_sdpa()) {
    r.impl = "torch-sdpa";
    call = [&] { return torch_sdpa(inputs[0], inputs[1], inputs[2], c.causal); };
  } else if (torch_row) {
    r.impl = "torch-composite";
    call = [&] { return torch_composite(inputs, c.causal); };
  } else if (run == "reference") {
    r.impl = "composite";
    r.dispatch_reason = "--impl reference";
    call = [&] { return info.reference(inputs, args, spec); };
  } else {
    const Dispatch d = info.dispatch ? info.dispatch(inputs, args, spec) : Dispatch::kernel();
    r.impl = to_string(d.backend);
    r.dispatch_reason = d.reason;
    r.dispatch_isa = d.isa;
    call = [&] { return info.run(inputs, args, spec); };
  }

  torch::Tensor out;
  const int64_t held_before = memory::current_bytes();
  int64_t peak = 0;
  auto body = [&] {
    memory::reset_peak();
    torch::AutoGradMode grad_mode(backward);
    out = call();
    if (backward) out.backward(torch::ones_like(out));
    peak = std::max(peak, memory::peak_bytes() - held_before);
  };
  auto clear = [&] {
    for (auto& t : inputs)
      if (t.grad().defined()) t.mutable_grad().reset();
  };
  try {
    r.ms = median(time_ms(body, c.repeats, clear, max_warmup));
  } catch (const std::bad_alloc&) {
    r.note = "out of memory";
    return r;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    r.note = msg.find("alloc") != std::string::npos ? "out of memory" : "error: " + msg.substr(0, 160);
    return r;
  }
  r.peak_bytes = peak;
  if (info.flops)
    if (auto f = info.flops(shape, c.causal, spec)) {
      r.flops = (backward ? 3.5 : 1.0) * *f;
      // These count 2 (E + M) flops per attended pair: exact attention's
      // (query, key) pairs, a sparse pattern's edges.
      const bool counts_pairs = info.exact || info.edges;
      if (counts_pairs && *f > 0) r.pairs = *f / (2.0 * double(shape.E + shape.M));
    }
  r.add_round(r.ms);  // this round's time, and the rates of it

  if (!check || shape.N * shape.H * shape.L * shape.S > c.check_limit) return r;
  // err: this row's output (and input gradients) against the mechanism's own
  // float64 definition on the same inputs.
  nn::MechanismInputs x64;
  for (const auto& t : inputs) x64.push_back(t.detach().to(torch::kDouble).requires_grad_(backward));
  torch::Tensor ref;
  {
    torch::AutoGradMode grad_mode(backward);
    ref = info.reference(x64, args, spec);
    if (backward) ref.backward(torch::ones_like(ref));
  }
  {
    torch::AutoGradMode grad_mode(backward);
    out = call();  // a fresh forward (and backward) for the gradients
    if (backward) out.backward(torch::ones_like(out));
  }
  double err = relative_max_error(out, ref);
  if (backward)
    for (size_t i = 0; i < x64.size(); ++i)
      if (inputs[i].grad().defined() && x64[i].grad().defined())
        err = std::max(err, relative_max_error(inputs[i].grad(), x64[i].grad()));
  r.err = err;
  // approx_err: distance to exact softmax attention, for approximations of it.
  if (info.approximates_exact) {
    torch::NoGradGuard no_grad;
    // float64 inputs: the op runs its composite definition (src/reference).
    auto exact = softmax_attention(x64[0].detach(), x64[1].detach(), x64[2].detach(),
                                   SoftmaxAttentionFuncOptions().causal(c.causal));
    r.approx_err = relative_max_error(out, exact);
  }
  return r;
}

void print_header(const MachineRecord& machine) {
  std::cout << machine.header()
            << "`torch` rows: "
            << (torch_has_sdpa() ? "torch's scaled_dot_product_attention (libtorch " + machine.torch_version +
                                       "; its CPU kernels), `torch-composite` rows: matmul-softmax-matmul"
                                 : "matmul-softmax-matmul (libtorch " + machine.torch_version +
                                       " has no public scaled_dot_product_attention)")
            << "\n\n"
            << std::left << std::setw(22) << "attention" << std::setw(16) << "impl" << std::setw(17)
            << "pass" << std::setw(6) << "dtype" << std::right << std::setw(7) << "L" << std::setw(7) << "S" << std::setw(11)
            << "ms" << std::setw(10)
            << "GFLOP/s" << std::setw(7) << "%peak" << std::setw(9) << "ns/edge" << std::setw(10)
            << "peak MiB" << std::setw(10)
            << "err" << std::setw(11) << "approx_err" << "\n";
}

std::string opt(const c10::optional<double>& x, int precision, bool scientific = false) {
  if (!x) return "-";
  if (!scientific) return fmt(*x, precision);
  std::ostringstream o;
  o << std::scientific << std::setprecision(precision) << *x;
  return o.str();
}

void print_row(const Result& r, double peak) {
  std::cout << std::left << std::setw(22) << r.attention << std::setw(16)
            << (r.impl.empty() ? r.run : r.impl) << std::setw(17) << r.pass << std::setw(6)
            << (r.dtype == "bfloat16" ? "bf16" : "f32") << std::right
            << std::setw(7) << r.L << std::setw(7) << r.S;
  if (!r.note.empty()) {
    std::cout << "   skipped: " << r.note << "\n";
    return;
  }
  c10::optional<double> pct;
  if (r.gflops && peak > 0) pct = 100.0 * *r.gflops / peak;
  std::cout << std::setw(11) << fmt(r.ms, 2) << std::setw(10) << opt(r.gflops, 1) << std::setw(7)
            << opt(pct, 0) << std::setw(9) << opt(r.ns_per_edge, 2) << std::setw(10)
            << fmt(r.peak_bytes / 1048576.0, 1) << std::setw(10)
            << opt(r.err, 1, true) << std::setw(11) << opt(r.approx_err, 3) << "\n";
}

void print_legend() {
  std::cout
      << "\nimpl        what ran: kernel (an attnkit kernel; the `path` lines name its ISA level\n"
      << "            and how it ran), composite (libtorch ops, src/reference), torch-sdpa\n"
      << "            (torch's scaled_dot_product_attention), torch-composite (plain libtorch\n"
      << "            matmul-softmax-matmul)\n"
      << "dtype       the inputs' dtype (f32, bf16); %peak is against the float32 sgemm peak\n"
      << "ms          median wall time of --repeats calls after an untimed warm-up (with\n"
      << "            --rounds, the median of the rounds' medians)\n"
      << "GFLOP/s     the mechanism's closed-form FLOPs / time (backward counted 2.5x forward)\n"
      << "%peak       GFLOP/s over the best sgemm peak measured before the row (header: the first)\n"
      << "ns/edge     full, sparse-*, sac: the row's time per attended (query, key) pair over the\n"
      << "            batch and heads (exact attention's pairs; a sparse pattern's edges);\n"
      << "            forward_backward rows include the backward pass\n"
      << "peak MiB    most memory held during a call beyond the inputs (tensors + scratch)\n"
      << "err         max |x - ref| / max |ref| against the mechanism's own float64 definition,\n"
      << "            worst of the output and (forward_backward) the input gradients\n"
      << "approx_err  max |out - exact| / max |exact| against exact softmax attention in float64,\n"
      << "            for mechanisms that approximate it\n";
}

/// Which path each mechanism's op took per dtype (the ISA level of its kernel,
/// and how it ran where the dispatch says), and with several dtypes, each fast
/// row's speed against float32's.
void print_paths_and_ratios(const std::vector<Result>& rows) {
  std::vector<std::string> paths;
  for (const auto& r : rows) {
    if (r.run != "fast") continue;
    Dispatch d{r.impl == "kernel" ? Backend::kernel : Backend::composite, r.dispatch_reason,
               r.dispatch_isa};
    const std::string line = r.attention + " " + r.dtype + ": " + d.describe();
    if (std::find(paths.begin(), paths.end(), line) == paths.end()) paths.push_back(line);
  }
  if (!paths.empty()) std::cout << "\n";
  for (const auto& line : paths) std::cout << "path " << line << "\n";
  for (const auto& r : rows) {
    if (r.run != "fast" || r.dtype == "float32" || !r.note.empty()) continue;
    for (const auto& base : rows)
      if (base.run == "fast" && base.dtype == "float32" && base.note.empty() &&
          base.attention == r.attention && base.pass == r.pass && base.L == r.L && base.S == r.S)
        std::cout << r.attention << " " << r.dtype << " " << r.pass << " L=" << r.L << " S=" << r.S
                  << ": " << fmt(base.ms / r.ms, 2) << "x the float32 row\n";
  }
}

nlohmann::json to_json(const Result& r, double peak) {
  auto opt_json = [](const c10::optional<double>& x) {
    return x ? nlohmann::json(*x) : nlohmann::json(nullptr);
  };
  return {{"attention", r.attention},
          {"run", r.run},
          {"impl", r.impl},
          {"dispatch_reason", r.dispatch_reason},
          {"dispatch_isa", r.dispatch_isa},
          {"pass", r.pass},
          {"dtype", r.dtype},
          {"N", r.N}, {"H", r.H}, {"L", r.L}, {"S", r.S}, {"E", r.E}, {"M", r.M},
          {"causal", r.causal},
          {"threads", r.threads},
          {"ms", r.ms},
          {"round_ms", r.round_ms},
          {"gflops", opt_json(r.gflops)},
          {"fraction_of_peak",
           r.gflops && peak > 0 ? nlohmann::json(*r.gflops / peak) : nlohmann::json(nullptr)},
          {"ns_per_edge", opt_json(r.ns_per_edge)},
          {"peak_bytes", r.peak_bytes},
          {"err", opt_json(r.err)},
          {"approx_err", opt_json(r.approx_err)}};
}

void run_bench(const BenchConfig& c) {
  memory::install_counting_allocator();
  set_num_threads(c.threads);
  at::set_num_threads(num_threads());  // the torch composite gets the same threads
  std::vector<std::pair<const nn::MechanismInfo*, nn::MechanismSpec>> mechanisms;
  for (const auto& text : c.attention) mechanisms.push_back(nn::resolve_mechanism(text));

  // The table's rows, in the order they run in each round.
  std::vector<Row> plan;
  for (int64_t length : c.lengths)
    for (const auto& [info, spec] : mechanisms)
      for (const auto& run : c.impl)
        for (const auto& pass : c.pass)
          for (const auto& dtype : c.dtypes)
            if (!is_torch_run(run) || info->torch_baseline)  // else nothing to compare
              plan.push_back({info, spec, run, pass, dtype, length});

  MachineRecord machine = MachineRecord::measure(c.measure_peak);
  print_header(machine);
  std::vector<Result> rows;
  nlohmann::json doc;
  doc["rounds"] = c.rounds;
  // Written after every row: nothing measured is lost on an interrupt.
  const auto write_progress = [&] {
    if (c.json.empty()) return;
    doc["results"] = nlohmann::json::array();
    for (const auto& r : rows)
      if (r.note.empty()) doc["results"].push_back(to_json(r, machine.sgemm_gflops));
    doc["machine"] = machine.to_json();
    write_json_atomically(c.json, doc);
  };
  for (int round = 0; round < c.rounds; ++round) {
    if (c.rounds > 1) std::cout << (round == 0 ? "" : "\n") << "round " << round + 1 << " of " << c.rounds << "\n";
    for (size_t i = 0; i < plan.size(); ++i) {
      if (round == 0) {
        rows.push_back(measure(c, plan[i], 5, true));
        print_row(rows.back(), machine.sgemm_gflops);
      } else if (rows[i].note.empty()) {
        // Rows ran since this one last did: one untimed call brings its data
        // and code back into the caches, unless a call takes over a second
        // (then its own start is a small part of it).
        const Result again = measure(c, plan[i], rows[i].ms < 1000 ? 1 : 0, false);
        print_row(again, machine.sgemm_gflops);
        if (!again.note.empty()) {
          rows[i].note = again.note;  // failed now (e.g. out of memory): reported, not averaged
        } else {
          rows[i].add_round(again.ms);
          rows[i].peak_bytes = std::max(rows[i].peak_bytes, again.peak_bytes);
        }
      }
      write_progress();
      // A busy moment lowers one peak measurement, never the best.
      if (c.measure_peak && (i + 1 == plan.size() || plan[i + 1].length != plan[i].length))
        machine.remeasure_peak();
    }
  }
  if (c.rounds > 1) {
    std::cout << "\nmedians over " << c.rounds << " rounds (each a median of " << c.repeats
              << " call(s)); fastest-slowest round in brackets\n";
    for (const auto& r : rows) {
      print_row(r, machine.sgemm_gflops);
      if (r.note.empty() && r.round_ms.size() > 1) {
        const auto [lo, hi] = std::minmax_element(r.round_ms.begin(), r.round_ms.end());
        std::cout << "    [" << fmt(*lo, 2) << " - " << fmt(*hi, 2) << " ms]\n";
      }
    }
  }
  print_paths_and_ratios(rows);
  print_legend();
  if (c.measure_peak)
    std::cout << "best sgemm peak over the run: " << fmt(machine.sgemm_gflops, 1)
              << " GFLOP/s (rows above used the best measured before them; the JSON uses this one)\n";
  if (!c.json.empty()) {
    write_progress();  // every row's fraction of the run's best peak
    std::cout << "wrote " << c.json << "\n";
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto config = std::make_shared<BenchConfig>();
  auto attention = std::make_shared<std::string>();
  auto impl = std::make_shared<std::string>();
  auto pass = std::make_shared<std::string>();
  auto lengths = std::make_shared<std::string>();
  auto list = std::make_shared<bool>(false);
  auto* cmd = app.add_subcommand("bench", "Time attention mechanisms over sequence lengths");
  cmd->add_option("--attention", *attention,
                  "Comma list of mechanism specs NAME[:key=value,...] (default: full,linear,"
                  "causal-linear,agglomerative,clustered,improved-clustered,sparse-local); "
                  "--list prints them");
  cmd->add_flag("--list", *list, "Print the mechanisms, their options and what they support");
  cmd->add_option("--impl", *impl,
                  "Comma list of fast (the attnkit op), reference (its composite definition), "
                  "torch (torch's scaled_dot_product_attention on torch 2, else as torch-composite; "
                  "full only), torch-composite (plain libtorch matmul-softmax-matmul, full only) "
                  "(default: fast,torch)");
  cmd->add_option("--pass", *pass, "Comma list of forward, forward_backward (default: forward)");
  cmd->add_option("--lengths", *lengths,
                  "Comma list of sequence lengths: keys S, and queries L = S unless --queries "
                  "(default: 256,1024)");
  cmd->add_option("--queries", config->queries,
                  "Queries L per sequence against each of --lengths keys (default: L = S); "
                  "--queries 1 times one decoding step over a cache of S keys")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--batch", config->batch, "Batch size N")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", config->heads, "Heads H")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--head-dim", config->head_dim, "Head dimension E = M")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_flag("--causal", config->causal, "Causal masking");
  cmd->add_option("--threads", config->threads, "Threads (default: all cores)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--repeats", config->repeats, "Timed repeats after the warm-up (median reported)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--rounds", config->rounds,
                  "Time the whole table this many times, the rows in turn each round; a row's ms "
                  "is the median of its rounds' medians (the JSON lists each round's)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--check-limit", config->check_limit,
                  "Largest N*H*L*S for which err and approx_err are computed (float64 references)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  auto dtypes = std::make_shared<std::string>();
  cmd->add_option("--dtype", *dtypes,
                  "Comma list of input dtypes, float32, bfloat16 (default: float32); the paths "
                  "the kernels took and each bfloat16 row's speed against float32 are printed "
                  "after the table");
  cmd->add_option("--json", config->json, "Also write the results to this JSON file");
  cmd->add_flag("--no-peak{false}", config->measure_peak,
                "Skip the sgemm peak and torch.mm measurements (about a second natively, minutes "
                "under an emulator); %peak stays empty");
  cmd->callback([=] {
    if (*list) {
      std::cout << describe_mechanisms();
      return;
    }
    BenchConfig c = *config;
    if (!attention->empty()) c.attention = split_specs(*attention);
    if (!impl->empty()) c.impl = split_list(*impl);
    if (!pass->empty()) c.pass = split_list(*pass);
    if (!lengths->empty()) c.lengths = parse_positive_list("--lengths", *lengths);
    if (!dtypes->empty()) c.dtypes = split_list(*dtypes);
    resolve_specs("--attention", c.attention);  // refuses bad specs before any work
    check_choices("--impl", c.impl, {"fast", "reference", "torch", "torch-composite"});
    check_choices("--pass", c.pass, {"forward", "forward_backward"});
    check_choices("--dtype", c.dtypes, {"float32", "bfloat16"});
    run_bench(c);
  });
}

}  // namespace attnkit::cli
