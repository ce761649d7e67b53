// `attnkit bench-model`'s memory measurement: the peak memory of a training
// step, each measured in a fresh child process (this binary run with --child).
#include <attnkit/models/transformer.h>
#include <attnkit/runtime.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_model.h"
#include "bench_util.h"

namespace attnkit::cli::bench_model {

namespace {

/// The value of `key` ("VmHWM", "RssAnon", ...) of /proc/self/status in KiB, -1 if absent.
int64_t proc_status_kib(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  return -1;
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

}  // namespace

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

}  // namespace attnkit::cli::bench_model
