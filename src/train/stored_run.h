// The checkpoints of `attnkit train` as the trainer writes and reads them:
// the header's fields besides the step and the tensors (run_directory.h holds
// the rest of the format), the comparison behind --resume's refusals, and the
// checks a model and a task must pass to form a run.
#pragma once

#include <attnkit/train/run_directory.h>
#include <attnkit/train/trainer.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace attnkit::train {

/// What a checkpoint's header says built the model.
struct RunHeader {
  int64_t step = 0;
  double elapsed = 0;  ///< seconds trained up to the step
  TrainerOptions trainer;
  models::TransformerOptions model;
  tasks::TaskOptions task;
};

/// The header of `checkpoint`; a field missing or not describing a run is
/// refused with an error naming the file.
RunHeader parse_run_header(const StoredCheckpoint& checkpoint);

/// The header of `model`'s checkpoint, without the step and the tensors
/// (make_checkpoint adds them).
nlohmann::json run_header(models::TransformerImpl& model, const TrainerOptions& trainer,
                          const models::TransformerOptions& model_options, const tasks::TaskOptions& task,
                          double elapsed);

/// loss, bits and accuracy under "<prefix>loss", "<prefix>bpc", "<prefix>accuracy":
/// metrics.jsonl's records and a checkpoint's last validation.
nlohmann::json metrics_json(const std::string& prefix, const tasks::Metrics& m);

/// The differences that would change a resumed run's trajectory; empty when it may resume.
std::vector<std::string> resume_mismatches(const RunHeader& stored, const TrainerOptions& t,
                                           const models::TransformerOptions& m, const tasks::TaskOptions& task);

/// char-lm -> decoder, copy -> encoder: what the task needs of the model.
void check_architecture(const models::TransformerOptions& model, const tasks::Task& task);

/// Absolute data directory, so that a run can be evaluated from anywhere.
tasks::TaskOptions normalised(tasks::TaskOptions t);

}  // namespace attnkit::train
