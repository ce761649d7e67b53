// The training loop of `attnkit train` (Trainer), and loading a trained run
// for eval and generate. Around it: the run directory (run_directory.cpp),
// mixed precision's working copy (mixed_precision.cpp), SAC's REINFORCE
// (sac_reinforce.cpp), the job of a data-parallel run (distributed.cpp).
#include <attnkit/runtime.h>
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/clock.h>
#include <attnkit/train/distributed.h>
#include <attnkit/train/loop.h>
#include <attnkit/train/progress.h>
#include <attnkit/train/run_directory.h>
#include <attnkit/train/signals.h>
#include <attnkit/train/trainer.h>

#include <ATen/Parallel.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <unordered_set>

#include "train/evaluate.h"
#include "train/mixed_precision.h"
#include "train/stored_run.h"

namespace attnkit::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

void apply_threads(int threads) {
  if (threads <= 0) return;
  attnkit::set_num_threads(threads);
  at::set_num_threads(threads);
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
                           std::to_string(task.copy_length);
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h >> 16);
}

}  // namespace

// ---------------------------------------------------------------------------
// Trainer: building the run
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
      (has(model_options_.positions(), models::Positions::learned) ||
       has(model_options_.positions(), models::Positions::sinusoidal)))
    throw std::invalid_argument("train: sequences of " + std::to_string(length) +
                                " tokens exceed the model's max_length " +
                                std::to_string(model_options_.max_length()));

  const auto resumed = open_or_resume(options_.out(), options_.resume());
  const auto header = resumed ? std::optional<RunHeader>(parse_run_header(*resumed)) : std::nullopt;
  if (resumed) check_resumable(*header, resumed->path());
  // bf16: the working copy first, so that it draws nothing from the seeded generator.
  if (options_.dtype() == DType::bf16) work_ = std::make_unique<WorkingCopy>(model_options_);
  torch::manual_seed(options_.seed());
  model_ = models::Transformer(model_options_);
  if (work_) work_->attach(model_);
  if (distributed_.world_size() > 1 && model_->edge_predictor())
    throw std::invalid_argument(
        "train: data-parallel training of SAC models is not supported: their REINFORCE baseline is a "
        "per-process moving average; train them in one process");
  optimizer_ = make_optimizer(model_, options_);
  if (resumed) {
    resumed->restore(*model_, optimizer_.get(), /*restore_generator=*/true);
    resumed_from_ = resumed->path();
    start_step_ = resumed->step();
    elapsed_before_ = header->elapsed;
  }
}

/// Refuses to resume `path`, whose header is `stored`, with options that
/// would change its trajectory (naming every difference) or too few steps.
void Trainer::check_resumable(const RunHeader& stored, const std::string& path) const {
  const auto mismatches = resume_mismatches(stored, options_, model_options_, task_options_);
  if (!mismatches.empty()) {
    std::string msg = "cannot resume from '" + path + "': the options differ from the ones that built the run:";
    for (const auto& m : mismatches) msg += "\n  " + m;
    throw std::runtime_error(msg);
  }
  if (stored.step > options_.steps())
    throw std::runtime_error("cannot resume from '" + path + "': it is at step " + std::to_string(stored.step) +
                             ", beyond --steps " + std::to_string(options_.steps()));
}

Trainer::~Trainer() = default;

models::Transformer& Trainer::compute_model() { return work_ ? work_->model() : model_; }

torch::optim::Optimizer& Trainer::optimizer() { return *optimizer_; }

// ---------------------------------------------------------------------------
// Trainer: the loop
// ---------------------------------------------------------------------------

/// One run(): the job of a data-parallel run, the run directory rank 0
/// claims, the display, and the sums of the current log interval.
struct Trainer::Session {
  Session(const TrainerOptions& options, const DistributedOptions& distributed, bool live)
      : rank(distributed.rank()),
        world(distributed.world_size()),
        leader(rank == 0),
        progress(stderr, live && leader),
        quiet(options.display() == Display::quiet || !leader) {}

