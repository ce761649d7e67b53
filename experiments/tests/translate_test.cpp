// The translation task and the zoo's encoder-decoder: the dictd parser on a
// hand-written database, UTF-8, the edit distance and the scores by hand, the
// splits and batches on the shipped fixture (German number words), and the
// model: attention weights over the source only, rows independent of the rest
// of the batch (packing), greedy decoding equal to teacher forcing on its own
// output, gradients reaching every parameter, refusals.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "models/seq2seq.h"
#include "tasks/dictionary.h"
#include "test_util.h"

namespace translate_test {

using attnkit::experiments::CharVocabulary;
using attnkit::experiments::decode_utf8;
using attnkit::experiments::edit_distance;
using attnkit::experiments::encode_utf8;
using attnkit::experiments::parse_dictd;
using attnkit::experiments::Score;
using attnkit::experiments::score_translation;
using attnkit::experiments::Seq2Seq;
using attnkit::experiments::Seq2SeqOptions;
using attnkit::experiments::TranslationOptions;
using attnkit::experiments::TranslationTask;
using attnkit::testing::expect_error;
using Split = attnkit::tasks::Split;

namespace {

const std::string kFixture = std::string(ATTNKIT_EXPERIMENTS_TEST_DATA_DIR) + "/numbers-deu-eng";

const std::vector<Score> kScores = {Score::none, Score::additive, Score::general,
                                    Score::dot,  Score::scaled_dot, Score::location};

/// A dictd database from entries' texts: the index in the order given.
std::pair<std::string, std::string> dictd(const std::vector<std::pair<std::string, std::string>>& entries) {
  auto base64 = [](uint64_t v) {
    const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string digits;
    do {
      digits.insert(digits.begin(), alphabet[v % 64]);
      v /= 64;
    } while (v);
    return digits;
  };
  std::string index, dict;
  for (const auto& [headword, body] : entries) {
    index += headword + "\t" + base64(dict.size()) + "\t" + base64(body.size()) + "\n";
    dict += body;
  }
  return {index, dict};
}

}  // namespace

TEST(Dictd, ParsesSourcesAndCleansSenses) {
  const auto [index, dict] = dictd({
      {"00-database-short", "A test database\n"},
      {"umverteilen", "umverteilen /ˈʊmfɛɾtˌaɪlən/ <v, trans>\nredirect <v>\n   Synonym: {umleiten}\n\n"},
      {"abblocken", "Abblocken <neut, n, sg>\n [soc.] defensiveness <n>, block (a ball, a shot)\n"},
      {"schön", "schön\nbeautiful,  lovely ,, {see: hübsch} fine\n"},
  });
  const auto entries = parse_dictd(index, dict);
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].source, "umverteilen");
  EXPECT_EQ(entries[0].senses, std::vector<std::string>({"redirect"}));
  // The cased source of line 1, not the index's lowercased headword; a comma
  // inside parentheses does not split.
  EXPECT_EQ(entries[1].source, "Abblocken");
  EXPECT_EQ(entries[1].senses, std::vector<std::string>({"defensiveness", "block (a ball, a shot)"}));
  EXPECT_EQ(entries[2].source, "schön");
  EXPECT_EQ(entries[2].senses, std::vector<std::string>({"beautiful", "lovely", "fine"}));
}

TEST(Dictd, RefusesAMalformedIndex) {
  expect_error([] { parse_dictd("word\tA\n", "x"); }, {"index line 1", "headword TAB offset TAB length"});
  expect_error([] { parse_dictd("a\tA\tB\nword\tA\t!\n", "xy"); }, {"index line 2"});
  expect_error([] { parse_dictd("word\tB\tD\n", "abc"); }, {"index line 1", "bytes [1, 4)", "of 3 bytes"});
}

TEST(Dictd, Utf8RoundTripsAndRefusesMalformedBytes) {
  const std::string text = "Grüße, 東京 🙂";
  const auto decoded = decode_utf8(text);
  EXPECT_EQ(decoded.size(), 11u);  // G r ü ß e , _ 東 京 _ 🙂
  EXPECT_EQ(decoded[2], U'ü');
  EXPECT_EQ(encode_utf8(decoded), text);
  expect_error([] { decode_utf8("a\xff"); }, {"malformed UTF-8 at byte 1"});
  expect_error([] { decode_utf8("a\xc3"); }, {"truncated UTF-8 at byte 1"});
  expect_error([] { decode_utf8("\xc3("); }, {"malformed UTF-8 at byte 1"});
}

