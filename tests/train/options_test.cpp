// TrainerOptions (JSON round trip, refusals, validation), the learning-rate
// schedule, the progress line, metrics.jsonl trimming and the stop signals.
#include <attnkit/train/progress.h>
#include <attnkit/train/signals.h>
#include <attnkit/train/trainer.h>
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>

namespace options_test {

namespace fs = std::filesystem;
using namespace attnkit::train;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(TrainOptions, JsonRoundTrip) {
  auto o = TrainerOptions()
               .steps(77).batch(3).context(33).lr(2e-3).warmup(5).min_lr(1e-5).weight_decay(0.2)
               .betas(std::make_tuple(0.8, 0.95)).eps(1e-7).clip(0.5).seed(42).threads(2)
               .log_every(4).eval_every(6).eval_batches(2).checkpoint_every(9).out("runs/x")
               .resume(true).display(Display::plain).dtype(DType::bf16);
  const auto back = TrainerOptions::from_json(o.to_json());
  EXPECT_EQ(back.to_json(), o.to_json());
  EXPECT_EQ(back.steps(), 77);
  EXPECT_EQ(back.seed(), 42u);
  EXPECT_DOUBLE_EQ(std::get<1>(back.betas()), 0.95);
  EXPECT_EQ(back.display(), Display::plain);
  EXPECT_EQ(back.dtype(), DType::bf16);
  // Doubles survive bit-exactly (the checkpoint comparison relies on it).
  EXPECT_EQ(TrainerOptions::from_json(TrainerOptions().lr(0.1 + 0.2).to_json()).lr(), 0.1 + 0.2);
}

TEST(TrainOptions, JsonRefusals) {
  auto j = TrainerOptions().to_json();
  EXPECT_NE(error_of([&] { TrainerOptions::from_json(j.substr(0, j.size() - 1) + ",\"stpes\":3}"); })
                .find("unknown key 'stpes'"),
            std::string::npos);
  auto wrong_type = j;
  wrong_type.replace(wrong_type.find("\"steps\":1000"), 12, "\"steps\":\"many\"");
  EXPECT_NE(error_of([&] { TrainerOptions::from_json(wrong_type); }).find("'steps' must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of([&] { TrainerOptions::from_json("{\"steps\":1}"); }).find("missing key"),
            std::string::npos);
  EXPECT_NE(error_of([&] { TrainerOptions::from_json("nope"); }).find("not JSON"), std::string::npos);
}

// --dtype: float32 by default, bf16 under either name, anything else refused
// naming the option, the accepted values and the value; a checkpoint written
// before the option existed (no "dtype" key) reads as float32.
TEST(TrainOptions, Dtype) {
  EXPECT_EQ(TrainerOptions().dtype(), DType::float32);
  EXPECT_EQ(dtype_from_string("float32"), DType::float32);
  EXPECT_EQ(dtype_from_string("bf16"), DType::bf16);
  EXPECT_EQ(dtype_from_string("bfloat16"), DType::bf16);
  EXPECT_EQ(to_string(DType::bf16), "bf16");
  EXPECT_EQ(to_string(DType::float32), "float32");
  for (const char* bad : {"fp16", "float16", "BF16", "", "float64"})
    EXPECT_EQ(error_of([&] { dtype_from_string(bad); }),
              std::string("TrainerOptions: dtype must be float32, bf16 or bfloat16, got '") + bad + "'");
  const auto bf16 = TrainerOptions().dtype(DType::bf16);
  EXPECT_NE(bf16.to_json().find("\"dtype\":\"bf16\""), std::string::npos) << bf16.to_json();
  EXPECT_EQ(TrainerOptions::from_json(bf16.to_json()).dtype(), DType::bf16);
  auto j = TrainerOptions().to_json();
  const auto key = j.find(",\"dtype\":\"float32\"");
  ASSERT_NE(key, std::string::npos) << j;
  auto old = j;
  old.erase(key, std::string(",\"dtype\":\"float32\"").size());
  EXPECT_EQ(TrainerOptions::from_json(old).dtype(), DType::float32);
  auto wrong = j;
  wrong.replace(key, std::string(",\"dtype\":\"float32\"").size(), ",\"dtype\":\"fp8\"");
  EXPECT_NE(error_of([&] { TrainerOptions::from_json(wrong); }).find("dtype must be float32, bf16 or bfloat16, got 'fp8'"),
            std::string::npos);
  wrong.replace(wrong.find("\"fp8\""), 5, "16");
  EXPECT_NE(error_of([&] { TrainerOptions::from_json(wrong); }).find("key 'dtype' must be a string"),
            std::string::npos);
}

TEST(TrainOptions, Validate) {
  auto ok = TrainerOptions().out("r");
  EXPECT_NO_THROW(validate(ok));
  EXPECT_NE(error_of([&] { validate(TrainerOptions().out("r").steps(0)); }).find("steps must be >= 1, got 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate(TrainerOptions().out("r").lr(NAN)); }).find("lr must be finite"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate(TrainerOptions().out("r").lr(1e-3).min_lr(1e-2)); }).find("min_lr must be <= lr"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate(TrainerOptions().out("r").betas(std::make_tuple(0.9, 1.0))); })
                .find("betas must be in [0, 1)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate(TrainerOptions()); }).find("out must be a run directory"),
            std::string::npos);
}

TEST(TrainSchedule, WarmupThenCosine) {
  auto o = TrainerOptions().steps(110).warmup(10).lr(1.0).min_lr(0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.1);   // (0 + 1) / 10
  EXPECT_DOUBLE_EQ(learning_rate(o, 4), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(o, 9), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 10), 1.0);  // t = 0: the peak
  EXPECT_NEAR(learning_rate(o, 60), 0.55, 1e-12);  // t = 1/2: the midpoint
  EXPECT_NEAR(learning_rate(o, 85), 0.1 + 0.45 * (1 + std::cos(M_PI * 0.75)), 1e-12);
  EXPECT_GT(learning_rate(o, 109), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, 500), 0.1);  // beyond the end: the floor
  for (int64_t s = 10; s < 109; ++s) EXPECT_GE(learning_rate(o, s), learning_rate(o, s + 1)) << s;
  // No warm-up: the peak at step 0.
  EXPECT_DOUBLE_EQ(learning_rate(TrainerOptions().steps(10).warmup(0).lr(0.5).min_lr(0), 0), 0.5);
}

