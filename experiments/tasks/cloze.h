// A cloze (fill-in-the-blank) reading task over the words of a char-lm corpus
// (the directory `attnkit data char-lm` writes: lowercase words separated by
// single spaces), for comparing the read-outs of a recurrent reader (the
// cheap-linear-attention paper, section 5; models/reader.h).
//
// One example, drawn from a split's words w_0 .. w_{M-1}:
//   paragraph  P consecutive words w_o .. w_{o+P-1} (o uniform in [0, M - P]);
//   query      Q consecutive words of that paragraph, w_{o+u} .. w_{o+u+Q-1}
//              (u uniform in [0, P - Q]), with one of them, the answer, replaced
//              by the placeholder kBlank;
//   answer     chosen uniformly among the query's words that may be answers:
//              in the vocabulary (not kUnk) and not among the `stop_words` most
//              frequent words of the train split ("the", "and", "of", ...);
//   candidates the distinct words of the paragraph that may be answers (so the
//              answer is always one of them; sorted ids).
// The query is a span of the paragraph, so every example is answerable from the
// paragraph alone: the model must find where the query's context occurs in the
// paragraph and read the word there. A draw whose span holds no possible answer
// is redrawn (the next draws of the same example's stream).
//
// Example `index` under `seed` is a pure function of (split, seed, index): its
// random numbers are kernels::random streams keyed by them. Training batch
// `step` holds examples step * batch .. step * batch + batch - 1 of the train
// split under the run's seed; evaluation examples 0 .. count - 1 of a split use
// a fixed seed of their own.
//
// Word vocabulary, from the train split only: id 0 = kUnk ("<unk>"), 1 = kBlank
// ("<blank>"), then every word seen at least `min_count` times, by decreasing
// count (ties alphabetically). Words of valid/test outside it read as kUnk.
#pragma once

#include <attnkit/tasks/task.h>

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace attnkit::experiments {

struct ClozeOptions {
  /// Words per paragraph, P.
  TORCH_ARG(int64_t, paragraph) = 80;
  /// Words per query, Q (<= P).
  TORCH_ARG(int64_t, query) = 16;
  /// A train word with fewer occurrences reads as kUnk.
  TORCH_ARG(int64_t, min_count) = 5;
  /// The most frequent words (by train count) that are never answers.
  TORCH_ARG(int64_t, stop_words) = 100;
};

/// The words of the train split with their ids (see the top of this file).
class WordVocabulary {
 public:
  static constexpr int64_t kUnk = 0;
  static constexpr int64_t kBlank = 1;
  /// Only kUnk and kBlank.
  WordVocabulary();
  /// Counts the words of `train_words` and keeps those seen >= min_count times.
  WordVocabulary(const std::vector<std::string>& train_words, int64_t min_count);
  int64_t size() const { return static_cast<int64_t>(words_.size()); }
  /// kUnk for a word not in the vocabulary.
  int64_t id(const std::string& word) const;
  /// Throws on an id outside [0, size()).
  const std::string& word(int64_t id) const;
  /// Occurrences in the train split (0 for kUnk and kBlank).
  int64_t count(int64_t id) const { return counts_.at(static_cast<size_t>(id)); }

 private:
  std::vector<std::string> words_;
  std::vector<int64_t> counts_;
  std::unordered_map<std::string, int64_t> ids_;
};

struct ClozeExample {
  std::vector<int64_t> paragraph;   ///< P word ids
  std::vector<int64_t> query;       ///< Q word ids, query[blank] == kBlank
  int64_t blank = 0;                ///< position of the placeholder in the query
  int64_t answer = 0;               ///< the word id replaced by the placeholder
  std::vector<int64_t> candidates;  ///< sorted distinct ids, contains `answer`
  int64_t offset = 0;               ///< o: the paragraph's first word in the split
  int64_t query_start = 0;          ///< u: the query's first word in the paragraph
};

/// Examples stacked for a model.
struct ClozeBatch {
  torch::Tensor document;   ///< int64 (N, P)
  torch::Tensor query;      ///< int64 (N, Q)
  torch::Tensor candidate;  ///< bool (N, V): true for the candidates of row n
  torch::Tensor answer;     ///< int64 (N)
};

/// Accuracy of answering without reading the query.
struct ClozeBaselines {
  int64_t examples = 0;
  double mean_candidates = 0;  ///< mean number of candidates per example
  double random = 0;           ///< expected accuracy of a uniform pick: mean of 1 / candidates
  /// The candidate that occurs most often in the paragraph (ties: the one that
  /// occurs first).
  double frequency = 0;
};

class ClozeTask {
 public:
  /// Loads data_dir/{train,valid,test}.txt; throws naming the file when one is
  /// missing or empty or has characters other than a-z and space.
  ClozeTask(const std::string& data_dir, const ClozeOptions& options);
  /// From the three splits' texts (lowercase words separated by spaces).
  ClozeTask(const std::string& train, const std::string& valid, const std::string& test,
            const ClozeOptions& options);

  const ClozeOptions& options() const { return options_; }
  const WordVocabulary& vocabulary() const { return vocabulary_; }
  /// Word ids of a split.
  const std::vector<int64_t>& words(tasks::Split split) const;
  /// True for the ids that may be answers: not kUnk, kBlank or a stop word.
  bool answerable(int64_t id) const;

  /// Example `index` of `split` under `seed` (see the top of this file).
  ClozeExample example(tasks::Split split, uint64_t seed, int64_t index) const;
  /// Examples step * batch ... of the train split under `seed`, stacked.
  ClozeBatch train_batch(uint64_t seed, int64_t step, int64_t batch) const;
  /// Examples 0 .. count - 1 of `split` under its fixed evaluation seed, in
  /// batches of `batch` (the last may be smaller).
  std::vector<ClozeBatch> eval_batches(tasks::Split split, int64_t count, int64_t batch) const;
  /// The same examples as eval_batches(split, count, ...), unstacked.
  std::vector<ClozeExample> eval_examples(tasks::Split split, int64_t count) const;
  /// The fixed seed of a split's evaluation examples.
  static uint64_t eval_seed(tasks::Split split);

  /// Stacks examples into a batch with candidate masks over vocabulary().size() words.
  ClozeBatch collate(const std::vector<ClozeExample>& examples) const;
  static ClozeBaselines baselines(const std::vector<ClozeExample>& examples);

 private:
  void build(const std::string& train, const std::string& valid, const std::string& test);
  ClozeOptions options_;
  WordVocabulary vocabulary_;
  std::vector<int64_t> words_[3];
};

}  // namespace attnkit::experiments
