// `attnkit train --nproc P`: the launcher. It starts P copies of this
// executable with the same command line and the environment of a
// data-parallel job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
// ATTNKIT_WORKER=1, which makes a copy a worker instead of a launcher, and
// ATTNKIT_LAUNCHER_STORE=1 when the launcher serves the TCPStore itself),
// then watches them:
//
//   - a worker that fails (non-zero exit, or killed by a signal) makes the
//     launcher stop the others (SIGTERM, then SIGKILL after `grace` seconds)
//     and exit non-zero, naming the worker;
//   - SIGINT / SIGTERM to the launcher is forwarded once to every worker per
//     signal received (the workers run in a process group of their own, so a
//     terminal's Ctrl-C reaches them through the launcher only, once): the
//     first stops training after the current step with a checkpoint, a second
//     one kills them, as for a single process;
//   - a worker whose launcher dies gets SIGTERM (PR_SET_PDEATHSIG).
#pragma once

#include <string>
#include <vector>

namespace attnkit::cli {

/// Records main's arguments (the command line the workers repeat; old flag
/// names already replaced, so that the workers do not warn again).
void set_command_line(const std::vector<std::string>& args);
const std::vector<std::string>& command_line();

/// True in a process the launcher started (ATTNKIT_WORKER is set).
bool launched_worker();

struct LaunchOptions {
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  /// 0: the launcher serves the job's TCPStore itself on a port the operating
  /// system picks (train::LauncherStore); > 0: rank 0 serves it on this port.
  int master_port = 0;
  double grace_seconds = 10;  ///< after SIGTERM to the surviving workers, until SIGKILL
  double store_timeout = 60;  ///< seconds: the launcher's TCPStore's waits
};

/// Starts the workers and watches them until all have exited; returns the
/// launcher's exit status: 0 when every worker exited 0, else the first failed
/// worker's exit code (128 + signal when it was killed).
int launch_workers(const LaunchOptions& options, const std::vector<std::string>& argv);

}  // namespace attnkit::cli
