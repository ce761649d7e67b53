// Edge-list validation (include/attnkit/ops.h: check_edge_list): the CSR
// invariants every consumer of an EdgeList relies on, each violation one clear
// error naming the caller. Shapes and dtypes always; the offsets' and
// columns' values when the tensors hold data (not a tracer's fake tensors).
#include <attnkit/ops.h>

#include "ops/checks.h"

namespace attnkit {

void check_edge_list(const EdgeList& edges, int64_t L, int64_t S, int64_t H, const char* op) {
  const auto& off = edges.offsets;
  const auto& col = edges.columns;
  TORCH_CHECK(off.defined() && col.defined(), op, ": argument 'edges' needs both 'offsets' and 'columns'");
  detail::check_strided(op, "edges.offsets", off);
  detail::check_strided(op, "edges.columns", col);
  TORCH_CHECK(off.device().is_cpu() && col.device().is_cpu(), op,
              ": edge list 'offsets' and 'columns' must be CPU tensors");
  TORCH_CHECK(off.scalar_type() == torch::kLong, op, ": edge list 'offsets' must be int64, got ",
              off.scalar_type());
  TORCH_CHECK(col.scalar_type() == torch::kLong, op, ": edge list 'columns' must be int64, got ",
              col.scalar_type());
  TORCH_CHECK(col.dim() == 1, op, ": edge list 'columns' must be 1-D, got shape ",
              detail::shape_str(col));
  TORCH_CHECK(off.dim() == 1 || off.dim() == 2, op,
              ": edge list 'offsets' must have shape (L+1) or (H, L+1), got ", detail::shape_str(off));
  TORCH_CHECK(off.size(-1) == L + 1, op, ": edge list 'offsets' must have L + 1 = ", L + 1,
              " entries per list for L = ", L, " queries, got shape ", detail::shape_str(off));
  if (off.dim() == 2)
    TORCH_CHECK(off.size(0) == H, op, ": per-head edge list 'offsets' must have H = ", H,
                " rows, got shape ", detail::shape_str(off));
  // The values are checked where they are there to read: a tracer's fake
  // tensors (torch.compile) have shapes only, and the kernel op that reads
  // them checks them again (ops/sparse_attention.cpp).
  if (!detail::has_data(off) || !detail::has_data(col)) return;
  const int64_t nnz = col.numel();
  auto o2 = off.contiguous().view({-1, L + 1});
  auto o = o2.accessor<int64_t, 2>();
  auto cc = col.contiguous();
  const int64_t* c = cc.data_ptr<int64_t>();
  if (off.dim() == 1) {
    TORCH_CHECK(o[0][0] == 0 && o[0][L] == nnz, op,
                ": edge list 'offsets' must start at 0 and end at the number of columns ", nnz,
                ", got ", o[0][0], " and ", o[0][L]);
  }
  for (int64_t h = 0; h < o2.size(0); ++h) {
    // The first offset of every list, checked on its own: with L = 0 the
    // loop below sees no pair, and a per-head list has no start-at-0 rule.
    TORCH_CHECK(0 <= o[h][0] && o[h][0] <= nnz, op, ": edge list 'offsets' must lie within [0, ",
                nnz, "], got offsets[", h, "][0] = ", o[h][0]);
    for (int64_t i = 0; i < L; ++i) {
      const int64_t begin = o[h][i], end = o[h][i + 1];
      TORCH_CHECK(0 <= begin && begin <= end && end <= nnz, op,
                  ": edge list 'offsets' must be non-decreasing within [0, ", nnz,
                  "], got offsets[", h, "][", i, ":", i + 2, "] = ", begin, ", ", end);
      if (begin == end) continue;
      // A row strictly increasing from >= 0 to < S has every column in
      // range: checked without a branch per edge (the kernel ops check each
      // list once per pass, so this runs at memory speed), and only a bad
      // row is looked at again to name its first bad entry.
      bool bad = c[begin] < 0 || c[end - 1] >= S;
      for (int64_t e = begin + 1; e < end; ++e) bad |= c[e] <= c[e - 1];
      if (!bad) continue;
      for (int64_t e = begin; e < end; ++e) {
        TORCH_CHECK(c[e] >= 0 && c[e] < S, op, ": edge list 'columns' entry ", e, " is ", c[e],
                    ", outside the key range [0, ", S, ")");
        TORCH_CHECK(e == begin || c[e] > c[e - 1], op,
                    ": edge list 'columns' must be strictly increasing within a row; row ", i,
                    " has ", c[e - 1], " then ", c[e]);
      }
    }
  }
}

}  // namespace attnkit
