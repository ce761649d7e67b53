// The bfloat16 working copy of mixed-precision training.
#include "train/mixed_precision.h"

#include <unordered_set>

namespace attnkit::train {

WorkingCopy::WorkingCopy(const models::TransformerOptions& options) : model_(options) {
  std::unordered_set<const void*> converted;
  for (auto& p : model_->parameters())
    if (converted.insert(p.unsafeGetTensorImpl()).second) p.set_data(p.detach().to(torch::kBFloat16));
}

void WorkingCopy::attach(models::Transformer& master) {
  const auto master_params = master->named_parameters(), copy_params = model_->named_parameters();
  std::unordered_set<const void*> seen;
  for (const auto& item : master_params) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // tied: once
    const auto* other = copy_params.find(item.key());
    TORCH_CHECK(other && other->sizes() == item.value().sizes(), "train: the bf16 working copy lacks parameter ",
                item.key());
    params_.emplace_back(item.value(), *other);
  }
  const auto master_buffers = master->named_buffers(), copy_buffers = model_->named_buffers();
  for (const auto& item : master_buffers) {
    const auto* other = copy_buffers.find(item.key());
    TORCH_CHECK(other && other->sizes() == item.value().sizes(), "train: the bf16 working copy lacks buffer ",
                item.key());
    buffers_.emplace_back(item.value(), *other);
  }
}

void WorkingCopy::refresh() {
  torch::NoGradGuard no_grad;
  for (auto& [master, copy] : params_) copy.copy_(master);
  for (auto& [master, copy] : buffers_) copy.copy_(master);
}

void WorkingCopy::keep_buffers() {
  torch::NoGradGuard no_grad;
  for (auto& [master, copy] : buffers_) master.copy_(copy);
}

void WorkingCopy::take_grads() {
  for (auto& [master, copy] : params_) {
    const auto& grad = copy.grad();
    if (!grad.defined()) continue;  // unused this step: no gradient, as in float32
    if (master.grad().defined())
      master.mutable_grad().copy_(grad);
    else
      master.mutable_grad() = grad.to(torch::kFloat32);
  }
}

}  // namespace attnkit::train
