// The block-mask ops behind python/attnkit/_block_mask.py, which holds a
// mask's tensors (include/attnkit/block_mask.h) and evaluates mask_mod
// functions over tensors itself: the block form of a chunk of rows,
// combining two masks, the dense form, the visited fraction, and the mask's
// checks. Registered at
// the bottom of this file.
#include <attnkit/block_mask.h>
#include <torch/library.h>

#include <string>
#include <tuple>

namespace attnkit {

namespace {

using MaskTensors = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;

/// A mask from the tensors Python holds, checked against itself.
BlockMask mask_of(const char* op, const torch::Tensor& kinds, const torch::Tensor& partial_index,
                  const torch::Tensor& bits, int64_t q_len, int64_t kv_len, int64_t q_block, int64_t kv_block) {
  BlockMask m{q_len, kv_len, q_block, kv_block, kinds, partial_index, bits};
  TORCH_CHECK(kinds.defined() && kinds.dim() == 4, op, ": the block mask's kinds must have 4 dimensions "
              "(B, H, query blocks, key blocks)");
  check_block_mask(op, m, m.batch(), m.heads(), q_len, kv_len);
  return m;
}

MaskTensors tensors_of(const BlockMask& m) { return {m.kinds, m.partial_index, m.bits}; }

MaskTensors blocks_op(const torch::Tensor& rows, int64_t q_block, int64_t kv_block, int64_t first_partial) {
  auto b = mask_blocks(rows, q_block, kv_block, first_partial);
  return {b.kinds, b.partial_index, b.bits};
}

MaskTensors combine_op(c10::string_view how, const torch::Tensor& a_kinds, const torch::Tensor& a_partial,
                       const torch::Tensor& a_bits, const torch::Tensor& b_kinds, const torch::Tensor& b_partial,
                       const torch::Tensor& b_bits, int64_t q_len, int64_t kv_len, int64_t q_block, int64_t kv_block) {
  constexpr const char* op = "_block_mask_combine";
  const auto a = mask_of(op, a_kinds, a_partial, a_bits, q_len, kv_len, q_block, kv_block);
  const auto b = mask_of(op, b_kinds, b_partial, b_bits, q_len, kv_len, q_block, kv_block);
  if (how == "and") return tensors_of(block_mask_and(a, b));
  TORCH_CHECK(how == "or", op, ": how must be 'and' or 'or', got '", std::string(how), "'");
  return tensors_of(block_mask_or(a, b));
}

torch::Tensor to_dense_op(const torch::Tensor& kinds, const torch::Tensor& partial_index, const torch::Tensor& bits,
                          int64_t q_len, int64_t kv_len, int64_t q_block, int64_t kv_block) {
  return mask_of("_block_mask_to_dense", kinds, partial_index, bits, q_len, kv_len, q_block, kv_block).to_dense();
}

double visited_fraction_op(const torch::Tensor& kinds, const torch::Tensor& partial_index, const torch::Tensor& bits,
                          int64_t q_len, int64_t kv_len, int64_t q_block, int64_t kv_block) {
  return mask_of("_block_mask_visited_fraction", kinds, partial_index, bits, q_len, kv_len, q_block, kv_block)
      .visited_fraction();
}

void check_op(const torch::Tensor& kinds, const torch::Tensor& partial_index, const torch::Tensor& bits,
              int64_t q_len, int64_t kv_len, int64_t q_block, int64_t kv_block) {
  mask_of("BlockMask", kinds, partial_index, bits, q_len, kv_len, q_block, kv_block);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def("_block_mask_blocks(Tensor rows, int q_block, int kv_block, int first_partial=0) "
        "-> (Tensor kinds, Tensor partial_index, Tensor bits)",
        &blocks_op);
  m.def("_block_mask_combine(str how, Tensor a_kinds, Tensor a_partial_index, Tensor a_bits, Tensor b_kinds, "
        "Tensor b_partial_index, Tensor b_bits, int q_len, int kv_len, int q_block, int kv_block) "
        "-> (Tensor kinds, Tensor partial_index, Tensor bits)",
        &combine_op);
  m.def("_block_mask_to_dense(Tensor kinds, Tensor partial_index, Tensor bits, int q_len, int kv_len, int q_block, "
        "int kv_block) -> Tensor",
        &to_dense_op);
  m.def("_block_mask_visited_fraction(Tensor kinds, Tensor partial_index, Tensor bits, int q_len, int kv_len, "
        "int q_block, int kv_block) -> float",
        &visited_fraction_op);
  m.def("_block_mask_check(Tensor kinds, Tensor partial_index, Tensor bits, int q_len, int kv_len, int q_block, "
        "int kv_block) -> ()",
        &check_op);
}

}  // namespace attnkit
