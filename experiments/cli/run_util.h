// What the training subcommands with run directories of their own (`cloze`,
// `node-classify`) share: the clocks and machine load they record, and the
// rule for --resume (flags not given come from the checkpoint, flags given
// must match it).
#pragma once

#include <CLI/CLI.hpp>
#include <attnkit/train/clock.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace attnkit::cli {

/// The clocks and the load a run records: train/clock.h's.
using train::loadavg_line;
using train::steady_seconds;
using train::utc_now;

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

/// Writes RUN/checkpoint-<step>.ckpt (train/run_directory.h's make_checkpoint)
/// for a run in directory `out`: the header holds `kind` (what wrote it),
/// `step`, `elapsed` (training seconds so far), `settings`, the description of
/// the stored tensors and every member of `extra`; the payload the model's and
/// the optimiser's state and the generator's. Keeps the newest `keep`
/// checkpoints; returns the path written.
std::string save_run_checkpoint(const std::string& out, const std::string& kind, int64_t step, double elapsed,
                                const nlohmann::json& settings, const nlohmann::json& extra,
                                torch::nn::Module& model, torch::optim::Optimizer& optimizer, std::size_t keep);

}  // namespace attnkit::cli
