// Packed variable-length batches for the tests of varlen_attention (and of
// dropout over packed batches): float64 inputs in FlashAttention's layout,
// a cotangent, and the offsets.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace attnkit::testing::varlen {

/// Packed float64 inputs of a batch, a cotangent, and its offsets.
struct Packed {
  torch::Tensor q, k, v, dout, cu_q, cu_k;
  std::vector<int64_t> offsets_q, offsets_k;
};

/// 0, then the running sums of the lengths: the B + 1 offsets.
inline std::vector<int64_t> offsets(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

/// Standard normal q (Tq, H, E), k (Tk, Hkv, E), v (Tk, Hkv, M) and dout
/// (Tq, H, M) from torch::manual_seed(seed), with the offsets of the lengths.
inline Packed pack(const std::vector<int64_t>& q_lengths, const std::vector<int64_t>& k_lengths, int64_t H,
                   int64_t Hkv, int64_t E, int64_t M, uint64_t seed) {
  torch::manual_seed(seed);
  Packed p;
  p.offsets_q = offsets(q_lengths);
  p.offsets_k = offsets(k_lengths);
  const int64_t Tq = p.offsets_q.back(), Tk = p.offsets_k.back();
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  p.q = torch::randn({Tq, H, E}, f64);
  p.k = torch::randn({Tk, Hkv, E}, f64);
  p.v = torch::randn({Tk, Hkv, M}, f64);
  p.dout = torch::randn({Tq, H, M}, f64);
  p.cu_q = torch::tensor(p.offsets_q, torch::kLong);
  p.cu_k = torch::tensor(p.offsets_k, torch::kLong);
  return p;
}

}  // namespace attnkit::testing::varlen
