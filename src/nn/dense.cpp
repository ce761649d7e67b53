// nn::Linear: torch::nn::Linear's parameters on attnkit::linear.
#include <attnkit/nn/dense.h>
#include <attnkit/ops.h>
#include <torch/nn/init.h>

#include <cmath>

#include "ops/checks.h"

namespace attnkit::nn {

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options_) : options(options_) {
  TORCH_CHECK(options.in_features() >= 0 && options.out_features() >= 0,
              "Linear: in_features and out_features must be >= 0, got ", options.in_features(),
              " and ", options.out_features());
  reset();
}

void LinearImpl::reset() {
  weight = register_parameter("weight",
                              torch::empty({options.out_features(), options.in_features()}));
  if (options.bias()) {
    bias = register_parameter("bias", torch::empty(options.out_features()));
  } else {
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  }
  reset_parameters();
}

void LinearImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const int64_t fan_in = options.in_features();
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::nn::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
         << options.bias() << ")";
}

torch::Tensor LinearImpl::forward(const torch::Tensor& input) {
  if (input.defined()) detail::check_parameter_dtype("Linear", "input", input, weight);
  return attnkit::linear(input, weight, bias);
}

}  // namespace attnkit::nn
