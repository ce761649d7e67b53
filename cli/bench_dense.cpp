// `attnkit bench-dense`: the dense layer (attnkit::linear) against the sgemm
// peak and against libtorch's linear, in each dtype asked for (--dtype
// float32,bfloat16 times both in one run, with the bf16 path named), and
// MultiheadAttention's forward+backward (float32) on attnkit::linear against
// the same module with libtorch's projections.
#include <attnkit/nn/multihead.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <torch/torch.h>

#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "commands.h"

namespace attnkit::cli {

namespace {

struct DenseConfig {
  int threads = 1;
  int64_t rows = 8192, in = 512, out = 2048;
  int64_t width = 512, heads = 8, length = 4096;
  int repeats = 5;
  std::vector<std::string> dtypes{"float32"};
  std::string json;
};

torch::ScalarType parse_dtype(const std::string& name) {
  return name == "bfloat16" ? torch::kBFloat16 : torch::kFloat;
}

/// The module's forward with libtorch's linear for every projection (what the
/// module computed before attnkit::linear existed); the attention is the same op.
torch::Tensor mha_on_torch_linear(nn::MultiheadAttention& m, const torch::Tensor& x) {
  const int64_t N = x.size(0), L = x.size(1), d = m->options.width(), H = m->options.heads();
  auto proj = [](nn::Linear& lin, const torch::Tensor& t) {
    return torch::nn::functional::linear(t, lin->weight, lin->bias);
  };
  auto heads = [&](const torch::Tensor& t) { return t.view({N, L, H, d / H}).transpose(1, 2); };
  auto a = softmax_attention(heads(proj(m->q_proj, x)), heads(proj(m->k_proj, x)),
                             heads(proj(m->v_proj, x)));
  return proj(m->out_proj, a.transpose(1, 2).reshape({N, L, d}));
}

void run_dense(const DenseConfig& c) {
  set_num_threads(c.threads);
  at::set_num_threads(num_threads());
  MachineRecord machine = MachineRecord::measure();
  std::cout << machine.header() << "\n";
  nlohmann::json doc;
  doc["results"] = nlohmann::json::array();

  std::cout << std::left << std::setw(42) << "case" << std::setw(11) << "impl" << std::setw(17)
            << "pass" << std::right << std::setw(11) << "ms" << std::setw(10) << "GFLOP/s"
            << std::setw(7) << "%peak" << "\n";
  auto row = [&](const std::string& name, const std::string& impl, const std::string& pass,
                 double ms, double flop, const nlohmann::json& extra = nlohmann::json::object()) {
    const double gflops = flop / (ms * 1e6);
    std::cout << std::left << std::setw(42) << name << std::setw(11) << impl << std::setw(17) << pass
              << std::right << std::setw(11) << fmt(ms, 2) << std::setw(10) << fmt(gflops, 1)
              << std::setw(7) << fmt(100 * gflops / machine.sgemm_gflops, 0) << "\n";
    nlohmann::json r = {{"case", name}, {"impl", impl}, {"pass", pass}, {"ms", ms},
                        {"gflops", gflops}, {"fraction_of_peak", gflops / machine.sgemm_gflops}};
    r.update(extra);
    doc["results"].push_back(r);
    doc["machine"] = machine.to_json();
    if (!c.json.empty()) write_json_atomically(c.json, doc);
  };

  // The dense layer alone, in each dtype: the same values (drawn in float32,
  // then converted), ours and libtorch's.
  torch::manual_seed(0);
  const auto x0 = torch::randn({c.rows, c.in});
  const auto w0 = torch::randn({c.out, c.in}) / std::sqrt(double(c.in));
  const auto b0 = torch::randn({c.out});
  const double fwd_flop = 2.0 * c.rows * c.in * c.out;
  const std::string shape = "linear x(" + std::to_string(c.rows) + "," + std::to_string(c.in) +
                            ") W(" + std::to_string(c.out) + "," + std::to_string(c.in) + ")";
  std::map<std::string, std::map<std::string, double>> linear_ms;  // ours: dtype -> pass -> ms
  std::vector<std::string> paths;
  for (const auto& dtype_name : c.dtypes) {
    const auto dtype = parse_dtype(dtype_name);
    // Copies (to() of the same dtype would return x0 itself, whose
    // requires_grad would then make the next dtype's conversion a non-leaf).
    auto leaf = [&](const torch::Tensor& t) { return t.to(dtype, false, true).requires_grad_(); };
    auto x = leaf(x0), w = leaf(w0), b = leaf(b0);
    auto clear = [&] {
      for (auto* t : {&x, &w, &b})
        if (t->grad().defined()) t->mutable_grad().reset();
    };
    const Dispatch d = linear_dispatch(x, w, b);
    // The path: the kernel's ISA level and how it ran (e.g. "kernel (amx;
    // bf16 via oneDNN matmul (amx))"), or why the composite runs.
    const std::string path = d.describe();
    paths.push_back(dtype_name + ": " + path);
    const auto dy = torch::ones({c.rows, c.out}, x.options().requires_grad(false));
    for (const bool ours : {true, false}) {
      auto f = [&] { return ours ? attnkit::linear(x, w, b) : torch::nn::functional::linear(x, w, b); };
      const std::string impl = ours ? to_string(d.backend) : "torch";
      const std::string name = shape + " " + dtype_name;
      const nlohmann::json extra = {{"dtype", dtype_name}, {"path", ours ? path : "libtorch"}};
      double ms;
      {
        torch::NoGradGuard no_grad;
        ms = median(time_ms([&] { f(); }, c.repeats));
        row(name, impl, "forward", ms, fwd_flop, extra);
        if (ours) linear_ms[dtype_name]["forward"] = ms;
      }
      // dx and dW each cost one forward product.
      ms = median(time_ms([&] { f().backward(dy); }, c.repeats, clear));
      row(name, impl, "forward_backward", ms, 3 * fwd_flop, extra);
      if (ours) linear_ms[dtype_name]["forward_backward"] = ms;
      machine.remeasure_peak();
    }
  }
  std::cout << "\n";
  for (const auto& p : paths) std::cout << "path " << p << "\n";
  if (linear_ms.count("float32") && linear_ms.count("bfloat16")) {
    for (const char* pass : {"forward", "forward_backward"}) {
      const double speedup = linear_ms["float32"][pass] / linear_ms["bfloat16"][pass];
      std::cout << "attnkit::linear bfloat16 " << pass << " is " << fmt(speedup, 2)
                << "x the float32 kernel\n";
      doc["bf16_speedup_over_float32"][pass] = speedup;
    }
  }
  std::cout << "\n";

  // MultiheadAttention forward+backward, projections on attnkit::linear vs libtorch.
  nn::MultiheadAttention m(nn::MultiheadAttentionOptions(c.width, c.heads));
  auto seq = torch::randn({1, c.length, c.width}).requires_grad_();
  const double d = c.width, L = c.length;
  const double mha_flop = 3 * (4 * 2 * L * d * d) + 3.5 * (4 * L * L * d);
  auto clear_mha = [&] {
    m->zero_grad();
    if (seq.grad().defined()) seq.mutable_grad().reset();
  };
  const std::string mha = "MultiheadAttention(" + std::to_string(c.width) + "," +
                          std::to_string(c.heads) + ") L=" + std::to_string(c.length);
  const double ours_ms = median(time_ms([&] { m->forward(seq, seq, seq).sum().backward(); }, c.repeats, clear_mha));
  row(mha, "kernel", "forward_backward", ours_ms, mha_flop);
  const double torch_ms =
      median(time_ms([&] { mha_on_torch_linear(m, seq).sum().backward(); }, c.repeats, clear_mha));
  row(mha + " on torch linear", "torch", "forward_backward", torch_ms, mha_flop);
  std::cout << "\nMultiheadAttention on attnkit::linear is " << fmt(torch_ms / ours_ms, 1)
            << "x faster than on libtorch's linear (" << machine.torch_blas << ")\n"
            << "%peak: GFLOP/s over the best sgemm peak measured before the row; the best of the\n"
            << "run is " << fmt(machine.sgemm_gflops, 1)
            << " GFLOP/s (the JSON's fraction_of_peak uses it); backward = 2x forward for linear\n";
  doc["mha_speedup_over_torch_linear"] = torch_ms / ours_ms;
  for (auto& r : doc["results"]) r["fraction_of_peak"] = r["gflops"].get<double>() / machine.sgemm_gflops;
  doc["machine"] = machine.to_json();
  if (!c.json.empty()) {
    write_json_atomically(c.json, doc);
    std::cout << "wrote " << c.json << "\n";
  }
}

}  // namespace

void add_bench_dense_command(CLI::App& app) {
  auto c = std::make_shared<DenseConfig>();
  auto* cmd = app.add_subcommand(
      "bench-dense", "Time the dense layer and MultiheadAttention's projections against the sgemm peak "
                     "and libtorch");
  cmd->add_option("--threads", c->threads, "Threads")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--rows", c->rows, "Rows of x")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--in", c->in, "in_features")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--out", c->out, "out_features")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--width", c->width, "MultiheadAttention width")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", c->heads, "MultiheadAttention heads")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--length", c->length, "MultiheadAttention sequence length")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--repeats", c->repeats, "Timed repeats after the warm-up")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--dtype", c->dtypes,
                  "Dtypes of the dense-layer rows, comma-separated (float32, bfloat16); "
                  "MultiheadAttention runs in float32")
      ->delimiter(',')
      ->check(CLI::IsMember({"float32", "bfloat16"}))
      ->capture_default_str();
  cmd->add_option("--json", c->json, "Also write the results to this JSON file");
  cmd->callback([c] {
    if (c->width % c->heads != 0)
      throw CLI::ValidationError("--width", "must be a multiple of --heads");
    run_dense(*c);
  });
}

}  // namespace attnkit::cli
