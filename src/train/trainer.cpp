// The training loop, checkpoints of a run, resume, loading a run for eval.
#include <attnkit/runtime.h>
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/clock.h>
#include <attnkit/train/distributed.h>
#include <attnkit/train/progress.h>
#include <attnkit/train/signals.h>
#include <attnkit/train/trainer.h>

#include <ATen/Parallel.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

namespace attnkit::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::size_t kKeepCheckpoints = 2;

void apply_threads(int threads) {
  if (threads <= 0) return;
  attnkit::set_num_threads(threads);
  at::set_num_threads(threads);
}

/// char-lm -> decoder, copy -> encoder: what the task needs of the model.
void check_architecture(const models::TransformerOptions& model, const tasks::Task& task) {
  using models::Architecture;
  if (model.architecture() == Architecture::encoder_decoder)
    throw std::invalid_argument("train: architecture 'encoder-decoder' needs source sequences; the " +
                                task.name() + " task gives one sequence per example (use decoder or encoder)");
  if (task.causal() && model.architecture() != Architecture::decoder)
    throw std::invalid_argument("train: task '" + task.name() +
                                "' predicts the next token and needs architecture 'decoder', got '" +
                                models::to_string(model.architecture()) + "'");
  if (model.vocab_size() != task.vocab_size())
    throw std::invalid_argument("train: the model's vocab_size " + std::to_string(model.vocab_size()) +
                                " differs from task '" + task.name() + "''s " +
                                std::to_string(task.vocab_size()));
}

/// Absolute data directory, so that a run can be evaluated from anywhere.
tasks::TaskOptions normalised(tasks::TaskOptions t) {
  if (!t.data_dir.empty()) t.data_dir = fs::weakly_canonical(fs::absolute(t.data_dir)).string();
  return t;
}

/// AdamW with decoupled weight decay on matrices (dim >= 2) and none on
/// vectors (biases, norms); every parameter once even when shared.
std::unique_ptr<torch::optim::AdamW> make_optimizer(models::Transformer& model, const TrainerOptions& o) {
  std::vector<torch::Tensor> decay, no_decay;
  std::unordered_set<const void*> seen;
  for (const auto& p : model->parameters()) {
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    (p.dim() >= 2 ? decay : no_decay).push_back(p);
  }
  auto options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(o.lr()).betas(o.betas()).eps(o.eps()).weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) groups.emplace_back(decay, options(o.weight_decay()));
  if (!no_decay.empty()) groups.emplace_back(no_decay, options(0.0));
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(o.lr()));
}

struct Header {
  int64_t step = 0;
  double elapsed = 0;
  TrainerOptions trainer;
  models::TransformerOptions model;
  tasks::TaskOptions task;
  std::string tensors;  // JSON array
};

