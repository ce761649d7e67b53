// Steady clock, load average, UTC time.
#include <attnkit/train/clock.h>

#include <chrono>
#include <ctime>
#include <fstream>
#include <sstream>

namespace attnkit::train {

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string loadavg_line() {
  std::ifstream in("/proc/loadavg");
  std::string line;
  std::getline(in, line);
  return line;
}

double load_average() {
  std::istringstream in(loadavg_line());
  double load = -1;
  in >> load;
  return in ? load : -1;
}

std::string utc_now() {
  const auto t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

}  // namespace attnkit::train
