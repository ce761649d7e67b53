// Binding tensors to kernel Params: a float pointer plus one stride (in
// elements) per dimension. Kernels read strides, so views bind without a copy.
#pragma once

#include <torch/types.h>

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

}  // namespace attnkit::detail
