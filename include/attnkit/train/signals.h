// Graceful stop of a training run on SIGINT / SIGTERM. The handler only sets
// an atomic flag; the training loop polls it after every step, finishes that
// step, writes a checkpoint and returns. A second signal while the first is
// pending restores the default action and re-raises it, so a user who presses
// Ctrl-C twice gets the usual immediate exit.
#pragma once

namespace attnkit::train {

/// Installs the handler for SIGINT and SIGTERM for the guard's lifetime and
/// restores the previous handlers when it goes out of scope. Not reentrant:
/// one guard at a time.
class StopSignalGuard {
 public:
  StopSignalGuard();
  ~StopSignalGuard();
  StopSignalGuard(const StopSignalGuard&) = delete;
  StopSignalGuard& operator=(const StopSignalGuard&) = delete;
};

/// True once a stop was requested (by a signal or request_stop()).
bool stop_requested();
/// The signal that requested the stop (SIGINT, SIGTERM), or 0 (none, or request_stop()).
int stop_signal();
/// Requests a stop as a signal would (tests, embedding applications).
void request_stop();
/// Forgets a pending stop request.
void clear_stop();

}  // namespace attnkit::train
