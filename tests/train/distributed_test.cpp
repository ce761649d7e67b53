// Data-parallel training (include/attnkit/train/distributed.h): the options'
// checks, the gradient reducer in a one-process group, and `attnkit train`
// with several processes on loopback: the same parameters as one process with
// the global batch, a killed worker (the others stop within the timeout, the
// job resumes from the checkpoint and continues the loss curve), SIGINT to the
// launcher, and refused arguments.
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/distributed.h>
#include <attnkit/train/trainer.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"
#include "train/train_test_util.h"

extern char** environ;

namespace attnkit::train::distributed_test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

/// A one-process job on a TCPStore this test serves and holds (LauncherStore:
/// a port the system picks at bind, no window for another process to take it
/// between finding it free and binding it), as the launcher does.
std::unique_ptr<Communicator> connect_alone(LauncherStore& store) {
  return Communicator::connect(DistributedOptions().master_port(store.port()).launcher_store(true).timeout(20));
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// A child process running the attnkit CLI with `args`, stdout and stderr
/// into files, the environment plus `env` (NAME=value), minus the variables
/// of a data-parallel job (the test's own environment must not leak in).
struct Child {
  pid_t pid = -1;
  std::string out, err;

  Child(const std::vector<std::string>& args, const std::string& log_prefix,
        const std::vector<std::string>& env = {}) {
    out = log_prefix + ".out";
    err = log_prefix + ".err";
    std::vector<std::string> argv_s{ATTNKIT_CLI};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_s;
    for (char** e = environ; *e; ++e) {
      const std::string entry = *e, name = entry.substr(0, entry.find('='));
      if (name != "RANK" && name != "WORLD_SIZE" && name != "MASTER_ADDR" && name != "MASTER_PORT" &&
          name != "ATTNKIT_WORKER" && name != "LOCAL_RANK" && name != "ATTNKIT_LAUNCHER_STORE")
        env_s.push_back(entry);
    }
    env_s.insert(env_s.end(), env.begin(), env.end());
    std::vector<char*> envp;
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw std::runtime_error("posix_spawn " + argv_s[0] + " failed");
  }
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  /// The wait status, or -1 when it has not exited within `seconds`.
  int wait(double seconds) {
    const double until = now_seconds() + seconds;
    while (true) {
      int status = 0;
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        pid = -1;
        return status;
      }
      if (now_seconds() > until) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::string output() const { return read_text(out) + read_text(err); }
};

/// The tiny char-lm model of these tests: dropout off, one thread per process.
std::vector<std::string> model_args(const std::string& out) {
  return {"train", "--task", "char-lm", "--data", testing::char_lm_data(), "--layers", "2", "--width", "32",
          "--heads", "2", "--ffn", "64", "--context", "32", "--dropout", "0", "--positions", "sinusoidal",
          "--seed", "1", "--lr", "3e-3", "--warmup", "2", "--threads", "1", "--display", "plain",
          "--eval-batches", "2", "--out", out};
}

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

bool exited_ok(int status) { return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0; }

std::vector<json> metrics_of(const std::string& run) {
  std::vector<json> out;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

/// The largest |a - b| over the parameters of the newest checkpoints of two runs.
double max_parameter_difference(const std::string& run_a, const std::string& run_b) {
  auto a = load_run(run_a), b = load_run(run_b);
  EXPECT_EQ(a.step, b.step);
  const auto pa = a.model->named_parameters(), pb = b.model->named_parameters();
  EXPECT_EQ(pa.size(), pb.size());
  double diff = 0;
  for (const auto& item : pa) diff = std::max(diff, (item.value() - pb[item.key()]).abs().max().item<double>());
  return diff;
}

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

TEST(DistributedOptions, RefusesBadValuesNamingThem) {
  auto refused = [](const DistributedOptions& o, const std::string& expected) {
    try {
      validate(o);
      ADD_FAILURE() << "accepted; expected an error with '" << expected << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  validate(DistributedOptions());
  refused(DistributedOptions().world_size(0), "world size 0 is outside [1, 65536]");
  refused(DistributedOptions().world_size(2).rank(2), "rank 2 is outside [0, 1] (world size 2)");
  refused(DistributedOptions().world_size(2).rank(-1), "rank -1 is outside [0, 1]");
  refused(DistributedOptions().master_port(0), "master port 0 is outside [1, 65535]");
  refused(DistributedOptions().master_port(70000), "master port 70000 is outside [1, 65535]");
  refused(DistributedOptions().master_addr(""), "master address is empty");
  refused(DistributedOptions().timeout(0), "timeout");
  refused(DistributedOptions().timeout(NAN), "timeout");
  refused(DistributedOptions().bucket_bytes(0), "bucket size 0 bytes");
}

TEST(DistributedOptions, EnvironmentVariables) {
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "3", 1);
  ::setenv("MASTER_ADDR", "10.0.0.7", 1);
  ::setenv("MASTER_PORT", "1234", 1);
  DistributedOptions o;
  EXPECT_TRUE(distributed_from_environment(o));
  EXPECT_EQ(o.world_size(), 4);
  EXPECT_EQ(o.rank(), 3);
  EXPECT_EQ(o.master_addr(), "10.0.0.7");
  EXPECT_EQ(o.master_port(), 1234);
  ::setenv("WORLD_SIZE", "four", 1);
  try {
    distributed_from_environment(o);
    ADD_FAILURE() << "WORLD_SIZE=four accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("WORLD_SIZE='four' is not an integer"), std::string::npos) << e.what();
  }
  for (const char* name : {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
  DistributedOptions none;
  EXPECT_FALSE(distributed_from_environment(none));
  EXPECT_EQ(none.world_size(), 1);
  EXPECT_FALSE(none.launcher_store());
  // The launcher's own store: rank 0 connects instead of serving.
  ::setenv("ATTNKIT_LAUNCHER_STORE", "1", 1);
  DistributedOptions launched;
  distributed_from_environment(launched);
  EXPECT_TRUE(launched.launcher_store());
  ::setenv("ATTNKIT_LAUNCHER_STORE", "yes", 1);
  EXPECT_THROW(distributed_from_environment(launched), std::invalid_argument);
  ::unsetenv("ATTNKIT_LAUNCHER_STORE");
}

TEST(LauncherStore, AnAddressThatDoesNotReachThisHostFailsAtOnce) {
  // 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never a host's own address.
  const double start = now_seconds();
  EXPECT_THROW(LauncherStore("192.0.2.1", 2), DistributedError);
  EXPECT_LT(now_seconds() - start, 10.0);
  LauncherStore here("127.0.0.1", 20);
  EXPECT_GT(here.port(), 0);
}

TEST(DistributedOptions, DropoutSeedsDifferPerRankAndStep) {
  EXPECT_EQ(dropout_seed(1, 5, 0), dropout_seed(1, 5, 0));
  EXPECT_NE(dropout_seed(1, 5, 0), dropout_seed(1, 5, 1));
  EXPECT_NE(dropout_seed(1, 5, 0), dropout_seed(1, 6, 0));
  EXPECT_NE(dropout_seed(1, 5, 0), dropout_seed(2, 5, 0));
}

TEST(DistributedTrainer, RefusesABatchNotDivisibleByTheProcesses) {
  testing::ScratchDir dir;
  const auto model = models::TransformerOptions().layers(1).width(16).heads(2).ffn(32);
  try {
    Trainer t(TrainerOptions().batch(6).context(16).steps(2).out((dir.path() / "run").string()), model,
              {"char-lm", testing::char_lm_data(), 0}, DistributedOptions().world_size(4).rank(1));
    ADD_FAILURE() << "batch 6 over 4 processes accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("the batch 6 (the global batch: sequences per step over all processes) is "
                                         "not divisible by 4 processes"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.path() / "run"));
}

// ---------------------------------------------------------------------------
// The reducer in a group of one process (loopback): the hooks fire during the
// backward pass, every parameter's gradient survives the round trip, a tied
// and an unused parameter included.
// ---------------------------------------------------------------------------

TEST(GradientReducer, OneProcessKeepsTheGradientsAndOverlapsTheBackwardPass) {
  LauncherStore store("127.0.0.1", 20);
  auto comm = connect_alone(store);
  EXPECT_EQ(comm->world_size(), 1);
  torch::manual_seed(3);
  auto w1 = torch::randn({64, 32}).requires_grad_();
  auto w2 = torch::randn({32, 16}).requires_grad_();
  auto unused = torch::randn({7}).requires_grad_();
  auto b = torch::randn({16}).requires_grad_();
  // Buckets of >= 1 KiB: w2 + b (2112 bytes), then w1 (8 KiB) and unused.
  GradientReducer reducer(*comm, {w1, unused, w2, b}, 1024, /*overlap=*/true);
  EXPECT_EQ(reducer.bytes(), (64 * 32 + 7 + 32 * 16 + 16) * 4);
  EXPECT_EQ(reducer.buckets(), 2u);
  const auto x = torch::randn({5, 64});
  for (int step = 0; step < 2; ++step) {
    for (auto* p : {&w1, &w2, &unused, &b})
      if (p->grad().defined()) p->mutable_grad().zero_();
    reducer.prepare();
    // w1 used twice (as a tied weight is).
    const auto h = torch::tanh(x.matmul(w1) + 0.5 * x.matmul(w1));
    const auto loss = (h.matmul(w2) + b).pow(2).sum();
    loss.backward();
    const auto g1 = w1.grad().clone(), g2 = w2.grad().clone(), gb = b.grad().clone();
    reducer.finish();
    // The bucket of b and w2 (the last parameters: bucket 0) was launched
    // during the backward pass; the one with `unused` is never ready:
    // finish() launched it.
    EXPECT_EQ(reducer.last_launched_in_backward(), 1u);
    EXPECT_TRUE(torch::equal(w1.grad(), g1));
    EXPECT_TRUE(torch::equal(w2.grad(), g2));
    EXPECT_TRUE(torch::equal(b.grad(), gb));
    ASSERT_TRUE(unused.grad().defined());
    EXPECT_EQ(unused.grad().abs().sum().item<float>(), 0.0f);
  }
}

TEST(GradientReducer, LaunchesBucketsDuringTheBackwardPass) {
  LauncherStore store("127.0.0.1", 20);
  auto comm = connect_alone(store);
  torch::manual_seed(4);
  auto w1 = torch::randn({64, 32}).requires_grad_();
  auto w2 = torch::randn({32, 16}).requires_grad_();
  GradientReducer reducer(*comm, {w1, w2}, 1, /*overlap=*/true);  // one bucket per parameter
  EXPECT_EQ(reducer.buckets(), 2u);
  reducer.prepare();
  torch::tanh(torch::randn({5, 64}).matmul(w1)).matmul(w2).sum().backward();
  reducer.finish();
  EXPECT_EQ(reducer.last_launched_in_backward(), 2u);
  // Without overlap, nothing is launched before finish().
  GradientReducer sequential(*comm, {w1, w2}, 1, /*overlap=*/false);
  sequential.prepare();
  torch::tanh(torch::randn({5, 64}).matmul(w1)).matmul(w2).sum().backward();
  sequential.finish();
  EXPECT_EQ(sequential.last_launched_in_backward(), 0u);
}

// Mixed precision: the hooks watch bfloat16 working copies, the buckets take
// their gradients in float32, the float32 parameters receive the mean (in a
// one-process group: the copies' gradients, converted exactly).
TEST(GradientReducer, ReducesTheBf16GradientsOfWorkingCopiesIntoFloat32Parameters) {
  LauncherStore store("127.0.0.1", 20);
  auto comm = connect_alone(store);
  torch::manual_seed(5);
  auto w1 = torch::randn({64, 32}).requires_grad_();
  auto w2 = torch::randn({32, 16}).requires_grad_();
  auto c1 = w1.detach().to(torch::kBFloat16).requires_grad_();
  auto c2 = w2.detach().to(torch::kBFloat16).requires_grad_();
  GradientReducer reducer(*comm, {w1, w2}, 1, /*overlap=*/true, {c1, c2});  // one bucket per parameter
  EXPECT_EQ(reducer.bytes(), (64 * 32 + 32 * 16) * 4);  // float32 buckets
  reducer.prepare();
  torch::tanh(torch::randn({5, 64}).to(torch::kBFloat16).matmul(c1)).matmul(c2).sum().backward();
  EXPECT_FALSE(w1.grad().defined());
  reducer.finish();
  EXPECT_EQ(reducer.last_launched_in_backward(), 2u);  // the copies' hooks fired
  ASSERT_TRUE(w1.grad().defined() && w2.grad().defined());
  EXPECT_EQ(w1.grad().scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(w1.grad(), c1.grad().to(torch::kFloat32)));
  EXPECT_TRUE(torch::equal(w2.grad(), c2.grad().to(torch::kFloat32)));
  // One source per parameter, of its shape.
  auto error_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "(no error)";
  };
  EXPECT_NE(error_of([&] { GradientReducer(*comm, {w1, w2}, 1, true, {c1}); })
                .find("1 gradient sources for 2 parameters"),
            std::string::npos);
  EXPECT_NE(error_of([&] { GradientReducer(*comm, {w1, w2}, 1, true, {c2, c1}); })
                .find("gradient source 0 must be a floating-point leaf that requires grad, of its parameter's shape"),
            std::string::npos);
}

// ---------------------------------------------------------------------------
// `attnkit train` with several processes on loopback.
// ---------------------------------------------------------------------------

// Two processes with batch 4 each end where one process with batch 8 ends.
//
// Why they differ at all. The two runs do the same arithmetic except for the
// order of float32 sums: each rank's weight gradients sum over its own 4 x 32
// positions and the all-reduce adds the two halves, where one process sums
// all 8 x 32 in its GEMM's order (oneDNN also blocks a 128-row and a 256-row
// product differently), and the mean is (a + b) / 2 instead of one sum. So a
// gradient element differs by a few units of float32 rounding (2^-24 = 6e-8)
// of the magnitudes summed: an absolute perturbation d of a gradient g.
//
// The bound. AdamW's update lr m/(sqrt(v) + eps) is invariant to the
// gradient's scale, so d moves an update by about lr d/|g|: nothing where
// |g| >> d, up to lr where g is itself at the rounding level. Two kinds of
// parameters, two bounds:
//  - The key projections' biases have a gradient that is exactly zero in
//    exact arithmetic (q . b_k adds the same constant to every score of a
//    row, which the softmax ignores): they follow rounding noise, which AdamW
//    turns into steps of up to lr. Any two float32 computations that sum in
//    different orders move them apart by up to steps x lr: bound
//    4 x 3e-3 = 1.2e-2, which says nothing but that they stay finite
//    (measured: 6.5e-5).
//  - Every other parameter has a gradient far above rounding for almost all
//    elements: their update differences are lr d/|g| ~ 3e-3 x 1e-6 per step.
//    Bounds: at most 0.1% of their elements differ by more than 1e-6 (a few
//    float32 ulps of weights of magnitude 0.1-1; measured: 1 of 17,952), none
//    by more than 1e-5 (an element whose gradient cancels to 1e-3 of its
//    summands; measured max 2.8e-6).
// A wrong shard (rank 1 reading rank 0's rows) moves every parameter by ~lr
// = 3e-3 per step, far outside both; a missing average would be hidden by
// AdamW's scale invariance, so the gradient norm and the loss of every step
// are compared too, relatively to 1e-5 (measured: 1e-8).
TEST(DataParallelCli, TwoProcessesMatchOneProcessWithTheGlobalBatch) {
  testing::ScratchDir dir;
  const std::string one = (dir.path() / "one").string(), two = (dir.path() / "two").string();
  Child single(model_args(one) + std::vector<std::string>{"--batch", "8", "--steps", "4", "--log-every", "1"},
               (dir.path() / "single").string());
  Child pair(model_args(two) + std::vector<std::string>{"--batch", "8", "--steps", "4", "--log-every", "1",
                                                         "--nproc", "2", "--bucket-mb", "0.01"},
             (dir.path() / "pair").string());
  const int s1 = single.wait(120), s2 = pair.wait(120);
  ASSERT_TRUE(exited_ok(s1)) << single.output();
  ASSERT_TRUE(exited_ok(s2)) << pair.output();
  EXPECT_NE(pair.output().find("trained to step 4 of 4"), std::string::npos) << pair.output();
  auto a = load_run(one), b = load_run(two);
  ASSERT_EQ(a.step, 4);
  ASSERT_EQ(b.step, 4);
  const auto pa = a.model->named_parameters(), pb = b.model->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  double noise_diff = 0, diff = 0;
  int64_t elements = 0, above_1e6 = 0, key_biases = 0;
  for (const auto& item : pa) {
    const auto d = (item.value() - pb[item.key()]).abs();
    const std::string& name = item.key();
    if (name.size() >= 11 && name.compare(name.size() - 11, 11, "k_proj.bias") == 0) {
      noise_diff = std::max(noise_diff, d.max().item<double>());
      ++key_biases;
      continue;
    }
    diff = std::max(diff, d.max().item<double>());
    elements += d.numel();
    above_1e6 += (d > 1e-6).sum().item<int64_t>();
  }
  std::cout << "after 4 steps: max |difference| " << diff << ", " << above_1e6 << " of " << elements
            << " elements above 1e-6; key biases (zero gradient) " << noise_diff << "\n";
  EXPECT_EQ(key_biases, 2);  // one per block
  EXPECT_LE(diff, 1e-5);
  EXPECT_LE(above_1e6, elements / 1000);
  EXPECT_LE(noise_diff, 4 * 3e-3);
  const auto m1 = metrics_of(one), m2 = metrics_of(two);
  ASSERT_EQ(m1.size(), 4u);
  ASSERT_EQ(m2.size(), 4u);
  for (std::size_t i = 0; i < m1.size(); ++i) {
    EXPECT_EQ(m2[i]["world_size"].template get<int>(), 2);
    EXPECT_GT(m2[i]["allreduce_bytes"].get<int64_t>(), 0);
    EXPECT_GT(m2[i]["allreduce_buckets"].get<int64_t>(), 1);
    for (const char* key : {"loss", "grad_norm", "accuracy"})
      EXPECT_NEAR(m2[i][key].get<double>(), m1[i][key].get<double>(), 1e-5 * std::abs(m1[i][key].get<double>()))
          << key << " at record " << i;
    EXPECT_EQ(m1[i].contains("valid_loss"), m2[i].contains("valid_loss"));
    if (m1[i].contains("valid_loss")) {  // validation split over the two ranks: sums in another order
      EXPECT_NEAR(m2[i]["valid_loss"].get<double>(), m1[i]["valid_loss"].get<double>(),
                  1e-5 * m1[i]["valid_loss"].get<double>());
    }
  }
  // Only rank 0 wrote: one metrics file, checkpoints, nothing else per rank.
  EXPECT_EQ(list_checkpoints(two).size(), 1u);
}

// bf16: two processes with batch 4 each against one with batch 8, one step.
// Both start from the same float32 weights and round them to the same bf16
// copy; they differ where the bf16 arithmetic does (each rank's bf16 weight
// gradients sum 4 x 32 positions and are rounded to bf16 before the float32
// all-reduce, one process rounds the sum of 8 x 32 once): relative 2^-8 of a
// gradient's summands. AdamW's first step moves every element by
// lr g / (|g| + eps) = +-lr, so the two runs agree exactly except where that
// noise flips the sign of a gradient that cancels to the noise level (and the
// key biases, whose gradient is zero in exact arithmetic: pure noise). Where
// |g| is within a few orders of eps = 1e-8, the relative noise moves
// g / (|g| + eps) a little: many elements differ by far less than lr / 100
// (measured: 7.6% of them, max 8e-6 = lr / 190). Bounds: at most 0.1% of the
// other elements differ by more than lr / 100 (measured: 3 of 17,952), none
// by more than 2 lr (a flipped sign). Rank 1 reading rank 0's rows, or
// gradients not reduced, would flip about half of them. The step's loss is the same
// computation on the same bf16 weights, sharded: within 1e-3 relative; the
// gradient norm (of the float32 mean gradient) within 2^-7.
TEST(DataParallelCli, Bf16TwoProcessesMatchOneProcessWithTheGlobalBatch) {
  testing::ScratchDir dir;
  const std::string one = (dir.path() / "one").string(), two = (dir.path() / "two").string();
  const std::vector<std::string> args{"--dtype", "bf16", "--batch", "8", "--steps", "1", "--log-every", "1"};
  Child single(model_args(one) + args, (dir.path() / "single").string());
  Child pair(model_args(two) + args + std::vector<std::string>{"--nproc", "2", "--bucket-mb", "0.01"},
             (dir.path() / "pair").string());
  const int s1 = single.wait(120), s2 = pair.wait(120);
  ASSERT_TRUE(exited_ok(s1)) << single.output();
  ASSERT_TRUE(exited_ok(s2)) << pair.output();
  auto a = load_run(one), b = load_run(two);
  EXPECT_EQ(a.trainer.dtype(), DType::bf16);
  EXPECT_EQ(b.trainer.dtype(), DType::bf16);
  const auto pa = a.model->named_parameters(), pb = b.model->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  const double lr = 3e-3 * 1 / 2;  // warm-up: step 1 of 2
  int64_t elements = 0, differ = 0;
  double diff = 0;
  for (const auto& item : pa) {
    EXPECT_EQ(pb[item.key()].scalar_type(), torch::kFloat32);
    const auto d = (item.value() - pb[item.key()]).abs();
    const std::string& name = item.key();
    if (name.size() >= 11 && name.compare(name.size() - 11, 11, "k_proj.bias") == 0) continue;
    diff = std::max(diff, d.max().item<double>());
    elements += d.numel();
    differ += (d > lr / 100).sum().item<int64_t>();
  }
  std::cout << "bf16, one step: " << differ << " of " << elements << " elements differ by more than lr / 100, max "
            << diff << " (lr " << lr << ")\n";
  EXPECT_LE(differ, elements / 1000);
  EXPECT_LE(diff, 2 * lr * (1 + 1e-3));
  const auto m1 = metrics_of(one), m2 = metrics_of(two);
  ASSERT_EQ(m1.size(), 1u);
  ASSERT_EQ(m2.size(), 1u);
  EXPECT_NEAR(m2[0]["loss"].get<double>(), m1[0]["loss"].get<double>(), 1e-3 * m1[0]["loss"].get<double>());
  EXPECT_NEAR(m2[0]["grad_norm"].get<double>(), m1[0]["grad_norm"].get<double>(),
              std::ldexp(m1[0]["grad_norm"].get<double>(), -7));
}

// A worker killed with SIGKILL mid-run: the other one stops with an error
// within its timeout (no hang); --resume (here with the launcher) continues
// from the last checkpoint and ends where an uninterrupted run ends.
TEST(DataParallelCli, KilledWorkerStopsTheOthersAndTheJobResumes) {
  testing::ScratchDir dir;
  const std::string run = (dir.path() / "run").string(), reference = (dir.path() / "reference").string();
  const std::vector<std::string> schedule{"--batch", "4", "--steps", "300", "--log-every", "10",
                                          "--checkpoint-every", "20", "--eval-every", "0"};
  const double timeout = 20;
  // The workers' TCPStore, served here as the launcher serves it: the port
  // stays held from bind to the end (a port found free, closed and bound by
  // rank 0 later could be taken in between on a loaded machine).
  LauncherStore store("127.0.0.1", 60);
  const std::string port = std::to_string(store.port());
  auto worker = [&](int rank) {
    return std::make_unique<Child>(
        model_args(run) + schedule +
            std::vector<std::string>{"--world-size", "2", "--rank", std::to_string(rank), "--master-port", port,
                                     "--dist-timeout", "20"},
        (dir.path() / ("rank" + std::to_string(rank))).string(),
        std::vector<std::string>{"ATTNKIT_LAUNCHER_STORE=1"});
  };
  auto rank0 = worker(0), rank1 = worker(1);
  // Wait for the first checkpoint, then kill rank 1.
  const double until = now_seconds() + 120;
  while (list_checkpoints(run).empty() && now_seconds() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_FALSE(list_checkpoints(run).empty()) << rank0->output() << rank1->output();
  ASSERT_EQ(::kill(rank1->pid, SIGKILL), 0);
  const double killed_at = now_seconds();
  const int killed = rank1->wait(10);
  EXPECT_TRUE(killed >= 0 && WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL) << killed;
  const int status = rank0->wait(timeout + 10);
  const double stopped_after = now_seconds() - killed_at;
  ASSERT_GE(status, 0) << "rank 0 still running " << timeout + 10 << " s after its peer was killed";
  EXPECT_FALSE(exited_ok(status)) << rank0->output();
  EXPECT_LE(stopped_after, timeout + 5);
  const std::string said = rank0->output();
  EXPECT_NE(said.find("attnkit: rank 0: "), std::string::npos) << said;
  EXPECT_NE(said.find("restart the job with --resume"), std::string::npos) << said;
  std::cout << "rank 0 stopped " << stopped_after << " s after rank 1 was killed:\n" << read_text(rank0->err);
  const auto checkpoints = list_checkpoints(run);
  ASSERT_FALSE(checkpoints.empty());
  const int64_t resumed_step = checkpoints[0].step;
  ASSERT_LT(resumed_step, 300);

  // Resume with the launcher (2 workers) and compare with an uninterrupted run.
  Child resumed(model_args(run) + schedule + std::vector<std::string>{"--nproc", "2", "--resume"},
                (dir.path() / "resumed").string());
  Child uninterrupted(model_args(reference) + schedule + std::vector<std::string>{"--nproc", "2"},
                      (dir.path() / "reference").string());
  ASSERT_TRUE(exited_ok(resumed.wait(300))) << resumed.output();
  ASSERT_TRUE(exited_ok(uninterrupted.wait(300))) << uninterrupted.output();
  EXPECT_NE(resumed.output().find("resuming from"), std::string::npos) << resumed.output();
  const auto a = metrics_of(run), b = metrics_of(reference);
  ASSERT_EQ(a.size(), b.size());  // 30 records: the ones after the checkpoint were trimmed and redone
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>())
        << "step " << a[i]["step"] << " (resumed from step " << resumed_step << ")";
  }
  const double diff = max_parameter_difference(run, reference);
  // The same P, one thread per rank: the same arithmetic in the same order
  // (Gloo's sum of two halves is a + b on both ranks), so bitwise equal.
  EXPECT_EQ(diff, 0.0);
}

// The launcher: a worker killed with SIGKILL makes it stop the other and exit
// non-zero, naming the worker; SIGINT to the launcher stops every worker after
// the same step with rank 0's checkpoint, and the run resumes with another
// number of processes.
TEST(DataParallelCli, LauncherStopsOnADeadWorkerAndOnSigint) {
  testing::ScratchDir dir;
  const std::string run = (dir.path() / "run").string();
  const std::vector<std::string> schedule{"--batch", "4", "--steps", "100000", "--log-every", "10",
                                          "--checkpoint-every", "20", "--nproc", "2"};
  auto children_of = [](pid_t pid) {
    std::vector<pid_t> out;
    std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
    for (pid_t c; in >> c;) out.push_back(c);
    return out;
  };
  {
    Child launcher(model_args(run) + schedule, (dir.path() / "launcher1").string());
    const double until = now_seconds() + 120;
    while (list_checkpoints(run).empty() && now_seconds() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    auto workers = children_of(launcher.pid);
    ASSERT_EQ(workers.size(), 2u) << launcher.output();
    // Rank 1: the worker whose environment says RANK=1.
    auto rank_of = [](pid_t pid) {
      std::ifstream in("/proc/" + std::to_string(pid) + "/environ");
      for (std::string entry; std::getline(in, entry, '\0');)
        if (entry.rfind("RANK=", 0) == 0) return std::stoi(entry.substr(5));
      return -1;
    };
    if (rank_of(workers[1]) != 1) std::swap(workers[0], workers[1]);
    ASSERT_EQ(rank_of(workers[1]), 1);
    ASSERT_EQ(::kill(workers[1], SIGKILL), 0);
    const int status = launcher.wait(30);
    ASSERT_GE(status, 0) << "the launcher did not stop";
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGKILL) << status << launcher.output();
    EXPECT_NE(launcher.output().find("worker rank 1 (pid " + std::to_string(workers[1]) +
                                     ") was killed by signal 9"),
              std::string::npos)
        << launcher.output();
    for (pid_t w : workers) EXPECT_NE(::kill(w, 0), 0) << "worker " << w << " survived";
  }
  {
    const int64_t before = list_checkpoints(run)[0].step;
    Child launcher(model_args(run) + schedule + std::vector<std::string>{"--resume"},
                   (dir.path() / "launcher2").string());
    const double until = now_seconds() + 120;
    while (list_checkpoints(run)[0].step == before && now_seconds() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_EQ(::kill(launcher.pid, SIGINT), 0);
    const int status = launcher.wait(60);
    ASSERT_TRUE(exited_ok(status)) << status << launcher.output();
    const std::string said = launcher.output();
    EXPECT_NE(said.find("stopped by SIGINT after step"), std::string::npos) << said;
    EXPECT_NE(said.find("interrupted at step"), std::string::npos) << said;
  }
  // Resume with one process (the batch 4 is divisible by any P in 1, 2, 4).
  const int64_t at = list_checkpoints(run)[0].step;
  Child single(model_args(run) + std::vector<std::string>{"--steps", std::to_string(at + 5), "--resume"},
               (dir.path() / "single").string());
  ASSERT_TRUE(exited_ok(single.wait(120))) << single.output();
  EXPECT_EQ(list_checkpoints(run)[0].step, at + 5);
}

TEST(DataParallelCli, RefusesBadArguments) {
  testing::ScratchDir dir;
  const std::string run = (dir.path() / "run").string();
  auto refused = [&](const std::vector<std::string>& extra, const std::string& expected,
                     const std::vector<std::string>& env = {}) {
    Child c(model_args(run) + extra, (dir.path() / "refused").string(), env);
    const int status = c.wait(60);
    ASSERT_GE(status, 0);
    EXPECT_FALSE(exited_ok(status)) << "accepted: " << extra.size();
    EXPECT_NE(c.output().find(expected), std::string::npos) << c.output();
    EXPECT_FALSE(fs::exists(run)) << "a refused command created the run directory";
  };
  refused({"--batch", "6", "--nproc", "4"}, "the batch 6 (the global batch: sequences per step over all processes) "
                                            "is not divisible by 4 processes");
  refused({"--nproc", "2", "--rank", "1"}, "--nproc starts a whole job on this machine");
  refused({"--world-size", "2"}, "needs this process's --rank (or RANK)");
  refused({"--world-size", "2", "--rank", "2"}, "rank 2 is outside [0, 1] (world size 2)");
  refused({"--world-size", "2", "--rank", "0", "--master-port", "70000"}, "master port 70000 is outside [1, 65535]");
  refused({"--nproc", "0"}, "--nproc");
  refused({"--dist-timeout", "0", "--nproc", "2"}, "--dist-timeout");
  refused({}, "WORLD_SIZE='two' is not an integer", {"WORLD_SIZE=two", "RANK=0"});
  refused({}, "needs this process's --rank (or RANK)", {"WORLD_SIZE=2"});
}

}  // namespace
}  // namespace attnkit::train::distributed_test
