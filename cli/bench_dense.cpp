// `attnkit bench-dense`: the dense layer (attnkit::linear) against the sgemm
// peak and against libtorch's linear, and MultiheadAttention's forward+backward
// on attnkit::linear against the same module with libtorch's projections.
#include <attnkit/nn/multihead.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <torch/torch.h>

#include <iomanip>
#include <iostream>
#include <memory>

#include "bench_util.h"
#include "commands.h"

namespace attnkit::cli {

namespace {

struct DenseConfig {
  int threads = 1;
  int64_t rows = 8192, in = 512, out = 2048;
  int64_t embed = 512, heads = 8, length = 4096;
  int repeats = 5;
  std::string json;
};

/// The module's forward with libtorch's linear for every projection (what the
/// module computed before attnkit::linear existed); the attention is the same op.
torch::Tensor mha_on_torch_linear(nn::MultiheadAttention& m, const torch::Tensor& x) {
  const int64_t N = x.size(0), L = x.size(1), d = m->options.embed_dim(), H = m->options.heads();
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
                 double ms, double flop) {
    const double gflops = flop / (ms * 1e6);
    std::cout << std::left << std::setw(42) << name << std::setw(11) << impl << std::setw(17) << pass
              << std::right << std::setw(11) << fmt(ms, 2) << std::setw(10) << fmt(gflops, 1)
              << std::setw(7) << fmt(100 * gflops / machine.sgemm_gflops, 0) << "\n";
    doc["results"].push_back({{"case", name}, {"impl", impl}, {"pass", pass}, {"ms", ms},
                              {"gflops", gflops}, {"fraction_of_peak", gflops / machine.sgemm_gflops}});
    doc["machine"] = machine.to_json();
    if (!c.json.empty()) write_json_atomically(c.json, doc);
  };

  // The dense layer alone.
  torch::manual_seed(0);
  auto x = torch::randn({c.rows, c.in}).requires_grad_();
  auto w = (torch::randn({c.out, c.in}) / std::sqrt(double(c.in))).requires_grad_();
  auto b = torch::randn({c.out}).requires_grad_();
  const double fwd_flop = 2.0 * c.rows * c.in * c.out;
  const std::string shape = "linear x(" + std::to_string(c.rows) + "," + std::to_string(c.in) +
                            ") W(" + std::to_string(c.out) + "," + std::to_string(c.in) + ")";
  auto clear = [&] {
    for (auto* t : {&x, &w, &b})
      if (t->grad().defined()) t->mutable_grad().reset();
  };
  for (const bool ours : {true, false}) {
    auto f = [&] { return ours ? attnkit::linear(x, w, b) : torch::nn::functional::linear(x, w, b); };
    const std::string impl = ours ? to_string(linear_dispatch(x, w, b).backend) : "torch";
    {
      torch::NoGradGuard no_grad;
      row(shape, impl, "forward", median(time_ms([&] { f(); }, c.repeats)), fwd_flop);
    }
    // dx and dW each cost one forward product.
    row(shape, impl, "forward_backward",
        median(time_ms([&] { f().backward(torch::ones({c.rows, c.out})); }, c.repeats, clear)),
        3 * fwd_flop);
    machine.remeasure_peak();
  }

  // MultiheadAttention forward+backward, projections on attnkit::linear vs libtorch.
  nn::MultiheadAttention m(nn::MultiheadAttentionOptions(c.embed, c.heads));
  auto seq = torch::randn({1, c.length, c.embed}).requires_grad_();
  const double d = c.embed, L = c.length;
  const double mha_flop = 3 * (4 * 2 * L * d * d) + 3.5 * (4 * L * L * d);
  auto clear_mha = [&] {
    m->zero_grad();
    if (seq.grad().defined()) seq.mutable_grad().reset();
  };
  const std::string mha = "MultiheadAttention(" + std::to_string(c.embed) + "," +
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
  cmd->add_option("--embed", c->embed, "MultiheadAttention embed_dim")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", c->heads, "MultiheadAttention heads")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--length", c->length, "MultiheadAttention sequence length")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--repeats", c->repeats, "Timed repeats after the warm-up")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--json", c->json, "Also write the results to this JSON file");
  cmd->callback([c] {
    if (c->embed % c->heads != 0)
      throw CLI::ValidationError("--embed", "must be a multiple of --heads");
    run_dense(*c);
  });
}

}  // namespace attnkit::cli