TEST(Dictd, EditDistanceAndScoresByHand) {
  EXPECT_EQ(edit_distance(U"", U""), 0);
  EXPECT_EQ(edit_distance(U"", U"abc"), 3);
  EXPECT_EQ(edit_distance(U"kitten", U"sitting"), 3);
  EXPECT_EQ(edit_distance(U"flaw", U"lawn"), 2);
  EXPECT_EQ(edit_distance(U"ä", U"a"), 1);  // one code point, not two bytes
  const auto hit = score_translation(U"lovely", {U"beautiful", U"lovely"});
  EXPECT_TRUE(hit.exact);
  EXPECT_EQ(hit.cer, 0.0);
  // "fin" is 1 edit from "fine" (1/4) and 7 from "beautiful" (7/9): the nearest counts.
  const auto miss = score_translation(U"fin", {U"beautiful", U"fine"});
  EXPECT_FALSE(miss.exact);
  EXPECT_DOUBLE_EQ(miss.cer, 0.25);
  EXPECT_DOUBLE_EQ(score_translation(U"", {U"ab"}).cer, 1.0);
}

TEST(TranslationTask, SplitsTheFixtureBySourceAndKeepsEverySense) {
  const TranslationTask task(kFixture, TranslationOptions());
  std::set<std::u32string> seen;
  size_t total = 0;
  for (auto split : {Split::train, Split::valid, Split::test}) {
    const auto& examples = task.examples(split);
    ASSERT_FALSE(examples.empty()) << attnkit::tasks::to_string(split);
    for (const auto& e : examples) {
      EXPECT_TRUE(seen.insert(e.source).second) << "a source in two splits";
      EXPECT_EQ(task.split_of(encode_utf8(e.source)), split);
    }
    total += examples.size();
  }
  EXPECT_EQ(total, 999u);  // 1-999, none longer than 32 characters
  EXPECT_GT(task.examples(Split::train).size(), 900u);
  // "einhundert" has two senses, "one hundred" and "a hundred".
  for (auto split : {Split::train, Split::valid, Split::test})
    for (const auto& e : task.examples(split))
      if (e.source == U"einhundert")
        EXPECT_EQ(e.senses, std::vector<std::u32string>({U"a hundred", U"one hundred"}));
  // Shorter limits drop the long sources.
  const TranslationTask shorter(kFixture, TranslationOptions().max_source(20));
  for (const auto& e : shorter.examples(Split::train)) EXPECT_LE(e.source.size(), 20u);
  EXPECT_LT(shorter.examples(Split::train).size(), task.examples(Split::train).size());
}

TEST(TranslationTask, BatchesArePureFunctionsOfSeedAndStep) {
  const TranslationTask task(kFixture, TranslationOptions());
  const auto a = task.train_batch(7, 3, 16), b = task.train_batch(7, 3, 16), c = task.train_batch(8, 3, 16);
  EXPECT_TRUE(a.source.equal(b.source) && a.target.equal(b.target));
  EXPECT_FALSE(a.source.equal(c.source));
  const int64_t N = 16;
  ASSERT_EQ(a.source.size(0), N);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t S = a.source_lengths[n].item<int64_t>();
    EXPECT_TRUE(a.source[n].narrow(0, S, a.source.size(1) - S).eq(CharVocabulary::kPad).all().item<bool>());
    // decoder_input = kBos then the sense; target = the sense then kEos.
    EXPECT_EQ(a.decoder_input[n][0].item<int64_t>(), CharVocabulary::kBos);
    const int64_t T = a.target[n].ne(CharVocabulary::kPad).sum().item<int64_t>();
    EXPECT_EQ(a.target[n][T - 1].item<int64_t>(), CharVocabulary::kEos);
    EXPECT_TRUE(a.decoder_input[n].narrow(0, 1, T - 1).equal(a.target[n].narrow(0, 0, T - 1)));
  }
  // Evaluation: the split's first examples in order, each with its first sense.
  const auto batches = task.eval_batches(Split::test, 5, 2);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[2].source.size(0), 1);
  const auto examples = task.eval_examples(Split::test, 5);
  ASSERT_EQ(examples.size(), 5u);
  const auto& v = task.vocabulary();
  const auto first = batches[0].target[1].contiguous();
  EXPECT_EQ(v.text(std::vector<int64_t>(first.data_ptr<int64_t>(), first.data_ptr<int64_t>() + first.size(0))),
            examples[1].senses[0]);
}

