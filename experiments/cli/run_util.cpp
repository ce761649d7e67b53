#include "run_util.h"

#include <attnkit/runtime.h>
#include <attnkit/train/clock.h>
#include <c10/util/Exception.h>

namespace attnkit::cli {

void check_resume_flags(const char* command, const nlohmann::json& stored, const nlohmann::json& given,
                        const CLI::App& cmd, const char* may_change) {
  for (const auto& [key, value] : stored.items()) {
    std::string flag = "--" + key;
    for (auto& c : flag) c = c == '_' ? '-' : c;
    if (cmd.count(flag) > 0 && given.contains(key) && given.at(key) != value)
      TORCH_CHECK(false, command, ": --resume: ", flag, ": checkpoint ", value.dump(), ", now ",
                  given.at(key).dump(), " (only ", may_change, " may change)");
  }
}

nlohmann::json session_record(const std::string& resumed_from, const char* start_key, int64_t start,
                              double wall_start, const std::string& load_start) {
  return {{"resumed_from", resumed_from.empty() ? nlohmann::json(nullptr) : nlohmann::json(resumed_from)},
          {start_key, start},
          {"wall_seconds", train::steady_seconds() - wall_start},
          {"loadavg_start", load_start},
          {"loadavg_end", train::loadavg_line()},
          {"finished_utc", train::utc_now()},
          {"threads", attnkit::num_threads()}};
}

}  // namespace attnkit::cli
