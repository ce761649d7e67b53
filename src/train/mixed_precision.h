// Mixed precision (DType::bf16): the bfloat16 working copy of a float32 model
// that the trainer's forward and backward passes run on.
//
// The trainer keeps two models: the master holds the float32 weights that the
// optimiser, clipping, the all-reduce and the checkpoints see, and the working
// copy runs the passes with bfloat16 parameters, refreshed from the master
// before every step. A separate copy (rather than casting inside each module's
// forward, or converting the model with Module::to) leaves the model code
// dtype-agnostic, keeps the float64 and int64 buffers (SAC's baseline,
// clustered attention's call counter) in their dtypes, and rounds each weight
// to bfloat16 once per step instead of once per use.
#pragma once

#include <attnkit/models/transformer.h>

#include <utility>
#include <vector>

namespace attnkit::train {

class WorkingCopy {
 public:
  /// Builds the copy of a model with `options`, parameters in bfloat16. Built
  /// before the master and its seed, so that its initial weights (overwritten
  /// by refresh()) draw nothing from the seeded generator.
  explicit WorkingCopy(const models::TransformerOptions& options);

  /// Pairs the copy's parameters (each once) and buffers with `master`'s, by name.
  void attach(models::Transformer& master);

  models::Transformer& model() { return model_; }
  /// (float32 parameter, its bfloat16 copy), each parameter once.
  const std::vector<std::pair<torch::Tensor, torch::Tensor>>& parameters() const { return params_; }

  /// The copy's parameters := the master's rounded to bfloat16 (to nearest
  /// even), its buffers := the master's.
  void refresh();
  /// The master's buffers := the copy's (after a forward pass or a REINFORCE
  /// update changed them).
  void keep_buffers();
  /// Each float32 parameter's grad := its copy's gradient in float32
  /// (undefined where the copy got none).
  void take_grads();

 private:
  models::Transformer model_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> params_, buffers_;
};

}  // namespace attnkit::train