  void say(const std::string& text) {
    if (!quiet) progress.message(text);
  }
  std::string last_checkpoint() const { return result.checkpoint.empty() ? resumed_from : result.checkpoint; }

  const int rank, world;
  const bool leader;  // writes the run directory and shows progress
  std::string resumed_from;  // the Trainer's, for last_checkpoint()
  std::unique_ptr<Communicator> comm;  // these two: data parallel only
  std::unique_ptr<GradientReducer> reducer;
  std::unique_ptr<RunDirectory> dir;  // these two: rank 0 only
  std::unique_ptr<MetricsLog> metrics;
  ProgressPrinter progress;
  const bool quiet;
  // The network's parameters and SAC's edge predictor's, clipped apart.
  std::vector<torch::Tensor> network_params, predictor_params;
  double start = 0;  // steady_seconds() when the first step began
  double lr = 0, grad_norm = 0, predictor_grad_norm = 0;  // the last step's
  struct Interval {   // since the last log line
    double start = 0;
    int64_t steps = 0;
    tasks::Metrics metrics;
    double allreduce_seconds = 0;  // waits for the gradient all-reduce
    double reward_sum = 0;         // SAC: summed batch-mean rewards
    int64_t reward_batches = 0;
  } interval;
  TrainResult result;
};

TrainResult Trainer::run() {
  if (ran_)
    throw std::logic_error("Trainer::run: this trainer has run; continue with a new Trainer and resume(true)");
  ran_ = true;
  apply_threads(options_.threads());
  const bool live = options_.display() == Display::live ||
                    (options_.display() == Display::automatic && ::isatty(STDERR_FILENO));
  Session s(options_, distributed_, live);
  s.resumed_from = resumed_from_;
  if (s.world > 1) join_job(s);
  if (s.leader) {  // rank 0 alone touches the run directory
    s.dir = std::make_unique<RunDirectory>(options_.out(), resumed_from_, start_step_);
    s.metrics = s.dir->open_log("metrics.jsonl");
  }
  if (!resumed_from_.empty()) s.say("resuming from " + resumed_from_ + " at step " + std::to_string(start_step_));
  s.start = s.interval.start = steady_seconds();
  split_clipped_parameters(s);
  model_->train();
  compute_model()->train();
  LoopHooks hooks;
  hooks.step = [&](int64_t step) {
    const bool any_rank_stops = train_step(step, s);
    s.result.step = step + 1;
    if (on_step_) on_step_(step + 1);  // may request a stop: asked below
    return s.comm ? any_rank_stops : stop_requested();
  };
  hooks.after_step = [&](const StepDone& d) {
    // Validation at the end and every eval_every steps. A stop does not add
    // one: the steps that validate are the same in an interrupted and
    // resumed run as in an uninterrupted one.
    const bool evaluate_now = d.last || (options_.eval_every() > 0 && d.done % options_.eval_every() == 0);
    const bool log_now = d.done % options_.log_every() == 0 || d.last || evaluate_now || d.stopping;
    report(d.done, log_now, evaluate_now, s);
    if (d.last || d.stopping || d.done % options_.checkpoint_every() == 0) checkpoint(d.done, s);
  };
  try {
    const LoopEnd end = run_loop(start_step_, options_.steps(), hooks);
    if (end.interrupted) {
      s.result.interrupted = true;
      s.say(std::string("stopped") +
            (end.signal == SIGINT ? " by SIGINT" : end.signal == SIGTERM ? " by SIGTERM" : "") +
            " after step " + std::to_string(end.done) + "; checkpoint " + s.result.checkpoint +
            " (continue with --resume)");
    }
    // Every rank leaves after rank 0's last checkpoint is durable.
    if (s.comm) s.comm->barrier("final barrier");
  } catch (const DistributedError& e) {
    throw std::runtime_error(std::string(e.what()) + "; the last checkpoint: " +
                             (s.last_checkpoint().empty() ? "none" : s.last_checkpoint()) +
                             "; restart the job with --resume");
  }
  if (s.result.checkpoint.empty() && !resumed_from_.empty()) s.result.checkpoint = resumed_from_;
  if (!s.quiet) s.progress.finish();
  return s.result;
}

