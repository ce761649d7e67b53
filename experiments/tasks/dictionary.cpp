// Translation pairs from a dictd dictionary (experiments/tasks/dictionary.h).
#include "tasks/dictionary.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>

#include "base/random.h"

namespace attnkit::experiments {

namespace {

namespace fs = std::filesystem;

// Stream of kernels::random for the training draws.
constexpr uint64_t kTranslateStream = 0x7472616e736c;  // "transl"

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "task translate: cannot read ", path.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// A base-64 number of the dictd index (most significant digit first).
bool decode_base64_number(const std::string& digits, uint64_t& value) {
  static const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  if (digits.empty() || digits.size() > 10) return false;
  value = 0;
  for (char c : digits) {
    const auto digit = alphabet.find(c);
    if (digit == std::string::npos) return false;
    value = value * 64 + digit;
  }
  return true;
}

std::string collapse_spaces(const std::string& text) {
  std::istringstream in(text);
  std::string word, out;
  while (in >> word) out += (out.empty() ? "" : " ") + word;
  return out;
}

/// Line 1 up to the pronunciation (" /") or the grammar (" <").
std::string entry_source(const std::string& line) {
  size_t end = line.size();
  for (const char* marker : {" /", " <"}) end = std::min(end, line.find(marker));
  return collapse_spaces(line.substr(0, end));
}

/// Line 2 without <...>, [...] and {...} labels, split at commas outside
/// parentheses, spaces collapsed, empty pieces dropped.
std::vector<std::string> entry_senses(const std::string& line) {
  std::string text;
  char closing = 0;
  for (char c : line) {
    if (closing) {
      if (c == closing) closing = 0;
    } else if (c == '<' || c == '[' || c == '{') {
      closing = c == '<' ? '>' : c == '[' ? ']' : '}';
    } else {
      text += c;
    }
  }
  std::vector<std::string> senses;
  std::string piece;
  int depth = 0;
  auto flush = [&] {
    if (auto sense = collapse_spaces(piece); !sense.empty()) senses.push_back(sense);
    piece.clear();
  };
  for (char c : text) {
    depth += c == '(' ? 1 : c == ')' ? -1 : 0;
    if (c == ',' && depth <= 0) flush();
    else piece += c;
  }
  flush();
  return senses;
}

/// FNV-1a, 64 bits.
uint64_t fnv1a(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

bool only_from(const std::u32string& text, const std::set<char32_t>& allowed) {
  return std::all_of(text.begin(), text.end(), [&](char32_t c) { return allowed.count(c) > 0; });
}

std::set<char32_t> char_set(const std::string& utf8) {
  const auto text = decode_utf8(utf8);
  return {text.begin(), text.end()};
}

}  // namespace

std::vector<DictdEntry> read_dictd_directory(const std::string& data_dir) {
  TORCH_CHECK(fs::is_directory(data_dir), "task translate: no directory '", data_dir,
              "' (scripts/fetch-corpus freedict-deu-eng writes one)");
  std::vector<fs::path> indexes;
  for (const auto& file : fs::directory_iterator(data_dir))
    if (file.path().extension() == ".index") indexes.push_back(file.path());
  TORCH_CHECK(indexes.size() == 1, "task translate: '", data_dir,
              "' must hold exactly one dictd database (NAME.index and NAME.dict), found ", indexes.size(),
              " .index files");
  auto dict = indexes[0];
  dict.replace_extension(".dict");
  TORCH_CHECK(fs::exists(dict), "task translate: ", indexes[0].string(), " has no ", dict.string(),
              " beside it (the dictionary uncompressed: gunzip NAME.dict.dz)");
  return parse_dictd(read_file(indexes[0]), read_file(dict));
}

std::vector<DictdEntry> parse_dictd(const std::string& index_text, const std::string& dict_text) {
  std::vector<DictdEntry> entries;
  std::istringstream index(index_text);
  std::string line;
  for (int64_t number = 1; std::getline(index, line); ++number) {
    if (line.empty()) continue;
    const auto tab1 = line.find('\t');
    const auto tab2 = tab1 == std::string::npos ? tab1 : line.find('\t', tab1 + 1);
    uint64_t offset = 0, length = 0;
    const bool ok = tab2 != std::string::npos &&
                    decode_base64_number(line.substr(tab1 + 1, tab2 - tab1 - 1), offset) &&
                    decode_base64_number(line.substr(tab2 + 1), length);
    TORCH_CHECK(ok, "task translate: index line ", number,
                " is not 'headword TAB offset TAB length' (base-64 numbers): '", line, "'");
    TORCH_CHECK(offset <= dict_text.size() && length <= dict_text.size() - offset, "task translate: index line ",
                number, " points at bytes [", offset, ", ", offset + length, ") of a dictionary of ",
                dict_text.size(), " bytes");
    const std::string headword = line.substr(0, tab1);
    if (headword.rfind("00-database", 0) == 0 || headword.rfind("00database", 0) == 0) continue;
    std::istringstream entry(dict_text.substr(offset, length));
    std::string first, second;
    std::getline(entry, first);
    std::getline(entry, second);
    entries.push_back({entry_source(first), entry_senses(second)});
  }
  return entries;
}

std::u32string decode_utf8(const std::string& text) {
  std::u32string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    const int extra = lead < 0x80 ? 0 : (lead >> 5) == 0x6 ? 1 : (lead >> 4) == 0xe ? 2 : (lead >> 3) == 0x1e ? 3 : -1;
    TORCH_CHECK(extra >= 0, "task translate: malformed UTF-8 at byte ", i);
    TORCH_CHECK(i + static_cast<size_t>(extra) < text.size(), "task translate: truncated UTF-8 at byte ", i);
    char32_t c = extra == 0 ? lead : lead & (0x3f >> extra);
    for (int k = 1; k <= extra; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      TORCH_CHECK((next & 0xc0) == 0x80, "task translate: malformed UTF-8 at byte ", i + k);
      c = (c << 6) | (next & 0x3f);
    }
    out.push_back(c);
    i += 1 + extra;
  }
  return out;
}

std::string encode_utf8(const std::u32string& text) {
  std::string out;
  for (char32_t c : text) {
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else if (c < 0x800) {
      out += static_cast<char>(0xc0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3f));
    } else if (c < 0x10000) {
      out += static_cast<char>(0xe0 | (c >> 12));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (c & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (c >> 18));
      out += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (c & 0x3f));
    }
  }
  return out;
}

