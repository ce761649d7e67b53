// Training a models::Transformer on a tasks::Task: AdamW, linear warm-up then
// cosine decay, global-norm gradient clipping, seeded everything, progress and
// RUN/metrics.jsonl, atomic checkpoints (the last two kept), bitwise resume,
// and a graceful stop on SIGINT / SIGTERM. The run directory's rules are
// RunDirectory's (run_directory.h). The user-facing description is
// docs/TRAINING.md.
//
//   attnkit::train::Trainer trainer(
//       attnkit::train::TrainerOptions().steps(2000).batch(16).context(256).out("runs/lm"),
//       attnkit::models::TransformerOptions().layers(4).width(256).heads(4),
//       {"char-lm", "data/kjv", 0});
//   auto result = trainer.run();
//
// Determinism: torch::manual_seed(seed) before the model is built; the batch
// of step s is Task::train_batch(seed, s, ...) (a pure function of s); dropout
// draws from torch's default CPU generator, whose state every checkpoint
// stores. With one thread a run interrupted and resumed ends with bitwise the
// weights of an uninterrupted one.
//
// Data parallel (DistributedOptions with world_size P > 1, distributed.h): P
// processes, each with a replica of the model. Every rank builds the global
// batch of step s (the same pure function of (seed, s) as a single process)
// and trains on its rows [r B/P, (r+1) B/P); the gradients are averaged over
// the ranks during the backward pass, with the loss of each shard weighted by
// its share of the global batch's scored positions, so that the averaged
// gradient is the gradient of the global batch's loss: the global batch, the
// data order and the learning-rate schedule do not depend on P. Dropout of
// rank r at step s draws from torch's default generator seeded with
// dropout_seed(seed, s, r) (so with dropout on, runs with different P differ;
// with dropout off they agree within float32 rounding). Rank 0 alone writes the
// run directory (checkpoints, metrics.jsonl) and shows progress; training and
// interval metrics, validation (split over the ranks) and the stop request
// (SIGINT / SIGTERM on any rank) are combined over the ranks.
#pragma once

#include <attnkit/models/transformer.h>
#include <attnkit/train/distributed.h>
#include <attnkit/tasks/task.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace attnkit::train {

struct RunHeader;        // what a checkpoint says built the run (src/train/stored_run.h)
class WorkingCopy;       // mixed precision's bf16 copy (src/train/mixed_precision.h)

/// How a run shows its progress: `automatic` is `live` when stderr is a
/// terminal and `plain` otherwise.
enum class Display { automatic, live, plain, quiet };

/// The dtype a run computes in. `float32`: everything in float32. `bf16`
/// (mixed precision): the forward and backward passes run in bfloat16 on a
/// working copy of the model, refreshed from the float32 weights before every
/// step; the loss (its log-softmax) is computed in float32 from the bf16
/// logits, the gradients are converted to float32 and everything after the
/// backward pass (data-parallel all-reduce, clipping, AdamW and its state,
/// checkpoints) works on the float32 weights. Validation runs in the run's
/// dtype. docs/TRAINING.md, "Mixed precision".
enum class DType { float32, bf16 };

/// "float32" or "bf16" (the names the options' JSON and `--dtype` use).
std::string to_string(DType dtype);
/// "float32", "bf16" or "bfloat16"; anything else throws an error naming the
/// option, the accepted values and the value given.
DType dtype_from_string(const std::string& name);

struct TrainerOptions {
  TORCH_ARG(int64_t, steps) = 1000;   ///< optimiser steps of the whole run
  TORCH_ARG(int64_t, batch) = 16;     ///< sequences per step
  TORCH_ARG(int64_t, context) = 256;  ///< tokens per sequence
  TORCH_ARG(double, lr) = 1e-3;       ///< peak learning rate (after warm-up)
  TORCH_ARG(int64_t, warmup) = 100;   ///< steps of linear warm-up from lr / warmup to lr
  TORCH_ARG(double, min_lr) = 1e-4;   ///< cosine decay from lr to min_lr over the steps after warm-up
  TORCH_ARG(double, weight_decay) = 0.01;  ///< AdamW's decoupled decay, on matrices only (dim >= 2)
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.99);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, clip) = 1.0;      ///< gradient norm bound (the network; a SAC predictor separately); 0: none
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(int, threads) = 0;        ///< attnkit::set_num_threads and at::set_num_threads; 0: default
  TORCH_ARG(int64_t, log_every) = 10;        ///< steps per progress line / metrics.jsonl record
  TORCH_ARG(int64_t, eval_every) = 0;        ///< steps between validations; 0: only at the end
  TORCH_ARG(int64_t, eval_batches) = 8;      ///< validation batches per evaluation (the first ones); 0: all
  TORCH_ARG(int64_t, checkpoint_every) = 500;  ///< steps between checkpoints (one is always written at the end)
  TORCH_ARG(std::string, out);               ///< the run directory
  TORCH_ARG(bool, resume) = false;           ///< continue from the newest checkpoint of `out`
  TORCH_ARG(Display, display) = Display::automatic;
  TORCH_ARG(DType, dtype) = DType::float32;  ///< compute dtype (float32 weights and optimiser state either way)

 public:  // TORCH_ARG leaves the access private
  /// The options as JSON (what a checkpoint stores) and back; from_json
  /// refuses unknown keys and wrong types with an error naming the key.
  std::string to_json() const;
  static TrainerOptions from_json(const std::string& json);
};

