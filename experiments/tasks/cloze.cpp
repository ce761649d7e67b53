// The cloze reading task over a char-lm corpus (experiments/tasks/cloze.h).
#include "tasks/cloze.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "base/random.h"

namespace attnkit::experiments {

namespace {

namespace fs = std::filesystem;

// Streams of kernels::random: one per (split, example); the evaluation seeds.
constexpr uint64_t kClozeStream = 0x636c6f7a65;  // "cloze"
constexpr uint64_t kClozeEvalSeed = 0x636c6f7a6565;
// Redraws of one example before giving up (a span without a possible answer).
constexpr int64_t kMaxDraws = 1000;

std::vector<std::string> split_words(const std::string& text) {
  std::istringstream in(text);
  return {std::istream_iterator<std::string>(in), std::istream_iterator<std::string>()};
}

std::string read_split(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "task cloze: cannot read ", path.string(),
              " (expected the directory `attnkit data char-lm --out DIR` wrote)");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!text.empty(), "task cloze: ", path.string(), " is empty");
  return text;
}

void check_text(const std::string& text, const char* split) {
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    TORCH_CHECK(c == ' ' || (c >= 'a' && c <= 'z'), "task cloze: the ", split,
                " text must hold only a-z and spaces (the char-lm format), found byte ",
                static_cast<int>(static_cast<unsigned char>(c)), " at offset ", i);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// WordVocabulary

WordVocabulary::WordVocabulary() : words_{"<unk>", "<blank>"}, counts_{0, 0} {}

WordVocabulary::WordVocabulary(const std::vector<std::string>& train_words, int64_t min_count)
    : WordVocabulary() {
  TORCH_CHECK(min_count >= 1, "task cloze: min_count must be >= 1, got ", min_count);
  std::unordered_map<std::string, int64_t> counts;
  for (const auto& w : train_words) ++counts[w];
  std::vector<std::pair<std::string, int64_t>> kept;
  for (const auto& [w, c] : counts)
    if (c >= min_count) kept.emplace_back(w, c);
  std::sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  for (const auto& [w, c] : kept) {
    ids_.emplace(w, static_cast<int64_t>(words_.size()));
    words_.push_back(w);
    counts_.push_back(c);
  }
}

int64_t WordVocabulary::id(const std::string& word) const {
  const auto it = ids_.find(word);
  return it == ids_.end() ? kUnk : it->second;
}

const std::string& WordVocabulary::word(int64_t id) const {
  TORCH_CHECK(id >= 0 && id < size(), "task cloze: word id ", id, " outside [0, ", size(), ")");
  return words_[static_cast<size_t>(id)];
}

// ---------------------------------------------------------------------------
// ClozeTask

ClozeTask::ClozeTask(const std::string& data_dir, const ClozeOptions& options) : options_(options) {
  const fs::path dir(data_dir);
  TORCH_CHECK(fs::is_directory(dir), "task cloze: data directory '", data_dir,
              "' does not exist (prepare one with `attnkit data char-lm --input FILE --out DIR`)");
  build(read_split(dir / "train.txt"), read_split(dir / "valid.txt"), read_split(dir / "test.txt"));
}

ClozeTask::ClozeTask(const std::string& train, const std::string& valid, const std::string& test,
                     const ClozeOptions& options)
    : options_(options) {
  build(train, valid, test);
}

void ClozeTask::build(const std::string& train, const std::string& valid, const std::string& test) {
  const auto& o = options_;
  TORCH_CHECK(o.query() >= 1, "task cloze: query (words per query) must be >= 1, got ", o.query());
  TORCH_CHECK(o.paragraph() >= o.query(), "task cloze: paragraph (words per paragraph, ",
              o.paragraph(), ") must be >= query (words per query, ", o.query(), ")");
  TORCH_CHECK(o.stop_words() >= 0, "task cloze: stop_words must be >= 0, got ", o.stop_words());
  const std::string* texts[3] = {&train, &valid, &test};
  const char* names[3] = {"train", "valid", "test"};
  std::vector<std::string> split[3];
  for (int s = 0; s < 3; ++s) {
    check_text(*texts[s], names[s]);
    split[s] = split_words(*texts[s]);
    TORCH_CHECK(static_cast<int64_t>(split[s].size()) >= o.paragraph(), "task cloze: the ",
                names[s], " split has ", split[s].size(), " words, fewer than one paragraph (",
                o.paragraph(), " words)");
  }
  vocabulary_ = WordVocabulary(split[0], o.min_count());
  TORCH_CHECK(vocabulary_.size() > 2 + o.stop_words(), "task cloze: the train split has ",
              vocabulary_.size() - 2, " words seen >= ", o.min_count(),
              " times, so none is left as a possible answer after the ", o.stop_words(),
              " stop words");
  for (int s = 0; s < 3; ++s) {
    words_[s].reserve(split[s].size());
    for (const auto& w : split[s]) words_[s].push_back(vocabulary_.id(w));
  }
}

const std::vector<int64_t>& ClozeTask::words(tasks::Split split) const {
  return words_[static_cast<int>(split)];
}

bool ClozeTask::answerable(int64_t id) const {
  // Ids are in order of decreasing train count after kUnk and kBlank.
  return id >= 2 + options_.stop_words();
}

uint64_t ClozeTask::eval_seed(tasks::Split split) {
  return kClozeEvalSeed + static_cast<uint64_t>(split);
}

ClozeExample ClozeTask::example(tasks::Split split, uint64_t seed, int64_t index) const {
  TORCH_CHECK(index >= 0, "task cloze: example index must be >= 0, got ", index);
  namespace rnd = kernels::random;
  const auto& w = words(split);
  const int64_t P = options_.paragraph(), Q = options_.query();
  const int64_t M = static_cast<int64_t>(w.size());
  // The example's own seed; its draws are numbers 0, 1, 2, ... of its stream.
  const uint64_t key = rnd::bits(seed, kClozeStream + static_cast<uint64_t>(split),
                                 static_cast<uint64_t>(index));
  uint64_t draw = 0;
  std::vector<int64_t> eligible;
  for (int64_t attempt = 0; attempt < kMaxDraws; ++attempt) {
    const auto o = static_cast<int64_t>(rnd::below(key, 0, draw++, static_cast<uint64_t>(M - P + 1)));
    const auto u = static_cast<int64_t>(rnd::below(key, 0, draw++, static_cast<uint64_t>(P - Q + 1)));
    eligible.clear();
    for (int64_t j = 0; j < Q; ++j)
      if (answerable(w[static_cast<size_t>(o + u + j)])) eligible.push_back(j);
    if (eligible.empty()) continue;
    const auto pick = rnd::below(key, 0, draw++, eligible.size());
    ClozeExample ex;
    ex.offset = o;
    ex.query_start = u;
    ex.blank = eligible[pick];
    ex.paragraph.assign(w.begin() + o, w.begin() + o + P);
    ex.query.assign(w.begin() + o + u, w.begin() + o + u + Q);
    ex.answer = ex.query[static_cast<size_t>(ex.blank)];
    ex.query[static_cast<size_t>(ex.blank)] = WordVocabulary::kBlank;
    for (const int64_t id : ex.paragraph)
      if (answerable(id)) ex.candidates.push_back(id);
    std::sort(ex.candidates.begin(), ex.candidates.end());
    ex.candidates.erase(std::unique(ex.candidates.begin(), ex.candidates.end()), ex.candidates.end());
    return ex;
  }
  TORCH_CHECK(false, "task cloze: ", kMaxDraws, " draws of ", to_string(split), " example ", index,
              " found no query span with a word outside the ", options_.stop_words(),
              " stop words and <unk>; is the split mostly stop words?");
}

ClozeBatch ClozeTask::collate(const std::vector<ClozeExample>& examples) const {
  const auto N = static_cast<int64_t>(examples.size());
  TORCH_CHECK(N >= 1, "task cloze: collate needs at least one example");
  const int64_t P = options_.paragraph(), Q = options_.query(), V = vocabulary_.size();
  ClozeBatch b;
  b.document = torch::empty({N, P}, torch::kInt64);
  b.query = torch::empty({N, Q}, torch::kInt64);
  b.candidate = torch::zeros({N, V}, torch::kBool);
  b.answer = torch::empty({N}, torch::kInt64);
  auto doc = b.document.accessor<int64_t, 2>();
  auto qry = b.query.accessor<int64_t, 2>();
  auto cand = b.candidate.accessor<bool, 2>();
  auto ans = b.answer.accessor<int64_t, 1>();
  for (int64_t n = 0; n < N; ++n) {
    const auto& ex = examples[static_cast<size_t>(n)];
    TORCH_CHECK(static_cast<int64_t>(ex.paragraph.size()) == P &&
                    static_cast<int64_t>(ex.query.size()) == Q,
                "task cloze: collate: example ", n, " has ", ex.paragraph.size(), " + ",
                ex.query.size(), " words, expected ", P, " + ", Q);
    for (int64_t i = 0; i < P; ++i) doc[n][i] = ex.paragraph[static_cast<size_t>(i)];
    for (int64_t i = 0; i < Q; ++i) qry[n][i] = ex.query[static_cast<size_t>(i)];
    for (const int64_t c : ex.candidates) cand[n][c] = true;
    ans[n] = ex.answer;
  }
  return b;
}

ClozeBatch ClozeTask::train_batch(uint64_t seed, int64_t step, int64_t batch) const {
  TORCH_CHECK(step >= 0, "task cloze: train_batch: step must be >= 0, got ", step);
  TORCH_CHECK(batch >= 1, "task cloze: train_batch: batch must be >= 1, got ", batch);
  std::vector<ClozeExample> examples;
  examples.reserve(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) examples.push_back(example(tasks::Split::train, seed, step * batch + i));
  return collate(examples);
}

std::vector<ClozeExample> ClozeTask::eval_examples(tasks::Split split, int64_t count) const {
  TORCH_CHECK(count >= 1, "task cloze: evaluation examples: count must be >= 1, got ", count);
  std::vector<ClozeExample> examples;
  examples.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) examples.push_back(example(split, eval_seed(split), i));
  return examples;
}

