// The clocks and machine load a run records, in one place: the training loop's
// intervals and ETA, the progress line's throttle, the `elapsed` of
// metrics.jsonl and checkpoints, and the session records of result.json.
#pragma once

#include <string>

namespace attnkit::train {

/// Seconds on the steady clock since an arbitrary origin (differences only).
double steady_seconds();

/// /proc/loadavg's line ("" if unreadable): the load a run's result records.
std::string loadavg_line();

/// The 1-minute load average of /proc/loadavg (-1 if unknown), to record how
/// busy a shared machine was (2 cores: load 2 = both busy).
double load_average();

/// The current UTC time as "YYYY-MM-DDTHH:MM:SSZ".
std::string utc_now();

}  // namespace attnkit::train
