// What the training subcommands with run directories of their own (`cloze`,
// `node-classify`, `translate`) share besides train::RunDirectory and
// train/clock.h: how they open a run directory and resume it, the rule for
// the flags of a resumed run (flags not given come from the checkpoint, flags
// given must match it), and the session record of their result.json.
//
//   const OpenedRun opened("cloze", kClozeKind, f.out, f.resume);
//   if (opened.resumed()) { check_resume_flags(...opened.settings()...); apply_settings(opened.settings(), f); }
//   ... build the model and optimiser from f ...
//   const int64_t start = opened.restore(*model, &optimizer);
//   train::RunDirectory dir(f.out, opened.resumed_from(), start);
#pragma once

#include <attnkit/train/run_directory.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>

namespace attnkit::cli {

/// A run directory opened by an experiment subcommand whose checkpoints carry
/// a "kind" and a header with "settings" and "elapsed" (the run's wall seconds
/// so far). Writes nothing: train::RunDirectory claims the directory later.
class OpenedRun {
 public:
  /// train::open_or_resume(out, resume) for `command`, whose checkpoints are
  /// of `kind`. Throws naming `command` when `out` is empty, when --resume
  /// finds no checkpoint, and when the checkpoint is of another kind.
  OpenedRun(const char* command, const char* kind, const std::string& out, bool resume);

  bool resumed() const { return checkpoint_.has_value(); }
  /// The checkpoint this run resumes; "" for a fresh run.
  std::string resumed_from() const { return checkpoint_ ? checkpoint_->path() : ""; }
  /// The resumed checkpoint's header; an empty object for a fresh run.
  const nlohmann::json& header() const { return header_; }
  /// The header's "settings" (the run's flags); throws for a fresh run.
  const nlohmann::json& settings() const;
  /// The run's wall seconds before this session; 0 for a fresh run.
  double elapsed_before() const;

  /// Loads the checkpoint into `model`, `optimizer` and torch's default
  /// generator (nothing for a fresh run) and returns the step (or epoch) the
  /// run continues from: the checkpoint's, or 0.
  int64_t restore(torch::nn::Module& model, torch::optim::Optimizer* optimizer) const;

 private:
  std::string command_;
  std::optional<train::StoredCheckpoint> checkpoint_;
  nlohmann::json header_ = nlohmann::json::object();
};

/// --resume's rule for a run's settings (keys: flag names without "--", '_'
/// for '-'): every flag given on `cmd` must equal the checkpoint's value of
/// `stored`; throws naming the flag, both values and `may_change` (the flags
/// that are not settings) otherwise.
void check_resume_flags(const char* command, const nlohmann::json& stored, const nlohmann::json& given,
                        const CLI::App& cmd, const char* may_change);

/// The training flags `cloze` and `translate` share, with their checks:
/// --lr (AdamW's, constant), --weight-decay, --clip (the global gradient-norm
/// bound, 0: none) and --eval-every (steps between validation records and
/// checkpoints); the defaults are the values the references hold.
void add_training_options(CLI::App* cmd, double& lr, double& weight_decay, double& clip, int64_t& eval_every);

/// Sets attnkit's and ATen's intra-op thread counts to `threads`; 0 leaves
/// both at their defaults.
void set_threads(int threads);

/// The "session" record of a run's result.json: where it resumed from (null
/// when it started fresh), the step (or epoch) it started at under the key
/// `start_key`, its wall seconds since `wall_start` (steady_seconds()), the load
/// at its start and now, the UTC time and the thread count.
nlohmann::json session_record(const std::string& resumed_from, const char* start_key, int64_t start,
                              double wall_start, const std::string& load_start);

}  // namespace attnkit::cli