/// Data parallel: joins the job, checks that every rank builds the same run
/// from the same step, starts from rank 0's weights, and arms the reducer.
void Trainer::join_job(Session& s) {
  s.comm = Communicator::connect(distributed_);
  const int64_t fingerprint = run_fingerprint(options_, model_options_, task_options_);
  auto agree = torch::tensor({start_step_, -start_step_, fingerprint, -fingerprint}, torch::kInt64);
  s.comm->allreduce_max(agree, "start-up check");
  const auto a = agree.accessor<int64_t, 1>();
  if (a[0] != -a[1])
    throw std::runtime_error("rank " + std::to_string(s.rank) + ": the ranks start from different steps (" +
                             std::to_string(-a[1]) + " to " + std::to_string(a[0]) + "; this one: " +
                             std::to_string(start_step_) +
                             "): every rank must see the same run directory (--out on a shared file system)");
  if (a[2] != -a[3])
    throw std::runtime_error("rank " + std::to_string(s.rank) +
                             ": the ranks were given different options (model, task or training); every rank "
                             "must run the same command");
  // Into detached views of the same storage: Gloo writes them from its own
  // threads, outside autograd.
  for (const auto& t : model_->parameters()) {
    auto data = t.detach();
    s.comm->broadcast(data, 0, "broadcast of rank 0's parameters");
  }
  for (const auto& t : model_->buffers()) {
    auto data = t.detach();
    s.comm->broadcast(data, 0, "broadcast of rank 0's buffers");
  }
  // The gradients of every trainable parameter (each once), in the model's
  // order, averaged in buckets during the backward pass. bf16: the hooks
  // watch the working copy's parameters, whose bfloat16 gradients the buckets
  // take in float32; the float32 mean lands in the float32 parameters' grads.
  std::vector<torch::Tensor> trainable, sources;
  if (work_) {
    for (const auto& [master, copy] : work_->parameters())
      if (master.requires_grad()) {
        trainable.push_back(master);
        sources.push_back(copy);
      }
  } else {
    std::unordered_set<const void*> seen;
    for (const auto& p : model_->parameters())
      if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) trainable.push_back(p);
  }
  s.reducer = std::make_unique<GradientReducer>(*s.comm, trainable, distributed_.bucket_bytes(),
                                                distributed_.overlap(), sources);
}

/// The gradient norm is clipped separately for the network and for SAC's
/// edge predictor: the policy gradient's scale (rewards times summed
/// log-probabilities over 2 alpha n steps) has nothing to do with the
/// likelihood's, and one global bound would let it squeeze the network's steps.
void Trainer::split_clipped_parameters(Session& s) {
  if (auto& predictor = model_->edge_predictor()) s.predictor_params = predictor->parameters();
  for (const auto& group : optimizer_->param_groups())
    for (const auto& p : group.params()) {
      const bool in_predictor = std::any_of(s.predictor_params.begin(), s.predictor_params.end(),
                                            [&](const torch::Tensor& q) { return q.is_same(p); });
      if (!in_predictor) s.network_params.push_back(p);
    }
}