/// The learning rate of (0-based) step `step`: lr * (step + 1) / warmup during
/// warm-up, then min_lr + (lr - min_lr) (1 + cos(pi t)) / 2 with
/// t = (step - warmup) / (steps - warmup) in [0, 1).
double learning_rate(const TrainerOptions& options, int64_t step);

/// TaskOptions as JSON and back (what a checkpoint stores).
std::string task_options_to_json(const tasks::TaskOptions& options);
tasks::TaskOptions task_options_from_json(const std::string& json);

/// Checks trainer options (positive steps, batch, context, ...; finite lr,
/// 0 <= min_lr <= lr, betas in [0, 1), an output directory) and throws an error
/// naming the option and its value.
void validate(const TrainerOptions& options);

/// What a run ended with.
struct TrainResult {
  int64_t step = 0;                 ///< optimiser steps done (the data position)
  bool interrupted = false;         ///< stopped early by SIGINT / SIGTERM / request_stop()
  std::string checkpoint;           ///< the last checkpoint written
  tasks::Metrics train;             ///< the last log interval's training metrics
  bool validated = false;           ///< whether `valid` holds a validation
  tasks::Metrics valid;             ///< the last validation
};

class Trainer {
 public:
  /// Builds the task and the model, or with options.resume() loads the newest
  /// checkpoint of options.out() (see docs/TRAINING.md for what must match).
  /// `model.vocab_size()` 0 means the task's vocabulary. Nothing in the run
  /// directory is written or removed until run(). With `distributed`'s
  /// world_size P > 1 (validated here: the batch must be divisible by P, SAC
  /// models are refused), run() joins the job before its first step.
  Trainer(const TrainerOptions& options, const models::TransformerOptions& model,
          const tasks::TaskOptions& task, const DistributedOptions& distributed = {});
  ~Trainer();

  /// Trains up to options.steps(); returns early, after writing a checkpoint,
  /// when a stop is requested (SIGINT / SIGTERM while run() is active, or
  /// request_stop()). Once per Trainer (a second call throws).
  TrainResult run();

  /// The step training continues from: 0, or the resumed checkpoint's.
  int64_t start_step() const { return start_step_; }
  /// The checkpoint resumed from, or "".
  const std::string& resumed_from() const { return resumed_from_; }
  const TrainerOptions& options() const { return options_; }
  const DistributedOptions& distributed() const { return distributed_; }
  const models::TransformerOptions& model_options() const { return model_options_; }
  const tasks::TaskOptions& task_options() const { return task_options_; }
  /// The model with the run's float32 weights (what the optimiser updates and
  /// checkpoints hold).
  models::Transformer& model() { return model_; }
  /// The model the forward and backward passes run on: model() in float32;
  /// with DType::bf16 its bfloat16 working copy (parameters refreshed from
  /// model() before every step and every validation; buffers copied both
  /// ways, so that state such as a SAC baseline lives in model()).
  models::Transformer& compute_model();
  const tasks::Task& task() const { return *task_; }
  torch::optim::Optimizer& optimizer();

  /// Called after every completed step with the step count (tests use it to
  /// interrupt a run with request_stop()).
  void on_step(std::function<void(int64_t)> callback) { on_step_ = std::move(callback); }

 private:
  struct Session;  // one run(): the job, the claimed run directory, the display, the log interval
  void check_resumable(const RunHeader& stored, const std::string& path) const;
  void join_job(Session& s);
  void split_clipped_parameters(Session& s);
  bool train_step(int64_t step, Session& s);
  double take_shard(tasks::Batch& batch, int64_t step, const Session& s) const;
  torch::Tensor with_reinforce(const torch::Tensor& loss, const torch::Tensor& logits, const tasks::Batch& batch,
                               Session& s);
  bool backward_in_job(torch::Tensor objective, double loss_scale, int64_t step, double loss_value, Session& s);
  void report(int64_t done, bool log_now, bool evaluate_now, Session& s);
  tasks::Metrics validation(int64_t done, Session& s);
  void checkpoint(int64_t done, Session& s);