std::vector<ClozeBatch> ClozeTask::eval_batches(tasks::Split split, int64_t count, int64_t batch) const {
  TORCH_CHECK(batch >= 1, "task cloze: eval_batches: batch must be >= 1, got ", batch);
  const auto examples = eval_examples(split, count);
  std::vector<ClozeBatch> out;
  for (size_t begin = 0; begin < examples.size(); begin += static_cast<size_t>(batch)) {
    const size_t end = std::min(examples.size(), begin + static_cast<size_t>(batch));
    out.push_back(collate({examples.begin() + static_cast<std::ptrdiff_t>(begin),
                           examples.begin() + static_cast<std::ptrdiff_t>(end)}));
  }
  return out;
}

ClozeBaselines ClozeTask::baselines(const std::vector<ClozeExample>& examples) {
  ClozeBaselines b;
  b.examples = static_cast<int64_t>(examples.size());
  if (examples.empty()) return b;
  double candidates = 0, random = 0, frequency = 0;
  for (const auto& ex : examples) {
    const auto k = static_cast<double>(ex.candidates.size());
    candidates += k;
    random += 1.0 / k;
    // The most frequent candidate in the paragraph, ties to the earliest.
    int64_t best = -1, best_count = 0;
    for (const int64_t id : ex.paragraph) {
      if (!std::binary_search(ex.candidates.begin(), ex.candidates.end(), id)) continue;
      const auto c = std::count(ex.paragraph.begin(), ex.paragraph.end(), id);
      if (c > best_count) best = id, best_count = c;
    }
    frequency += best == ex.answer ? 1.0 : 0.0;
  }
  const auto n = static_cast<double>(examples.size());
  b.mean_candidates = candidates / n;
  b.random = random / n;
  b.frequency = frequency / n;
  return b;
}

}  // namespace attnkit::experiments