/// One optimiser step on the batch of `step`. Data parallel: returns whether
/// any rank was asked to stop (all stop after the same step).
bool Trainer::train_step(int64_t step, Session& s) {
  s.lr = learning_rate(options_, step);
  for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(s.lr);
  auto batch = task_->train_batch(options_.seed(), step, options_.batch(), options_.context());
  const double loss_scale = s.comm ? take_shard(batch, step, s) : 1.0;
  optimizer_->zero_grad();
  if (work_) {
    work_->refresh();
    work_->model()->zero_grad();
  }
  // The loss and its log-softmax in float32 whatever the compute dtype.
  const auto logits = compute_model()->forward(batch.input).to(torch::kFloat32);
  const auto loss = tasks::loss(logits, batch);
  const double loss_value = loss.item<double>();
  if (!s.comm && !std::isfinite(loss_value))
    throw std::runtime_error("train: the loss is " + std::to_string(loss_value) + " at step " +
                             std::to_string(step + 1) + "; stopping without a checkpoint (the last one: " +
                             s.last_checkpoint() + "); try a lower --lr or a tighter --clip");
  const auto objective = with_reinforce(loss, logits, batch, s);
  bool any_rank_stops = false;
  if (s.comm) {
    any_rank_stops = backward_in_job(objective, loss_scale, step, loss_value, s);
  } else {
    objective.backward();
    if (work_) work_->take_grads();
  }
  if (work_) work_->keep_buffers();  // the forward pass's and REINFORCE's buffer updates
  if (options_.clip() > 0) {
    s.grad_norm = torch::nn::utils::clip_grad_norm_(s.network_params, options_.clip());
    if (model_->edge_predictor())
      s.predictor_grad_norm = torch::nn::utils::clip_grad_norm_(s.predictor_params, options_.clip());
  }
  optimizer_->step();
  s.interval.metrics += tasks::score(logits.detach(), batch);
  ++s.interval.steps;
  return any_rank_stops;
}

/// Data parallel: narrows `batch` to this rank's rows of the global batch and
/// returns the weight of its loss (a mean over its scored positions): P x its
/// share of the global batch's scored positions, so that the mean over the
/// ranks of the weighted losses (and of their gradients) is the global
/// batch's loss (and gradient). Seeds this rank's dropout for `step`.
double Trainer::take_shard(tasks::Batch& batch, int64_t step, const Session& s) const {
  const int64_t shard = options_.batch() / s.world;
  const double global_scored = batch.weight.sum().item<double>();
  batch.input = batch.input.narrow(0, s.rank * shard, shard);
  batch.target = batch.target.narrow(0, s.rank * shard, shard);
  batch.weight = batch.weight.narrow(0, s.rank * shard, shard);
  const double local_scored = batch.weight.sum().item<double>();
  torch::manual_seed(dropout_seed(options_.seed(), step, s.rank));
  return global_scored > 0 ? s.world * local_scored / global_scored : 0.0;
}

/// `loss`, plus for a SAC model the REINFORCE surrogate of its edge predictor
/// (sac_reinforce: -sum_t grad log p(y_t | y_<t) (R - b), b the moving average
/// of past rewards kept in the predictor's buffer).
torch::Tensor Trainer::with_reinforce(const torch::Tensor& loss, const torch::Tensor& logits,
                                      const tasks::Batch& batch, Session& s) {
  if (!model_->edge_predictor()) return loss;
  // The model the passes ran on: in bf16 the working copy, whose predictor
  // keeps the baseline until keep_buffers() hands it to model_.
  auto& net = compute_model();
  const auto reinforce = sac_reinforce(*net->edge_predictor(), net->sac_structures(), logits.detach(), batch,
                                       net->sac_options());
  if (!reinforce.surrogate.defined()) return loss;
  s.interval.reward_sum += reinforce.mean_reward;
  ++s.interval.reward_batches;
  return loss + reinforce.surrogate;
}

/// Data parallel: the backward pass with the gradients all-reduced. Returns
/// whether any rank was asked to stop; a non-finite loss on any rank stops
/// every rank with an error.
bool Trainer::backward_in_job(torch::Tensor objective, double loss_scale, int64_t step, double loss_value,
                              Session& s) {
  if (loss_scale != 1) objective = objective * loss_scale;
  s.reducer->prepare();
  objective.backward();
  s.reducer->finish();
  s.interval.allreduce_seconds += s.reducer->last_wait_seconds();
  auto flags = torch::tensor({stop_requested() ? 1.0 : 0.0, std::isfinite(loss_value) ? 0.0 : 1.0}, torch::kFloat64);
  s.comm->allreduce_sum(flags, "stop-flag all-reduce");
  if (flags[1].item<double>() > 0)
    throw std::runtime_error("train: the loss is not finite at step " + std::to_string(step + 1) + " (on rank " +
                             std::to_string(s.rank) + ": " + std::to_string(loss_value) +
                             "); stopping without a checkpoint (the last one: " + s.last_checkpoint() +
                             "); try a lower --lr or a tighter --clip");
  return flags[0].item<double>() > 0;
}

