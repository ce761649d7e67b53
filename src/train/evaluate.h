// What the data-parallel loop adds to evaluate() (trainer.h): metrics summed
// over the ranks, and a validation split over them.
#pragma once

#include <attnkit/train/distributed.h>
#include <attnkit/train/trainer.h>

#include <cstdint>

namespace attnkit::train {

/// Metrics summed over the ranks.
tasks::Metrics allreduce_metrics(Communicator& comm, const tasks::Metrics& m, const char* what);

/// evaluate() split over the ranks: rank r scores the evaluation batches
/// i = r, r + P, ...; the sums are combined.
tasks::Metrics evaluate_distributed(Communicator& comm, models::Transformer& model, const tasks::Task& task,
                                    tasks::Split split, int64_t batch, int64_t context, int64_t max_batches);

}  // namespace attnkit::train
