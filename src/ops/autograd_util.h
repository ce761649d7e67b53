// Autograd helpers shared by the ops' torch::autograd::Function classes.
#pragma once

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <memory>
#include <string>

namespace attnkit::detail {

/// The C++ counterpart of torch.autograd.function.once_differentiable, for a
/// custom Function whose backward computes first-order gradients only (a
/// torch-free kernel records no graph). Call it on the list backward returns,
/// naming what those gradients were computed from (the saved inputs and the
/// output gradients):
///   return detail::once_differentiable("softmax_attention", {dq, dk, dv, {}},
///                                      {q, k, v, grads[0]});
/// Outside create_graph (grad mode is off during such a backward) the list
/// comes back unchanged. Under create_graph each gradient gets an Error node
/// as its grad_fn, with edges to `sources`: the gradients have the same values
/// and can be used as usual, but differentiating them again (towards any of
/// the sources) raises "<op>: <why>" instead of silently dropping the
/// second-order terms.
inline torch::autograd::variable_list once_differentiable(
    const std::string& op, torch::autograd::variable_list grads,
    const torch::autograd::variable_list& sources,
    const std::string& why = "double backward (the gradient of a gradient) is not supported "
                             "by the float32 kernel; use float64 inputs, which take the "
                             "differentiable composite path") {
  const bool recorded = std::any_of(sources.begin(), sources.end(), [](const torch::Tensor& t) {
    return t.defined() && t.requires_grad();
  });
  if (!torch::GradMode::is_enabled() || !recorded) return grads;
  auto error = std::make_shared<torch::autograd::Error>(op + ": " + why,
                                                        torch::autograd::collect_next_edges(sources));
  for (auto& g : grads) torch::autograd::set_history(g, error);
  return grads;
}

}  // namespace attnkit::detail