Header parse_header(const CheckpointFile& file, const std::string& path) {
  auto refuse = [&](const std::string& problem) -> Header {
    throw std::runtime_error("checkpoint '" + path + "' refused: " + problem);
  };
  json j;
  try {
    j = json::parse(file.header);
  } catch (const json::exception& e) {
    return refuse(std::string("its header is not JSON: ") + e.what());
  }
  for (const char* key : {"step", "elapsed_seconds", "trainer", "model", "task", "tensors"})
    if (!j.contains(key)) return refuse(std::string("its header lacks '") + key + "'");
  Header h;
  try {
    h.step = j.at("step").get<int64_t>();
    h.elapsed = j.at("elapsed_seconds").get<double>();
    h.trainer = TrainerOptions::from_json(j.at("trainer").dump());
    h.model = models::TransformerOptions::from_json(j.at("model").dump());
    h.task = task_options_from_json(j.at("task").dump());
    h.tensors = j.at("tensors").dump();
  } catch (const c10::Error& e) {
    return refuse(std::string("its header does not describe a run: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return refuse(std::string("its header does not describe a run: ") + e.what());
  }
  return h;
}

/// The newest checkpoint of `run_dir`, read and verified. A corrupt newest
/// checkpoint is refused, not skipped: silently resuming from an older one
/// would repeat steps without saying so. The error names the file and says
/// how to fall back deliberately.
std::pair<CheckpointFile, Header> read_newest(const std::string& run_dir, std::string* path) {
  const auto entries = list_checkpoints(run_dir);
  if (entries.empty())
    throw std::runtime_error("no checkpoint in '" + run_dir + "' (expected checkpoint-<step>.ckpt files)");
  *path = entries[0].path;
  CheckpointFile file;
  try {
    file = read_checkpoint_file(entries[0].path);
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    if (entries.size() > 1)
      msg += ". The newest checkpoint is not skipped silently; to continue from the older '" +
             entries[1].path + "' (step " + std::to_string(entries[1].step) +
             "), move the refused file out of the run directory";
    throw std::runtime_error(msg);
  }
  auto header = parse_header(file, entries[0].path);
  if (header.step != entries[0].step)
    throw std::runtime_error("checkpoint '" + entries[0].path + "' refused: its header says step " +
                             std::to_string(header.step) + ", its name step " +
                             std::to_string(entries[0].step));
  return {std::move(file), std::move(header)};
}

/// The differences that would change a resumed run's trajectory; empty when it may resume.
std::vector<std::string> resume_mismatches(const Header& stored, const TrainerOptions& t,
                                           const models::TransformerOptions& m,
                                           const tasks::TaskOptions& task) {
  std::vector<std::string> out;
  const json stored_model = json::parse(stored.model.to_json()), model = json::parse(m.to_json());
  for (const auto& item : stored_model.items())
    if (!model.contains(item.key()) || model[item.key()] != item.value())
      out.push_back("model " + item.key() + ": checkpoint " + item.value().dump() + ", now " +
                    (model.contains(item.key()) ? model[item.key()].dump() : "absent"));
  const json stored_trainer = json::parse(stored.trainer.to_json()), trainer = json::parse(t.to_json());
  // What may change between sessions of a run: its length, threads, logging,
  // evaluation and checkpoint cadence, the display. Everything else shapes
  // the trajectory.
  static const std::unordered_set<std::string> free_keys = {
      "steps", "threads", "log_every", "eval_every", "eval_batches", "checkpoint_every", "out", "resume", "display"};
  for (const auto& item : stored_trainer.items())
    if (!free_keys.count(item.key()) && trainer[item.key()] != item.value())
      out.push_back("trainer " + item.key() + ": checkpoint " + item.value().dump() + ", now " +
                    trainer[item.key()].dump());
  if (stored.task.name != task.name)
    out.push_back("task: checkpoint '" + stored.task.name + "', now '" + task.name + "'");
  if (stored.task.data_dir != task.data_dir)
    out.push_back("data: checkpoint '" + stored.task.data_dir + "', now '" + task.data_dir + "'");
  if (stored.task.length != task.length)
    out.push_back("length: checkpoint " + std::to_string(stored.task.length) + ", now " +
                  std::to_string(task.length));
  return out;
}

/// Logits as scored: a bfloat16 model's in float32 (its log-softmax would
/// otherwise run in bfloat16), any other as they are.
torch::Tensor scoring_logits(const torch::Tensor& logits) {
  return logits.scalar_type() == torch::kBFloat16 ? logits.to(torch::kFloat32) : logits;
}

json metrics_json(const std::string& prefix, const tasks::Metrics& m) {
  return {{prefix + "loss", m.loss()}, {prefix + "bpc", m.bits()}, {prefix + "accuracy", m.accuracy()}};
}

}  // namespace

// ---------------------------------------------------------------------------
// Trainer
// ---------------------------------------------------------------------------

Trainer::Trainer(const TrainerOptions& options, const models::TransformerOptions& model,
                 const tasks::TaskOptions& task, const DistributedOptions& distributed)
    : options_(options), distributed_(distributed), model_options_(model), task_options_(normalised(task)) {
  validate(options_);
  validate(distributed_);
  if (options_.batch() % distributed_.world_size() != 0)
    throw std::invalid_argument("train: the batch " + std::to_string(options_.batch()) +
                                " (the global batch: sequences per step over all processes) is not divisible by " +
                                std::to_string(distributed_.world_size()) +
                                " processes; each reads batch / processes sequences: choose a batch that is a multiple of " +
                                std::to_string(distributed_.world_size()));
  apply_threads(options_.threads());
  task_ = tasks::make_task(task_options_);
  if (model_options_.vocab_size() == 0) model_options_.vocab_size(task_->vocab_size());
  check_architecture(model_options_, *task_);
  models::validate(model_options_);
  const int64_t length = task_->sequence_length(options_.context());
  if (length > model_options_.max_length() &&
      (model_options_.positions() == models::Positions::learned ||
       model_options_.positions() == models::Positions::sinusoidal))
    throw std::invalid_argument("train: sequences of " + std::to_string(length) +
                                " tokens exceed the model's max_length " +
                                std::to_string(model_options_.max_length()));

  const auto existing = list_checkpoints(options_.out());
  if (!options_.resume() && !existing.empty())
    throw std::runtime_error("run directory '" + options_.out() + "' already holds checkpoints (newest: '" +
                             existing[0].path + "'); pass --resume to continue it or choose another --out");

  CheckpointFile file;
  Header header;
  if (options_.resume() && !existing.empty()) {
    std::tie(file, header) = read_newest(options_.out(), &resumed_from_);
    const auto mismatches = resume_mismatches(header, options_, model_options_, task_options_);
    if (!mismatches.empty()) {
      std::string msg = "cannot resume from '" + resumed_from_ +
                        "': the options differ from the ones that built the run:";
      for (const auto& m : mismatches) msg += "\n  " + m;
      throw std::runtime_error(msg);
    }
    if (header.step > options_.steps())
      throw std::runtime_error("cannot resume from '" + resumed_from_ + "': it is at step " +
                               std::to_string(header.step) + ", beyond --steps " +
                               std::to_string(options_.steps()));
  }

  if (options_.dtype() == DType::bf16) {
    // Mixed precision keeps two models: model_ holds the float32 weights that
    // the optimiser, clipping, the all-reduce and the checkpoints see, and
    // work_ runs the forward and backward passes with bfloat16 parameters,
    // refreshed from model_ before every step. A separate copy (rather than
    // casting inside each module's forward, or converting the model with
    // Module::to) leaves the model code dtype-agnostic, keeps the float64 and
    // int64 buffers (SAC's baseline, clustered attention's call counter) in
    // their dtypes, and rounds each weight to bfloat16 once per step instead
    // of once per use. Built before the seed, so that its initial weights
    // (overwritten by refresh_work) draw nothing from the seeded generator.
    work_ = models::Transformer(model_options_);
    std::unordered_set<const void*> converted;
    for (auto& p : work_->parameters())
      if (converted.insert(p.unsafeGetTensorImpl()).second) p.set_data(p.detach().to(torch::kBFloat16));
  }
  torch::manual_seed(options_.seed());
  model_ = models::Transformer(model_options_);
  if (work_) {
    const auto master = model_->named_parameters(), copy = work_->named_parameters();
    std::unordered_set<const void*> seen;
    for (const auto& item : master) {
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // tied: once
      const auto* other = copy.find(item.key());
      TORCH_CHECK(other && other->sizes() == item.value().sizes(), "train: the bf16 working copy lacks parameter ",
                  item.key());
      work_params_.emplace_back(item.value(), *other);
    }
    const auto master_buffers = model_->named_buffers(), copy_buffers = work_->named_buffers();
    for (const auto& item : master_buffers) {
      const auto* other = copy_buffers.find(item.key());
      TORCH_CHECK(other && other->sizes() == item.value().sizes(), "train: the bf16 working copy lacks buffer ",
                  item.key());
      work_buffers_.emplace_back(item.value(), *other);
    }
  }
  if (distributed_.world_size() > 1 && model_->edge_predictor())
    throw std::invalid_argument(
        "train: data-parallel training of SAC models is not supported: their REINFORCE baseline is a "
        "per-process moving average; train them in one process");
  optimizer_ = make_optimizer(model_, options_);
  if (!resumed_from_.empty()) {
    load_training_state(file.payload, header.tensors, *model_, optimizer_.get(),
                        /*restore_generator=*/true, resumed_from_);
    start_step_ = header.step;
    elapsed_before_ = header.elapsed;
  }
}

Trainer::~Trainer() = default;

void Trainer::refresh_work() {
  if (!work_) return;
  torch::NoGradGuard no_grad;
  for (auto& [master, copy] : work_params_) copy.copy_(master);  // rounds to nearest even
  for (auto& [master, copy] : work_buffers_) copy.copy_(master);
}

void Trainer::keep_work_buffers() {
  if (!work_) return;
  torch::NoGradGuard no_grad;
  for (auto& [master, copy] : work_buffers_) master.copy_(copy);
}

void Trainer::take_work_grads() {
  if (!work_) return;
  for (auto& [master, copy] : work_params_) {
    const auto& grad = copy.grad();
    if (!grad.defined()) continue;  // unused this step: no gradient, as in float32
    if (master.grad().defined())
      master.mutable_grad().copy_(grad);
    else
      master.mutable_grad() = grad.to(torch::kFloat32);
  }
}

torch::optim::Optimizer& Trainer::optimizer() { return *optimizer_; }

namespace {

/// The checkpoint header and payload of `model` at `step`, as every run
/// directory stores them (load_run and --resume read them).
CheckpointFile run_checkpoint(models::TransformerImpl& model, torch::optim::Optimizer* optimizer,
                              const TrainerOptions& trainer, const models::TransformerOptions& model_options,
                              const tasks::TaskOptions& task, int64_t step, double elapsed) {
  std::string tensors;
  CheckpointFile file;
  file.payload = save_training_state(model, optimizer, &tensors);
  json header = {{"format", "attnkit-checkpoint"},
                 {"attnkit_version", attnkit::version()},
                 {"step", step},
                 {"elapsed_seconds", elapsed},
                 {"trainer", json::parse(trainer.to_json())},
                 {"model", json::parse(model_options.to_json())},
                 {"task", json::parse(task_options_to_json(task))},
                 {"parameters", model.parameter_count()},
                 {"tensors", json::parse(tensors)}};
  file.header = header.dump();
  return file;
}

}  // namespace

void Trainer::write_checkpoint(int64_t step, double elapsed, const TrainResult& result) {
  auto file = run_checkpoint(*model_, optimizer_.get(), options_, model_options_, task_options_, step, elapsed);
  if (result.validated) {
    auto header = json::parse(file.header);
    header["valid"] = metrics_json("", result.valid);
    file.header = header.dump();
  }
  const auto path = (fs::path(options_.out()) / checkpoint_name(step)).string();
  write_checkpoint_file(path, file);
  prune_checkpoints(options_.out(), kKeepCheckpoints);  // only after the new one is durable
}

std::string save_model_run(const std::string& run_dir, models::TransformerImpl& model,
                           const tasks::TaskOptions& task, TrainerOptions trainer, int64_t step) {
  TORCH_CHECK(!run_dir.empty(), "save_model_run: the run directory is empty");
  TORCH_CHECK(step >= 0, "save_model_run: step must be >= 0, got ", step);
  for (const auto& t : model.parameters())
    TORCH_CHECK(t.scalar_type() == torch::kFloat32, "save_model_run: the model's parameters are ",
                c10::toString(t.scalar_type()), "; runs store float32 (convert the model with .float())");
  const auto stored_task = normalised(task);
  check_architecture(model.options(), *tasks::make_task(stored_task));  // also refuses missing data
  std::error_code error;
  fs::create_directories(run_dir, error);
  TORCH_CHECK(!error, "save_model_run: cannot create '", run_dir, "': ", error.message());
  trainer.out(run_dir).resume(false);
  const auto path = (fs::path(run_dir) / checkpoint_name(step)).string();
  write_checkpoint_file(path, run_checkpoint(model, nullptr, trainer, model.options(), stored_task, step, 0.0));
  return path;
}

namespace {

/// What every rank of a data-parallel job must agree on: the options that
/// shape the trajectory (the trainer's without the per-session ones, the
/// model's, the task's name and length; not the data directory's path, which
/// may differ between machines), as 48 bits of a hash.
int64_t run_fingerprint(const TrainerOptions& t, const models::TransformerOptions& m, const tasks::TaskOptions& task) {
  json trainer = json::parse(t.to_json());
  for (const char* key : {"steps", "threads", "log_every", "eval_every", "eval_batches", "checkpoint_every", "out",
                          "resume", "display"})
    trainer.erase(key);
  const std::string text = trainer.dump() + json::parse(m.to_json()).dump() + task.name + "/" +
                           std::to_string(task.length);
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h >> 16);
}

/// Metrics summed over the ranks.
tasks::Metrics allreduce_metrics(Communicator& comm, const tasks::Metrics& m, const char* what) {
  auto t = torch::tensor({m.loss_sum, m.correct, m.scored, m.positions}, torch::kFloat64);
  comm.allreduce_sum(t, what);
  const auto a = t.accessor<double, 1>();
  tasks::Metrics out;
  out.loss_sum = a[0];
  out.correct = a[1];
  out.scored = a[2];
  out.positions = a[3];
  return out;
}

/// evaluate() split over the ranks: rank r scores the evaluation batches
/// i = r, r + P, ...; the sums are combined.
tasks::Metrics evaluate_distributed(Communicator& comm, models::Transformer& model, const tasks::Task& task,
                                    tasks::Split split, int64_t batch, int64_t context, int64_t max_batches) {
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  tasks::Metrics local;
  const auto batches = task.eval_batches(split, batch, context);
  const std::size_t n = max_batches > 0 ? std::min<std::size_t>(batches.size(), max_batches) : batches.size();
  for (std::size_t i = comm.rank(); i < n; i += comm.world_size())
    local += tasks::score(scoring_logits(model->forward(batches[i].input)), batches[i]);
  model->train(was_training);
  return allreduce_metrics(comm, local, "validation all-reduce");
}

}  // namespace

