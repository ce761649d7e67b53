// What every task shares: splits, metrics, the masked cross-entropy, and the
// factory that turns command-line options into a task.
#include <attnkit/tasks/char_lm.h>
#include <attnkit/tasks/copy.h>
#include <attnkit/tasks/task.h>

#include <torch/torch.h>

#include <cmath>
#include <filesystem>

namespace attnkit::tasks {

Split split_from_string(const std::string& name) {
  if (name == "train") return Split::train;
  if (name == "valid") return Split::valid;
  if (name == "test") return Split::test;
  TORCH_CHECK(false, "split: expected one of train, valid, test; got '", name, "'");
}

std::string to_string(Split split) {
  switch (split) {
    case Split::train: return "train";
    case Split::valid: return "valid";
    case Split::test: return "test";
  }
  TORCH_CHECK(false, "to_string(Split): invalid value ", static_cast<int>(split));
}

double Metrics::bits() const { return loss() / std::log(2.0); }

Metrics& Metrics::operator+=(const Metrics& other) {
  loss_sum += other.loss_sum;
  correct += other.correct;
  scored += other.scored;
  positions += other.positions;
  return *this;
}

namespace {

// Checks logits (N, L, V) against the batch and returns -log p(target), (N, L),
// in the dtype of the logits.
torch::Tensor target_nll(const char* op, const torch::Tensor& logits, const Batch& batch) {
  TORCH_CHECK(logits.defined() && logits.dim() == 3, op, ": logits must be (N, L, V), got ",
              logits.defined() ? logits.sizes() : torch::IntArrayRef{}, " (",
              logits.defined() ? logits.dim() : 0, "-D)");
  TORCH_CHECK(logits.is_floating_point(), op, ": logits must be floating point, got ",
              logits.scalar_type());
  TORCH_CHECK(batch.target.defined() && batch.target.scalar_type() == torch::kInt64, op,
              ": batch.target must be int64");
  TORCH_CHECK(batch.weight.defined() && batch.weight.is_floating_point(), op,
              ": batch.weight must be floating point");
  const auto n = logits.size(0), l = logits.size(1), v = logits.size(2);
  TORCH_CHECK(batch.target.sizes() == torch::IntArrayRef({n, l}), op, ": batch.target must be (N, L) = (",
              n, ", ", l, ") to match logits ", logits.sizes(), ", got ", batch.target.sizes());
  TORCH_CHECK(batch.weight.sizes() == batch.target.sizes(), op, ": batch.weight must be ",
              batch.target.sizes(), " like batch.target, got ", batch.weight.sizes());
  if (batch.target.numel() > 0) {
    const auto low = batch.target.min().item<int64_t>();
    const auto high = batch.target.max().item<int64_t>();
    TORCH_CHECK(low >= 0 && high < v, op, ": batch.target must lie in [0, V) = [0, ", v,
                "), got values in [", low, ", ", high, "]");
  }
  auto log_p = torch::log_softmax(logits, -1);
  return -log_p.gather(-1, batch.target.unsqueeze(-1)).squeeze(-1);
}

}  // namespace

torch::Tensor target_log_probs(const torch::Tensor& logits, const Batch& batch) {
  torch::NoGradGuard no_grad;
  return -target_nll("target_log_probs", logits.to(torch::kFloat64), batch);
}

torch::Tensor loss(const torch::Tensor& logits, const Batch& batch) {
  auto weight = batch.weight.to(logits.scalar_type());
  // Unscored positions contribute 0 even when their logits make the nll infinite.
  auto nll = target_nll("loss", logits, batch).masked_fill(weight.eq(0), 0);
  return (nll * weight).sum() / weight.sum().clamp_min(1e-30);
}

Metrics score(const torch::Tensor& logits, const Batch& batch) {
  torch::NoGradGuard no_grad;
  auto weight = batch.weight.to(torch::kFloat64);
  auto nll = target_nll("score", logits, batch).to(torch::kFloat64).masked_fill(weight.eq(0), 0);
  auto hit = logits.argmax(-1).eq(batch.target).to(torch::kFloat64);
  Metrics m;
  m.loss_sum = (nll * weight).sum().item<double>();
  m.correct = (hit * weight).sum().item<double>();
  m.scored = weight.sum().item<double>();
  m.positions = static_cast<double>(batch.input.numel());
  return m;
}

torch::Tensor Task::encode(const std::string& text) const {
  TORCH_CHECK(false, "encode: the task '", name(),
              "' is not over text and has no text encoding (char-lm has one)");
}

std::string Task::decode(const torch::Tensor& tokens) const {
  TORCH_CHECK(false, "decode: the task '", name(),
              "' is not over text and has no text decoding (char-lm has one)");
}

std::unique_ptr<Task> make_task(const TaskOptions& options) {
  if (options.name == "char-lm" || options.name == "masked-char") {
    const auto& task = options.name;
    TORCH_CHECK(!options.data_dir.empty(),
                "task ", task, ": needs a data directory (--data DIR) holding train.txt, valid.txt "
                "and test.txt; make one with `attnkit data char-lm --input FILE... --out DIR` "
                "or scripts/fetch-corpus");
    const auto train = std::filesystem::path(options.data_dir) / "train.txt";
    TORCH_CHECK(std::filesystem::is_regular_file(train), "task ", task, ": the data directory '",
                options.data_dir, "' has no train.txt; make it with `attnkit data char-lm --input "
                "FILE... --out ", options.data_dir, "` or scripts/fetch-corpus --out ",
                options.data_dir);
    if (task == "masked-char") return std::make_unique<MaskedCharLm>(options.data_dir);
    return std::make_unique<CharLm>(options.data_dir);
  }
  if (options.name == "copy") return std::make_unique<CopyTask>(options.copy_length);
  TORCH_CHECK(false, "unknown task '", options.name, "'; known tasks: char-lm, masked-char, copy");
}

}  // namespace attnkit::tasks
