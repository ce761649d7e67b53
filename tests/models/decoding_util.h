// What the decoding tests of the models share: a model's logits computed one
// token at a time, to compare with its forward over the whole sequence.
#pragma once

#include <attnkit/models/transformer.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "test_util.h"

namespace attnkit::testing {

/// Logits of every position, computed by stepping the decoder one token at a
/// time (with the encoder's source for an encoder-decoder): (N, L, V).
inline torch::Tensor decode_all(models::Transformer& model, const torch::Tensor& tokens,
                                const torch::Tensor& source = {}) {
  auto state = model->start_decoding(tokens.size(0), source);
  std::vector<torch::Tensor> out;
  for (int64_t t = 0; t < tokens.size(1); ++t) out.push_back(model->step(tokens.select(1, t), state));
  return torch::stack(out, 1);
}

/// Each model of `variants`, in float64 and float32, decodes token by token
/// to its forward's logits: 1e-10 (float64) or 1e-5 (float32) relative to the
/// largest logit, as tests/models/transformer_test.cpp states (the same sums
/// in another order). Inputs from `seed`, vocabulary of 11.
inline void expect_decoding_equals_forward(const std::vector<models::TransformerOptions>& variants,
                                           uint64_t seed) {
  for (auto dtype : {torch::kFloat64, torch::kFloat32})
    for (const auto& options : variants) {
      SCOPED_TRACE(options.to_json() + " " + c10::toString(dtype));
      torch::manual_seed(seed);
      models::Transformer model(options);
      model->to(dtype);
      model->eval();
      auto tokens = torch::randint(0, 11, {2, 13}, torch::kLong);
      EXPECT_LE(rel_err(decode_all(model, tokens), model->forward(tokens)), dtype == torch::kFloat64 ? 1e-10 : 1e-5);
    }
}

}  // namespace attnkit::testing
