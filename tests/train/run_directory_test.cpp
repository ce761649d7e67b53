// RunDirectory (include/attnkit/train/run_directory.h) on a tiny module: the
// open-or-resume rule, the header a checkpoint gets and the reader's checks,
// restore, the lock, cleanup of interrupted writes, rotation, log trimming;
// and the clock helpers (train/clock.h). The trainer's use of them is
// trainer_test.cpp's.
#include <attnkit/train/clock.h>
#include <attnkit/train/run_directory.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "test_util.h"
#include "train/train_test_util.h"

namespace run_directory_test {

namespace fs = std::filesystem;
using namespace attnkit::train;
using attnkit::testing::expect_error;
using attnkit::testing::fresh_dir;
using nlohmann::json;

namespace {

struct Tiny {
  torch::nn::Linear model{torch::nn::Linear(3, 2)};
  torch::optim::AdamW optimizer{model->parameters(), torch::optim::AdamWOptions(1e-2)};

  void step() {
    optimizer.zero_grad();
    model->forward(torch::ones({4, 3})).pow(2).sum().backward();
    optimizer.step();
  }
};

std::string header_of(const std::string& kind) { return json{{"kind", kind}, {"elapsed", 1.5}}.dump(); }

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

}  // namespace

TEST(TrainRunDirectory, FreshThenResumedWithItsStateAndHeader) {
  const auto dir = fresh_dir("rundir_resume");
  EXPECT_FALSE(open_or_resume(dir + "/absent", false));  // nothing there: fresh
  EXPECT_FALSE(open_or_resume(dir, true));               // --resume without a checkpoint: fresh too
  Tiny tiny;
  {
    RunDirectory run(dir, "", 0);
    tiny.step();
    run.write_checkpoint(1, header_of("attnkit-test"), *tiny.model, &tiny.optimizer);
  }
  expect_error([&] { open_or_resume(dir, false); },
               {"run directory '" + dir + "' already holds checkpoints", checkpoint_name(1), "pass --resume"});

  const auto resumed = open_or_resume(dir, true);
  ASSERT_TRUE(resumed);
  EXPECT_EQ(resumed->step(), 1);
  EXPECT_EQ(resumed->path(), (fs::path(dir) / checkpoint_name(1)).string());
  EXPECT_EQ(resumed->kind(), "attnkit-test");
  const auto header = json::parse(resumed->header());
  EXPECT_EQ(header.at("step"), 1);  // added by make_checkpoint, as "tensors"
  EXPECT_EQ(header.at("elapsed"), 1.5);
  EXPECT_EQ(header.at("tensors").size(), 2u);  // weight, bias

  Tiny copy;
  resumed->restore(*copy.model, &copy.optimizer, /*restore_generator=*/false);
  EXPECT_TRUE(torch::equal(copy.model->weight, tiny.model->weight));
  tiny.step();
  copy.step();  // the optimiser's state came along
  EXPECT_TRUE(torch::equal(copy.model->weight, tiny.model->weight));
}

TEST(TrainRunDirectory, ReaderRefusesAHeaderThatDisagreesWithItsName) {
  const auto dir = fresh_dir("rundir_name");
  Tiny tiny;
  { RunDirectory(dir, "", 0).write_checkpoint(2, header_of("x"), *tiny.model, nullptr); }
  fs::rename(fs::path(dir) / checkpoint_name(2), fs::path(dir) / checkpoint_name(3));
  expect_error([&] { read_newest_checkpoint(dir); },
               {checkpoint_name(3), "refused: its header says step 2, its name step 3"});
  expect_error([&] { read_newest_checkpoint(fresh_dir("rundir_empty")); }, {"no checkpoint in"});
}

TEST(TrainRunDirectory, KeepsTheNewestCheckpointsAndTrimsLogs) {
  const auto dir = fresh_dir("rundir_keep");
  Tiny tiny;
  {
    RunDirectory run(dir, "", 0);
    auto log = run.open_log("metrics.jsonl");
    for (int64_t step = 1; step <= 3; ++step) {
      run.write_checkpoint(step, header_of("x"), *tiny.model, &tiny.optimizer);
      log->append(json{{"step", step}}.dump());
    }
    log->append(json{{"step", 4}}.dump());  // logged, then interrupted before its checkpoint
  }
  const auto kept = list_checkpoints(dir);
  ASSERT_EQ(kept.size(), kKeepCheckpoints);
  EXPECT_EQ(kept[0].step, 3);
  EXPECT_EQ(kept[1].step, 2);

  // Resumed at step 3: the record of step 4 goes; a fresh run's log starts empty.
  const auto metrics = (fs::path(dir) / "metrics.jsonl").string();
  { RunDirectory(dir, kept[0].path, 3).open_log("metrics.jsonl"); }
  EXPECT_EQ(lines_of(metrics), (std::vector<std::string>{R"({"step":1})", R"({"step":2})", R"({"step":3})"}));
  const auto other = fresh_dir("rundir_fresh_log");
  { std::ofstream(fs::path(other) / "metrics.jsonl") << R"({"step":9})" << "\n"; }
  { RunDirectory(other, "", 0).open_log("metrics.jsonl"); }
  EXPECT_TRUE(lines_of((fs::path(other) / "metrics.jsonl").string()).empty());
}

TEST(TrainRunDirectory, ClaimLocksRechecksAndCleansUp) {
  const auto dir = fresh_dir("rundir_claim");
  const auto stale = fs::path(dir) / ".checkpoint-00000004.ckpt.tmp-12345";
  const auto other = fs::path(dir) / "notes.tmp-1";
  { std::ofstream(stale) << "torn"; }
  { std::ofstream(other) << "not ours"; }
  {
    RunDirectory run(dir, "", 0);
    EXPECT_FALSE(fs::exists(stale));  // an interrupted checkpoint write
    EXPECT_TRUE(fs::exists(other));   // anything else stays
    expect_error([&] { RunDirectory(dir, "", 0); }, {"another process is training in '" + dir + "'", ".lock"});
  }
  // Released with its owner; a run that expects another newest checkpoint is refused.
  Tiny tiny;
  { RunDirectory(dir, "", 0).write_checkpoint(1, header_of("x"), *tiny.model, nullptr); }
  expect_error([&] { RunDirectory(dir, "", 0); }, {"changed since", checkpoint_name(1)});
}

TEST(TrainClock, HelpersReadTheClocksAndTheLoad) {
  const double a = steady_seconds(), b = steady_seconds();
  EXPECT_LE(a, b);
  EXPECT_TRUE(std::regex_match(utc_now(), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)"))) << utc_now();
  if (fs::exists("/proc/loadavg")) {
    EXPECT_FALSE(loadavg_line().empty());
    EXPECT_GE(load_average(), 0);
  } else {
    EXPECT_EQ(load_average(), -1);
  }
}

}  // namespace run_directory_test
