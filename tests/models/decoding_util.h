// What the decoding tests of the models share: a model's logits computed one
// token at a time, to compare with its forward over the whole sequence.
#pragma once

#include <attnkit/models/transformer.h>
#include <torch/torch.h>

#include <vector>

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

}  // namespace attnkit::testing
