// Reference gated linear attention (docs/MATH.md, "Gated linear attention"):
// the recurrence step by step.
#include "reference/reference.h"

#include <vector>

namespace attnkit::reference {

torch::Tensor gated_linear_attention(const torch::Tensor& f, const torch::Tensor& q,
                                     const torch::Tensor& alpha, const torch::Tensor& beta,
                                     const GatedLinearAttentionFuncOptions& o) {
  const int64_t N = f.size(0), H = f.size(1), L = f.size(2), E = f.size(3);
  if (L == 0) {
    // No step: C = 0 and an empty output. C is written as the (empty) sum over
    // t of alpha_t beta_t f_t f_t^T rather than a fresh zeros tensor, so that
    // the output is still connected to every input in the autograd graph, as
    // the kernel's output is: without it, an output of inputs that require
    // grad had no grad_fn (and autograd.grad(..., allow_unused=True) silently
    // returned no gradients at all).
    const auto C = torch::einsum("nht,nht,nhte,nhtf->nhef", {alpha, beta, f, f});
    return torch::matmul(q, C.transpose(-2, -1));
  }
  auto C = torch::zeros({N, H, E, E}, f.options());
  std::vector<torch::Tensor> outs;
  outs.reserve(o.causal() ? L : 0);
  for (int64_t t = 0; t < L; ++t) {
    auto ft = f.select(2, t);                                   // (N,H,E)
    auto at = alpha.select(2, t).view({N, H, 1, 1});
    auto bt = beta.select(2, t).view({N, H, 1, 1});
    C = at * C + bt * ft.unsqueeze(-1) * ft.unsqueeze(-2);      // C_t
    if (o.causal()) outs.push_back(torch::matmul(C, q.select(2, t).unsqueeze(-1)).squeeze(-1));
  }
  if (o.causal()) return torch::stack(outs, 2);
  return torch::matmul(q, C.transpose(-2, -1));                 // out_t = C_L q_t
}

}  // namespace attnkit::reference
