// char-lm: the normalisation rules of attnkit/tasks/char_lm.h case by case,
// prepare_char_lm's splits, files and refusals, and the task's batches
// (determinism, the shift by one, evaluation covering each character once).
#include <attnkit/tasks/char_lm.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <unistd.h>

#include "test_util.h"

namespace char_lm_test {

namespace fs = std::filesystem;
using attnkit::tasks::Batch;
using attnkit::tasks::CharLm;
using attnkit::tasks::MaskedCharLm;
using attnkit::tasks::normalize_text;
using attnkit::tasks::NormalizeCounts;
using attnkit::tasks::prepare_char_lm;
using attnkit::tasks::Split;
using attnkit::testing::expect_error;

namespace {

const fs::path kGenesis = fs::path(ATTNKIT_TEST_DATA_DIR) / "genesis-1-2.txt";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A fresh directory for one test's files, removed afterwards.
using TempDir = attnkit::testing::ScratchDir;

}  // namespace

TEST(CharLmNormalize, LowercasesAndCollapsesNonLetters) {
  EXPECT_EQ(normalize_text("Hello, World!"), "hello world");
  EXPECT_EQ(normalize_text("  \t\nIn the\r\n\r\nbeginning...  "), "in the beginning");
  EXPECT_EQ(normalize_text("don't stop-me_now"), "don t stop me now");
  EXPECT_EQ(normalize_text("a\x01\x7f" "b"), "a b");  // control characters separate words
  EXPECT_EQ(normalize_text(""), "");
  EXPECT_EQ(normalize_text(" ;-) "), "");
}

TEST(CharLmNormalize, SpellsDigitsOneByOne) {
  EXPECT_EQ(normalize_text("1611"), "one six one one");
  EXPECT_EQ(normalize_text("Ge1:31"), "ge one three one");
  EXPECT_EQ(normalize_text("a0b 9"), "a zero b nine");
  EXPECT_EQ(normalize_text("2,345"), "two three four five");
}

TEST(CharLmNormalize, FoldsAccentedLettersInUtf8AndLatin1) {
  // UTF-8.
  EXPECT_EQ(normalize_text("Caf\xc3\xa9 na\xc3\xafve \xc3\x86sop Stra\xc3\x9f" "e"),
            "cafe naive aesop strasse");
  EXPECT_EQ(normalize_text("\xc5\x92uvre \xc3\x9e" "orn \xc3\x97 \xc3\xb7"), "oeuvre thorn");
  // The same words in Latin-1: bytes that are not UTF-8 are read as Latin-1.
  NormalizeCounts counts;
  EXPECT_EQ(normalize_text("Caf\xe9 na\xefve", &counts), "cafe naive");
  EXPECT_EQ(counts.latin1_bytes, 2);
  // A Latin-1 letter followed by a byte that cannot continue a UTF-8 sequence.
  EXPECT_EQ(normalize_text("\xc9t\xc9"), "ete");
}

TEST(CharLmNormalize, DropsOtherScriptsAndSymbols) {
  NormalizeCounts counts;
  // Greek alpha (2 bytes), an em dash (3 bytes), an emoji (4 bytes), a curly apostrophe.
  EXPECT_EQ(normalize_text("a\xce\xb1" "b\xe2\x80\x94" "c\xf0\x9f\x98\x80" "d don\xe2\x80\x99t", &counts),
            "a b c d don t");
  EXPECT_EQ(counts.dropped, 5);  // the four non-ASCII characters and the space
  EXPECT_EQ(counts.non_ascii_dropped, 4);
  EXPECT_EQ(counts.latin1_bytes, 0);
  EXPECT_EQ(counts.kept, 4 + 4);
  EXPECT_EQ(counts.mapped, 0);
  EXPECT_EQ(counts.output, 13);
}

TEST(CharLmNormalize, CountsEveryCharacterOnce) {
  NormalizeCounts counts;
  const auto out = normalize_text("Ab 7!\xc3\xa9", &counts);  // A b ' ' 7 ! é
  EXPECT_EQ(out, "ab seven e");
  EXPECT_EQ(counts.kept, 1);                // b
  EXPECT_EQ(counts.mapped, 3);              // A, 7, é
  EXPECT_EQ(counts.dropped, 2);             // ' ', !
  EXPECT_EQ(counts.non_ascii_dropped, 0);
  EXPECT_EQ(counts.output, static_cast<int64_t>(out.size()));
}

TEST(CharLmNormalize, StreamsInChunksOfAnySize) {
  // UTF-8 sequences split across chunks, and a truncated one at the end of a
  // document (read as Latin-1), give what the whole text gives.
  const std::string text =
      "Na\xc3\xafve \xe2\x80\x94 r\xc3\xa9sum\xc3\xa9 42 \xf0\x9f\x98\x80 end\xc3";
  const auto whole = normalize_text(text);
  EXPECT_EQ(whole, "naive resume four two enda");  // \xc3 alone is Latin-1 Ã: a letter
  for (size_t chunk : {1, 2, 3, 5}) {
    std::string out;
    attnkit::tasks::TextNormalizer n([&](const char* d, size_t s) { out.append(d, s); });
    for (size_t i = 0; i < text.size(); i += chunk)
      n.feed(text.data() + i, std::min(chunk, text.size() - i));
    n.finish();
    EXPECT_EQ(out, whole) << "chunk " << chunk;
  }
  // end_document separates the words of two inputs.
  std::string out;
  attnkit::tasks::TextNormalizer n([&](const char* d, size_t s) { out.append(d, s); });
  n.feed("end", 3);
  n.end_document();
  n.feed("start", 5);
  n.finish();
  EXPECT_EQ(out, "end start");
}

TEST(CharLmPrepare, SplitsNinetyFiveFive) {
  TempDir tmp;
  const auto in = tmp.path() / "in.txt";
  std::string text;
  for (int i = 0; i < 200; ++i) text += "Abcd\n";
  write_file(in, text);  // normalises to 200 * 5 - 1 = 999 characters
  const auto out = tmp.path() / "out";
  const auto report = prepare_char_lm({in.string()}, out.string());
  EXPECT_EQ(report.train, 899);  // floor(0.9 * 999)
  EXPECT_EQ(report.valid, 50);   // floor(0.95 * 999) - 899 = 949 - 899
  EXPECT_EQ(report.test, 50);
  EXPECT_EQ(report.input_bytes, 1000);
  const auto train = read_file(out / "train.txt"), valid = read_file(out / "valid.txt"),
             test = read_file(out / "test.txt");
  EXPECT_EQ(train.size(), 899u);
  EXPECT_EQ(valid.size(), 50u);
  EXPECT_EQ(test.size(), 50u);
  EXPECT_EQ(train + valid + test, normalize_text(text));  // contiguous, in order
  EXPECT_EQ(report.counts.kept, 600);
  EXPECT_EQ(report.counts.mapped, 200);
  EXPECT_EQ(report.counts.dropped, 200);
  // meta.json names the source and the counts; no temporary file is left.
  const auto meta = read_file(out / "meta.json");
  const std::vector<std::string> fields = {
      "\"characters\": 999",
      "\"train\": {\"file\": \"train.txt\", \"offset\": 0, \"characters\": 899}",
      "\"valid\": {\"file\": \"valid.txt\", \"offset\": 899, \"characters\": 50}",
      "\"kept\": 600", "\"mapped\": 200", "\"dropped\": 200", "\"bytes\": 1000", in.string()};
  for (const auto& field : fields)
    EXPECT_NE(meta.find(field), std::string::npos) << field << " not in " << meta;
  int files = 0;
  for (const auto& entry : fs::directory_iterator(out)) {
    ++files;
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
  }
  EXPECT_EQ(files, 4);
}

TEST(CharLmPrepare, JoinsInputsAndHandlesTheShippedText) {
  TempDir tmp;
  const auto second = tmp.path() / "second.txt";
  write_file(second, "Amen.");
  const auto out = tmp.path() / "out";
  const auto report = prepare_char_lm({kGenesis.string(), second.string()}, out.string());
  const auto all = read_file(out / "train.txt") + read_file(out / "valid.txt") +
                   read_file(out / "test.txt");
  EXPECT_EQ(all, normalize_text(read_file(kGenesis)) + " amen");
  EXPECT_EQ(all.substr(0, 31), "in the beginning god created th");
  EXPECT_EQ(report.train + report.valid + report.test, static_cast<int64_t>(all.size()));
  EXPECT_EQ(report.train, static_cast<int64_t>(all.size()) * 9 / 10);
  EXPECT_EQ(all.find("  "), std::string::npos);
  EXPECT_EQ(all.find_first_not_of(" abcdefghijklmnopqrstuvwxyz"), std::string::npos);
}

TEST(CharLmPrepare, RefusesBadInputsAndOverwriting) {
  TempDir tmp;
  const auto out = (tmp.path() / "out").string();
  expect_error([&] { prepare_char_lm({}, out); }, {"no input files"});
  expect_error([&] { prepare_char_lm({(tmp.path() / "missing.txt").string()}, out); },
               {"missing.txt", "does not exist"});
  const auto empty = tmp.path() / "empty.txt";
  write_file(empty, "");
  expect_error([&] { prepare_char_lm({empty.string()}, out); }, {"empty.txt", "is empty"});
  const auto punct = tmp.path() / "punct.txt";
  write_file(punct, "... !!! ---\n");
  expect_error([&] { prepare_char_lm({punct.string()}, out); }, {"no letters or digits"});
  const auto tiny = tmp.path() / "tiny.txt";
  write_file(tiny, "Hi there");
  expect_error([&] { prepare_char_lm({tiny.string()}, out); }, {"8 characters", "too short"});
  EXPECT_FALSE(fs::exists(tmp.path() / "out" / "train.txt"));

  prepare_char_lm({kGenesis.string()}, out);
  const auto before = read_file(tmp.path() / "out" / "train.txt");
  const auto other = tmp.path() / "other.txt";
  write_file(other, std::string(100, 'z'));
  expect_error([&] { prepare_char_lm({other.string()}, out); }, {"train.txt", "exists", "--force"});
  EXPECT_EQ(read_file(tmp.path() / "out" / "train.txt"), before);
  prepare_char_lm({other.string()}, out, /*force=*/true);
  EXPECT_EQ(read_file(tmp.path() / "out" / "train.txt"), std::string(90, 'z'));
  expect_error([&] { prepare_char_lm({kGenesis.string()}, other.string()); },
               {"other.txt", "not a directory"});
}

namespace {

// The shipped text prepared once per process into a directory shared by the
// task tests, removed when the process's tests end.
fs::path* genesis_dir_made = nullptr;

const fs::path& genesis_dir() {
  if (!genesis_dir_made) {
    auto d = fs::temp_directory_path() / ("attnkit_tasks_genesis_" + std::to_string(::getpid()));
    fs::remove_all(d);
    prepare_char_lm({kGenesis.string()}, d.string());
    genesis_dir_made = new fs::path(d);
  }
  return *genesis_dir_made;
}

struct RemoveGenesisDir : ::testing::Environment {
  void TearDown() override {
    if (genesis_dir_made) fs::remove_all(*genesis_dir_made);
  }
};
const auto* const kRemoveGenesisDir = ::testing::AddGlobalTestEnvironment(new RemoveGenesisDir);

std::string decode_row(const CharLm& task, const torch::Tensor& row) { return task.decode(row); }

}  // namespace

TEST(CharLmTask, DescribesItself) {
  CharLm task(genesis_dir().string());
  EXPECT_EQ(task.name(), "char-lm");
  EXPECT_EQ(task.vocab_size(), 27);
  EXPECT_TRUE(task.causal());
  EXPECT_EQ(task.metric_name(), "bpc");
  attnkit::tasks::Metrics m;
  m.loss_sum = 6 * std::log(2.0);
  m.scored = 3;
  EXPECT_DOUBLE_EQ(task.metric(m), 2.0);
  EXPECT_EQ(task.sequence_length(100), 100);
  const auto train = read_file(genesis_dir() / "train.txt");
  EXPECT_EQ(task.split_ids(Split::train).numel(), static_cast<int64_t>(train.size()));
  EXPECT_EQ(task.split_ids(Split::train).scalar_type(), torch::kUInt8);
  EXPECT_EQ(task.decode(task.split_ids(Split::train)), train);
}

TEST(CharLmTask, EncodeNormalisesAndDecodeInverts) {
  CharLm task(genesis_dir().string());
  auto ids = task.encode("A b, Z 1");
  EXPECT_TRUE(torch::equal(ids, torch::tensor({1, 0, 2, 0, 26, 0, 15, 14, 5}, torch::kInt64)));
  EXPECT_EQ(task.decode(ids), "a b z one");
  EXPECT_EQ(task.decode(ids.view({3, 3})), "a b z one");
  // A trailing separator is kept as one space (a prompt asks for the next word).
  EXPECT_EQ(task.decode(task.encode("In the, ")), "in the ");
  EXPECT_EQ(task.decode(task.encode("the")), "the");
  EXPECT_EQ(task.encode("  ,").numel(), 0);
  expect_error([&] { task.decode(torch::tensor({3, 27})); }, {"decode", "token 1 is 27", "[0, 27)"});
  expect_error([&] { task.decode(torch::tensor({0.5})); }, {"decode", "integer"});
}

TEST(CharLmTask, TrainBatchIsAPureFunctionOfSeedAndStep) {
  CharLm task(genesis_dir().string());
  const auto a = task.train_batch(7, 3, 4, 32), b = task.train_batch(7, 3, 4, 32);
  EXPECT_TRUE(torch::equal(a.input, b.input));
  EXPECT_TRUE(torch::equal(a.target, b.target));
  // A fresh task (no shared state) gives the same batch.
  CharLm again(genesis_dir().string());
  EXPECT_TRUE(torch::equal(again.train_batch(7, 3, 4, 32).input, a.input));
  // Another step or another seed: another batch. The global generator does not matter.
  EXPECT_FALSE(torch::equal(task.train_batch(7, 4, 4, 32).input, a.input));
  EXPECT_FALSE(torch::equal(task.train_batch(8, 3, 4, 32).input, a.input));
  torch::manual_seed(123);
  const auto c = task.train_batch(7, 3, 4, 32);
  torch::manual_seed(456);
  EXPECT_TRUE(torch::equal(task.train_batch(7, 3, 4, 32).input, c.input));
  EXPECT_TRUE(torch::equal(c.input, a.input));
}

TEST(CharLmTask, TrainTargetsAreInputsShiftedByOne) {
  CharLm task(genesis_dir().string());
  const auto train = read_file(genesis_dir() / "train.txt");
  const auto b = task.train_batch(1, 0, 8, 50);
  ASSERT_EQ(b.input.sizes(), torch::IntArrayRef({8, 50}));
  ASSERT_EQ(b.target.sizes(), torch::IntArrayRef({8, 50}));
  EXPECT_EQ(b.input.scalar_type(), torch::kInt64);
  EXPECT_EQ(b.target.scalar_type(), torch::kInt64);
  EXPECT_EQ(b.weight.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(b.weight, torch::ones({8, 50})));
  EXPECT_TRUE(torch::equal(b.input.slice(1, 1), b.target.slice(1, 0, 49)));
  std::set<size_t> offsets;
  for (int64_t r = 0; r < 8; ++r) {
    // Each row is a window of train.txt: input at some offset, target one later.
    const auto in = decode_row(task, b.input[r]), tgt = decode_row(task, b.target[r]);
    const auto at = train.find(in + tgt.back());
    ASSERT_NE(at, std::string::npos) << "row " << r << " '" << in << "' is not in train.txt";
    EXPECT_EQ(train.substr(at + 1, 50), tgt);
    offsets.insert(at);
  }
  EXPECT_GT(offsets.size(), 1u);  // windows at random offsets, not one
  // The largest window fits exactly; one more character does not.
  const auto n = static_cast<int64_t>(train.size());
  const auto whole = task.train_batch(1, 0, 2, n - 1);
  EXPECT_EQ(task.decode(whole.input[0]) + train.back(), train);
  expect_error([&] { task.train_batch(1, 0, 2, n); }, {"context", "train.txt has", std::to_string(n)});
  expect_error([&] { task.train_batch(1, -1, 2, 8); }, {"step", ">= 0"});
  expect_error([&] { task.train_batch(1, 0, 0, 8); }, {"batch", ">= 1"});
  expect_error([&] { task.train_batch(1, 0, 2, 0); }, {"context", ">= 1"});
}

TEST(CharLmTask, EvalCoversEverySplitCharacterOnceInOrder) {
  CharLm task(genesis_dir().string());
  for (const auto split : {Split::train, Split::valid, Split::test}) {
    const auto text = read_file(genesis_dir() / (attnkit::tasks::to_string(split) + ".txt"));
    for (const int64_t context : {1, 7, 64, 100000}) {
      const auto batches = task.eval_batches(split, 3, context);
      std::string targets, inputs;
      int64_t rows = 0;
      for (size_t i = 0; i < batches.size(); ++i) {
        const auto& b = batches[i];
        ASSERT_EQ(b.input.size(1), context);
        ASSERT_EQ(b.target.sizes(), b.input.sizes());
        ASSERT_EQ(b.weight.sizes(), b.input.sizes());
        EXPECT_LE(b.input.size(0), 3);
        if (i + 1 < batches.size()) EXPECT_EQ(b.input.size(0), 3);
        rows += b.input.size(0);
        // Scored targets, in order; the input is the target sequence shifted right by one.
        auto scored = b.weight.view(-1).gt(0);
        targets += task.decode(b.target.reshape(-1).masked_select(scored));
        inputs += task.decode(b.input.reshape(-1).masked_select(scored));
        // Weight 1 on a prefix of the flattened batch, 0 on the padding after it.
        EXPECT_TRUE(b.weight.eq(0).logical_or(b.weight.eq(1)).all().item<bool>());
      }
      const auto n = static_cast<int64_t>(text.size());
      EXPECT_EQ(rows, (n + context - 1) / context) << "context " << context;
      EXPECT_EQ(targets, text) << "split " << to_string(split) << " context " << context;
      EXPECT_EQ(inputs, " " + text.substr(0, text.size() - 1));
    }
  }
  // The same batches every time.
  const auto a = task.eval_batches(Split::valid, 2, 16), b = task.eval_batches(Split::valid, 2, 16);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].input, b[i].input));
}

