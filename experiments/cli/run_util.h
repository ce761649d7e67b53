// What the training subcommands with run directories of their own (`cloze`,
// `node-classify`) share besides train::RunDirectory and train/clock.h: the
// session record of their result.json and the rule for --resume (flags not
// given come from the checkpoint, flags given must match it).
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace attnkit::cli {

/// --resume's rule for a run's settings (keys: flag names without "--", '_'
/// for '-'): every flag given on `cmd` must equal the checkpoint's value of
/// `stored`; throws naming the flag, both values and `may_change` (the flags
/// that are not settings) otherwise.
void check_resume_flags(const char* command, const nlohmann::json& stored, const nlohmann::json& given,
                        const CLI::App& cmd, const char* may_change);

/// The "session" record of a run's result.json: where it resumed from (null
/// when it started fresh), the step (or epoch) it started at under the key
/// `start_key`, its wall seconds since `wall_start` (steady_seconds()), the load
/// at its start and now, the UTC time and the thread count.
nlohmann::json session_record(const std::string& resumed_from, const char* start_key, int64_t start,
                              double wall_start, const std::string& load_start);

}  // namespace attnkit::cli
