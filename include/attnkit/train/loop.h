// The training loop: the one every training command runs (attnkit train's
// Trainer, attnkit-experiments' cloze and node-classify). Its body is theirs,
// as hooks: take a step, then act on it (record, evaluate, checkpoint). The
// loop owns what they must agree on: where the run stands, the stop signals,
// when to stop, and how fast this session goes.
//
//   for (step = start; step < end && !finished(); ++step) {
//     stopping = step_hook(step);        // one optimiser step
//     after_step({step + 1, last, stopping, ...});
//     if (stopping) break;               // after the hook's checkpoint
//   }
#pragma once

#include <cstdint>
#include <functional>

namespace attnkit::train {

/// What the hook after a step knows of it.
struct StepDone {
  int64_t done = 0;          ///< steps of the run taken, this one included
  bool last = false;         ///< this was the run's last step
  bool stopping = false;     ///< the loop ends after this hook (a stop was requested)
  double session_seconds = 0;  ///< since this session's first step began
  double eta_seconds = 0;    ///< the steps left, at this session's speed
};

struct LoopHooks {
  /// One optimiser step: number `step` of the run (0-based). Returns whether
  /// to stop after it: train::stop_requested() for one process; a
  /// data-parallel run returns what all ranks agreed on, so that they stop
  /// at the same step.
  std::function<bool(int64_t step)> step;
  /// After each step (before the loop stops on a request, so a checkpoint
  /// written here is the one a resumed run continues from).
  std::function<void(const StepDone&)> after_step;
  /// Optional: true once the run has ended early (e.g. patience ran out);
  /// asked before every step.
  std::function<bool()> finished;
};

struct LoopEnd {
  int64_t done = 0;          ///< steps of the run taken when the loop ended
  bool interrupted = false;  ///< a stop ended it before the run's last step
  int signal = 0;            ///< the signal that asked for the stop (SIGINT, SIGTERM), or 0
};

/// Runs steps `start` .. `end` - 1 through `hooks`. SIGINT and SIGTERM ask for
/// a stop while it runs (StopSignalGuard; a stop left from before is
/// forgotten first, and none is left behind). Exceptions of the hooks pass
/// through.
LoopEnd run_loop(int64_t start, int64_t end, const LoopHooks& hooks);

}  // namespace attnkit::train