TEST(CharLmTask, RefusesMissingOrForeignData) {
  TempDir tmp;
  expect_error([&] { CharLm task(tmp.path().string()); }, {"train.txt", "attnkit data char-lm"});
  for (const char* name : {"train.txt", "valid.txt", "test.txt"})
    write_file(tmp.path() / name, "some text");
  write_file(tmp.path() / "valid.txt", "Some text");
  expect_error([&] { CharLm task(tmp.path().string()); },
               {"valid.txt", "byte 83 at offset 0", "text8 alphabet"});
  write_file(tmp.path() / "valid.txt", "");
  expect_error([&] { CharLm task(tmp.path().string()); }, {"valid.txt", "is empty"});
}

// --- masked-char ------------------------------------------------------------------------------

TEST(MaskedCharTask, DescribesItself) {
  MaskedCharLm task(genesis_dir().string());
  EXPECT_EQ(task.name(), "masked-char");
  EXPECT_EQ(task.vocab_size(), 28);
  EXPECT_FALSE(task.causal());
  EXPECT_EQ(task.metric_name(), "bpc");
  EXPECT_EQ(MaskedCharLm::masked_per_window(1), 1);
  EXPECT_EQ(MaskedCharLm::masked_per_window(10), 2);   // round(1.5) rounds half away from zero
  EXPECT_EQ(MaskedCharLm::masked_per_window(256), 38);
  EXPECT_EQ(task.decode(torch::tensor({1, 27, 0, 2}, torch::kInt64)), "a_ b");
  expect_error([&] { task.decode(torch::tensor({28})); }, {"masked-char decode", "token 0 is 28", "[0, 28)"});
}

