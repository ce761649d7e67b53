// Word and phrase translation from a bilingual dictionary in the dictd format
// (Debian's FreeDict packages, e.g. dict-freedict-deu-eng), character by
// character: the setting of the classic zoo's encoder-decoder (models/seq2seq.h).
//
// The dictd format: NAME.index holds one line per entry, "headword TAB offset
// TAB length", offset and length in base 64 (A-Z a-z 0-9 + /, most significant
// digit first) into NAME.dict (the uncompressed text). Entries whose headword
// starts with "00-database" or "00database" are the database's own notes. An
// entry of the FreeDict (ding2tei) dictionaries reads
//
//   umverteilen /ˈʊmfɛɾtˌaɪlən/ <v, trans>      headword, pronunciation, grammar
//   redirect <v>                                  the translations, comma-separated
//      Synonym: {umleiten}                        annotations (indented or empty lines)
//
// so that its source is line 1 up to the pronunciation or grammar (the index's
// headword is lowercased for lookup and not used), and its senses are line 2
// split at commas outside parentheses, with <grammar>, [domain] and {reference}
// labels removed and spaces collapsed.
//
// A pair is kept when the source and the sense pass the task's character and
// length filters (TranslationOptions). Entries with the same source are merged:
// one example per distinct source, with every sense any of its entries lists
// (the exact-match metric accepts any of them).
//
// Splits are by source, from a hash of its UTF-8 bytes (FNV-1a, 64 bits): an
// example's split never depends on the rest of the dictionary, and no source is
// in two splits. Related forms of one word (a verb and its participles) are
// separate entries and may fall in different splits; that is the task: a
// dictionary's held-out entries, not held-out words.
//
// Text is handled as Unicode code points (UTF-8 decoded), so that an umlaut is
// one character for the model and for the character error rate.
#pragma once

#include <attnkit/tasks/task.h>

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace attnkit::experiments {

/// One dictionary entry before filtering: its source and the senses of its
/// translation line, cleaned as described at the top of this file (UTF-8).
struct DictdEntry {
  std::string source;
  std::vector<std::string> senses;
};

/// Parses a dictd database: the index's text and the dictionary's (uncompressed)
/// text. Throws naming the line of the index that is malformed or points
/// outside the dictionary.
std::vector<DictdEntry> parse_dictd(const std::string& index_text, const std::string& dict_text);
/// parse_dictd of the one NAME.index / NAME.dict pair in `data_dir`; throws
/// when there is none or more than one.
std::vector<DictdEntry> read_dictd_directory(const std::string& data_dir);

/// Decodes UTF-8; throws on a malformed sequence.
std::u32string decode_utf8(const std::string& text);
std::string encode_utf8(const std::u32string& text);

/// Levenshtein distance (insertions, deletions and substitutions of one code
/// point, each costing 1).
int64_t edit_distance(const std::u32string& a, const std::u32string& b);

struct TranslationOptions {
  /// The longest source and sense kept, in characters (code points).
  TORCH_ARG(int64_t, max_source) = 32;
  TORCH_ARG(int64_t, max_target) = 32;
  /// Characters a source may hold (UTF-8); anything else drops the entry.
  TORCH_ARG(std::string, source_characters) =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZäöüÄÖÜß '-";
  /// Characters a sense may hold; a sense with others is dropped (its entry
  /// stays when another sense is kept).
  TORCH_ARG(std::string, target_characters) =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ '-";
  /// Per mille of the sources held out for validation and for test.
  TORCH_ARG(int64_t, valid_per_mille) = 20;
  TORCH_ARG(int64_t, test_per_mille) = 20;
};

/// Characters of every kept source and sense, with four specials.
class CharVocabulary {
 public:
  static constexpr int64_t kPad = 0;  ///< padding, never predicted
  static constexpr int64_t kBos = 1;  ///< the decoder's first input
  static constexpr int64_t kEos = 2;  ///< the end of a target
  static constexpr int64_t kUnk = 3;  ///< a character outside the vocabulary
  /// The specials, then the code points of `characters` in increasing order.
  explicit CharVocabulary(const std::u32string& characters);
  int64_t size() const { return static_cast<int64_t>(chars_.size()); }
  int64_t id(char32_t c) const;
  std::vector<int64_t> ids(const std::u32string& text) const;
  /// The text of ids up to the first kEos (specials other than kUnk skipped; kUnk reads "?").
  std::u32string text(const std::vector<int64_t>& ids) const;

 private:
  std::u32string chars_;
  std::unordered_map<char32_t, int64_t> ids_;
};

/// A source and its senses (decoded).
struct TranslationExample {
  std::u32string source;
  std::vector<std::u32string> senses;
};

/// Examples stacked for the model; padding is kPad.
struct TranslationBatch {
  torch::Tensor source;          ///< int64 (N, S), S = the longest source
  torch::Tensor source_lengths;  ///< int64 (N)
  torch::Tensor decoder_input;   ///< int64 (N, T): kBos then the sense
  torch::Tensor target;          ///< int64 (N, T): the sense then kEos
};

/// How well outputs match their examples.
struct TranslationScore {
  bool exact = false;  ///< the output equals one of the senses
  /// Edit distance to the nearest sense over that sense's length (0 is perfect).
  double cer = 0;
};
TranslationScore score_translation(const std::u32string& output, const std::vector<std::u32string>& senses);

class TranslationTask {
 public:
  /// read_dictd_directory(data_dir) (the directory scripts/fetch-corpus
  /// freedict-deu-eng writes); throws when no example survives the filters in
  /// some split.
  TranslationTask(const std::string& data_dir, const TranslationOptions& options);
  TranslationTask(const std::vector<DictdEntry>& entries, const TranslationOptions& options);

  const TranslationOptions& options() const { return options_; }
  const CharVocabulary& vocabulary() const { return vocabulary_; }
  const std::vector<TranslationExample>& examples(tasks::Split split) const;
  /// Which split a source falls in (its hash; see the top of this file).
  tasks::Split split_of(const std::string& source) const;

  /// Training batch `step` under `seed`: example j of it is a source drawn
  /// uniformly from the train split and one of its senses drawn uniformly, from
  /// the random stream of (seed, step * batch + j).
  TranslationBatch train_batch(uint64_t seed, int64_t step, int64_t batch) const;
  /// The first `count` examples of a split (all when count exceeds it), in the
  /// split's fixed order, stacked in batches of `batch`, each example with its
  /// first sense as the target.
  std::vector<TranslationBatch> eval_batches(tasks::Split split, int64_t count, int64_t batch) const;
  /// The examples eval_batches(split, count, ...) holds, in order.
  std::vector<TranslationExample> eval_examples(tasks::Split split, int64_t count) const;

  /// Stacks (source, target sense) pairs.
  TranslationBatch collate(const std::vector<std::pair<const std::u32string*, const std::u32string*>>& pairs) const;

 private:
  TranslationOptions options_;
  CharVocabulary vocabulary_{U""};
  std::vector<TranslationExample> examples_[3];
};

}  // namespace attnkit::experiments
