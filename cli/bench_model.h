// What the files of `attnkit bench-model` share: the configuration, the
// model's options, random batches and the training step, and what each file
// gives the command (bench_model_flops, _baseline and _memory.cpp).
#pragma once

#include <attnkit/models/transformer.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace attnkit::cli::bench_model {

/// What `attnkit bench-model` was asked for (its options).
struct ModelConfig {
  std::vector<std::string> what = {"train", "generate", "memory"};
  std::vector<std::string> attention;  // empty: each measurement's default list
  int threads = 1;  // the targets are on one thread
  // The model.
  std::string architecture = "decoder";
  std::string positions = "sinusoidal";
  int64_t layers = 4, width = 256, heads = 4, ffn = 1024, vocab = 27;
  int64_t kv_heads = 0;  // 0: as many as heads
  double dropout = 0.1;
  // train
  int64_t context = 512, batch = 16;
  int repeats = 5;
  bool baseline = true;
  // generate
  std::vector<int64_t> contexts = {1024, 4096, 16384};
  int64_t steps = 64;
  // memory
  std::vector<int64_t> memory_contexts = {512, 1024, 2048, 4096, 8192};
  int64_t memory_batch = 1;
  uint64_t seed = 0;
  std::string json;
  // The hidden child mode of the memory measurement: "step" or "idle".
  std::string child;
  int64_t max_length = 0;  // child: the position table's length (the parent's choice)
};

/// The builder's options for the configured model with `spec` in every block.
models::TransformerOptions model_options(const ModelConfig& c, const std::string& spec,
                                         int64_t max_length);

bool causal_model(const ModelConfig& c);

/// Random tokens (N, L + 1): inputs are the first L, targets the last L.
struct LmBatch {
  torch::Tensor input, target, weight;
};

LmBatch random_batch(const ModelConfig& c, int64_t batch, int64_t context, uint64_t seed);

/// The masked training loss: mean cross-entropy over the positions of weight
/// 1 (here every position).
torch::Tensor masked_cross_entropy(const torch::Tensor& logits, const LmBatch& b);

/// One training step of `model` on `batch`: forward, loss, backward, AdamW.
template <typename Model>
std::function<void()> train_step(Model& model, torch::optim::AdamW& optimizer, const LmBatch& batch) {
  return [&model, &optimizer, &batch] {
    auto loss = masked_cross_entropy(model->forward(batch.input), batch);
    loss.backward();
    optimizer.step();
  };
}

torch::optim::AdamW make_optimizer(torch::nn::Module& model);

/// The "model: ..." line under each measurement's title.
std::string model_line(const ModelConfig& c);

// --- FLOPs (bench_model_flops.cpp) ---------------------------------------------------------

/// Model FLOPs of one training step (forward + backward), the MFU convention:
/// what the model needs, recomputation not counted.
struct StepFlops {
  double dense = 0;                       // every matrix applied per token, output layer included
  c10::optional<double> attention;        // the mechanisms' own products (q k^T, P v, ...)
  std::string attention_rule;             // how `attention` was counted, or why it was not
  double total() const { return dense + attention.value_or(0); }
};

StepFlops model_step_flops(const ModelConfig& c, models::Transformer& model, const std::string& spec,
                           int64_t batch, int64_t context);

// --- The libtorch baseline (bench_model_baseline.cpp) --------------------------------------

/// The pre-norm decoder (or encoder) of models::Transformer with the same
/// sizes, parameters, dropout and step, built only from libtorch: its
/// Embedding, Linear and LayerNorm, and attention as the composite
/// softmax(q k^T / sqrt(d_head) + causal mask) v on torch::matmul. It runs
/// whatever BLAS libtorch is bound to; it exists only for this benchmark.
class TorchBaselineImpl : public torch::nn::Module {
 public:
  TorchBaselineImpl(const ModelConfig& c, int64_t max_length);

  /// tokens (N, L) -> logits (N, L, vocab), the output layer tied to the embedding.
  torch::Tensor forward(const torch::Tensor& tokens);

  int64_t parameter_count() const;

 private:
  struct Block {
    torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, out{nullptr}, ff1{nullptr}, ff2{nullptr};
    torch::nn::LayerNorm norm_self{nullptr}, norm_ff{nullptr};
  };
  ModelConfig c_;
  torch::nn::Embedding embedding_{nullptr};
  torch::Tensor table_;
  std::vector<Block> blocks_;
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(TorchBaseline);

// --- memory (bench_model_memory.cpp) -------------------------------------------------------

/// The memory measurement: per spec, the idle reference and one training step
/// per context of c.memory_contexts, each in a child process; prints the table.
nlohmann::json run_memory(const ModelConfig& c, const std::vector<std::string>& specs);

/// The child process: builds the model and its optimizer, runs one step at a
/// context of one token so that gradients and AdamW's state exist (and
/// libtorch, oneDNN and the OpenMP pool are loaded), then - for "step" - one
/// training step at the requested context. Prints one JSON line: its own peak
/// RSS (VmHWM) and the counting allocator's peak of tensor bytes during the
/// step above what it held before.
void run_child(const ModelConfig& c);

}  // namespace attnkit::cli::bench_model