TEST(TrainTaskOptions, JsonRoundTrip) {
  attnkit::tasks::TaskOptions t{"copy", "/data/x", 17};
  const auto back = task_options_from_json(task_options_to_json(t));
  EXPECT_EQ(back.name, "copy");
  EXPECT_EQ(back.data_dir, "/data/x");
  EXPECT_EQ(back.copy_length, 17);
  EXPECT_THROW(task_options_from_json("{\"name\":\"copy\"}"), std::invalid_argument);
}

// Runs written before the naming pass store the copy length as "length".
TEST(TrainTaskOptions, ReadsTheOldNameOfTheCopyLength) {
  EXPECT_EQ(task_options_to_json({"copy", "", 9}), R"({"copy_length":9,"data_dir":"","name":"copy"})");
  const auto old = task_options_from_json(R"({"data_dir":"","length":9,"name":"copy"})");
  EXPECT_EQ(old.name, "copy");
  EXPECT_EQ(old.copy_length, 9);
  EXPECT_THROW(task_options_from_json(R"({"data_dir":"","length":9,"copy_length":9,"name":"copy"})"),
               std::invalid_argument);
}

TEST(TrainProgress, Formatting) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(59.4), "59s");
  EXPECT_EQ(format_duration(185), "3m05s");
  EXPECT_EQ(format_duration(7620), "2h07m");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_duration(NAN), "?");
  ProgressLine line;
  line.step = 5;
  line.total = 20;
  line.loss = 1.5;
  line.metric_name = "bpc";
  line.metric = 2.1640425613334453;
  line.lr = 3e-4;
  line.tokens_per_s = 12345;
  line.eta_seconds = 83;
  EXPECT_EQ(format_progress(line, false),
            "step 5/20  loss 1.5000  bpc 2.1640  lr 3.00e-04  12.3k tok/s  ETA 1m23s");
  EXPECT_EQ(format_progress(line, true).substr(0, 23), "[#####...............] ");
}

TEST(TrainProgress, PrinterPlainAndLive) {
  char* buffer = nullptr;
  size_t size = 0;
  std::FILE* out = open_memstream(&buffer, &size);
  ProgressLine line;
  line.step = 1;
  line.total = 2;
  line.metric_name = "accuracy";
  {
    ProgressPrinter plain(out, false);
    plain.show(line, false);  // not a log step: nothing
    plain.show(line, true);
    plain.message("note");
  }
  std::fflush(out);
  EXPECT_EQ(std::string(buffer, size),
            "step 1/2  loss 0.0000  accuracy 0.0000  lr 0.00e+00  0 tok/s  ETA ?\nnote\n");
  {
    ProgressPrinter live(out, true);
    live.show(line, true);
  }
  std::fflush(out);
  const std::string all(buffer, size);
  EXPECT_NE(all.find("\r[##########..........] step 1/2"), std::string::npos) << all;
  EXPECT_EQ(all.back(), '\n');  // finish() ends the live line
  std::fclose(out);
  std::free(buffer);
}

TEST(TrainProgress, MetricsLogAndTrim) {
  const auto path = (fs::temp_directory_path() / ("attnkit_metrics_" + std::to_string(::getpid()) + ".jsonl")).string();
  fs::remove(path);
  EXPECT_EQ(trim_metrics(path, 10), 0);  // absent: nothing to do
  {
    MetricsLog log(path);
    log.append("{\"step\":5,\"loss\":2.0}");
    log.append("{\"step\":10,\"loss\":1.0}");
    log.append("{\"step\":15,\"loss\":0.5}");
  }
  { std::ofstream(path, std::ios::app) << "{\"step\":20,\"lo"; }  // torn by a crash
  EXPECT_EQ(trim_metrics(path, 10), 2);
  std::ifstream in(path);
  std::string all((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(all, "{\"step\":5,\"loss\":2.0}\n{\"step\":10,\"loss\":1.0}\n");
  EXPECT_EQ(trim_metrics(path, 10), 0);
  fs::remove(path);
  EXPECT_THROW(MetricsLog("/nonexistent-dir/m.jsonl"), std::runtime_error);
}

TEST(TrainSignals, HandlerOnlySetsTheFlag) {
  clear_stop();
  EXPECT_FALSE(stop_requested());
  {
    StopSignalGuard guard;
    EXPECT_THROW(StopSignalGuard(), std::logic_error);
    std::raise(SIGTERM);  // would terminate the test binary without the handler
    EXPECT_TRUE(stop_requested());
    EXPECT_EQ(stop_signal(), SIGTERM);
    clear_stop();
    std::raise(SIGINT);
    EXPECT_EQ(stop_signal(), SIGINT);
    clear_stop();
  }
  // The previous (default) handlers are back; request_stop() works without a guard.
  struct sigaction now {};
  sigaction(SIGINT, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
  request_stop();
  EXPECT_TRUE(stop_requested());
  EXPECT_EQ(stop_signal(), 0);
  clear_stop();
  EXPECT_FALSE(stop_requested());
}

}  // namespace options_test