TEST(MaskedCharTask, MasksTheRightCountAndKeepsTheText) {
  MaskedCharLm task(genesis_dir().string());
  const auto train = read_file(genesis_dir() / "train.txt");
  const int64_t context = 40;
  const auto b = task.train_batch(3, 5, 6, context);
  ASSERT_EQ(b.input.sizes(), (std::vector<int64_t>{6, context}));
  const auto masked = b.input.eq(MaskedCharLm::kMask);
  // Exactly masked_per_window positions per row, scored there and nowhere else.
  EXPECT_TRUE(torch::equal(masked.sum(1), torch::full({6}, MaskedCharLm::masked_per_window(context), torch::kInt64)));
  EXPECT_TRUE(torch::equal(b.weight, masked.to(torch::kFloat32)));
  // Unmasked inputs equal the targets; the targets are a window of train.txt.
  EXPECT_TRUE(torch::equal(b.input.masked_select(masked.logical_not()), b.target.masked_select(masked.logical_not())));
  for (int64_t r = 0; r < 6; ++r)
    EXPECT_NE(train.find(task.decode(b.target[r])), std::string::npos) << "row " << r;
  EXPECT_TRUE(b.target.lt(27).all().item<bool>());
  // A pure function of (seed, step); another step masks elsewhere.
  const auto again = MaskedCharLm(genesis_dir().string()).train_batch(3, 5, 6, context);
  EXPECT_TRUE(torch::equal(again.input, b.input));
  EXPECT_TRUE(torch::equal(again.target, b.target));
  EXPECT_FALSE(torch::equal(task.train_batch(3, 6, 6, context).input, b.input));
}

