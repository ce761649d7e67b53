#include <attnkit/train/clock.h>
#include <attnkit/train/loop.h>
#include <attnkit/train/signals.h>

#include <stdexcept>
#include <string>

namespace attnkit::train {

LoopEnd run_loop(int64_t start, int64_t end, const LoopHooks& hooks) {
  if (!hooks.step || !hooks.after_step)
    throw std::invalid_argument("run_loop: the step and after_step hooks are required");
  if (start < 0 || start > end)
    throw std::invalid_argument("run_loop: start " + std::to_string(start) + " is outside [0, end " +
                                std::to_string(end) + "]");
  StopSignalGuard signals;
  clear_stop();
  // Forgets the request on every way out, exceptions included.
  struct ClearOnExit {
    ~ClearOnExit() { clear_stop(); }
  } clear_on_exit;
  LoopEnd result;
  result.done = start;
  const double session_start = steady_seconds();
  for (int64_t step = start; step < end; ++step) {
    if (hooks.finished && hooks.finished()) break;
    StepDone s;
    s.stopping = hooks.step(step);
    s.done = result.done = step + 1;
    s.last = s.done == end;
    s.session_seconds = steady_seconds() - session_start;
    s.eta_seconds = s.session_seconds / static_cast<double>(s.done - start) * static_cast<double>(end - s.done);
    hooks.after_step(s);
    if (s.stopping) {
      result.interrupted = !s.last;
      result.signal = stop_signal();
      break;
    }
  }
  return result;
}

}  // namespace attnkit::train
