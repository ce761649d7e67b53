// run_loop (include/attnkit/train/loop.h): the order of the hooks and what
// they are told, the stop rule (the step hook's answer, a signal, a stop left
// from before), early finishing, and its refusals. The Trainer, cloze and
// node-classify on top of it are tested in trainer_test.cpp and
// experiments/tests.
#include <attnkit/train/loop.h>
#include <attnkit/train/signals.h>
#include <gtest/gtest.h>

#include <csignal>
#include <stdexcept>
#include <string>
#include <vector>

namespace loop_test {

using namespace attnkit::train;

namespace {

// What the hooks saw, in order: "s3" for step 3, "a4" (+ "L" last, "S"
// stopping) for after_step with done = 4.
struct Trace {
  std::vector<std::string> events;
  std::vector<StepDone> after;

  LoopHooks hooks(int64_t stop_at = -1) {
    LoopHooks h;
    h.step = [this, stop_at](int64_t step) {
      events.push_back("s" + std::to_string(step));
      return step == stop_at;
    };
    h.after_step = [this](const StepDone& d) {
      events.push_back("a" + std::to_string(d.done) + (d.last ? "L" : "") + (d.stopping ? "S" : ""));
      after.push_back(d);
    };
    return h;
  }
};

}  // namespace

TEST(TrainLoop, RunsEveryStepFromStartToEndWithItsHookAfterIt) {
  Trace t;
  const auto end = run_loop(2, 5, t.hooks());
  EXPECT_EQ(t.events, (std::vector<std::string>{"s2", "a3", "s3", "a4", "s4", "a5L"}));
  EXPECT_EQ(end.done, 5);
  EXPECT_FALSE(end.interrupted);
  EXPECT_EQ(end.signal, 0);
  for (const auto& d : t.after) {
    EXPECT_GE(d.session_seconds, 0.0);
    EXPECT_GE(d.eta_seconds, 0.0);
  }
  EXPECT_EQ(t.after.back().eta_seconds, 0.0);  // nothing left
}

TEST(TrainLoop, AFinishedRunTakesNoStep) {
  Trace t;
  const auto end = run_loop(7, 7, t.hooks());
  EXPECT_TRUE(t.events.empty());
  EXPECT_EQ(end.done, 7);
  EXPECT_FALSE(end.interrupted);
}

TEST(TrainLoop, TheStepsAnswerStopsAfterItsHook) {
  Trace t;
  const auto end = run_loop(0, 10, t.hooks(/*stop_at=*/3));
  EXPECT_EQ(t.events, (std::vector<std::string>{"s0", "a1", "s1", "a2", "s2", "a3", "s3", "a4S"}));
  EXPECT_EQ(end.done, 4);
  EXPECT_TRUE(end.interrupted);
  EXPECT_EQ(end.signal, 0);  // asked by the hook, not by a signal
}

TEST(TrainLoop, AStopAtTheLastStepIsNoInterruption) {
  Trace t;
  const auto end = run_loop(0, 3, t.hooks(/*stop_at=*/2));
  EXPECT_EQ(t.events.back(), "a3LS");
  EXPECT_EQ(end.done, 3);
  EXPECT_FALSE(end.interrupted);
}

TEST(TrainLoop, FinishedEndsTheRunBeforeTheNextStep) {
  Trace t;
  auto hooks = t.hooks();
  hooks.finished = [&] { return t.after.size() == 2; };
  const auto end = run_loop(0, 10, hooks);
  EXPECT_EQ(t.events, (std::vector<std::string>{"s0", "a1", "s1", "a2"}));
  EXPECT_EQ(end.done, 2);
  EXPECT_FALSE(end.interrupted);
}

TEST(TrainLoop, ASignalStopsTheRunAndIsNamedAndForgotten) {
  Trace t;
  auto hooks = t.hooks();
  hooks.step = [&](int64_t step) {
    t.events.push_back("s" + std::to_string(step));
    if (step == 1) std::raise(SIGINT);  // the loop's handler only records it
    return stop_requested();
  };
  const auto end = run_loop(0, 5, hooks);
  EXPECT_EQ(t.events, (std::vector<std::string>{"s0", "a1", "s1", "a2S"}));
  EXPECT_TRUE(end.interrupted);
  EXPECT_EQ(end.signal, SIGINT);
  EXPECT_FALSE(stop_requested());
}

TEST(TrainLoop, AStopRequestedBeforeTheLoopIsForgotten) {
  request_stop();
  Trace t;
  auto hooks = t.hooks();
  hooks.step = [&](int64_t step) {
    t.events.push_back("s" + std::to_string(step));
    return stop_requested();
  };
  const auto end = run_loop(0, 3, hooks);
  EXPECT_EQ(end.done, 3);
  EXPECT_FALSE(end.interrupted);
}

TEST(TrainLoop, AHooksExceptionPassesThroughAndLeavesNoStopBehind) {
  LoopHooks hooks;
  hooks.step = [](int64_t) {
    request_stop();
    return false;
  };
  hooks.after_step = [](const StepDone&) { throw std::runtime_error("disk full"); };
  EXPECT_THROW(run_loop(0, 3, hooks), std::runtime_error);
  EXPECT_FALSE(stop_requested());
}

TEST(TrainLoop, RefusesMissingHooksAndAStartOutsideTheRun) {
  Trace t;
  LoopHooks no_step = t.hooks();
  no_step.step = nullptr;
  EXPECT_THROW(run_loop(0, 3, no_step), std::invalid_argument);
  LoopHooks no_after = t.hooks();
  no_after.after_step = nullptr;
  EXPECT_THROW(run_loop(0, 3, no_after), std::invalid_argument);
  EXPECT_THROW(run_loop(4, 3, t.hooks()), std::invalid_argument);
  EXPECT_THROW(run_loop(-1, 3, t.hooks()), std::invalid_argument);
  EXPECT_TRUE(t.events.empty());
}

}  // namespace loop_test