TEST(TranslationTask, RefusesWhatItCannotUse) {
  expect_error([] { TranslationTask("/nonexistent-dir", TranslationOptions()); }, {"no directory", "fetch-corpus"});
  expect_error([] { TranslationTask(std::vector<attnkit::experiments::DictdEntry>{{"Haus", {"house"}}},
                                    TranslationOptions()); },
               {"no", "example among 1 entries"});
  expect_error([] { TranslationTask(kFixture, TranslationOptions().valid_per_mille(600).test_per_mille(400)); },
               {"sum below 1000"});
}

class Seq2SeqScores : public ::testing::TestWithParam<Score> {};

TEST_P(Seq2SeqScores, WeightsCoverTheSourceOnlyAndRowsDoNotDependOnTheBatch) {
  torch::manual_seed(1);
  Seq2Seq model(Seq2SeqOptions(12, 9).embedding(6).hidden(5).score(GetParam()));
  model->eval();
  // Row 0 is short (3 of 9 positions); row 1 fills the width.
  const auto source = torch::tensor({4, 5, 6, 0, 0, 0, 0, 0, 0, 7, 8, 9, 10, 11, 4, 5, 6, 7}, torch::kInt64).view({2, 9});
  const auto lengths = torch::tensor({3, 9}, torch::kInt64);
  const auto input = torch::tensor({1, 4, 5, 6, 1, 7, 7, 0}, torch::kInt64).view({2, 4});
  const auto out = model->forward(source, lengths, input);
  ASSERT_EQ(out.logits.sizes(), torch::IntArrayRef({2, 4, 12}));
  if (GetParam() == Score::none) {
    EXPECT_FALSE(out.weights.defined());
  } else {
    ASSERT_EQ(out.weights.sizes(), torch::IntArrayRef({2, 4, 9}));
    EXPECT_TRUE(torch::allclose(out.weights.sum(2), torch::ones({2, 4}), 1e-5, 1e-6));
    EXPECT_TRUE(out.weights[0].narrow(1, 3, 6).eq(0).all().item<bool>()) << "weight on padding";
  }
  // Row 0 alone, without padding: the same logits (packing hides the padding
  // from both encoder directions).
  const auto alone = model->forward(source.narrow(0, 0, 1).narrow(1, 0, 3), lengths.narrow(0, 0, 1),
                                    input.narrow(0, 0, 1));
  EXPECT_TRUE(torch::allclose(alone.logits[0], out.logits[0], 1e-5, 1e-6))
      << (alone.logits[0] - out.logits[0]).abs().max();
}

TEST_P(Seq2SeqScores, GreedyDecodingIsTeacherForcingOnItsOwnOutput) {
  torch::manual_seed(2);
  Seq2Seq model(Seq2SeqOptions(10, 6).embedding(4).hidden(3).score(GetParam()));
  model->eval();
  torch::NoGradGuard no_grad;
  const auto source = torch::tensor({4, 5, 6, 7, 8, 9, 9, 8, 7, 0, 0, 0}, torch::kInt64).view({2, 6});
  const auto lengths = torch::tensor({6, 3}, torch::kInt64);
  const auto decoded = model->greedy(source, lengths, 7);
  const int64_t T = decoded.ids.size(1);
  ASSERT_GE(T, 1);
  ASSERT_LE(T, 7);
  // Feed the greedy ids back (kBos first): the logits of every step agree.
  const auto input = torch::cat({torch::full({2, 1}, CharVocabulary::kBos, torch::kInt64), decoded.ids.narrow(1, 0, T - 1)}, 1);
  const auto teacher = model->forward(source, lengths, input);
  for (int64_t n = 0; n < 2; ++n) {
    // Up to and including the row's kEos (after it greedy feeds padding).
    int64_t steps = T;
    for (int64_t t = 0; t < T; ++t)
      if (decoded.ids[n][t].item<int64_t>() == CharVocabulary::kEos) {
        steps = t + 1;
        break;
      }
    EXPECT_TRUE(torch::allclose(decoded.logits[n].narrow(0, 0, steps), teacher.logits[n].narrow(0, 0, steps), 1e-5, 1e-6));
    if (GetParam() != Score::none)
      EXPECT_TRUE(torch::allclose(decoded.weights[n].narrow(0, 0, steps), teacher.weights[n].narrow(0, 0, steps), 1e-5, 1e-6));
    // After kEos, padding.
    if (steps < T) EXPECT_TRUE(decoded.ids[n].narrow(0, steps, T - steps).eq(CharVocabulary::kPad).all().item<bool>());
  }
}

