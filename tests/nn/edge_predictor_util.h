// What the edge-predictor and SAC tests share.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <attnkit/nn/edge_predictor.h>
#include <torch/torch.h>

namespace attnkit::testing {

/// A CPU generator seeded with `seed`.
inline at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

/// A float64 predictor whose parameters are drawn after manual_seed(seed).
inline nn::EdgePredictor make_predictor(const nn::EdgePredictorOptions& options, uint64_t seed = 0) {
  torch::manual_seed(seed);
  nn::EdgePredictor p(options);
  p->to(torch::kFloat64);
  return p;
}

}  // namespace attnkit::testing