TrainResult Trainer::run() {
  if (ran_)
    throw std::logic_error("Trainer::run: this trainer has run; continue with a new Trainer and resume(true)");
  ran_ = true;
  apply_threads(options_.threads());
  const int world = distributed_.world_size(), rank = distributed_.rank();
  const bool distributed = world > 1;
  const bool leader = rank == 0;  // writes the run directory and shows progress

  // Data parallel: join the job, check that every rank builds the same run
  // from the same step, and start from rank 0's weights.
  std::unique_ptr<Communicator> comm;
  if (distributed) {
    comm = Communicator::connect(distributed_);
    auto agree = torch::tensor({start_step_, -start_step_, run_fingerprint(options_, model_options_, task_options_),
                                -run_fingerprint(options_, model_options_, task_options_)},
                               torch::kInt64);
    comm->allreduce_max(agree, "start-up check");
    const auto a = agree.accessor<int64_t, 1>();
    if (a[0] != -a[1])
      throw std::runtime_error("rank " + std::to_string(rank) + ": the ranks start from different steps (" +
                               std::to_string(-a[1]) + " to " + std::to_string(a[0]) + "; this one: " +
                               std::to_string(start_step_) +
                               "): every rank must see the same run directory (--out on a shared file system)");
    if (a[2] != -a[3])
      throw std::runtime_error("rank " + std::to_string(rank) +
                               ": the ranks were given different options (model, task or training); every rank "
                               "must run the same command");
    // Into detached views of the same storage: Gloo writes them from its own
    // threads, outside autograd.
    for (const auto& t : model_->parameters()) {
      auto data = t.detach();
      comm->broadcast(data, 0, "broadcast of rank 0's parameters");
    }
    for (const auto& t : model_->buffers()) {
      auto data = t.detach();
      comm->broadcast(data, 0, "broadcast of rank 0's buffers");
    }
  }

  // Rank 0 alone touches the run directory.
  int lock_fd = -1;
  struct LockRelease {
    int* fd;
    ~LockRelease() {
      if (*fd >= 0) ::close(*fd);
    }
  } lock_release{&lock_fd};
  std::unique_ptr<MetricsLog> metrics;
  if (leader) {
    fs::create_directories(options_.out());
    // One process per run directory: an advisory lock held while training.
    const std::string lock_path = (fs::path(options_.out()) / ".lock").string();
    lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd < 0) throw std::runtime_error("cannot open '" + lock_path + "': " + std::strerror(errno));
    if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(lock_fd);
      lock_fd = -1;
      throw std::runtime_error("another process is training in '" + options_.out() + "' (it holds " + lock_path + ")");
    }
    // Under the lock, the run directory must still be as the constructor found it.
    const auto checkpoints = list_checkpoints(options_.out());
    const std::string newest = checkpoints.empty() ? "" : checkpoints[0].path;
    if (newest != resumed_from_)
      throw std::runtime_error("the checkpoints of '" + options_.out() + "' changed since this Trainer was built (newest now: '" +
                               newest + "'); build the Trainer again");
    // Temporary files of checkpoint writes that a crash interrupted.
    static const std::regex stale(R"(\.checkpoint-[0-9]+\.ckpt\.tmp-[0-9]+)");
    for (const auto& entry : fs::directory_iterator(options_.out()))
      if (std::regex_match(entry.path().filename().string(), stale)) fs::remove(entry.path());
    const std::string metrics_path = (fs::path(options_.out()) / "metrics.jsonl").string();
    if (!resumed_from_.empty())
      trim_metrics(metrics_path, start_step_);
    else
      fs::remove(metrics_path);  // a fresh run (no checkpoint): its own log
    metrics = std::make_unique<MetricsLog>(metrics_path);
  }

  const bool live = options_.display() == Display::live ||
                    (options_.display() == Display::automatic && ::isatty(STDERR_FILENO));
  ProgressPrinter progress(stderr, live && leader);
  const bool quiet = options_.display() == Display::quiet || !leader;
  auto say = [&](const std::string& text) {
    if (!quiet) progress.message(text);
  };
  if (!resumed_from_.empty())
    say("resuming from " + resumed_from_ + " at step " + std::to_string(start_step_));

  StopSignalGuard signals;
  clear_stop();
  TrainResult result;
  result.step = start_step_;
  const double start = steady_seconds();
  double interval_start = start;
  int64_t interval_steps = 0;
  tasks::Metrics interval;
  double last_lr = 0, grad_norm = 0;
  const int64_t tokens_per_step = options_.batch() * task_->sequence_length(options_.context());
  const std::string metric_name = task_->metric_name();

  // The gradient norm is clipped separately for the network and for SAC's
  // edge predictor: the policy gradient's scale (rewards times summed
  // log-probabilities over 2 alpha n steps) has nothing to do with the
  // likelihood's, and one global bound would let it squeeze the network's steps.
  auto& predictor = model_->edge_predictor();
  std::vector<torch::Tensor> params, predictor_params;
  if (predictor) predictor_params = predictor->parameters();
  for (const auto& group : optimizer_->param_groups())
    for (const auto& p : group.params()) {
      const bool in_predictor = std::any_of(predictor_params.begin(), predictor_params.end(),
                                            [&](const torch::Tensor& q) { return q.is_same(p); });
      if (!in_predictor) params.push_back(p);
    }
  double predictor_grad_norm = 0;
  double reward_sum = 0;  // SAC: the interval's summed batch-mean rewards
  int64_t reward_batches = 0;

  // Data parallel: the gradients of every trainable parameter (each once),
  // in the model's order, averaged in buckets during the backward pass.
  std::unique_ptr<GradientReducer> reducer;
  double allreduce_seconds = 0;  // this interval's waits for the gradient all-reduce
  if (distributed) {
    std::vector<torch::Tensor> trainable, sources;
    if (work_) {
      // bf16: the hooks watch the working copy's parameters, whose bfloat16
      // gradients the buckets take in float32; the float32 mean lands in the
      // float32 parameters' grads.
      for (const auto& [master, copy] : work_params_)
        if (master.requires_grad()) {
          trainable.push_back(master);
          sources.push_back(copy);
        }
    } else {
      std::unordered_set<const void*> seen;
      for (const auto& p : model_->parameters())
        if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) trainable.push_back(p);
    }
    reducer = std::make_unique<GradientReducer>(*comm, trainable, distributed_.bucket_bytes(), distributed_.overlap(),
                                                sources);
  }
  const int64_t shard = options_.batch() / world;
  auto last_checkpoint = [&] { return result.checkpoint.empty() ? resumed_from_ : result.checkpoint; };

  // The model the passes run on: model_, or in bf16 its working copy (whose
  // edge predictor then samples the structures and keeps the REINFORCE
  // baseline until keep_work_buffers() hands it to model_).
  auto& net = compute_model();
  auto& net_predictor = net->edge_predictor();
  model_->train();
  net->train();
  try {
  for (int64_t step = start_step_; step < options_.steps(); ++step) {
    // One optimiser step on the batch of `step`.
    const double lr = learning_rate(options_, step);
    for (auto& group : optimizer_->param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    auto batch = task_->train_batch(options_.seed(), step, options_.batch(), options_.context());
    double loss_scale = 1;
    if (distributed) {
      // This rank's rows of the global batch. Its loss (a mean over its scored
      // positions) is weighted by P x its share of the global batch's scored
      // positions: the mean over the ranks of the weighted losses (and of their
      // gradients) is the global batch's loss (and gradient).
      const double global_scored = batch.weight.sum().item<double>();
      batch.input = batch.input.narrow(0, rank * shard, shard);
      batch.target = batch.target.narrow(0, rank * shard, shard);
      batch.weight = batch.weight.narrow(0, rank * shard, shard);
      const double local_scored = batch.weight.sum().item<double>();
      loss_scale = global_scored > 0 ? world * local_scored / global_scored : 0.0;
      torch::manual_seed(dropout_seed(options_.seed(), step, rank));
    }
    optimizer_->zero_grad();
    refresh_work();
    if (work_) work_->zero_grad();
    // The loss and its log-softmax in float32 whatever the compute dtype.
    const auto logits = net->forward(batch.input).to(torch::kFloat32);
    const auto loss = tasks::loss(logits, batch);
    const double loss_value = loss.item<double>();
    if (!distributed && !std::isfinite(loss_value))
      throw std::runtime_error("train: the loss is " + std::to_string(loss_value) + " at step " +
                               std::to_string(step + 1) + "; stopping without a checkpoint (the last one: " +
                               last_checkpoint() + "); try a lower --lr or a tighter --clip");
    auto objective = loss;
    if (predictor) {
      // REINFORCE: -sum_t grad log p(y_t | y_<t) (R - b), b the moving average
      // of past rewards (kept in the predictor's buffer).
      const auto reinforce = sac_reinforce(*net_predictor, net->sac_structures(), logits.detach(), batch,
                                           net->sac_options());
      if (reinforce.surrogate.defined()) {
        objective = loss + reinforce.surrogate;
        reward_sum += reinforce.mean_reward;
        ++reward_batches;
      }
    }
    bool stopping = false;
    if (distributed) {
      if (loss_scale != 1) objective = objective * loss_scale;
      reducer->prepare();
      objective.backward();
      reducer->finish();
      allreduce_seconds += reducer->last_wait_seconds();
      // Whether any rank was asked to stop or saw a non-finite loss: all stop
      // after the same step.
      auto flags = torch::tensor({stop_requested() ? 1.0 : 0.0, std::isfinite(loss_value) ? 0.0 : 1.0},
                                 torch::kFloat64);
      comm->allreduce_sum(flags, "stop-flag all-reduce");
      stopping = flags[0].item<double>() > 0;
      if (flags[1].item<double>() > 0)
        throw std::runtime_error("train: the loss is not finite at step " + std::to_string(step + 1) +
                                 " (on rank " + std::to_string(rank) + ": " + std::to_string(loss_value) +
                                 "); stopping without a checkpoint (the last one: " + last_checkpoint() +
                                 "); try a lower --lr or a tighter --clip");
    } else {
      objective.backward();
      take_work_grads();
    }
    keep_work_buffers();  // bf16: the forward pass's and REINFORCE's buffer updates
    if (options_.clip() > 0) {
      grad_norm = torch::nn::utils::clip_grad_norm_(params, options_.clip());
      if (predictor) predictor_grad_norm = torch::nn::utils::clip_grad_norm_(predictor_params, options_.clip());
    }
    optimizer_->step();
    interval += tasks::score(logits.detach(), batch);
    last_lr = lr;
    ++interval_steps;
    const int64_t done = step + 1;
    result.step = done;
    if (on_step_) on_step_(done);

    const bool last = done == options_.steps();
    if (!distributed) stopping = stop_requested();
    // Validation at the end and every eval_every steps. A stop does not add
    // one: the steps that validate are the same in an interrupted and resumed
    // run as in an uninterrupted one.
    const bool evaluate_now = last || (options_.eval_every() > 0 && done % options_.eval_every() == 0);
    const bool log_now = done % options_.log_every() == 0 || last || evaluate_now || stopping;
    if (distributed && log_now) interval = allreduce_metrics(*comm, interval, "metrics all-reduce");

    const double now = steady_seconds();
    const double interval_seconds = std::max(now - interval_start, 1e-9);
    const double tokens_per_s = static_cast<double>(interval_steps * tokens_per_step) / interval_seconds;
    ProgressLine line;
    line.step = done;
    line.total = options_.steps();
    line.loss = interval.loss();
    line.metric_name = metric_name;
    line.metric = task_->metric(interval);
    line.lr = lr;
    line.tokens_per_s = tokens_per_s;
    line.eta_seconds = static_cast<double>(options_.steps() - done) * interval_seconds /
                       static_cast<double>(interval_steps);
    if (!quiet) progress.show(line, log_now);

    if (log_now) {
      json record = {{"step", done}, {"lr", last_lr}, {"tokens_per_s", tokens_per_s},
                     {"elapsed", elapsed_before_ + (now - start)}};
      record.update(metrics_json("", interval));
      if (options_.clip() > 0) record["grad_norm"] = grad_norm;
      if (distributed) {
        record["world_size"] = world;
        record["allreduce_ms"] = 1000 * allreduce_seconds / static_cast<double>(interval_steps);
        record["allreduce_bytes"] = reducer->bytes();
        record["allreduce_buckets"] = reducer->buckets();
        record["allreduce_overlap"] = distributed_.overlap();
      }
      allreduce_seconds = 0;
      if (reward_batches > 0) {
        record["sac_reward"] = reward_sum / static_cast<double>(reward_batches);
        record["sac_baseline"] = net_predictor->baseline();
        if (options_.clip() > 0) record["sac_grad_norm"] = predictor_grad_norm;
      }
      reward_sum = 0;
      reward_batches = 0;
      if (evaluate_now) {
        // In the run's dtype: the working copy, refreshed with this step's weights.
        refresh_work();
        result.valid = distributed ? evaluate_distributed(*comm, net, *task_, tasks::Split::valid, options_.batch(),
                                                          options_.context(), options_.eval_batches())
                                   : evaluate(net, *task_, tasks::Split::valid, options_.batch(),
                                              options_.context(), options_.eval_batches());
        keep_work_buffers();
        result.validated = true;
        net->train();
        record.update(metrics_json("valid_", result.valid));
        char text[128];
        std::snprintf(text, sizeof(text), "step %lld: valid loss %.4f  %s %.4f",
                      static_cast<long long>(done), result.valid.loss(), metric_name.c_str(),
                      task_->metric(result.valid));
        say(text);
      }
      if (metrics) metrics->append(record.dump());
      result.train = interval;
      interval = tasks::Metrics{};
      interval_steps = 0;
      interval_start = steady_seconds();
    }

    if (last || stopping || done % options_.checkpoint_every() == 0) {
      if (leader) write_checkpoint(done, elapsed_before_ + (steady_seconds() - start), result);
      result.checkpoint = (fs::path(options_.out()) / checkpoint_name(done)).string();
    }
    if (stopping && !last) {
      result.interrupted = true;
      const int sig = stop_signal();
      say(std::string("stopped") + (sig == SIGINT ? " by SIGINT" : sig == SIGTERM ? " by SIGTERM" : "") +
          " after step " + std::to_string(done) + "; checkpoint " + result.checkpoint +
          " (continue with --resume)");
      break;
    }
  }
  // Every rank leaves after rank 0's last checkpoint is durable.
  if (distributed) comm->barrier("final barrier");
  } catch (const DistributedError& e) {
    throw std::runtime_error(std::string(e.what()) + "; the last checkpoint: " +
                             (last_checkpoint().empty() ? "none" : last_checkpoint()) +
                             "; restart the job with --resume");
  }
  if (result.checkpoint.empty() && !resumed_from_.empty()) result.checkpoint = resumed_from_;
  if (!quiet) progress.finish();
  clear_stop();
  return result;
}

