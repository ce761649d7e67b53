// Binding tensors to kernel Params: a float pointer plus one stride (in
// elements) per dimension. Kernels read strides, so views bind without a copy.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace attnkit::detail {

template <std::size_t R>
void bind_strides(const torch::Tensor& t, int64_t (&stride)[R]) {
  TORCH_INTERNAL_ASSERT(t.dim() == static_cast<int64_t>(R), "binding a rank-", t.dim(),
                        " tensor to ", R, " strides");
  for (std::size_t d = 0; d < R; ++d) stride[d] = t.stride(static_cast<int64_t>(d));
}

/// ptr = t's data (float32, or bfloat16 for a kernels::bf16 pointer), stride =
/// t's strides. An empty tensor binds as its data pointer (null when it has no
/// storage) with every stride 0: kernels compute row and head pointers as
/// base + index * stride, and null plus a
/// non-zero offset is undefined behaviour (UBSan's pointer-overflow check),
/// while null + 0 is not. No element of an empty tensor is ever read.
template <typename Ptr, std::size_t R>
void bind(Ptr& ptr, int64_t (&stride)[R], const torch::Tensor& t) {
  using Element = std::remove_cv_t<std::remove_pointer_t<Ptr>>;
  if constexpr (std::is_same_v<Element, float>) {
    ptr = t.data_ptr<float>();
  } else {  // kernels::bf16, layout-compatible with c10::BFloat16
    static_assert(sizeof(Element) == sizeof(c10::BFloat16), "a bf16 pointer binds a bfloat16 tensor");
    ptr = reinterpret_cast<Ptr>(t.data_ptr<c10::BFloat16>());
  }
  bind_strides(t, stride);
  if (t.numel() == 0)
    for (auto& s : stride) s = 0;
}

/// Binds q, k, v and out to a kernel's QkvParams-style fields (pointers and
/// strides) and sets N, H, L, S, E, M from their shapes.
template <typename Params>
void bind_qkv(Params& p, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& out) {
  bind(p.q, p.q_stride, q);
  bind(p.k, p.k_stride, k);
  bind(p.v, p.v_stride, v);
  bind(p.out, p.out_stride, out);
  p.N = q.size(0), p.H = q.size(1), p.L = q.size(2), p.S = k.size(2), p.E = q.size(3), p.M = v.size(3);
}

/// The input gradients of a q/k/v backward pass: dq, dk, dv allocated
/// contiguous in the shapes and dtype of q, k, v, and bound with the output
/// gradient dout to p's QkvGrads-style fields.
template <typename Params>
std::array<torch::Tensor, 3> bind_qkv_grads(Params& p, const torch::Tensor& q,
                                            const torch::Tensor& k, const torch::Tensor& v,
                                            const torch::Tensor& dout, bool per_query_head = false) {
  // per_query_head (grouped-query heads): dk and dv get q's head count, the
  // shares of each query head that the caller sums over each group. Without
  // query heads (H = 0, which any key/value head count divides) no query
  // reads k or v and the kernels write nothing: their gradients are zeros.
  auto like = [&](const torch::Tensor& x) {
    if (q.size(1) == 0) return torch::zeros_like(x, torch::MemoryFormat::Contiguous);
    if (!per_query_head) return torch::empty_like(x, torch::MemoryFormat::Contiguous);
    return torch::empty({x.size(0), q.size(1), x.size(2), x.size(3)}, x.options());
  };
  std::array<torch::Tensor, 3> grads{torch::empty_like(q, torch::MemoryFormat::Contiguous), like(k), like(v)};
  bind(p.dout, p.dout_stride, dout);
  bind(p.dq, p.dq_stride, grads[0]);
  bind(p.dk, p.dk_stride, grads[1]);
  bind(p.dv, p.dv_stride, grads[2]);
  return grads;
}

}  // namespace attnkit::detail
