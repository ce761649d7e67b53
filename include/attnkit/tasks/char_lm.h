// The character-level language model task ("char-lm") and the preparation of
// its data: raw text -> the text8 convention (lowercase a-z and single spaces)
// -> train.txt / valid.txt / test.txt.
//
// Normalisation (TextNormalizer; `attnkit data char-lm` and CharLm::encode
// apply the same rules). Input bytes are decoded as UTF-8; a byte that does not
// start or continue a valid UTF-8 sequence is read as one Latin-1 (ISO 8859-1)
// character, so Latin-1 files work too. Then, per character:
//   - a-z: kept;
//   - A-Z: lowercased ("mapped");
//   - Latin letters with diacritics (U+00C0..U+00FF, and Œ œ Š š Ž ž Ÿ): folded
//     to their base letters ("mapped"): À..Å -> a, Ç -> c, È..Ë -> e, Ì..Ï -> i,
//     Ñ -> n, Ò..Ö Ø -> o, Ù..Ü -> u, Ý ÿ Ÿ -> y, Š -> s, Ž -> z, Ð -> d,
//     and the ligatures Æ -> ae, Œ -> oe, ß -> ss, Þ -> th (either case);
//   - digits 0-9: spelled out one by one as a word each, as text8 does
//     ("1611" -> "one six one one"; "mapped");
//   - everything else (spaces, newlines, punctuation, apostrophes, × ÷, other
//     scripts, control bytes) is dropped: it only separates words. A run of
//     dropped characters between two words becomes one space, so "don't" ->
//     "don t" and "end.\n\nThe" -> "end the".
// The output never starts or ends with a space and never has two in a row;
// several input files are joined as if separated by whitespace.
//
// Token ids (CharLm::encode): 0 = space, 1..26 = a..z; vocab_size() = 27.
#pragma once

#include <attnkit/tasks/task.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace attnkit::tasks {

/// Counts of what normalisation did, per input character (a byte that is not
/// valid UTF-8 counts as one Latin-1 character).
struct NormalizeCounts {
  int64_t kept = 0;       ///< a-z, copied as they are
  int64_t mapped = 0;     ///< A-Z, folded accented letters and digits
  int64_t dropped = 0;    ///< everything else (at most one space remains per run)
  int64_t non_ascii_dropped = 0;  ///< of `dropped`: characters above U+007F
  int64_t latin1_bytes = 0;       ///< bytes that were not valid UTF-8, read as Latin-1
  int64_t output = 0;     ///< characters written: letters + spaces
  NormalizeCounts& operator+=(const NormalizeCounts& other);
};

/// Streaming normaliser: feed() the input in chunks of any size (a UTF-8
/// sequence may be split across chunks), end_document() between files and
/// finish() at the end. Output goes to the sink in pieces, in order; its memory
/// use does not grow with the input.
class TextNormalizer {
 public:
  using Sink = std::function<void(const char* data, size_t size)>;
  explicit TextNormalizer(Sink sink);
  void feed(const char* data, size_t size);
  /// Ends one input: a pending partial UTF-8 sequence is read as Latin-1 and
  /// the next input starts a new word.
  void end_document();
  /// end_document() and flush the output to the sink.
  void finish();
  const NormalizeCounts& counts() const { return counts_; }

 private:
  void character(uint32_t code);
  void letters(const char* text);
  void flush();
  Sink sink_;
  NormalizeCounts counts_;
  unsigned char pending_[4] = {};  // an incomplete UTF-8 sequence
  int pending_size_ = 0;
  bool space_pending_ = false;     // a separator came after the last letter
  std::string buffer_;
};

/// The whole of `text`, normalised (a convenience over TextNormalizer).
std::string normalize_text(const std::string& text, NormalizeCounts* counts = nullptr);

/// What prepare_char_lm() did.
struct CharLmReport {
  std::vector<std::string> inputs;
  int64_t input_bytes = 0;
  NormalizeCounts counts;
  int64_t train = 0, valid = 0, test = 0;  ///< characters per split
  std::string out_dir;
};

