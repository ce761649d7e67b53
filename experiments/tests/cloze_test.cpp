// The cloze task: the vocabulary's order, every invariant of an example (the
// query is a span of the paragraph with one possible answer blanked, the
// candidates are the paragraph's possible answers), determinism in (seed,
// index), batches as stacks of examples, the baselines on hand-made examples,
// and the refusals.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <attnkit/tasks/char_lm.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "tasks/cloze.h"
#include "test_util.h"

namespace cloze_test {

using attnkit::experiments::ClozeExample;
using attnkit::experiments::ClozeOptions;
using attnkit::experiments::ClozeTask;
using attnkit::tasks::Split;
using attnkit::experiments::WordVocabulary;
using attnkit::testing::expect_error;

namespace {

// A text whose word counts are known: "a" x6, "b" x5, "c" x4, "d" x3 and "e"
// x2, interleaved, then "rare" once.
std::string counted_text() {
  std::string text;
  const char* words[] = {"a", "b", "c", "d", "e"};
  for (int round = 0; round < 6; ++round)
    for (int w = 0; w < 5; ++w)
      if (6 - w > round) text += std::string(text.empty() ? "" : " ") + words[w];
  return text + " rare";
}

// n words cycling over `distinct` (<= 26) words wa, wb, ..., so every word is frequent.
std::string cycle_text(int n, int distinct) {
  std::string text;
  for (int i = 0; i < n; ++i) text += (i ? " w" : "w") + std::string(1, static_cast<char>('a' + i % distinct));
  return text;
}

void expect_example(const ClozeTask& task, Split split, const ClozeExample& ex) {
  const auto& o = task.options();
  const auto& words = task.words(split);
  ASSERT_EQ(static_cast<int64_t>(ex.paragraph.size()), o.paragraph());
  ASSERT_EQ(static_cast<int64_t>(ex.query.size()), o.query());
  ASSERT_GE(ex.offset, 0);
  ASSERT_LE(ex.offset + o.paragraph(), static_cast<int64_t>(words.size()));
  ASSERT_GE(ex.query_start, 0);
  ASSERT_LE(ex.query_start + o.query(), o.paragraph());
  // The paragraph is the split's words at the offset.
  for (int64_t i = 0; i < o.paragraph(); ++i)
    EXPECT_EQ(ex.paragraph[i], words[ex.offset + i]) << "paragraph word " << i;
  // The placeholder exactly once, at `blank`; the other query words are the
  // paragraph's words at query_start; the blanked word is the answer.
  ASSERT_GE(ex.blank, 0);
  ASSERT_LT(ex.blank, o.query());
  EXPECT_EQ(std::count(ex.query.begin(), ex.query.end(), WordVocabulary::kBlank), 1);
  EXPECT_EQ(ex.query[ex.blank], WordVocabulary::kBlank);
  for (int64_t j = 0; j < o.query(); ++j)
    if (j != ex.blank) EXPECT_EQ(ex.query[j], ex.paragraph[ex.query_start + j]) << "query word " << j;
  EXPECT_EQ(ex.answer, ex.paragraph[ex.query_start + ex.blank]);
  EXPECT_TRUE(task.answerable(ex.answer));
  // Candidates: exactly the distinct answerable words of the paragraph, sorted.
  std::set<int64_t> expected;
  for (const int64_t id : ex.paragraph)
    if (task.answerable(id)) expected.insert(id);
  EXPECT_EQ(ex.candidates, std::vector<int64_t>(expected.begin(), expected.end()));
  EXPECT_TRUE(std::binary_search(ex.candidates.begin(), ex.candidates.end(), ex.answer));
}

}  // namespace

TEST(WordVocabulary, OrdersByCountThenAlphabeticallyAndMapsRareWordsToUnk) {
  std::vector<std::string> words = {"b", "a", "c", "b", "a", "z", "c", "rare", "y", "y", "z"};
  // Counts: a 2, b 2, c 2, y 2, z 2, rare 1; min_count 2 drops "rare".
  const WordVocabulary v(words, 2);
  ASSERT_EQ(v.size(), 2 + 5);
  EXPECT_EQ(v.word(WordVocabulary::kUnk), "<unk>");
  EXPECT_EQ(v.word(WordVocabulary::kBlank), "<blank>");
  EXPECT_EQ(v.word(2), "a");
  EXPECT_EQ(v.word(6), "z");
  EXPECT_EQ(v.id("rare"), WordVocabulary::kUnk);
  EXPECT_EQ(v.id("never"), WordVocabulary::kUnk);
  EXPECT_EQ(v.count(v.id("y")), 2);
  const WordVocabulary by_count(std::vector<std::string>{"q", "p", "q", "q", "p", "r"}, 1);
  EXPECT_EQ(by_count.word(2), "q");
  EXPECT_EQ(by_count.word(3), "p");
  EXPECT_EQ(by_count.word(4), "r");
  expect_error([&] { v.word(7); }, {"word id 7", "[0, 7)"});
}

TEST(ClozeTask, StopWordsAreTheMostFrequentWords) {
  const auto text = counted_text();
  const ClozeTask task(text, text, text, ClozeOptions().paragraph(10).query(4).min_count(2).stop_words(2));
  const auto& v = task.vocabulary();
  EXPECT_EQ(v.id("a"), 2);
  EXPECT_EQ(v.id("rare"), WordVocabulary::kUnk);
  EXPECT_FALSE(task.answerable(v.id("a")));
  EXPECT_FALSE(task.answerable(v.id("b")));
  EXPECT_TRUE(task.answerable(v.id("c")));
  EXPECT_TRUE(task.answerable(v.id("e")));
  EXPECT_FALSE(task.answerable(WordVocabulary::kUnk));
  EXPECT_FALSE(task.answerable(WordVocabulary::kBlank));
  // No answer is ever a stop word or <unk>.
  for (int64_t i = 0; i < 200; ++i) {
    const auto ex = task.example(Split::train, 3, i);
    expect_example(task, Split::train, ex);
    EXPECT_GE(ex.answer, v.id("c"));
  }
}

namespace {

// tests/data/genesis-1-2.txt normalised as `attnkit data char-lm` does, its
// words cut into train (the first 80%), valid and test (10% each).
ClozeTask genesis_task(const ClozeOptions& options) {
  std::ifstream in(std::string(ATTNKIT_TEST_DATA_DIR) + "/genesis-1-2.txt", std::ios::binary);
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto text = attnkit::tasks::normalize_text(raw);
  std::istringstream words_in(text);
  std::vector<std::string> words{std::istream_iterator<std::string>(words_in),
                                 std::istream_iterator<std::string>()};
  const size_t a = words.size() * 8 / 10, b = words.size() * 9 / 10;
  auto join = [&](size_t begin, size_t end) {
    std::string s;
    for (size_t i = begin; i < end; ++i) s += (i > begin ? " " : "") + words[i];
    return s;
  };
  return ClozeTask(join(0, a), join(a, b), join(b, words.size()), options);
}

}  // namespace

TEST(ClozeTask, ExamplesHoldEveryInvariantOnGenesis) {
  const auto task = genesis_task(ClozeOptions().paragraph(40).query(10).min_count(2).stop_words(20));
  for (const auto split : {Split::train, Split::valid, Split::test})
    for (int64_t i = 0; i < 300; ++i) expect_example(task, split, task.example(split, 11, i));
}

TEST(ClozeTask, ExamplesAreAPureFunctionOfSplitSeedAndIndex) {
  const auto task = genesis_task(ClozeOptions().paragraph(30).query(8).min_count(2).stop_words(10));
  auto same = [](const ClozeExample& x, const ClozeExample& y) {
    return x.paragraph == y.paragraph && x.query == y.query && x.blank == y.blank &&
           x.answer == y.answer && x.candidates == y.candidates && x.offset == y.offset &&
           x.query_start == y.query_start;
  };
  // The same (split, seed, index) gives the same example, whatever came before.
  const auto first = task.example(Split::train, 5, 17);
  for (int64_t i = 0; i < 50; ++i) task.example(Split::train, 5, i);
  EXPECT_TRUE(same(first, task.example(Split::train, 5, 17)));
  // Other seeds, indices and splits give other examples (most of the time:
  // count the differences over many).
  int differ_seed = 0, differ_index = 0;
  for (int64_t i = 0; i < 100; ++i) {
    differ_seed += !same(task.example(Split::train, 5, i), task.example(Split::train, 6, i));
    differ_index += !same(task.example(Split::train, 5, i), task.example(Split::train, 5, i + 1));
  }
  EXPECT_GT(differ_seed, 90);
  EXPECT_GT(differ_index, 90);
  // Training batch `step` stacks examples step * batch .. of the train split.
  const auto batch = task.train_batch(5, 3, 4);
  ASSERT_EQ(batch.document.sizes(), torch::IntArrayRef({4, 30}));
  ASSERT_EQ(batch.query.sizes(), torch::IntArrayRef({4, 8}));
  ASSERT_EQ(batch.candidate.sizes(), torch::IntArrayRef({4, task.vocabulary().size()}));
  EXPECT_EQ(batch.candidate.scalar_type(), torch::kBool);
  for (int64_t n = 0; n < 4; ++n) {
    const auto ex = task.example(Split::train, 5, 3 * 4 + n);
    EXPECT_EQ(std::vector<int64_t>(batch.document[n].data_ptr<int64_t>(),
                                   batch.document[n].data_ptr<int64_t>() + 30),
              ex.paragraph);
    EXPECT_EQ(std::vector<int64_t>(batch.query[n].data_ptr<int64_t>(),
                                   batch.query[n].data_ptr<int64_t>() + 8),
              ex.query);
    EXPECT_EQ(batch.answer[n].item<int64_t>(), ex.answer);
    const auto ids = batch.candidate[n].nonzero().flatten();
    EXPECT_EQ(std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel()),
              ex.candidates);
  }
  EXPECT_TRUE(torch::equal(task.train_batch(5, 3, 4).document, batch.document));
  // Evaluation examples are fixed per split and do not depend on the batch size.
  const auto b7 = task.eval_batches(Split::valid, 10, 7), b3 = task.eval_batches(Split::valid, 10, 3);
  ASSERT_EQ(b7.size(), 2u);
  ASSERT_EQ(b3.size(), 4u);
  EXPECT_EQ(b3.back().answer.size(0), 1);
  EXPECT_TRUE(torch::equal(torch::cat({b7[0].answer, b7[1].answer}),
                           torch::cat({b3[0].answer, b3[1].answer, b3[2].answer, b3[3].answer})));
  EXPECT_TRUE(same(task.eval_examples(Split::valid, 10)[9],
                   task.example(Split::valid, ClozeTask::eval_seed(Split::valid), 9)));
}