int64_t edit_distance(const std::u32string& a, const std::u32string& b) {
  // One row of the dynamic programme: row[j] = distance(a[0, i), b[0, j)).
  std::vector<int64_t> row(b.size() + 1);
  std::iota(row.begin(), row.end(), 0);
  for (size_t i = 1; i <= a.size(); ++i) {
    int64_t diagonal = row[0];
    row[0] = static_cast<int64_t>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      const int64_t above = row[j];
      row[j] = std::min({above + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

TranslationScore score_translation(const std::u32string& output, const std::vector<std::u32string>& senses) {
  TORCH_CHECK(!senses.empty(), "score_translation: an example without senses");
  TranslationScore score;
  score.cer = std::numeric_limits<double>::infinity();
  for (const auto& sense : senses) {
    score.exact = score.exact || output == sense;
    const double cer = static_cast<double>(edit_distance(output, sense)) /
                       static_cast<double>(std::max<size_t>(sense.size(), 1));
    score.cer = std::min(score.cer, cer);
  }
  return score;
}

// --- The vocabulary -----------------------------------------------------------
CharVocabulary::CharVocabulary(const std::u32string& characters) {
  chars_ = {U'\0', U'\0', U'\0', U'\0'};  // kPad, kBos, kEos, kUnk: never text
  std::set<char32_t> sorted(characters.begin(), characters.end());
  for (char32_t c : sorted) {
    ids_[c] = static_cast<int64_t>(chars_.size());
    chars_.push_back(c);
  }
}

int64_t CharVocabulary::id(char32_t c) const {
  const auto it = ids_.find(c);
  return it == ids_.end() ? kUnk : it->second;
}

std::vector<int64_t> CharVocabulary::ids(const std::u32string& text) const {
  std::vector<int64_t> out(text.size());
  std::transform(text.begin(), text.end(), out.begin(), [&](char32_t c) { return id(c); });
  return out;
}

std::u32string CharVocabulary::text(const std::vector<int64_t>& ids) const {
  std::u32string out;
  for (int64_t id : ids) {
    if (id == kEos) break;
    if (id == kUnk) out += U'?';
    else if (id > kUnk && id < size()) out += chars_[static_cast<size_t>(id)];
  }
  return out;
}

// --- The task -----------------------------------------------------------------
TranslationTask::TranslationTask(const std::string& data_dir, const TranslationOptions& options)
    : TranslationTask(read_dictd_directory(data_dir), options) {}

TranslationTask::TranslationTask(const std::vector<DictdEntry>& entries, const TranslationOptions& options)
    : options_(options) {
  const auto& o = options_;
  TORCH_CHECK(o.max_source() >= 1 && o.max_target() >= 1, "task translate: max_source and max_target must be >= 1");
  TORCH_CHECK(o.valid_per_mille() >= 1 && o.test_per_mille() >= 1 && o.valid_per_mille() + o.test_per_mille() < 1000,
              "task translate: valid_per_mille and test_per_mille must be >= 1 with a sum below 1000, got ",
              o.valid_per_mille(), " and ", o.test_per_mille());
  const auto source_chars = char_set(o.source_characters()), target_chars = char_set(o.target_characters());
  vocabulary_ = CharVocabulary(decode_utf8(o.source_characters() + o.target_characters()));

  // Sources (UTF-8, so that the order is that of their bytes) to their senses.
  std::map<std::string, std::set<std::u32string>> senses;
  for (const auto& entry : entries) {
    const auto source = decode_utf8(entry.source);
    if (source.empty() || static_cast<int64_t>(source.size()) > o.max_source() || !only_from(source, source_chars))
      continue;
    for (const auto& sense_utf8 : entry.senses) {
      const auto sense = decode_utf8(sense_utf8);
      if (static_cast<int64_t>(sense.size()) <= o.max_target() && only_from(sense, target_chars))
        senses[entry.source].insert(sense);
    }
  }
  // Each split in the order of (hash, source): a fixed order unrelated to the text.
  std::vector<std::tuple<uint64_t, std::string>> order;
  for (const auto& [source, kept] : senses)
    if (!kept.empty()) order.emplace_back(fnv1a(source), source);
  std::sort(order.begin(), order.end());
  for (const auto& [hash, source] : order) {
    const auto& kept = senses.at(source);
    examples_[static_cast<int>(split_of(source))].push_back(
        {decode_utf8(source), std::vector<std::u32string>(kept.begin(), kept.end())});
  }
  for (auto split : {tasks::Split::train, tasks::Split::valid, tasks::Split::test})
    TORCH_CHECK(!examples(split).empty(), "task translate: no ", tasks::to_string(split), " example among ",
                entries.size(), " entries (", order.size(), " sources pass the filters)");
}

const std::vector<TranslationExample>& TranslationTask::examples(tasks::Split split) const {
  return examples_[static_cast<int>(split)];
}

tasks::Split TranslationTask::split_of(const std::string& source) const {
  const auto bucket = static_cast<int64_t>(fnv1a(source) % 1000);
  if (bucket < options_.valid_per_mille()) return tasks::Split::valid;
  if (bucket < options_.valid_per_mille() + options_.test_per_mille()) return tasks::Split::test;
  return tasks::Split::train;
}

TranslationBatch TranslationTask::collate(
    const std::vector<std::pair<const std::u32string*, const std::u32string*>>& pairs) const {
  const auto N = static_cast<int64_t>(pairs.size());
  TORCH_CHECK(N >= 1, "task translate: an empty batch");
  int64_t S = 1, T = 1;
  for (const auto& [source, sense] : pairs) {
    S = std::max<int64_t>(S, static_cast<int64_t>(source->size()));
    T = std::max<int64_t>(T, static_cast<int64_t>(sense->size()) + 1);
  }
  auto source = torch::full({N, S}, CharVocabulary::kPad, torch::kInt64);
  auto lengths = torch::empty({N}, torch::kInt64);
  auto input = torch::full({N, T}, CharVocabulary::kPad, torch::kInt64);
  auto target = torch::full({N, T}, CharVocabulary::kPad, torch::kInt64);
  auto s = source.accessor<int64_t, 2>(), in = input.accessor<int64_t, 2>(), out = target.accessor<int64_t, 2>();
  for (int64_t n = 0; n < N; ++n) {
    const auto src = vocabulary_.ids(*pairs[n].first), tgt = vocabulary_.ids(*pairs[n].second);
    for (size_t i = 0; i < src.size(); ++i) s[n][i] = src[i];
    lengths[n] = static_cast<int64_t>(src.size());
    in[n][0] = CharVocabulary::kBos;
    for (size_t t = 0; t < tgt.size(); ++t) {
      in[n][t + 1] = tgt[t];
      out[n][t] = tgt[t];
    }
    out[n][tgt.size()] = CharVocabulary::kEos;
  }
  return {source, lengths, input, target};
}

TranslationBatch TranslationTask::train_batch(uint64_t seed, int64_t step, int64_t batch) const {
  namespace rnd = kernels::random;
  TORCH_CHECK(step >= 0 && batch >= 1, "task translate: train_batch needs step >= 0 and batch >= 1");
  const auto& train = examples(tasks::Split::train);
  std::vector<std::pair<const std::u32string*, const std::u32string*>> pairs;
  for (int64_t j = 0; j < batch; ++j) {
    const auto stream = kTranslateStream + static_cast<uint64_t>(step * batch + j);
    const auto& example = train[rnd::below(seed, stream, 0, train.size())];
    pairs.emplace_back(&example.source, &example.senses[rnd::below(seed, stream, 1, example.senses.size())]);
  }
  return collate(pairs);
}

std::vector<TranslationExample> TranslationTask::eval_examples(tasks::Split split, int64_t count) const {
  const auto& all = examples(split);
  const auto n = std::min<size_t>(all.size(), static_cast<size_t>(std::max<int64_t>(count, 0)));
  return {all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n)};
}

std::vector<TranslationBatch> TranslationTask::eval_batches(tasks::Split split, int64_t count, int64_t batch) const {
  TORCH_CHECK(batch >= 1, "task translate: eval_batches needs batch >= 1");
  const auto& all = examples(split);
  const auto n = std::min<int64_t>(static_cast<int64_t>(all.size()), std::max<int64_t>(count, 0));
  std::vector<TranslationBatch> batches;
  for (int64_t start = 0; start < n; start += batch) {
    std::vector<std::pair<const std::u32string*, const std::u32string*>> pairs;
    for (int64_t i = start; i < std::min(n, start + batch); ++i) pairs.emplace_back(&all[i].source, &all[i].senses[0]);
    batches.push_back(collate(pairs));
  }
  return batches;
}

}  // namespace attnkit::experiments
