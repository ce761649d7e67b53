// `attnkit bench-model`'s FLOP counts: the model FLOPs of one training step,
// dense layers and attention, over which MFU is reported.
#include <attnkit/models/transformer.h>
#include <attnkit/nn/registry.h>
#include <torch/torch.h>

#include <string>

#include "bench_model.h"

namespace attnkit::cli::bench_model {

namespace {

/// Parameters of the matrices applied to every token: every 2-D parameter but
/// the token embedding (a lookup) and a learned position table (an add). A
/// tied embedding is counted once more as the output layer by the caller.
int64_t matmul_parameters(const torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.named_parameters()) {
    if (p.value().dim() != 2) continue;
    const auto& name = p.key();
    if (name == "embedding.weight" || name == "positions") continue;
    n += p.value().numel();
  }
  return n;
}

}  // namespace

StepFlops model_step_flops(const ModelConfig& c, models::Transformer& model, const std::string& spec,
                           int64_t batch, int64_t context) {
  StepFlops f;
  const double tokens = double(batch) * context;
  // A dense layer's backward is two products of its forward's size (dx, dW):
  // 2 * params per token forward, 6 * params per token forward + backward.
  const int64_t output = model->options().tie_embeddings() ? c.vocab * c.width : 0;
  f.dense = 6.0 * double(matmul_parameters(*model) + output) * tokens;

  const auto [info, parsed] = nn::resolve_mechanism(spec);
  const bool causal = causal_model(c) && (info->supports.causal || info->always_causal);
  nn::AttentionShape s;
  s.N = batch;
  s.L = s.S = models::attention_nodes(info->name, context);  // bp-tree and star add nodes
  if (info->layer == nn::MechanismLayer::class_projections) {
    const int64_t classes = parsed.get_int("classes", 0);
    s.H = classes > 0 ? classes : c.heads;  // one head per class over width / classes
  } else {
    s.H = c.heads;
  }
  s.E = s.M = c.width / s.H;
  c10::optional<double> forward;
  if (info->flops) {
    forward = info->flops(s, causal, parsed);
    if (forward) f.attention_rule = "registry closed form, x3 for forward + backward";
  }
  if (forward) {
    f.attention = 3.0 * c.layers * *forward;
  } else {
    f.attention_rule = "no closed form: not counted (MFU covers the dense layers only)";
  }
  return f;
}

}  // namespace attnkit::cli::bench_model
