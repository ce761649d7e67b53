// SAC's side of training: the structure statistics evaluate() gathers
// (sac_reinforce itself is public: trainer.h).
#pragma once

#include <attnkit/train/trainer.h>

#include <cstdint>
#include <vector>

namespace attnkit::train {

/// Adds one structure (shared or per head) to `stats`; rows whose position is
/// not scored in `weight` (N = 1 row of the batch's weights) are left out of
/// the partner counts.
void count_structure(const EdgeList& edges, const std::vector<int64_t>& partner, const torch::Tensor& weight,
                     StructureStats& stats);

}  // namespace attnkit::train
