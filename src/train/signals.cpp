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

// The handler runs on a stack of its own (SA_ONSTACK). On the interrupted
// thread's stack, the kernel writes the signal frame just below its red zone;
// code that keeps data further below its stack pointer (machine code generated
// at run time, e.g. a GEMM library's kernels) then finds it overwritten: a
// Ctrl-C during training aborted with glibc heap errors from inside
// dnnl_sgemm before this (CHANGELOG.md, Fixed, has the measurements).
alignas(64) char g_signal_stack[64 * 1024];
stack_t g_previous_stack;

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
  stack_t stack{};
  stack.ss_sp = g_signal_stack;
  stack.ss_size = sizeof g_signal_stack;
  sigaltstack(&stack, &g_previous_stack);
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  // Interrupted reads/writes resume (the loop polls the flag), on the stack above.
  action.sa_flags = SA_RESTART | SA_ONSTACK;
  sigaction(SIGINT, &action, &g_previous_int);
  sigaction(SIGTERM, &action, &g_previous_term);
}

StopSignalGuard::~StopSignalGuard() {
  sigaction(SIGINT, &g_previous_int, nullptr);
  sigaction(SIGTERM, &g_previous_term, nullptr);
  sigaltstack(&g_previous_stack, nullptr);
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
