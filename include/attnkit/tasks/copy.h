// The masked copy task of the clustered-attention paper (Vyas et al. 2020,
// appendix C.2, after Kitaev et al.'s Reformer): copy the symbols masked out in
// one half of the sequence from the other half.
//
// A sequence x of `length` symbols drawn uniformly (with replacement) from
// kSymbols values; target = [SEP, x, SEP, x] (2 * length + 2 tokens). The input
// is the target with kMaskedPerHalf(length) positions of the first copy
// replaced by MASK, and as many DIFFERENT positions of the second copy, so
// every masked symbol is visible in the other half. Weight 1 on the masked
// positions only: loss and accuracy count the tokens that must be copied.
// The paper's masking fraction did not survive in its text; we mask
// round(0.2 * length) positions per half (at least 1).
//
// Vocabulary (vocab_size() = 12): 0 = SEP, 1..10 = the symbols, 11 = MASK.
// Not causal: the model is an encoder that sees the whole input. Metric
// "accuracy" on the masked positions.
#pragma once

#include <attnkit/tasks/task.h>

#include <cstdint>
#include <string>
#include <vector>

namespace attnkit::tasks {

class CopyTask : public Task {
 public:
  static constexpr int64_t kSep = 0;
  static constexpr int64_t kSymbols = 10;  ///< symbol ids 1..kSymbols
  static constexpr int64_t kMask = kSymbols + 1;
  static constexpr int64_t kEvalSequences = 128;  ///< per split
  /// Positions masked in each half of a sequence of `length` symbols:
  /// max(1, round(0.2 * length)).
  static int64_t masked_per_half(int64_t length);

  /// `length` symbols per half; at least 2, so that the halves can mask
  /// different positions.
  explicit CopyTask(int64_t length);
  std::string name() const override { return "copy"; }
  int64_t vocab_size() const override { return kMask + 1; }
  bool causal() const override { return false; }
  std::string metric_name() const override { return "accuracy"; }
  double metric(const Metrics& m) const override { return m.accuracy(); }
  /// Sequences are always 2 * length + 2 tokens, whatever the context.
  int64_t sequence_length(int64_t context) const override { return 2 * length_ + 2; }
  /// `batch` sequences from a torch::Generator seeded from (seed, step);
  /// `context` is ignored (see sequence_length()).
  Batch train_batch(uint64_t seed, int64_t step, int64_t batch, int64_t context) const override;
  /// kEvalSequences sequences per split from a fixed seed of that split (the
  /// same whatever `batch`), in batches of `batch`; `context` is ignored.
  std::vector<Batch> eval_batches(Split split, int64_t batch, int64_t context) const override;
  /// Symbol i of one half (positions 1..length) and its twin in the other
  /// (positions length + 2 .. 2 length + 1) are partners, length + 1 apart;
  /// the separators (0 and length + 1) have none.
  std::vector<int64_t> partners(int64_t context) const override;

  int64_t length() const { return length_; }

 private:
  Batch generate(uint64_t generator_seed, int64_t count) const;
  int64_t length_;
};

}  // namespace attnkit::tasks