TEST(ClozeTask, Baselines) {
  auto ex = [](std::vector<int64_t> paragraph, std::vector<int64_t> candidates, int64_t answer) {
    ClozeExample e;
    e.paragraph = std::move(paragraph);
    e.candidates = std::move(candidates);
    e.answer = answer;
    return e;
  };
  // 1: candidate 7 occurs twice (right); 2: 8 twice, answer 9 (wrong); 3: a tie
  // between 5 and 6 goes to 6, which occurs first (right). Stop word 2 occurs
  // most often but is no candidate.
  const auto b = ClozeTask::baselines({ex({2, 2, 2, 7, 9, 7}, {7, 9}, 7),
                                       ex({8, 9, 8, 2}, {8, 9}, 9),
                                       ex({2, 6, 5, 5, 6, 4}, {4, 5, 6}, 6)});
  EXPECT_EQ(b.examples, 3);
  EXPECT_DOUBLE_EQ(b.mean_candidates, 7.0 / 3.0);
  EXPECT_DOUBLE_EQ(b.random, (0.5 + 0.5 + 1.0 / 3.0) / 3.0);
  EXPECT_DOUBLE_EQ(b.frequency, 2.0 / 3.0);
}

TEST(ClozeTask, RefusesBadInput) {
  const auto text = cycle_text(100, 10);
  expect_error([&] { (void)ClozeTask(text, text, text, ClozeOptions().paragraph(8).query(9)); },
               {"paragraph", "8", "must be >= query", "9"});
  expect_error([&] { (void)ClozeTask(text, text, text, ClozeOptions().paragraph(101).query(9)); },
               {"train split has 100 words, fewer than one paragraph (101 words)"});
  expect_error([&] { (void)ClozeTask(text, "short text", text, ClozeOptions().paragraph(5).query(2)); },
               {"valid split has 2 words"});
  expect_error([&] { (void)ClozeTask("Upper case", text, text, ClozeOptions().paragraph(2).query(1)); },
               {"train text must hold only a-z and spaces", "byte 85 at offset 0"});
  expect_error([&] { (void)ClozeTask(text, text, text, ClozeOptions().paragraph(5).query(2).stop_words(10)); },
               {"none is left as a possible answer after the 10 stop words"});
  expect_error([&] { (void)ClozeTask("/nonexistent/cloze-data", ClozeOptions()); },
               {"data directory '/nonexistent/cloze-data' does not exist"});
  // A split where no span of the query length holds a possible answer.
  const std::string stops = "a b a b a b a b a b a b";
  const ClozeTask task(stops + " c c", stops, stops, ClozeOptions().paragraph(4).query(2).min_count(1).stop_words(2));
  expect_error([&] { task.example(Split::valid, 1, 0); }, {"valid example 0", "found no query span"});
}

}  // namespace cloze_test