TEST(MaskedCharTask, MaskedPositionsAreUniform) {
  MaskedCharLm task(genesis_dir().string());
  const int64_t context = 20, rows = 4000;
  const auto b = task.train_batch(11, 0, rows, context);
  // Each position is masked with probability m / context = 3 / 20; over 4000
  // rows a position's count has s.d. sqrt(4000 * 0.15 * 0.85) ~ 22.6: allow 5 s.d.
  const auto per_position = b.weight.sum(0);
  const double expected = rows * 3.0 / context;
  EXPECT_LT((per_position - expected).abs().max().item<double>(), 5 * std::sqrt(rows * 0.15 * 0.85));
}

TEST(MaskedCharTask, EvalScoresTheSameCharactersEveryTime) {
  MaskedCharLm task(genesis_dir().string());
  const auto valid = read_file(genesis_dir() / "valid.txt");
  const int64_t n = static_cast<int64_t>(valid.size()), context = 64;
  const auto batches = task.eval_batches(Split::valid, 3, context);
  std::string text;
  int64_t scored = 0, windows = 0;
  for (const auto& b : batches) {
    ASSERT_EQ(b.input.size(1), context);
    for (int64_t r = 0; r < b.target.size(0); ++r, ++windows) {
      const int64_t real = std::min(context, n - windows * context);
      text += task.decode(b.target[r].slice(0, 0, real));
      const auto w = b.weight[r];
      EXPECT_EQ(w.sum().item<float>(), MaskedCharLm::masked_per_window(real)) << "window " << windows;
      EXPECT_EQ(w.slice(0, real).sum().item<float>(), 0) << "padding is never scored";
      scored += static_cast<int64_t>(w.sum().item<float>());
    }
  }
  EXPECT_EQ(text, valid);  // consecutive windows cover the split once, in order
  EXPECT_EQ(windows, (n + context - 1) / context);
  // The masks are fixed per split, whatever the batch size.
  const auto other = task.eval_batches(Split::valid, 7, context);
  EXPECT_TRUE(torch::equal(other.front().input.slice(0, 0, 3), batches.front().input));
  EXPECT_FALSE(torch::equal(task.eval_batches(Split::test, 3, context).front().weight,
                            batches.front().weight));
  EXPECT_GT(scored, 0);
}

}  // namespace char_lm_test