  TrainerOptions options_;
  DistributedOptions distributed_;
  models::TransformerOptions model_options_;
  tasks::TaskOptions task_options_;
  std::unique_ptr<tasks::Task> task_;
  models::Transformer model_{nullptr};
  std::unique_ptr<WorkingCopy> work_;  // bf16 only: the bfloat16 copy the passes run on
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  int64_t start_step_ = 0;
  double elapsed_before_ = 0;  // seconds trained before this process (resumed runs)
  std::string resumed_from_;
  std::function<void(int64_t)> on_step_;
  bool ran_ = false;
};

/// A trained model loaded for evaluation or generation.
struct LoadedRun {
  std::string checkpoint;  ///< the file it came from
  int64_t step = 0;
  TrainerOptions trainer;
  models::TransformerOptions model_options;
  tasks::TaskOptions task_options;
  std::unique_ptr<tasks::Task> task;
  models::Transformer model{nullptr};  ///< in eval mode
};

/// Loads the newest checkpoint of `run_dir` (weights only; not the optimiser
/// or the generator). A corrupt newest checkpoint is refused, not skipped.
LoadedRun load_run(const std::string& run_dir);

/// Writes `model` (float32) as checkpoint `step` of the run directory
/// `run_dir` (created when missing), in the format Trainer writes, for `task`
/// and with `trainer` as its recorded options: how a model trained elsewhere
/// (the Python package) becomes a run that `attnkit eval` and `generate`
/// read. It holds no optimiser state, so `--resume` refuses it. Returns the
/// file's path. Refuses a task the model cannot serve (vocabulary, causality)
/// with load_run's and the trainer's errors.
std::string save_model_run(const std::string& run_dir, models::TransformerImpl& model,
                           const tasks::TaskOptions& task, TrainerOptions trainer = {},
                           int64_t step = 0);

/// The options stored in the newest checkpoint of `run_dir` without building
/// anything (the CLI's --resume starts from them). Throws when there is none.
struct StoredOptions {
  std::string checkpoint;
  int64_t step = 0;
  TrainerOptions trainer;
  models::TransformerOptions model;
  tasks::TaskOptions task;
};
StoredOptions read_stored_options(const std::string& run_dir);

/// What the structures of a SAC model looked like over an evaluation: counts
/// summed over every evaluated sequence.
struct StructureStats {
  double nodes = 0;            ///< rows (per head for head-adaptive structures)
  double edges = 0;            ///< edges, self-edges included
  /// Tasks with known partners (Task::partners), rows whose position is scored
  /// and has one (the copy task's masked symbols):
  double partner_rows = 0;     ///< such rows
  double partner_found = 0;    ///< ... whose edges include the partner
  double predicted_edges = 0;  ///< their edges other than the self-edge
  double edges_per_node() const { return nodes > 0 ? edges / nodes : 0; }
  /// Fraction of rows that see their partner (recall).
  double partner_recall() const { return partner_rows > 0 ? partner_found / partner_rows : 0; }
  /// Fraction of the predicted (non-self) edges of those rows that point at the
  /// partner (precision).
  double partner_precision() const { return predicted_edges > 0 ? partner_found / predicted_edges : 0; }
};

/// One batch's REINFORCE term for a SAC model's predictor (docs/MATH.md,
/// "SAC"): `surrogate` (undefined when nothing in the batch is scored) has the
/// policy-gradient estimate as its gradient; `mean_reward` over the credited
/// rewards; `baseline` the b they were compared with, after which the
/// predictor's moving average is updated. `sac` the structures the model
/// sampled for `batch` (training mode), `logits` its output (no gradient is
/// taken through them); `options` the model's SAC options (`reward`, and
/// `entropy`: the surrogate also subtracts entropy x the batch mean of
/// sac.entropy, the sequences' summed step entropies).
struct SacReinforce {
  torch::Tensor surrogate;
  double mean_reward = 0, baseline = 0;
};
SacReinforce sac_reinforce(nn::EdgePredictorImpl& predictor, const models::SacStructures& sac,
                          const torch::Tensor& logits, const tasks::Batch& batch, const nn::SacOptions& options);

/// Metrics of `model` (eval mode, no autograd) over the first `max_batches`
/// (0: all) evaluation batches of `split`, `batch` sequences of `context` tokens.
/// For a SAC model, `structure` (when given) receives statistics of the
/// structures it decoded. The logits of a bfloat16 model are scored in float32.
tasks::Metrics evaluate(models::Transformer& model, const tasks::Task& task, tasks::Split split,
                        int64_t batch, int64_t context, int64_t max_batches,
                        StructureStats* structure = nullptr);

}  // namespace attnkit::train