/// Normalises `inputs` (in order) and splits the result 90/5/5 into
/// out_dir/train.txt, valid.txt and test.txt: contiguous, in order, cut at
/// characters floor(0.9 n) and floor(0.95 n), no trailing newline. Writes
/// out_dir/meta.json (sources, split sizes, the normalisation counts) last.
/// Streams the inputs twice (once to count, once to write) in memory that does
/// not depend on their size; every file is written to a temporary name in
/// out_dir and renamed into place. Throws (naming the file) when an input is
/// missing, unreadable or empty, when the text is too short for three
/// non-empty splits, and when out_dir already holds one of the four files and
/// `force` is false.
CharLmReport prepare_char_lm(const std::vector<std::string>& inputs, const std::string& out_dir,
                             bool force = false);

/// "char-lm": next-character prediction over a directory written by
/// prepare_char_lm(). Vocabulary: 0 = space, 1..26 = a..z. Causal. Metric
/// "bpc": bits per character, Metrics::bits().
///
/// train_batch: `batch` windows of context + 1 characters of train.txt at
/// offsets drawn uniformly by a torch::Generator seeded from (seed, step);
/// input = the first `context`, target = the last `context` (shifted by one),
/// weight 1 everywhere.
///
/// eval_batches: the split as if preceded by one space, cut into consecutive
/// non-overlapping windows of `context` positions, so that every character of
/// the split is a target exactly once (the first is predicted from that space);
/// the last window is padded with weight 0; the last batch may have fewer rows.
class CharLm : public Task {
 public:
  /// Loads data_dir/{train,valid,test}.txt into memory (one byte per
  /// character); throws if one is missing, empty or not the text8 alphabet.
  explicit CharLm(const std::string& data_dir);
  std::string name() const override { return "char-lm"; }
  int64_t vocab_size() const override { return 27; }
  bool causal() const override { return true; }
  std::string metric_name() const override { return "bpc"; }
  double metric(const Metrics& m) const override { return m.bits(); }
  Batch train_batch(uint64_t seed, int64_t step, int64_t batch, int64_t context) const override;
  std::vector<Batch> eval_batches(Split split, int64_t batch, int64_t context) const override;
  /// Normalises `text` (the rules above) and returns its ids, int64 (n).
  /// Text to ids with the normalisation of the data, except that a text
  /// ending in a separator (a space, punctuation) keeps one trailing space:
  /// a prompt "the " asks for the next word, not the next letter.
  torch::Tensor encode(const std::string& text) const override;
  /// Ids (any shape, read in order) to text; throws on an id outside [0, 27).
  std::string decode(const torch::Tensor& tokens) const override;

  /// The ids of a split, uint8 (n).
  const torch::Tensor& split_ids(Split split) const;

 private:
  torch::Tensor ids_[3];
};

/// "masked-char": the bidirectional counterpart of char-lm, a character-level
/// masked language model (BERT's objective on the text8 alphabet) over the
/// same data directory. An encoder sees a window of `context` characters in
/// which masked_per_window(context) positions, drawn uniformly without
/// replacement, are replaced by kMask, and predicts the original characters
/// there; only those positions are scored. Vocabulary: char-lm's 27 ids and
/// kMask = 27. Not causal, so every mechanism applies, including the
/// clustered ones (which have no causal form). Metric "bpc": bits per masked
/// character.
///
/// train_batch: windows at offsets drawn uniformly from train.txt and the
/// masked positions, both from a generator seeded from (seed, step).
/// eval_batches: the split cut into consecutive non-overlapping windows of
/// `context` characters (the last one padded with spaces of weight 0, its mask
/// drawn among its real characters), masked positions from a fixed seed per
/// split, so every evaluation of a split scores the same characters.
class MaskedCharLm : public CharLm {
 public:
  static constexpr int64_t kMask = 27;
  /// Characters masked per window of n: max(1, round(0.15 n)).
  static int64_t masked_per_window(int64_t n);
  using CharLm::CharLm;
  std::string name() const override { return "masked-char"; }
  int64_t vocab_size() const override { return kMask + 1; }
  bool causal() const override { return false; }
  Batch train_batch(uint64_t seed, int64_t step, int64_t batch, int64_t context) const override;
  std::vector<Batch> eval_batches(Split split, int64_t batch, int64_t context) const override;
  /// As char-lm, with kMask shown as '_'.
  std::string decode(const torch::Tensor& tokens) const override;
};

}  // namespace attnkit::tasks
