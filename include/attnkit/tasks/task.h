// What the trainer and `attnkit eval` need from a task: batches that are a pure
// function of (seed, step), fixed evaluation batches per split, and what the
// model must be (its vocabulary, causal or not). Tasks: "char-lm" (next
// character, bits per character), "masked-char" (masked characters seen from
// both sides, bits per masked character) and "copy" (the masked copy task of the
// clustered-attention paper, appendix C.2; accuracy on the masked tokens).
// Their classes and data preparation: attnkit/tasks/char_lm.h, attnkit/tasks/copy.h.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace attnkit::tasks {

/// One batch of token ids and what the model must predict at each position.
struct Batch {
  torch::Tensor input;   ///< int64 (N, L)
  torch::Tensor target;  ///< int64 (N, L)
  torch::Tensor weight;  ///< float32 (N, L): 1 where the target is scored, 0 elsewhere
};

enum class Split { train, valid, test };
/// "train", "valid" or "test"; anything else throws, listing the three.
Split split_from_string(const std::string& name);
std::string to_string(Split split);

/// Sums over scored positions, from which every reported metric follows.
struct Metrics {
  double loss_sum = 0;   ///< cross-entropy in nats, summed over scored positions
  double correct = 0;    ///< scored positions whose argmax equals the target
  double scored = 0;     ///< number of scored positions
  double positions = 0;  ///< positions the model read, scored or not (batch x length)
  double loss() const { return scored > 0 ? loss_sum / scored : 0; }  ///< nats per position
  double bits() const;       ///< loss() / ln 2: bits per character for char-lm
  double accuracy() const { return scored > 0 ? correct / scored : 0; }
  Metrics& operator+=(const Metrics& other);
};

/// Metrics of logits (N, L, V) against a batch (no gradient; sums in float64).
/// An argmax tie goes to the lowest id.
Metrics score(const torch::Tensor& logits, const Batch& batch);

/// Masked mean cross-entropy of logits (N, L, V) against a batch: the training
/// loss (differentiable), nats per scored position: the sum over positions of
/// weight * -log_softmax(logits)[target], divided by the sum of the weights
/// (0 when no position is scored). Throws on mismatched shapes or a target
/// outside [0, V).
torch::Tensor loss(const torch::Tensor& logits, const Batch& batch);

/// log p(target) at every position, float64 (N, L), without gradient (scored
/// or not): what SAC's rewards are made of.
torch::Tensor target_log_probs(const torch::Tensor& logits, const Batch& batch);

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string name() const = 0;
  /// Token ids are in [0, vocab_size()).
  virtual int64_t vocab_size() const = 0;
  /// True when a position may only see earlier positions (a decoder language
  /// model); false when the model sees its whole input (the copy task's encoder).
  virtual bool causal() const = 0;
  /// The headline metric: "bpc" (char-lm) or "accuracy" (copy), and its value.
  virtual std::string metric_name() const = 0;
  virtual double metric(const Metrics& m) const = 0;

  /// The length L of this task's batches when the trainer asks for `context`
  /// positions: `context` for char-lm, fixed by the task for copy (2 * length + 2).
  virtual int64_t sequence_length(int64_t context) const { return context; }

  /// The training batch of `step`: a pure function of (seed, step, batch,
  /// context), so that a resumed run sees exactly the data it would have seen.
  virtual Batch train_batch(uint64_t seed, int64_t step, int64_t batch, int64_t context) const = 0;
  /// Evaluation batches that cover `split` deterministically (no seed).
  virtual std::vector<Batch> eval_batches(Split split, int64_t batch, int64_t context) const = 0;

  /// For tasks whose right attention structure is known (copy: each symbol's
  /// twin in the other half): partner[i] is the position that holds what
  /// position i must predict when it is scored (masked), for sequences of
  /// sequence_length(context) tokens; -1 where there is none. Empty (the
  /// default) when the task has no such structure.
  virtual std::vector<int64_t> partners(int64_t context) const { return {}; }

  /// Text <-> token ids for tasks over text (char-lm); the defaults throw,
  /// naming the task.
  virtual torch::Tensor encode(const std::string& text) const;
  virtual std::string decode(const torch::Tensor& tokens) const;
};

/// Task settings from the command line (`attnkit train --task ... --data ... --copy-length ...`).
struct TaskOptions {
  std::string name;          ///< "char-lm", "masked-char" or "copy"
  std::string data_dir;      ///< char-lm, masked-char: the directory `attnkit data char-lm` wrote
  int64_t copy_length = 64;  ///< copy: symbols per half (the input has 2 * copy_length + 2 tokens)
};

/// The task named in `options`; errors list the known tasks and say what is
/// missing (e.g. a data directory without train.txt).
std::unique_ptr<Task> make_task(const TaskOptions& options);

}  // namespace attnkit::tasks