/// After step `done`: the progress line, and on a log step the metrics.jsonl
/// record (with a validation when `evaluate_now`); a new interval starts.
void Trainer::report(int64_t done, bool log_now, bool evaluate_now, Session& s) {
  auto& interval = s.interval;
  if (s.comm && log_now) interval.metrics = allreduce_metrics(*s.comm, interval.metrics, "metrics all-reduce");
  const double now = steady_seconds();
  const double seconds = std::max(now - interval.start, 1e-9);
  const int64_t tokens_per_step = options_.batch() * task_->sequence_length(options_.context());
  const double tokens_per_s = static_cast<double>(interval.steps * tokens_per_step) / seconds;
  if (!s.quiet) {
    ProgressLine line;
    line.step = done;
    line.total = options_.steps();
    line.loss = interval.metrics.loss();
    line.metric_name = task_->metric_name();
    line.metric = task_->metric(interval.metrics);
    line.lr = s.lr;
    line.tokens_per_s = tokens_per_s;
    line.eta_seconds =
        static_cast<double>(options_.steps() - done) * seconds / static_cast<double>(interval.steps);
    s.progress.show(line, log_now);
  }
  if (!log_now) return;
  json record = {{"step", done}, {"lr", s.lr}, {"tokens_per_s", tokens_per_s},
                 {"elapsed", elapsed_before_ + (now - s.start)}};
  record.update(metrics_json("", interval.metrics));
  if (options_.clip() > 0) record["grad_norm"] = s.grad_norm;
  if (s.comm) {
    record["world_size"] = s.world;
    record["allreduce_ms"] = 1000 * interval.allreduce_seconds / static_cast<double>(interval.steps);
    record["allreduce_bytes"] = s.reducer->bytes();
    record["allreduce_buckets"] = s.reducer->buckets();
    record["allreduce_overlap"] = distributed_.overlap();
  }
  if (interval.reward_batches > 0) {
    record["sac_reward"] = interval.reward_sum / static_cast<double>(interval.reward_batches);
    record["sac_baseline"] = compute_model()->edge_predictor()->baseline();
    if (options_.clip() > 0) record["sac_grad_norm"] = s.predictor_grad_norm;
  }
  if (evaluate_now) record.update(metrics_json("valid_", validation(done, s)));
  if (s.metrics) s.metrics->append(record.dump());
  s.result.train = interval.metrics;
  interval = Session::Interval{};
  interval.start = steady_seconds();
}

/// The validation after step `done`, in the run's dtype (bf16: the working
/// copy, refreshed with this step's weights), split over the ranks of a job.
tasks::Metrics Trainer::validation(int64_t done, Session& s) {
  if (work_) work_->refresh();
  auto& net = compute_model();
  s.result.valid = s.comm ? evaluate_distributed(*s.comm, net, *task_, tasks::Split::valid, options_.batch(),
                                                 options_.context(), options_.eval_batches())
                          : evaluate(net, *task_, tasks::Split::valid, options_.batch(), options_.context(),
                                     options_.eval_batches());
  if (work_) work_->keep_buffers();
  s.result.validated = true;
  net->train();
  char text[128];
  std::snprintf(text, sizeof(text), "step %lld: valid loss %.4f  %s %.4f", static_cast<long long>(done),
                s.result.valid.loss(), task_->metric_name().c_str(), task_->metric(s.result.valid));
  s.say(text);
  return s.result.valid;
}

/// Checkpoint `done` (rank 0 writes it; every rank reports it).
void Trainer::checkpoint(int64_t done, Session& s) {
  if (s.dir) {
    auto header = run_header(*model_, options_, model_options_, task_options_,
                             elapsed_before_ + (steady_seconds() - s.start));
    if (s.result.validated) header["valid"] = metrics_json("", s.result.valid);
    s.dir->write_checkpoint(done, header.dump(), *model_, optimizer_.get());
  }
  s.result.checkpoint = (fs::path(options_.out()) / checkpoint_name(done)).string();
}

}  // namespace attnkit::train
