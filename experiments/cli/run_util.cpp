#include "run_util.h"

#include <attnkit/runtime.h>
#include <attnkit/train/clock.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace attnkit::cli {

OpenedRun::OpenedRun(const char* command, const char* kind, const std::string& out, bool resume)
    : command_(command) {
  TORCH_CHECK(!out.empty(), command, ": --out (the run directory) is required");
  checkpoint_ = train::open_or_resume(out, resume);
  TORCH_CHECK(!resume || checkpoint_, command, ": --resume: '", out, "' holds no checkpoint to resume");
  if (!checkpoint_) return;
  TORCH_CHECK(checkpoint_->kind() == kind, command, ": --resume: ", checkpoint_->path(),
              " is not a checkpoint of `attnkit-experiments ", command, "` (kind '", checkpoint_->kind(), "')");
  header_ = nlohmann::json::parse(checkpoint_->header());
}

const nlohmann::json& OpenedRun::settings() const {
  TORCH_CHECK(checkpoint_, command_, ": a fresh run has no stored settings");
  return header_.at("settings");
}

double OpenedRun::elapsed_before() const { return checkpoint_ ? header_.at("elapsed").get<double>() : 0.0; }

int64_t OpenedRun::restore(torch::nn::Module& model, torch::optim::Optimizer* optimizer) const {
  if (!checkpoint_) return 0;
  checkpoint_->restore(model, optimizer, /*restore_generator=*/true);
  return checkpoint_->step();
}

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

void add_training_options(CLI::App* cmd, double& lr, double& weight_decay, double& clip, int64_t& eval_every) {
  cmd->add_option("--lr", lr, "AdamW learning rate (constant)")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--weight-decay", weight_decay, "AdamW's decoupled weight decay")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--clip", clip, "Global gradient-norm bound (0: none)")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--eval-every", eval_every, "Steps between validation records and checkpoints")
      ->check(CLI::PositiveNumber)->capture_default_str();
}

void set_threads(int threads) {
  if (threads <= 0) return;
  attnkit::set_num_threads(threads);
  at::set_num_threads(threads);
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
