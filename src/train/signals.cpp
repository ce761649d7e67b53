// SIGINT / SIGTERM -> an atomic flag the training loop polls.
#include <attnkit/train/signals.h>

#include <atomic>
#include <csignal>
#include <stdexcept>

namespace attnkit::train {

namespace {

// Lock-free atomics are async-signal-safe; checked at compile time.
std::atomic<int> g_stop{0};  // 0: none; -1: request_stop(); else the signal number
static_assert(std::atomic<int>::is_always_lock_free, "the stop flag must be lock-free");

struct sigaction g_previous_int, g_previous_term;
std::atomic<bool> g_installed{false};

extern "C" void on_stop_signal(int sig) {
  int none = 0;
  if (!g_stop.compare_exchange_strong(none, sig)) {
    // Second signal: the default action (terminate) now.
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}

}  // namespace

StopSignalGuard::StopSignalGuard() {
  if (g_installed.exchange(true))
    throw std::logic_error("StopSignalGuard: a guard is already installed");
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // interrupted reads/writes resume; the loop polls the flag
  sigaction(SIGINT, &action, &g_previous_int);
  sigaction(SIGTERM, &action, &g_previous_term);
}

StopSignalGuard::~StopSignalGuard() {
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
  g_installed = false;
}

bool stop_requested() { return g_stop.load() != 0; }
int stop_signal() {
  const int s = g_stop.load();
  return s > 0 ? s : 0;
}
void request_stop() {
  int none = 0;
  g_stop.compare_exchange_strong(none, -1);
}
void clear_stop() { g_stop = 0; }

}  // namespace attnkit::train
