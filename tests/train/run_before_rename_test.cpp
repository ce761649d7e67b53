// A run directory written before the naming pass (issue 28 item 5) still
// works: tests/data/run-before-rename holds a checkpoint of attnkit 0.1.0 whose
// task options name the copy length "length" (tests/data/README.md has its
// command). It loads, evaluates to the validation its run recorded, resumes,
// and generates; the checkpoints written from it use today's names.
#include <attnkit/runtime.h>
#include <attnkit/train/checkpoint.h>
#include <attnkit/train/trainer.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "train/train_test_util.h"

namespace run_before_rename_test {

namespace fs = std::filesystem;
using namespace attnkit;
using namespace attnkit::train;

namespace {

const std::string kOldRun = std::string(ATTNKIT_TEST_DATA_DIR) + "/run-before-rename";

/// A copy of the checked-in run (the tests must not write into the source tree).
std::string copy_of_old_run(const std::string& name) {
  const auto dir = attnkit::testing::fresh_dir(name);
  fs::copy(kOldRun, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  return dir;
}

/// The JSON header of checkpoint `path`.
nlohmann::json header_of(const std::string& path) { return nlohmann::json::parse(read_checkpoint_file(path).header); }

/// The last record of `dir`/metrics.jsonl.
nlohmann::json last_record(const std::string& dir) {
  std::ifstream in(fs::path(dir) / "metrics.jsonl");
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return nlohmann::json::parse(last);
}

}  // namespace

TEST(RunBeforeRename, TheCheckedInRunUsesTheOldNames) {
  const auto header = header_of(kOldRun + "/" + checkpoint_name(4));
  EXPECT_EQ(header.at("attnkit_version"), "0.1.0");
  EXPECT_EQ(header.at("task").at("length"), 6);
  EXPECT_FALSE(header.at("task").contains("copy_length"));
}

TEST(RunBeforeRename, LoadsAndEvaluatesToItsRecordedValidation) {
  set_num_threads(1);  // as the run was trained
  const auto dir = copy_of_old_run("before_rename_eval");
  auto run = load_run(dir);
  EXPECT_EQ(run.step, 4);
  EXPECT_EQ(run.task_options.name, "copy");
  EXPECT_EQ(run.task_options.copy_length, 6);
  EXPECT_EQ(run.model_options.width(), 8);
  EXPECT_EQ(run.model_options.heads(), 2);
  EXPECT_EQ(run.task->sequence_length(run.trainer.context()), 2 * 6 + 2);
  // The validation `attnkit train` recorded at step 4 (eval batches 2).
  const auto recorded = last_record(dir);
  ASSERT_EQ(recorded.at("step"), 4);
  const auto m = evaluate(run.model, *run.task, tasks::Split::valid, run.trainer.batch(), run.trainer.context(),
                          run.trainer.eval_batches());
  // The record was computed at one ISA level (avx2); the float32 kernels of
  // another level sum in another order (bitwise equal only within a level),
  // so the loss agrees to float32 rounding: relative 1e-6. Weights restored
  // wrongly or an option misread would move it by orders of magnitude more.
  const double recorded_loss = recorded.at("valid_loss").get<double>();
  EXPECT_NEAR(m.loss(), recorded_loss, 1e-6 * recorded_loss);
  EXPECT_DOUBLE_EQ(m.accuracy(), recorded.at("valid_accuracy").get<double>());
}

TEST(RunBeforeRename, ResumesAndWritesTodaysNames) {
  const auto dir = copy_of_old_run("before_rename_resume");
  const auto stored = read_stored_options(dir);
  EXPECT_EQ(stored.task.copy_length, 6);
  Trainer trainer(TrainerOptions(stored.trainer).out(dir).resume(true).steps(6).display(Display::quiet),
                  stored.model, stored.task);
  EXPECT_EQ(trainer.start_step(), 4);
  const auto result = trainer.run();
  EXPECT_EQ(result.step, 6);
  const auto header = header_of(dir + "/" + checkpoint_name(6));
  EXPECT_EQ(header.at("task").at("copy_length"), 6);
  EXPECT_FALSE(header.at("task").contains("length"));
  // A resume that changes the copy length is refused under the new name.
  auto changed = stored.task;
  changed.copy_length = 7;
  try {
    Trainer(TrainerOptions(stored.trainer).out(dir).resume(true).steps(8).display(Display::quiet), stored.model,
            changed);
    FAIL() << "a resume with another copy length was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("copy_length: checkpoint 6, now 7"), std::string::npos) << e.what();
  }
}

TEST(RunBeforeRename, Generates) {
  const auto dir = copy_of_old_run("before_rename_generate");
  auto run = load_run(dir);
  const auto prompt = torch::tensor({{1, 2, 3}}, torch::kInt64);
  const auto out = run.model->generate(prompt, models::GenerateOptions().tokens(5).temperature(0).seed(1));
  ASSERT_EQ(out.dim(), 2);
  EXPECT_EQ(out.size(0), 1);
  EXPECT_GE(out.size(1), 5);
  EXPECT_TRUE((out >= 0).all().item<bool>());
  EXPECT_TRUE((out < run.model_options.vocab_size()).all().item<bool>());
  // Greedy decoding is deterministic.
  EXPECT_TRUE(torch::equal(out, run.model->generate(prompt, models::GenerateOptions().tokens(5).temperature(0).seed(1))));
}

}  // namespace run_before_rename_test