// ---------------------------------------------------------------------------
// Loading a run
// ---------------------------------------------------------------------------

StoredOptions read_stored_options(const std::string& run_dir) {
  StoredOptions out;
  auto [file, header] = read_newest(run_dir, &out.checkpoint);
  out.step = header.step;
  out.trainer = header.trainer;
  out.model = header.model;
  out.task = header.task;
  return out;
}

LoadedRun load_run(const std::string& run_dir) {
  LoadedRun run;
  auto [file, header] = read_newest(run_dir, &run.checkpoint);
  run.step = header.step;
  run.trainer = header.trainer;
  run.model_options = header.model;
  run.task_options = header.task;
  run.task = tasks::make_task(run.task_options);
  run.model = models::Transformer(run.model_options);
  load_training_state(file.payload, header.tensors, *run.model, nullptr, /*restore_generator=*/false,
                      run.checkpoint);
  run.model->eval();
  return run;
}

SacReinforce sac_reinforce(nn::EdgePredictorImpl& predictor, const models::SacStructures& sac,
                          const torch::Tensor& logits, const tasks::Batch& batch, const nn::SacOptions& options) {
  const bool edge_credit = options.reward == "edge";
  TORCH_CHECK(sac.log_prob.defined() && sac.step_log_prob.defined() && sac.tokens.defined(),
              "sac_reinforce: the structures were not sampled (a model in training mode samples them)");
  const auto lp = tasks::target_log_probs(logits, batch);
  const auto w = batch.weight.to(torch::kFloat64);
  const int64_t N = lp.size(0);
  torch::Tensor rewards, scored, log_probs;  // matching shapes
  if (edge_credit) {
    // The destination step of edge k (step 2k + 1) earns its origin's reward.
    const int64_t S = sac.tokens.size(1), P = sac.tokens.size(2) / 2;
    const auto origins = sac.tokens.view({N, S, P, 2}).select(3, 0).reshape({N, S * P});
    rewards = lp.gather(1, origins).view({N, S, P});
    scored = w.gather(1, origins).view({N, S, P}) > 0;
    log_probs = sac.step_log_prob.view({N, S, P, 2}).select(3, 1);
  } else {
    // The paper's R: the sequence's mean log-probability of its scored labels.
    const auto counts = w.sum(1);
    rewards = (lp * w).sum(1) / counts.clamp_min(1);
    scored = counts > 0;
    log_probs = sac.log_prob;
  }
  SacReinforce out;
  if (!scored.any().item<bool>()) return out;
  const auto earned = rewards.masked_select(scored);
  out.mean_reward = earned.mean().item<double>();
  out.baseline = predictor.update_baseline(earned);
  const auto advantage = torch::where(scored, rewards - out.baseline, torch::zeros_like(rewards));
  out.surrogate = -(advantage.to(log_probs.scalar_type()) * log_probs).sum() / static_cast<double>(N);
  if (options.entropy > 0) out.surrogate = out.surrogate - options.entropy * sac.entropy.mean();
  return out;
}

