// The dense layer of every attnkit module: torch::nn::Linear's interface and
// parameters on attnkit::linear (oneDNN's sgemm for float32), because
// libtorch's own matmul runs netlib's reference BLAS on a default Debian
// install, far slower than the attention kernels it would feed
// (docs/PERFORMANCE.md, "Dense layers").
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/pimpl.h>

namespace attnkit::nn {

/// y = x weight^T + bias for x (..., in_features) -> (..., out_features).
/// Same options (torch::nn::LinearOptions), parameter names ("weight",
/// "bias"), shapes and initialisation as torch::nn::Linear, so state_dicts and
/// serialized weights interchange with it in both directions.
class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
  explicit LinearImpl(const torch::nn::LinearOptions& options);

  void reset() override;
  /// torch::nn::Linear's initialisation: weight ~ kaiming_uniform(a = sqrt(5)),
  /// bias ~ U(-1/sqrt(in), 1/sqrt(in)).
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  torch::Tensor forward(const torch::Tensor& input);

  torch::nn::LinearOptions options;
  torch::Tensor weight;  // (out_features, in_features)
  torch::Tensor bias;    // (out_features), undefined when options.bias() is false
};
TORCH_MODULE(Linear);

}  // namespace attnkit::nn
