// Packed variable-length batches (varlen_attention, varlen_linear_attention):
// the checks of packed q, k, v and their offsets, and the view of one
// sequence as a batch of one, which is how the kernels see it.
#pragma once

#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops/checks.h"

namespace attnkit::detail {

/// Offsets of a packed batch: int64 (B + 1) on the CPU, starting at 0,
/// non-decreasing, ending at `total` (the packed length). Returned as a vector;
/// empty where the values cannot be read (has_data: a tracer's fake tensor),
/// which only the structure's checks meet.
inline std::vector<int64_t> check_offsets(const char* op, const char* name, const torch::Tensor& cu,
                                          int64_t total) {
  TORCH_CHECK(cu.defined(), op, ": argument '", name, "' is undefined");
  check_strided(op, name, cu);
  TORCH_CHECK(cu.device().is_cpu(), op, ": argument '", name, "' must be on the CPU, got device ",
              cu.device());
  TORCH_CHECK(cu.scalar_type() == torch::kLong, op, ": argument '", name, "' must be int64, got dtype ",
              cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, op, ": argument '", name,
              "' must have shape (B + 1) with B >= 0 sequences, got ", shape_str(cu));
  if (!has_data(cu)) return {};  // a tracer's stand-in: the kernel op reads the values
  const auto c = cu.contiguous();
  std::vector<int64_t> offsets(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  TORCH_CHECK(offsets.front() == 0, op, ": argument '", name, "' must start at 0, got ", offsets.front());
  for (std::size_t b = 1; b < offsets.size(); ++b)
    TORCH_CHECK(offsets[b] >= offsets[b - 1], op, ": argument '", name,
                "' must be non-decreasing, got ", offsets[b - 1], " then ", offsets[b], " at entries ",
                b - 1, " and ", b);
  TORCH_CHECK(offsets.back() == total, op, ": argument '", name, "' must end at the packed length ",
              total, ", got ", offsets.back());
  return offsets;
}

/// Packed q (Tq, H, E), k (Tk, Hkv, E), v (Tk, Hkv, M) with Hkv dividing H,
/// and their offsets (one sequence count for both). Returns {cu_q, cu_k}
/// (both empty where they cannot be read: check_offsets).
inline std::pair<std::vector<int64_t>, std::vector<int64_t>> check_packed(
    const char* op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k) {
  check_float_tensor(op, "q", q, 3);
  check_float_tensor(op, "k", k, 3);
  check_float_tensor(op, "v", v, 3);
  check_same_dtype(op, "k", k, "q", q);
  check_same_dtype(op, "v", v, "q", q);
  const int64_t H = q.size(1), Hkv = k.size(1);
  TORCH_CHECK(Hkv == H || (Hkv > 0 && H % Hkv == 0), op, ": argument 'k' has head count ", Hkv,
              ", which must divide q's head count ", H, " (packed shapes (T, heads, features): ",
              shape_str(q), " and ", shape_str(k), ")");
  check_dim(op, "k", k, 2, q.size(2), "feature size E");
  check_dim(op, "v", v, 0, k.size(0), "packed key count Tk");
  check_dim(op, "v", v, 1, Hkv, "head count (k's)");
  TORCH_CHECK(q.size(2) > 0 && v.size(2) > 0, op, ": feature sizes E and M must be positive, got E = ",
              q.size(2), ", M = ", v.size(2));
  auto cu_q = check_offsets(op, "cu_seqlens_q", cu_seqlens_q, q.size(0));
  auto cu_k = check_offsets(op, "cu_seqlens_k", cu_seqlens_k, k.size(0));
  TORCH_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), op,
              ": 'cu_seqlens_q' and 'cu_seqlens_k' must describe "
              "as many sequences, got ",
              cu_seqlens_q.size(0) - 1, " and ", cu_seqlens_k.size(0) - 1);
  return {std::move(cu_q), std::move(cu_k)};
}

/// Rows begin .. end - 1 of a packed (T, H, X) tensor as the (1, H, end - begin, X)
/// batch of one sequence: a view, no copy.
inline torch::Tensor sequence_view(const torch::Tensor& packed, int64_t begin, int64_t end) {
  return packed.narrow(0, begin, end - begin).permute({1, 0, 2}).unsqueeze(0);
}

/// The inverse of sequence_view for a result: (1, H, Lb, X) to (Lb, H, X).
inline torch::Tensor packed_rows(const torch::Tensor& sequence) { return sequence.squeeze(0).permute({1, 0, 2}); }

/// Sequence b of a packed batch as the kernels see it: a batch of one.
struct PackedSequence {
  PackedSequence(const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k, std::size_t b)
      : q_begin(cu_q[b]), q_end(cu_q[b + 1]), k_begin(cu_k[b]), k_end(cu_k[b + 1]) {}
  /// Its rows of a packed (Tq, H, X) query-side tensor (q, out, dq, dout).
  torch::Tensor of(const torch::Tensor& packed) const { return sequence_view(packed, q_begin, q_end); }
  /// Its rows of a packed (Tk, Hkv, X) key-side tensor (k, v, dk, dv).
  torch::Tensor keys(const torch::Tensor& packed) const { return sequence_view(packed, k_begin, k_end); }
  /// Its (1, H, Lb) block of per-row statistics kept as H Tq floats, block b
  /// at H cu_q[b] (the kernels' contiguous (N, H, L) layout for N = 1):
  /// the exact kernel's lse, linear attention's den. Undefined stays undefined.
  torch::Tensor row_stats(const torch::Tensor& stats, int64_t H) const {
    if (!stats.defined()) return stats;
    return stats.narrow(0, H * q_begin, H * (q_end - q_begin)).view({1, H, q_end - q_begin});
  }
  int64_t q_begin, q_end, k_begin, k_end;
};

/// The composite of a packed op: `single` (an op on (1, H, L, E) batches) on
/// each sequence's views, the results packed again into (Tq, H, M).
template <typename Single>
torch::Tensor each_sequence(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const std::vector<int64_t>& cu_q, const std::vector<int64_t>& cu_k,
                            const Single& single) {
  std::vector<torch::Tensor> rows{q.new_empty({0, q.size(1), v.size(2)})};  // B = 0 too
  for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const PackedSequence s(cu_q, cu_k, b);
    rows.push_back(packed_rows(single(s.of(q), s.keys(k), s.keys(v))));
  }
  return torch::cat(rows, 0);
}

}  // namespace attnkit::detail