TEST_P(Seq2SeqScores, GradientsReachEveryParameter) {
  torch::manual_seed(3);
  Seq2Seq model(Seq2SeqOptions(10, 5).embedding(4).hidden(3).score(GetParam()));
  const auto source = torch::randint(4, 10, {3, 5}, torch::kInt64);
  const auto lengths = torch::tensor({5, 2, 4}, torch::kInt64);
  const auto input = torch::randint(4, 10, {3, 4}, torch::kInt64);
  model->forward(source, lengths, input).logits.square().sum().backward();
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    // The padding characters' embedding rows are never read: the rest is.
    const auto g = p.key() == "embed_source.weight" ? p.value().grad().narrow(0, 4, 6) : p.value().grad();
    if (p.key() == "embed_target.weight") continue;  // rows of ids not in `input` stay zero
    EXPECT_GT(g.abs().sum().item<double>(), 0) << p.key();
  }
}

INSTANTIATE_TEST_SUITE_P(EveryScore, Seq2SeqScores, ::testing::ValuesIn(kScores),
                         [](const auto& info) {
                           auto name = attnkit::experiments::to_string(info.param);
                           for (auto& c : name) c = c == '-' ? '_' : c;
                           return name;
                         });

TEST(Seq2Seq, NoneHasDotAttentionsParametersAndNamesParse) {
  auto count = [](Score score) {
    Seq2Seq model(Seq2SeqOptions(10, 5).embedding(4).hidden(3).score(score));
    int64_t n = 0;
    for (const auto& p : model->parameters()) n += p.numel();
    return n;
  };
  EXPECT_EQ(count(Score::none), count(Score::dot));
  EXPECT_EQ(count(Score::dot), count(Score::scaled_dot));
  EXPECT_GT(count(Score::additive), count(Score::none));
  for (auto score : {Score::none, Score::additive, Score::general, Score::dot, Score::scaled_dot, Score::location})
    EXPECT_EQ(attnkit::experiments::score_from_string(attnkit::experiments::to_string(score)), score);
  expect_error([] { attnkit::experiments::score_from_string("concat"); }, {"unknown score 'concat'", "scaled-dot"});
}

TEST(Seq2Seq, RefusesBadInput) {
  Seq2Seq model(Seq2SeqOptions(10, 4).embedding(4).hidden(3).score(Score::location));
  const auto source = torch::randint(4, 10, {2, 5}, torch::kInt64);
  const auto input = torch::randint(4, 10, {2, 3}, torch::kInt64);
  expect_error([&] { model->forward(source, torch::tensor({5, 5}), input); }, {"longer than max_source 4"});
  const auto fits = source.narrow(1, 0, 4);
  expect_error([&] { model->forward(fits, torch::tensor({0, 4}), input); }, {"lengths must be in [1, S = 4]"});
  expect_error([&] { model->forward(fits, torch::tensor({4}), input); }, {"lengths must be int64 (N) = (2)"});
  expect_error([&] { model->forward(fits, torch::tensor({4, 4}), input.narrow(0, 0, 1)); }, {"decoder_input"});
  expect_error([&] { model->greedy(fits, torch::tensor({4, 4}), 0); }, {"max_steps >= 1"});
  expect_error([] { Seq2Seq(Seq2SeqOptions(4, 4)); }, {"'vocab' must be >= 5"});
}

}  // namespace translate_test
