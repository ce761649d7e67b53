#include "launch.h"

#include <attnkit/train/clock.h>
#include <attnkit/train/distributed.h>

#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace attnkit::cli {

namespace {

std::vector<std::string> g_command_line;

std::atomic<int> g_signals{0};      // SIGINT / SIGTERM received by the launcher
std::atomic<int> g_last_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "signal counters must be lock-free");

extern "C" void on_launcher_signal(int sig) {
  g_last_signal = sig;
  g_signals.fetch_add(1);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "ended with wait status " + std::to_string(status);
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

void set_command_line(const std::vector<std::string>& args) { g_command_line = args; }
const std::vector<std::string>& command_line() { return g_command_line; }

bool launched_worker() { return std::getenv("ATTNKIT_WORKER") != nullptr; }

int launch_workers(const LaunchOptions& o, const std::vector<std::string>& argv) {
  if (o.nproc < 1) throw std::invalid_argument("train: --nproc must be >= 1");
  // Without a port from the user the launcher serves the TCPStore itself and
  // holds its port to the end; rank 0 then connects like the others.
  // The store's threads start with SIGINT and SIGTERM blocked, so that the
  // launcher's handler (below) runs on this thread, never on one of theirs.
  std::unique_ptr<train::LauncherStore> store;
  if (o.master_port == 0) {
    sigset_t stop_signals, previous;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, &previous);
    try {
      store = std::make_unique<train::LauncherStore>(o.master_addr, o.store_timeout);
    } catch (...) {
      pthread_sigmask(SIG_SETMASK, &previous, nullptr);
      throw;
    }
    pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  }
  const int port = store ? store->port() : o.master_port;

  // Everything the children need, built before fork (only async-signal-safe
  // calls between fork and exec).
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const auto name = entry.substr(0, entry.find('='));
    if (name != "RANK" && name != "WORLD_SIZE" && name != "LOCAL_RANK" && name != "LOCAL_WORLD_SIZE" &&
        name != "MASTER_ADDR" && name != "MASTER_PORT" && name != "ATTNKIT_WORKER" &&
        name != "ATTNKIT_LAUNCHER_STORE")
      base.push_back(entry);
  }
  std::vector<std::vector<std::string>> envs(o.nproc, base);
  std::vector<std::vector<char*>> envps(o.nproc);
  for (int r = 0; r < o.nproc; ++r) {
    for (const auto& kv : {std::string("RANK=") + std::to_string(r), std::string("LOCAL_RANK=") + std::to_string(r),
                           std::string("WORLD_SIZE=") + std::to_string(o.nproc),
                           std::string("LOCAL_WORLD_SIZE=") + std::to_string(o.nproc),
                           std::string("MASTER_ADDR=") + o.master_addr,
                           std::string("MASTER_PORT=") + std::to_string(port), std::string("ATTNKIT_WORKER=1")})
      envs[r].push_back(kv);
    if (store) envs[r].push_back("ATTNKIT_LAUNCHER_STORE=1");
    for (auto& e : envs[r]) envps[r].push_back(e.data());
    envps[r].push_back(nullptr);
  }

  // Signals: counted by the handler, forwarded by the loop below. Installed
  // before the fork so that none is lost; the children reset them.
  struct sigaction action {}, old_int, old_term;
  action.sa_handler = on_launcher_signal;
  sigemptyset(&action.sa_mask);
  g_signals = 0;
  sigaction(SIGINT, &action, &old_int);
  sigaction(SIGTERM, &action, &old_term);

  const pid_t launcher = ::getpid();
  std::vector<pid_t> pids(o.nproc, -1);
  std::vector<bool> alive(o.nproc, false);
  for (int r = 0; r < o.nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::fprintf(stderr, "attnkit train: fork of worker %d failed: %s\n", r, std::strerror(errno));
      for (int k = 0; k < r; ++k) ::kill(pids[k], SIGKILL);
      for (int k = 0; k < r; ++k) ::waitpid(pids[k], nullptr, 0);
      sigaction(SIGINT, &old_int, nullptr);
      sigaction(SIGTERM, &old_term, nullptr);
      return 1;
    }
    if (pid == 0) {
      ::setpgid(0, 0);                       // away from the terminal's Ctrl-C: the launcher forwards it
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);    // the launcher died: stop with a checkpoint
      if (::getppid() != launcher) ::_exit(1);  // ... already before the line above
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      ::execve("/proc/self/exe", args.data(), envps[r].data());
      const char msg[] = "attnkit train: exec of a worker failed\n";
      [[maybe_unused]] auto n = ::write(2, msg, sizeof msg - 1);
      ::_exit(127);
    }
    pids[r] = pid;
    alive[r] = true;
  }

  int living = o.nproc, forwarded = 0, result = 0;
  bool stopping_others = false;
  double kill_at = 0;
  while (living > 0) {
    // Forward each SIGINT / SIGTERM once to every living worker.
    const int received = g_signals.load();
    for (; forwarded < received; ++forwarded)
      for (int r = 0; r < o.nproc; ++r)
        if (alive[r]) ::kill(pids[r], g_last_signal.load());
    // Every worker that has exited since the last poll. When several failed
    // in the same poll, the cause is reported: a worker killed by a signal
    // (the others then fail because it vanished) before one that exited.
    std::vector<std::pair<int, int>> exited;  // rank, wait status
    int status = 0;
    pid_t pid;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      for (int r = 0; r < o.nproc; ++r)
        if (pids[r] == pid && alive[r]) {
          alive[r] = false;
          --living;
          exited.emplace_back(r, status);
        }
    }
    if (pid < 0 && errno == ECHILD) living = 0;  // no children left
    const std::pair<int, int>* cause = nullptr;
    for (const auto& e : exited) {
      const bool failed = !(WIFEXITED(e.second) && WEXITSTATUS(e.second) == 0);
      if (failed && (cause == nullptr || (WIFSIGNALED(e.second) && !WIFSIGNALED(cause->second)))) cause = &e;
    }
    if (cause != nullptr && !stopping_others) {
      result = exit_code(cause->second);
      std::fprintf(stderr, "attnkit train: worker rank %d (pid %d) %s; stopping the other %d worker(s)%s\n",
                   cause->first, static_cast<int>(pids[cause->first]), describe(cause->second).c_str(),
                   static_cast<int>(std::count(alive.begin(), alive.end(), true)),
                   received > 0 ? "" : "; restart the job with --resume");
      stopping_others = true;
      kill_at = train::steady_seconds() + o.grace_seconds;
      for (int k = 0; k < o.nproc; ++k)
        if (alive[k]) ::kill(pids[k], SIGTERM);
    }
    if (!exited.empty()) continue;
    if (stopping_others && train::steady_seconds() > kill_at) {
      for (int k = 0; k < o.nproc; ++k)
        if (alive[k]) ::kill(pids[k], SIGKILL);
      kill_at = train::steady_seconds() + 3600;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  return result;
}

}  // namespace attnkit::cli