namespace {

/// Adds one structure (shared or per head) to `stats`; rows whose position is
/// not scored in `weight` (N = 1 row of the batch's weights) are left out of
/// the partner counts.
void count_structure(const EdgeList& edges, const std::vector<int64_t>& partner, const torch::Tensor& weight,
                     StructureStats& stats) {
  const auto scored = weight.to(torch::kFloat32).contiguous();
  const float* w = scored.data_ptr<float>();
  const auto offsets = edges.offsets.reshape({-1, edges.num_queries() + 1}).contiguous();
  const auto columns = edges.columns.contiguous();
  const int64_t* col = columns.data_ptr<int64_t>();
  const int64_t n = edges.num_queries();
  for (int64_t h = 0; h < offsets.size(0); ++h) {
    const int64_t* off = offsets[h].data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      bool self = false, found = false;
      const int64_t want = i < static_cast<int64_t>(partner.size()) && w[i] > 0 ? partner[i] : -1;
      for (int64_t e = off[i]; e < off[i + 1]; ++e) {
        self |= col[e] == i;
        found |= col[e] == want;
      }
      const double count = static_cast<double>(off[i + 1] - off[i]);
      stats.nodes += 1;
      stats.edges += count;
      if (want >= 0) {
        stats.partner_rows += 1;
        stats.partner_found += found;
        stats.predicted_edges += count - self;
      }
    }
  }
}

}  // namespace

tasks::Metrics evaluate(models::Transformer& model, const tasks::Task& task, tasks::Split split,
                        int64_t batch, int64_t context, int64_t max_batches, StructureStats* structure) {
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  tasks::Metrics total;
  const auto batches = task.eval_batches(split, batch, context);
  const std::size_t n = max_batches > 0 ? std::min<std::size_t>(batches.size(), max_batches) : batches.size();
  const auto partner = structure ? task.partners(context) : std::vector<int64_t>{};
  for (std::size_t i = 0; i < n; ++i) {
    total += tasks::score(scoring_logits(model->forward(batches[i].input)), batches[i]);
    if (structure) {
      const auto& edges = model->sac_structures().edges;
      for (size_t b = 0; b < edges.size(); ++b)
        count_structure(edges[b], partner, batches[i].weight[static_cast<int64_t>(b)], *structure);
    }
  }
  model->train(was_training);
  return total;
}

}  // namespace attnkit::train
