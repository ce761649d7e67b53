// Long on purpose: softmax_attention and varlen_attention share the
// validation, the kernels' parameters and autograd (a split waited for issue
// 47's one-file-per-op registration, now in place: this file registers both
// at its bottom).
//
// Op boundary of exact softmax attention: validation, the dispatch between
// the tiled kernels (float32; bfloat16 on AMX tiles, or through float32) and
// the composite reference (other dtypes), and the kernels' autograd. Registers
// its ops' schemas (softmax_attention, varlen_attention,
// attention_dropout_mask, alibi_slopes, and the kernel ops) at its bottom.
#include "kernels/softmax_attention.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/checks.h"
#include "kernels/dropout.h"
#include "kernels/softmax_attention_bf16.h"
#include "ops/autograd_util.h"
#include "ops/binding.h"
#include "ops/head_features.h"
#include "ops/kernel_op.h"
#include "ops/schema.h"
#include "ops/varlen.h"
#include "reference/reference.h"

namespace attnkit {

namespace {

constexpr const char* kSoftmaxOp = "softmax_attention";

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

void check_bias(const char* op, const torch::Tensor& bias, const torch::Tensor& q, int64_t S) {
  if (!bias.defined()) return;
  TORCH_CHECK(bias.device().is_cpu() && bias.is_floating_point(), op,
              ": argument 'bias' must be a floating CPU tensor, got ", bias.scalar_type(),
              " on ", bias.device());
  detail::check_same_dtype(op, "bias", bias, "q", q);
  const int64_t target[4] = {q.size(0), q.size(1), q.size(2), S};
  bool ok = bias.dim() <= 4;
  for (int64_t d = 0; ok && d < bias.dim(); ++d) {
    const int64_t size = bias.size(bias.dim() - 1 - d);
    ok = size == 1 || size == target[3 - d];
  }
  TORCH_CHECK(ok, op, ": argument 'bias' must broadcast to (N, H, L, S) = (", target[0], ", ",
              target[1], ", ", target[2], ", ", target[3], "), got shape ",
              detail::shape_str(bias));
}

void check_sinks(const char* op, const torch::Tensor& sinks, int64_t H) {
  if (!sinks.defined()) return;
  TORCH_CHECK(sinks.device().is_cpu() && sinks.is_floating_point() && sinks.dim() == 1 && sinks.size(0) == H, op,
              ": argument 'sinks' must be a floating CPU tensor of shape (H) = (", H, "), got ",
              detail::dtype_name(sinks.scalar_type()), " ", detail::shape_str(sinks), " on ", sinks.device());
}

void check_arguments(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const SoftmaxAttentionFuncOptions& options) {
  detail::check_qkv(kSoftmaxOp, q, k, v, /*grouped_heads=*/true);
  detail::check_scale(kSoftmaxOp, options.scale(), q.scalar_type());
  detail::check_lengths(kSoftmaxOp, "key_lengths", options.key_lengths(), q.size(0), k.size(2));
  check_bias(kSoftmaxOp, options.bias(), q, k.size(2));
  detail::check_alibi_slopes(kSoftmaxOp, options.alibi_slopes(), q.size(1));
  detail::check_rotary(kSoftmaxOp, "rotary_dim", options.rotary_dim(), "rotary_base", options.rotary_base(),
                       q.size(3));
  TORCH_CHECK(options.window() >= 0, kSoftmaxOp, ": option 'window' must be >= 0 (0: no window), got ",
              options.window());
  detail::check_dropout(kSoftmaxOp, options.dropout_p());
  if (options.block_mask())
    check_block_mask(kSoftmaxOp, *options.block_mask(), q.size(0), q.size(1), q.size(2), k.size(2));
  check_sinks(kSoftmaxOp, options.sinks(), q.size(1));
  TORCH_CHECK(std::isfinite(options.softcap()) && options.softcap() >= 0, kSoftmaxOp,
              ": option 'softcap' must be finite and >= 0 (0: none), got ", options.softcap());
}

/// What the kernel needs besides q, k, v (and the bias): constants of the
/// autograd graph. (Passed as one struct because Function::apply records the
/// device of every tensor argument, and key_lengths may be undefined.)
struct SoftmaxConstants {
  torch::Tensor key_lengths;  // undefined, or contiguous int64 (N)
  double scale;
  bool causal;
  torch::Tensor alibi_slopes;  // undefined, or contiguous float32 (H)
  int64_t rotary_dim;          // 0: no rotary positions
  double rotary_base;
  int64_t window;              // 0: no window
  double dropout_p;            // 0: no dropout
  int64_t dropout_seed;        // drawn (or given) once per call: the backward's mask is the forward's
  c10::optional<BlockMask> block_mask = c10::nullopt;  // checked against the problem
  double softcap = 0.0;                 // 0: none
  // A traced score modifier (kernels/common/score_program.h): its
  // instructions, int32 (n, 4) (op, a, b, c); their constants, float32 (n);
  // its captured tensors flattened into one float32 vector. Undefined: none.
  torch::Tensor score_code = {}, score_values = {}, score_tables = {};
};

/// c's numbers as saved_data (its tensors go through save_for_backward),
/// read back by saved_constants.
void save_constants(AutogradContext* ctx, const SoftmaxConstants& c) {
  ctx->saved_data["scale"] = c.scale;
  ctx->saved_data["causal"] = c.causal;
  ctx->saved_data["rotary_dim"] = c.rotary_dim;
  ctx->saved_data["rotary_base"] = c.rotary_base;
  ctx->saved_data["window"] = c.window;
  ctx->saved_data["dropout_p"] = c.dropout_p;
  ctx->saved_data["dropout_seed"] = c.dropout_seed;
  ctx->saved_data["softcap"] = c.softcap;
  ctx->saved_data["block_size"] = c.block_mask ? std::vector<int64_t>{c.block_mask->q_block, c.block_mask->kv_block}
                                               : std::vector<int64_t>{};
}

/// The block mask's tensors for save_for_backward (undefined without one).
std::vector<torch::Tensor> block_mask_tensors(const SoftmaxConstants& c) {
  if (!c.block_mask) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
  return {c.block_mask->kinds, c.block_mask->partial_index, c.block_mask->bits};
}

/// `mask` the saved block mask's tensors (block_mask_tensors), of a problem
/// of L queries and S keys.
SoftmaxConstants saved_constants(AutogradContext* ctx, const torch::Tensor& key_lengths,
                                 const torch::Tensor& alibi_slopes, const torch::Tensor* mask = nullptr,
                                 int64_t L = 0, int64_t S = 0) {
  const auto& d = ctx->saved_data;
  SoftmaxConstants c{key_lengths, d.at("scale").toDouble(), d.at("causal").toBool(), alibi_slopes,
                     d.at("rotary_dim").toInt(), d.at("rotary_base").toDouble(), d.at("window").toInt(),
                     d.at("dropout_p").toDouble(), d.at("dropout_seed").toInt()};
  c.softcap = d.at("softcap").toDouble();
  const auto block_size = d.at("block_size").toIntVector();
  if (mask && !block_size.empty())
    c.block_mask = BlockMask{L, S, block_size[0], block_size[1], mask[0], mask[1], mask[2]};
  return c;
}

/// The kernel reads strides, so views of q, k, v, out and a broadcast bias
/// cost no copy. `batch`: the dropout mask's batch index of q's entry 0 (a
/// packed batch's sequence).
kernels::SoftmaxAttentionParams make_params(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, const torch::Tensor& bias,
                                            const torch::Tensor& key_lengths, const SoftmaxConstants& c,
                                            const torch::Tensor& out, const torch::Tensor& lse,
                                            int64_t batch = 0) {
  kernels::SoftmaxAttentionParams p;
  detail::bind_qkv(p, q, k, v, out);
  p.kv_group = detail::kv_group(q, k);
  p.lse = lse.data_ptr<float>();
  p.scale = static_cast<float>(c.scale);
  p.causal = c.causal;
  p.key_lengths = key_lengths.defined() ? key_lengths.data_ptr<int64_t>() : nullptr;
  p.alibi_slopes = c.alibi_slopes.defined() ? c.alibi_slopes.data_ptr<float>() : nullptr;
  p.rotary_dim = c.rotary_dim;
  p.rotary_base = c.rotary_base;
  // A window no narrower than max(L, S) covers every key of every query
  // (|i + S - L - j| < max(L, S) always): no window, and the dense tiles.
  p.window = c.window >= std::max(p.L, p.S) ? 0 : c.window;
  p.dropout_p = c.dropout_p;
  p.dropout_seed = static_cast<uint64_t>(c.dropout_seed);
  p.dropout_batch_offset = batch;
  p.softcap = static_cast<float>(c.softcap);
  if (c.block_mask) {
    const BlockMask& m = *c.block_mask;
    p.block_mask.kinds = m.kinds.data_ptr<uint8_t>();
    p.block_mask.partial_index = m.partial_index.data_ptr<int32_t>();
    p.block_mask.bits = m.bits.data_ptr<uint8_t>();
    p.block_mask.batch = m.batch(), p.block_mask.heads = m.heads();
    p.block_mask.q_block = m.q_block, p.block_mask.kv_block = m.kv_block;
    p.block_mask.q_blocks = m.q_blocks(), p.block_mask.kv_blocks = m.kv_blocks();
  }
  if (bias.defined()) {
    // stride 0 on broadcast dimensions: no copy of a broadcast bias
    const auto full = bias.expand({p.N, p.H, p.L, p.S});
    p.bias = full.data_ptr<float>();
    detail::bind_strides(full, p.bias_stride);
  }
  return p;
}

/// The bfloat16 kernel's parameters (it takes key lengths, scale and causal
/// alone; the checks keep everything else away from it).
kernels::SoftmaxAttentionBf16Params bf16_params(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                const SoftmaxConstants& c, const torch::Tensor& out,
                                                const torch::Tensor& lse) {
  kernels::SoftmaxAttentionBf16Params p;
  detail::bind_qkv(p, q, k, v, out);
  p.lse = lse.data_ptr<float>();
  p.scale = static_cast<float>(c.scale);
  p.causal = c.causal;
  p.key_lengths = c.key_lengths.defined() ? c.key_lengths.data_ptr<int64_t>() : nullptr;
  return p;
}

/// Why bfloat16 inputs cannot take the AMX kernel; empty when they can.
std::string bf16_fallback_reason(const torch::Tensor& q, const torch::Tensor& k,
                                 const SoftmaxAttentionFuncOptions& options) {
  if (options.bias().defined()) return "a bias";
  if (options.alibi_slopes().defined()) return "ALiBi slopes";
  if (options.rotary_dim() > 0) return "rotary positions";
  if (options.window() > 0) return "a window";
  if (options.dropout_p() > 0) return "attention dropout";
  if (options.block_mask()) return "a block mask";
  if (options.sinks().defined()) return "attention sinks";
  if (options.softcap() > 0) return "soft-capping";
  if (k.size(1) != q.size(1)) return "grouped-query heads";
  if (kernels::bf16_float32_forced()) return "ATTNKIT_BF16_GEMM=float32";
  // The level is below amx when the CPU lacks AMX, when Linux did not grant
  // the tile state, or when ATTNKIT_MAX_ISA caps it (kernels/common/isa.h).
  if (!kernels::softmax_attention_bf16_available()) return "no AMX";
  return {};
}

// ---------------------------------------------------------------------------
// The kernels as ops of their own
//
// attnkit::_softmax_attention_forward and attnkit::_softmax_attention_backward
// run the tiled kernels (float32, or bfloat16 on AMX tiles): a CPU kernel
// each, and a Meta kernel that only makes the outputs. The autograd Function
// below reaches the kernels through these two ops and the dispatcher, never
// directly, so that a tracer (torch.compile's fake tensors, torch.export)
// meets ops whose outputs it can shape instead of code that reads data
// pointers: a compiled graph holds one call of each, forward and backward.
// Their arguments are softmax_attention's after its defaults are applied
// (the scale, the seed, float32 slopes). Python can call them too
// (torch.ops.attnkit._softmax_attention_forward), so their CPU kernels check
// everything again that the kernels rely on: a few microseconds.
// ---------------------------------------------------------------------------

// A block mask as op arguments: attnkit::BlockMask's three tensors and its
// block sizes (its grid is the problem's L x S), all or none given.
#define ATTNKIT_BLOCK_MASK_ARGUMENTS \
  "Tensor? block_kinds=None, Tensor? block_partial_index=None, Tensor? block_bits=None, int[] block_size=[128, 128]"
// A traced score modifier as op arguments (SoftmaxConstants::score_code).
#define ATTNKIT_SCORE_MOD_ARGUMENTS "Tensor? score_code=None, Tensor? score_values=None, Tensor? score_tables=None"

constexpr const char* kSoftmaxForwardOp = "_softmax_attention_forward";
constexpr const char* kSoftmaxBackwardOp = "_softmax_attention_backward";
constexpr const char* kSoftmaxForwardSchema =
    "_softmax_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor? key_lengths, "
    "Tensor? alibi_slopes, float scale, bool causal, int rotary_dim, float rotary_base, int window, "
    "float dropout_p, int dropout_seed, " ATTNKIT_BLOCK_MASK_ARGUMENTS ", Tensor? sinks=None, float softcap=0., "
    ATTNKIT_SCORE_MOD_ARGUMENTS ") -> (Tensor out, Tensor lse)";
constexpr const char* kSoftmaxBackwardSchema =
    "_softmax_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor? bias, Tensor? key_lengths, Tensor? alibi_slopes, float scale, bool causal, int rotary_dim, "
    "float rotary_base, int window, float dropout_p, int dropout_seed, bool bias_grad, "
    ATTNKIT_BLOCK_MASK_ARGUMENTS ", Tensor? sinks=None, Tensor? grad_lse=None, float softcap=0., "
    ATTNKIT_SCORE_MOD_ARGUMENTS ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias, Tensor dsinks, "
    "Tensor dscore_tables)";

using detail::OptionalTensor;
using SoftmaxForwardResult = std::tuple<torch::Tensor, torch::Tensor>;
using SoftmaxBackwardResult =
    std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>;
using SoftmaxForwardSignature = SoftmaxForwardResult(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                     const OptionalTensor&, const OptionalTensor&,
                                                     const OptionalTensor&, double, bool, int64_t, double, int64_t,
                                                     double, int64_t, const OptionalTensor&, const OptionalTensor&,
                                                     const OptionalTensor&, c10::IntArrayRef, const OptionalTensor&,
                                                     double, const OptionalTensor&, const OptionalTensor&,
                                                     const OptionalTensor&);
using SoftmaxBackwardSignature = SoftmaxBackwardResult(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                       const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                       const OptionalTensor&, const OptionalTensor&,
                                                       const OptionalTensor&, double, bool, int64_t, double, int64_t,
                                                       double, int64_t, bool, const OptionalTensor&,
                                                       const OptionalTensor&, const OptionalTensor&, c10::IntArrayRef,
                                                       const OptionalTensor&, const OptionalTensor&, double,
                                                       const OptionalTensor&, const OptionalTensor&,
                                                       const OptionalTensor&);

/// The block mask of op arguments (ATTNKIT_BLOCK_MASK_ARGUMENTS) over an
/// L x S grid: none when no tensor is given, refused when only some are.
c10::optional<BlockMask> block_mask_of(const char* op, const OptionalTensor& kinds, const OptionalTensor& partial_index,
                                       const OptionalTensor& bits, c10::IntArrayRef block_size, int64_t L,
                                       int64_t S) {
  const int given = kinds.has_value() + partial_index.has_value() + bits.has_value();
  if (given == 0) return c10::nullopt;
  TORCH_CHECK(given == 3, op, ": a block mask needs all of block_kinds, block_partial_index and block_bits, got ",
              given, " of them");
  TORCH_CHECK(block_size.size() == 2, op, ": argument 'block_size' must be (q_block, kv_block), got ",
              block_size.size(), " values");
  return BlockMask{L, S, block_size[0], block_size[1], *kinds, *partial_index, *bits};
}

SoftmaxConstants softmax_constants(const OptionalTensor& key_lengths, const OptionalTensor& alibi_slopes, double scale,
                                   bool causal, int64_t rotary_dim, double rotary_base, int64_t window,
                                   double dropout_p, int64_t dropout_seed,
                                   c10::optional<BlockMask> block_mask = c10::nullopt) {
  return {key_lengths.value_or(torch::Tensor()),
          scale,
          causal,
          alibi_slopes.value_or(torch::Tensor()),
          rotary_dim,
          rotary_base,
          window,
          dropout_p,
          dropout_seed,
          std::move(block_mask)};
}

/// The checks of softmax_attention on a kernel op's arguments, and what the
/// kernels assume besides: float32 (bias and slopes too), or bfloat16 with
/// nothing the AMX kernel does not take; contiguous key lengths.
void check_softmax_kernel_arguments(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& bias, const SoftmaxConstants& c,
                                    const torch::Tensor& sinks = {}) {
  const auto options = SoftmaxAttentionFuncOptions()
                           .scale(c.scale)
                           .causal(c.causal)
                           .key_lengths(c.key_lengths)
                           .bias(bias)
                           .alibi_slopes(c.alibi_slopes)
                           .rotary_dim(c.rotary_dim)
                           .rotary_base(c.rotary_base)
                           .window(c.window)
                           .dropout_p(c.dropout_p)
                           .block_mask(c.block_mask)
                           .sinks(sinks)
                           .softcap(c.softcap);
  check_arguments(q, k, v, options);
  TORCH_CHECK(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16, op,
              ": the kernels take float32 or bfloat16, got ", detail::dtype_name(q.scalar_type()));
  if (q.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(!c.score_code.defined(), op,
                ": bfloat16 inputs run on the AMX kernel, which cannot take a score modifier (pass float32)");
    const std::string why = bf16_fallback_reason(q, k, options);
    TORCH_CHECK(why.empty(), op, ": bfloat16 inputs run on the AMX kernel, which cannot take ", why,
                " (softmax_attention converts them to float32 then)");
  }
  TORCH_CHECK(
      !c.alibi_slopes.defined() || (c.alibi_slopes.scalar_type() == torch::kFloat && c.alibi_slopes.is_contiguous()),
      op, ": argument 'alibi_slopes' must be contiguous float32");
  TORCH_CHECK(!c.key_lengths.defined() || c.key_lengths.is_contiguous(), op,
              ": argument 'key_lengths' must be contiguous");
  TORCH_CHECK(!sinks.defined() || (sinks.scalar_type() == torch::kFloat && sinks.is_contiguous()), op,
              ": argument 'sinks' must be contiguous float32");
}

/// Arity of each opcode of kernels/common/score_program.h (how many of a, b,
/// c it reads), -1 for a number that is no opcode.
int score_op_arity(int32_t op) {
  using kernels::ScoreOp;
  switch (static_cast<ScoreOp>(op)) {
    case ScoreOp::kScore: case ScoreOp::kBatch: case ScoreOp::kHead: case ScoreOp::kQuery: case ScoreOp::kKey:
    case ScoreOp::kConst:
      return 0;
    case ScoreOp::kNeg: case ScoreOp::kAbs: case ScoreOp::kExp: case ScoreOp::kLog: case ScoreOp::kTanh:
    case ScoreOp::kSigmoid: case ScoreOp::kSqrt: case ScoreOp::kFloor: case ScoreOp::kCeil: case ScoreOp::kTrunc:
    case ScoreOp::kNot: case ScoreOp::kRound: case ScoreOp::kIndex: case ScoreOp::kGather:
      return 1;
    case ScoreOp::kAdd: case ScoreOp::kSub: case ScoreOp::kMul: case ScoreOp::kDiv: case ScoreOp::kFloorDiv:
    case ScoreOp::kMod: case ScoreOp::kPow: case ScoreOp::kMinimum: case ScoreOp::kMaximum: case ScoreOp::kClampMin:
    case ScoreOp::kClampMax: case ScoreOp::kLt: case ScoreOp::kLe: case ScoreOp::kGt: case ScoreOp::kGe:
    case ScoreOp::kEq: case ScoreOp::kNe: case ScoreOp::kAnd: case ScoreOp::kOr:
      return 2;
    case ScoreOp::kWhere:
      return 3;
  }
  return -1;
}

/// c's score modifier from the op arguments (all three or none; score_tables
/// may be left out when no instruction gathers), checked whole: the kernels
/// read every register and index they name without checking.
void set_score_mod(const char* op, SoftmaxConstants& c, const OptionalTensor& code, const OptionalTensor& values,
                   const OptionalTensor& tables) {
  if (!code && !values && !tables) return;
  TORCH_CHECK(code && values, op, ": a score modifier needs score_code and score_values (score_tables when it ",
              "reads captured tensors)");
  TORCH_CHECK(code->scalar_type() == torch::kInt && code->dim() == 2 && code->size(1) == 4 && code->size(0) >= 1 &&
                  code->is_contiguous(),
              op, ": argument 'score_code' must be contiguous int32 of shape (n, 4) with n >= 1, got ",
              detail::dtype_name(code->scalar_type()), " ", detail::shape_str(*code));
  const int64_t n = code->size(0);
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max() / 2, op, ": a score modifier of ", n,
              " instructions is too long");
  TORCH_CHECK(values->scalar_type() == torch::kFloat && values->dim() == 1 && values->size(0) == n &&
                  values->is_contiguous(),
              op, ": argument 'score_values' must be contiguous float32 of shape (", n, "), got ",
              detail::dtype_name(values->scalar_type()), " ", detail::shape_str(*values));
  TORCH_CHECK(!tables || (tables->scalar_type() == torch::kFloat && tables->dim() == 1 && tables->is_contiguous()),
              op, ": argument 'score_tables' must be a contiguous float32 vector, got ",
              tables ? detail::dtype_name(tables->scalar_type()) : "", " ", tables ? detail::shape_str(*tables) : "");
  const int32_t* ins = code->data_ptr<int32_t>();
  const float* value = values->data_ptr<float>();
  const int64_t numel = tables ? tables->numel() : 0;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t* in = ins + 4 * t;
    const int arity = score_op_arity(in[0]);
    TORCH_CHECK(arity >= 0, op, ": score_code instruction ", t, " has no opcode ", in[0],
                " (kernels/common/score_program.h)");
    for (int k = 0; k < 3; ++k)
      TORCH_CHECK(k < arity ? in[1 + k] >= 0 && in[1 + k] < t : in[1 + k] == -1, op, ": score_code instruction ", t,
                  " (opcode ", in[0], ") must read ", arity, " earlier registers and mark the rest -1, got (",
                  in[1], ", ", in[2], ", ", in[3], ")");
    if (in[0] == static_cast<int32_t>(kernels::ScoreOp::kIndex))
      TORCH_CHECK(value[t] >= 1.f && value[t] == std::floor(value[t]) && value[t] <= 16777216.f, op,
                  ": score_code instruction ", t, " indexes a dimension of ", value[t],
                  " entries; it must be a whole number in [1, 2^24]");
    if (in[0] == static_cast<int32_t>(kernels::ScoreOp::kGather))
      TORCH_CHECK(numel > 0 && numel <= 16777216, op, ": score_code instruction ", t,
                  " reads score_tables, which hold ", numel, " values (it must be 1 to 2^24)");
  }
  c.score_code = *code;
  c.score_values = *values;
  c.score_tables = tables ? *tables : torch::empty({0}, values->options());
}

/// A score modifier bound to a kernel's parameters for one call: its
/// instructions in the kernels' layout and the flag where they report an
/// index out of range, which check() turns into an error.
class ScoreModBinding {
 public:
  ScoreModBinding(const SoftmaxConstants& c, kernels::SoftmaxAttentionParams& p) {
    if (!c.score_code.defined()) return;
    const int64_t n = c.score_code.size(0);
    const int32_t* ins = c.score_code.data_ptr<int32_t>();
    const float* values = c.score_values.data_ptr<float>();
    code_.resize(static_cast<std::size_t>(n));
    for (int64_t t = 0; t < n; ++t)
      code_[t] = {ins[4 * t], ins[4 * t + 1], ins[4 * t + 2], ins[4 * t + 3], values[t]};
    p.score_mod.code = code_.data();
    p.score_mod.size = static_cast<int32_t>(n);
    p.score_mod.tables = c.score_tables.numel() > 0 ? c.score_tables.data_ptr<float>() : nullptr;
    p.score_mod.tables_numel = c.score_tables.numel();
    p.score_mod.error = &error_;
  }

  /// Raises when an instruction met an index out of range.
  void check(const char* op) const {
    const int32_t t = error_.load() - 1;
    if (t < 0) return;
    const kernels::ScoreInstr& in = code_[t];
    if (in.op == static_cast<int32_t>(kernels::ScoreOp::kIndex))
      TORCH_CHECK(false, op, ": the score modifier indexes a dimension of ", static_cast<int64_t>(in.value),
                  " entries out of range (instruction ", t, ")");
    TORCH_CHECK(false, op, ": the score modifier read outside its captured tensors (instruction ", t, ")");
  }

 private:
  std::vector<kernels::ScoreInstr> code_;
  std::atomic<int32_t> error_{0};
};

/// out (N, H, L, M) in q's dtype and the rows' log-sum-exp lse (N, H, L) in
/// float32, on q's device (meta tensors in the Meta kernel).
SoftmaxForwardResult softmax_forward_outputs(const torch::Tensor& q, const torch::Tensor& v) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
  return {torch::empty({N, H, L, M}, q.options()), torch::empty({N, H, L}, q.options().dtype(torch::kFloat))};
}

SoftmaxForwardResult softmax_forward_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         const OptionalTensor& bias, const OptionalTensor& key_lengths,
                                         const OptionalTensor& alibi_slopes, double scale, bool causal,
                                         int64_t rotary_dim, double rotary_base, int64_t window, double dropout_p,
                                         int64_t dropout_seed, const OptionalTensor& block_kinds,
                                         const OptionalTensor& block_partial_index, const OptionalTensor& block_bits,
                                         c10::IntArrayRef block_size, const OptionalTensor& sinks_given,
                                         double softcap, const OptionalTensor& score_code,
                                         const OptionalTensor& score_values, const OptionalTensor& score_tables) {
  auto c = softmax_constants(
      key_lengths, alibi_slopes, scale, causal, rotary_dim, rotary_base, window, dropout_p, dropout_seed,
      block_mask_of(kSoftmaxForwardOp, block_kinds, block_partial_index, block_bits, block_size, q.size(2), k.size(2)));
  c.softcap = softcap;
  set_score_mod(kSoftmaxForwardOp, c, score_code, score_values, score_tables);
  const auto b = bias.value_or(torch::Tensor());
  const auto sinks = sinks_given.value_or(torch::Tensor());
  check_softmax_kernel_arguments(kSoftmaxForwardOp, q, k, v, b, c, sinks);
  auto [out, lse] = softmax_forward_outputs(q, v);
  if (q.scalar_type() == torch::kBFloat16) {
    kernels::softmax_attention_forward_bf16(bf16_params(q, k, v, c, out, lse));
  } else {
    auto p = make_params(q, k, v, b, c.key_lengths, c, out, lse);
    if (sinks.defined()) p.sinks = sinks.data_ptr<float>();
    ScoreModBinding score_mod(c, p);
    kernels::softmax_attention_forward(p);
    score_mod.check(kSoftmaxForwardOp);
  }
  return {out, lse};
}

SoftmaxForwardResult softmax_forward_meta(const torch::Tensor& q, const torch::Tensor& /*k*/, const torch::Tensor& v,
                                          const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, double,
                                          bool, int64_t, double, int64_t, double, int64_t, const OptionalTensor&,
                                          const OptionalTensor&, const OptionalTensor&, c10::IntArrayRef,
                                          const OptionalTensor&, double, const OptionalTensor&, const OptionalTensor&,
                                          const OptionalTensor&) {
  return softmax_forward_outputs(q, v);
}

/// dq, dk, dv contiguous in the shapes of q, k, v, and dbias in the bias's
/// shape when asked for (bias_grad), dsinks in the sinks' and dscore_tables
/// in the score modifier's tables' when given; each else an empty (0) tensor.
SoftmaxBackwardResult softmax_backward_meta(const torch::Tensor& /*grad_out*/, const torch::Tensor& q,
                                            const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor&,
                                            const torch::Tensor&, const OptionalTensor& bias, const OptionalTensor&,
                                            const OptionalTensor&, double, bool, int64_t, double, int64_t, double,
                                            int64_t, bool bias_grad, const OptionalTensor&, const OptionalTensor&,
                                            const OptionalTensor&, c10::IntArrayRef, const OptionalTensor& sinks,
                                            const OptionalTensor&, double, const OptionalTensor&,
                                            const OptionalTensor&, const OptionalTensor& score_tables) {
  auto like = [](const torch::Tensor& x) { return torch::empty_like(x, torch::MemoryFormat::Contiguous); };
  return {like(q), like(k), like(v),
          bias_grad && bias ? torch::empty(bias->sizes(), bias->options()) : torch::empty({0}, q.options()),
          sinks ? torch::empty(sinks->sizes(), sinks->options()) : torch::empty({0}, q.options()),
          score_tables ? torch::empty(score_tables->sizes(), score_tables->options()) : torch::empty({0}, q.options())};
}

SoftmaxBackwardResult softmax_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& q,
                                           const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                           const torch::Tensor& lse, const OptionalTensor& bias_given,
                                           const OptionalTensor& key_lengths, const OptionalTensor& alibi_slopes,
                                           double scale, bool causal, int64_t rotary_dim, double rotary_base,
                                           int64_t window, double dropout_p, int64_t dropout_seed, bool bias_grad,
                                           const OptionalTensor& block_kinds, const OptionalTensor& block_partial_index,
                                           const OptionalTensor& block_bits, c10::IntArrayRef block_size,
                                           const OptionalTensor& sinks_given, const OptionalTensor& grad_lse_given,
                                           double softcap, const OptionalTensor& score_code,
                                           const OptionalTensor& score_values, const OptionalTensor& score_tables) {
  auto c = softmax_constants(
      key_lengths, alibi_slopes, scale, causal, rotary_dim, rotary_base, window, dropout_p, dropout_seed,
      block_mask_of(kSoftmaxBackwardOp, block_kinds, block_partial_index, block_bits, block_size, q.size(2), k.size(2)));
  c.softcap = softcap;
  set_score_mod(kSoftmaxBackwardOp, c, score_code, score_values, score_tables);
  const auto bias = bias_given.value_or(torch::Tensor());
  const auto sinks = sinks_given.value_or(torch::Tensor());
  const auto grad_lse = grad_lse_given.value_or(torch::Tensor());
  check_softmax_kernel_arguments(kSoftmaxBackwardOp, q, k, v, bias, c, sinks);
  const auto [N, H, L, M] = std::array<int64_t, 4>{q.size(0), q.size(1), q.size(2), v.size(3)};
  for (const auto& [name, t] : {std::pair<const char*, const torch::Tensor*>{"grad_out", &grad_out}, {"out", &out}}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->sizes() == torch::IntArrayRef({N, H, L, M}),
                kSoftmaxBackwardOp, ": argument '", name, "' must be ", detail::dtype_name(q.scalar_type()),
                " of shape (", N, ", ", H, ", ", L, ", ", M, "), got ", detail::dtype_name(t->scalar_type()), " ",
                detail::shape_str(*t));
  }
  TORCH_CHECK(lse.scalar_type() == torch::kFloat && lse.sizes() == torch::IntArrayRef({N, H, L}) && lse.is_contiguous(),
              kSoftmaxBackwardOp, ": argument 'lse' must be contiguous float32 of shape (", N, ", ", H, ", ", L,
              "), got ", detail::dtype_name(lse.scalar_type()), " ", detail::shape_str(lse));
  TORCH_CHECK(!bias_grad || bias.defined(), kSoftmaxBackwardOp, ": bias_grad=True needs a bias");
  TORCH_CHECK(!grad_lse.defined() || (grad_lse.scalar_type() == torch::kFloat &&
                                      grad_lse.sizes() == torch::IntArrayRef({N, H, L}) && grad_lse.is_contiguous()),
              kSoftmaxBackwardOp, ": argument 'grad_lse' must be contiguous float32 of shape (", N, ", ", H, ", ", L,
              "), got ", detail::dtype_name(grad_lse.scalar_type()), " ", detail::shape_str(grad_lse));
  if (q.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(!grad_lse.defined(), kSoftmaxBackwardOp,
                ": the bfloat16 kernel takes no gradient of lse (softmax_attention_with_lse converts bfloat16 "
                "inputs to float32)");
    kernels::SoftmaxAttentionBf16BackwardParams p;
    static_cast<kernels::SoftmaxAttentionBf16Params&>(p) = bf16_params(q, k, v, c, out, lse);
    auto [dq, dk, dv] = detail::bind_qkv_grads(p, q, k, v, grad_out);
    kernels::softmax_attention_backward_bf16(p);
    return {dq, dk, dv, torch::empty({0}, q.options()), torch::empty({0}, q.options()),
            torch::empty({0}, q.options())};
  }
  kernels::SoftmaxAttentionBackwardParams p;
  static_cast<kernels::SoftmaxAttentionParams&>(p) = make_params(q, k, v, bias, c.key_lengths, c, out, lse);
  // Grouped-query heads: the kernel writes each query head's share of dk
  // and dv (kernels/softmax_attention.h), summed over each group below.
  auto [dq, dk, dv] = detail::bind_qkv_grads(p, q, k, v, grad_out, /*per_query_head=*/p.kv_group > 1);
  // dbias in the bias's own shape, left-padded to 4 dimensions: the kernel
  // sums over the dimensions it broadcasts, so nothing of size N H L S is made.
  torch::Tensor dbias = torch::empty({0}, q.options());
  if (bias_grad) {
    std::vector<int64_t> shape(4 - bias.dim(), 1);
    for (int64_t d = 0; d < bias.dim(); ++d) shape.push_back(bias.size(d));
    dbias = torch::empty(shape, bias.options());
    p.dbias = dbias.data_ptr<float>();
    std::copy(shape.begin(), shape.end(), p.dbias_shape);
  }
  torch::Tensor dsinks = torch::empty({sinks.defined() ? H : 0}, q.options());
  if (sinks.defined()) p.sinks = sinks.data_ptr<float>(), p.dsinks = dsinks.data_ptr<float>();
  if (grad_lse.defined()) p.dlse = grad_lse.data_ptr<float>();
  torch::Tensor dscore_tables = torch::empty({c.score_tables.defined() ? c.score_tables.numel() : 0}, q.options());
  ScoreModBinding score_mod(c, p);
  if (c.score_tables.defined()) p.dscore_tables = dscore_tables.data_ptr<float>();
  kernels::softmax_attention_backward(p);
  score_mod.check(kSoftmaxBackwardOp);
  if (p.kv_group > 1) {
    dk = detail::sum_over_groups(dk, p.kv_group);
    dv = detail::sum_over_groups(dv, p.kv_group);
  }
  return {dq, dk, dv, bias_grad ? dbias.view(bias.sizes()) : dbias, dsinks, dscore_tables};
}

/// The block sizes argument of the kernel ops (the schema's default without a mask).
std::vector<int64_t> block_size_of(const SoftmaxConstants& c) {
  if (!c.block_mask) return {128, 128};
  return {c.block_mask->q_block, c.block_mask->kv_block};
}

/// The two ops through the dispatcher (their handles found once).
SoftmaxForwardResult call_softmax_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& bias, const torch::Tensor& sinks,
                                          const SoftmaxConstants& c) {
  static const auto op = detail::kernel_op<SoftmaxForwardSignature>("attnkit::_softmax_attention_forward");
  const auto mask = block_mask_tensors(c);
  return op.call(q, k, v, detail::as_optional(bias), detail::as_optional(c.key_lengths),
                 detail::as_optional(c.alibi_slopes), c.scale, c.causal, c.rotary_dim, c.rotary_base, c.window,
                 c.dropout_p, c.dropout_seed, detail::as_optional(mask[0]), detail::as_optional(mask[1]),
                 detail::as_optional(mask[2]), block_size_of(c), detail::as_optional(sinks), c.softcap,
                 detail::as_optional(c.score_code), detail::as_optional(c.score_values),
                 detail::as_optional(c.score_tables));
}

SoftmaxBackwardResult call_softmax_backward(const torch::Tensor& grad_out, const torch::Tensor& q,
                                            const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                                            const torch::Tensor& lse, const torch::Tensor& bias,
                                            const torch::Tensor& sinks, const torch::Tensor& grad_lse,
                                            const SoftmaxConstants& c, bool bias_grad) {
  static const auto op = detail::kernel_op<SoftmaxBackwardSignature>("attnkit::_softmax_attention_backward");
  const auto mask = block_mask_tensors(c);
  return op.call(grad_out, q, k, v, out, lse, detail::as_optional(bias), detail::as_optional(c.key_lengths),
                 detail::as_optional(c.alibi_slopes), c.scale, c.causal, c.rotary_dim, c.rotary_base, c.window,
                 c.dropout_p, c.dropout_seed, bias_grad, detail::as_optional(mask[0]), detail::as_optional(mask[1]),
                 detail::as_optional(mask[2]), block_size_of(c), detail::as_optional(sinks),
                 detail::as_optional(grad_lse), c.softcap, detail::as_optional(c.score_code),
                 detail::as_optional(c.score_values), detail::as_optional(c.score_tables));
}

/// Exact attention by the tiled kernels, through the two ops above: out and
/// lse, both differentiable. bias and sinks are arguments of apply so that
/// autograd can give them a gradient; apply takes no undefined tensor, so a
/// missing one is passed as absent() (run() does both).
class SoftmaxAttentionFunction : public torch::autograd::Function<SoftmaxAttentionFunction> {
 public:
  /// out and lse; bias and sinks may be undefined.
  static tensor_list run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& bias, const torch::Tensor& sinks, const SoftmaxConstants& c) {
    return apply(q, k, v, bias.defined() ? bias : absent(), sinks.defined() ? sinks : absent(), bias.defined(),
                 sinks.defined(), c);
  }

  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v, const torch::Tensor& bias_or_absent,
                             const torch::Tensor& sinks_or_absent, bool has_bias, bool has_sinks,
                             const SoftmaxConstants& c) {
    const auto bias = has_bias ? bias_or_absent : torch::Tensor();
    const auto sinks = has_sinks ? sinks_or_absent : torch::Tensor();
    auto [out, lse] = call_softmax_forward(q, k, v, bias, sinks, c);
    const auto mask = block_mask_tensors(c);
    ctx->save_for_backward(
        {q, k, v, out, lse, bias, c.key_lengths, c.alibi_slopes, mask[0], mask[1], mask[2], sinks});
    save_constants(ctx, c);
    return {out, lse};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    // Saved with version checks: an in-place change of any of them between
    // forward and backward raises instead of changing the gradients.
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const auto &bias = saved[5], &key_lengths = saved[6], &sinks = saved[11];
    const SoftmaxConstants c = saved_constants(ctx, key_lengths, saved[7], &saved[8], q.size(2), k.size(2));
    const bool bias_grad = bias.defined() && ctx->needs_input_grad(3);
    // A loss that reads lse alone leaves out's gradient undefined: zeros.
    const auto grad_out = grads[0].defined() ? grads[0] : torch::zeros_like(out);
    const auto grad_lse = grads[1].defined() ? grads[1].contiguous() : torch::Tensor();
    // (c has no score modifier here: this Function does not take one.)
    auto [dq, dk, dv, dbias, dsinks, dscore_tables] =
        call_softmax_backward(grad_out, q, k, v, out, lse, bias, sinks, grad_lse, c, bias_grad);
    tensor_list result = {dq, dk, dv, bias_grad ? dbias : torch::Tensor(),
                          sinks.defined() && ctx->needs_input_grad(4) ? dsinks : torch::Tensor(),
                          torch::Tensor(), torch::Tensor(), torch::Tensor()};  // the flags and constants
    if (q.scalar_type() != torch::kBFloat16)
      return detail::once_differentiable(kSoftmaxOp, std::move(result), {q, k, v, bias, sinks, grad_out});
    return detail::once_differentiable(
        kSoftmaxOp, std::move(result), {q, k, v, grad_out},
        "double backward (the gradient of a gradient) is not supported by the bfloat16 kernel; "
        "use float64 inputs, which take the differentiable composite path");
  }

 private:
  static torch::Tensor absent() { return torch::empty({0}); }
};

// ---------------------------------------------------------------------------
// Packed batches (varlen_attention): their kernels as ops of their own too,
// attnkit::_varlen_attention_forward and _varlen_attention_backward. The
// offsets are tensor arguments, read in the CPU kernels (a tracer has none to
// read: the Meta kernels need only the packed lengths).
// ---------------------------------------------------------------------------

constexpr const char* kVarlenOp = "varlen_attention";
constexpr const char* kVarlenForwardOp = "_varlen_attention_forward";
constexpr const char* kVarlenBackwardOp = "_varlen_attention_backward";
using VarlenForwardSignature = SoftmaxForwardResult(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                    const torch::Tensor&, const torch::Tensor&, const OptionalTensor&,
                                                    double, bool, int64_t, double, int64_t, double, int64_t);
using VarlenBackwardResult = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
using VarlenBackwardSignature = VarlenBackwardResult(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                     const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                     const torch::Tensor&, const torch::Tensor&, const OptionalTensor&,
                                                     double, bool, int64_t, double, int64_t, double, int64_t);

/// varlen_attention's checks: the packed tensors and offsets (whose values
/// are read where they can be: detail::check_packed), and the options a packed
/// batch takes. Returns the offsets (empty when not read).
std::pair<std::vector<int64_t>, std::vector<int64_t>> check_varlen_arguments(
    const char* op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k, const SoftmaxAttentionFuncOptions& o) {
  auto offsets = detail::check_packed(op, q, k, v, cu_seqlens_q, cu_seqlens_k);
  TORCH_CHECK(!o.key_lengths().defined(), op,
              ": option 'key_lengths' is not taken: 'cu_seqlens_k' gives each sequence its keys");
  TORCH_CHECK(!o.bias().defined(), op,
              ": option 'bias' is not taken (a bias has no packed layout); for a bias, pad the batch "
              "and call softmax_attention");
  TORCH_CHECK(!o.sinks().defined() && o.softcap() == 0, op,
              ": options 'sinks' and 'softcap' are not taken by packed batches; pad the batch and call "
              "softmax_attention");
  TORCH_CHECK(!o.block_mask(), op,
              ": option 'block_mask' is not taken (its grid is one sequence's); for packed documents, give "
              "softmax_attention the packed sequence as one batch entry and the block mask of "
              "masks::documents(cu_seqlens), which may be combined with any other block mask");
  detail::check_scale(op, o.scale(), q.scalar_type());
  detail::check_alibi_slopes(op, o.alibi_slopes(), q.size(1));
  detail::check_rotary(op, "rotary_dim", o.rotary_dim(), "rotary_base", o.rotary_base(), q.size(2));
  TORCH_CHECK(o.window() >= 0, op, ": option 'window' must be >= 0 (0: no window), got ", o.window());
  detail::check_dropout(op, o.dropout_p());
  return offsets;
}

/// The offsets of a kernel op's arguments, checked (with the rest) as
/// varlen_attention checks them, and what the kernel assumes besides.
std::pair<std::vector<int64_t>, std::vector<int64_t>> check_varlen_kernel_arguments(
    const char* op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k, const SoftmaxConstants& c) {
  auto offsets = check_varlen_arguments(op, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                        SoftmaxAttentionFuncOptions()
                                            .scale(c.scale)
                                            .alibi_slopes(c.alibi_slopes)
                                            .rotary_dim(c.rotary_dim)
                                            .rotary_base(c.rotary_base)
                                            .window(c.window)
                                            .dropout_p(c.dropout_p));
  TORCH_CHECK(q.scalar_type() == torch::kFloat, op, ": the kernel takes float32, got ",
              detail::dtype_name(q.scalar_type()));
  TORCH_CHECK(
      !c.alibi_slopes.defined() || (c.alibi_slopes.scalar_type() == torch::kFloat && c.alibi_slopes.is_contiguous()),
      op, ": argument 'alibi_slopes' must be contiguous float32");
  return offsets;
}

/// out (Tq, H, M) and lse (H Tq) floats, sequence b's (H, Lb) block at
/// H cu_q[b]: the kernel's contiguous (1, H, Lb) layout.
SoftmaxForwardResult varlen_forward_outputs(const torch::Tensor& q, const torch::Tensor& v) {
  return {torch::empty({q.size(0), q.size(1), v.size(2)}, q.options()),
          torch::empty({q.size(1) * q.size(0)}, q.options().dtype(torch::kFloat))};
}

/// Exact attention over a packed batch: one kernel call per sequence over
/// views of the packed tensors (no copy), so that each sequence's tiles, key
/// splits and thread schedule are those of the sequence alone and its values
/// and gradients are bitwise the op's on it.
SoftmaxForwardResult varlen_forward_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                        const OptionalTensor& alibi_slopes, double scale, bool causal,
                                        int64_t rotary_dim, double rotary_base, int64_t window, double dropout_p,
                                        int64_t dropout_seed) {
  const auto c =
      softmax_constants({}, alibi_slopes, scale, causal, rotary_dim, rotary_base, window, dropout_p, dropout_seed);
  const auto [cu_q, cu_k] = check_varlen_kernel_arguments(kVarlenForwardOp, q, k, v, cu_seqlens_q, cu_seqlens_k, c);
  TORCH_INTERNAL_ASSERT(!cu_q.empty(), "a CPU kernel read no offsets");
  // q, k, v are read and out is written in place, in the packed layout.
  auto [out, lse] = varlen_forward_outputs(q, v);
  for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const detail::PackedSequence s(cu_q, cu_k, b);
    kernels::softmax_attention_forward(make_params(s.of(q), s.keys(k), s.keys(v), {}, {}, c, s.of(out),
                                                   s.row_stats(lse, q.size(1)), static_cast<int64_t>(b)));
  }
  return {out, lse};
}

SoftmaxForwardResult varlen_forward_meta(const torch::Tensor& q, const torch::Tensor&, const torch::Tensor& v,
                                         const torch::Tensor&, const torch::Tensor&, const OptionalTensor&, double,
                                         bool, int64_t, double, int64_t, double, int64_t) {
  return varlen_forward_outputs(q, v);
}

/// dq contiguous in q's shape; dk and dv in k's and v's shapes: contiguous,
/// or with grouped-query heads the (Tk, Hkv, X) view of a contiguous
/// (Hkv, Tk, X) sum (how the group sum below leaves them).
VarlenBackwardResult varlen_gradients_meta(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const bool grouped = detail::kv_group(q, k) > 1;
  auto like = [&](const torch::Tensor& x) {
    return grouped ? torch::empty({x.size(1), x.size(0), x.size(2)}, x.options()).permute({1, 0, 2})
                   : torch::empty_like(x, torch::MemoryFormat::Contiguous);
  };
  return {torch::empty_like(q, torch::MemoryFormat::Contiguous), like(k), like(v)};
}

VarlenBackwardResult varlen_backward_meta(const torch::Tensor&, const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v, const torch::Tensor&, const torch::Tensor&,
                                          const torch::Tensor&, const torch::Tensor&, const OptionalTensor&, double,
                                          bool, int64_t, double, int64_t, double, int64_t) {
  return varlen_gradients_meta(q, k, v);
}

VarlenBackwardResult varlen_backward_cpu(const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                         const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                         const OptionalTensor& alibi_slopes, double scale, bool causal,
                                         int64_t rotary_dim, double rotary_base, int64_t window, double dropout_p,
                                         int64_t dropout_seed) {
  const auto c =
      softmax_constants({}, alibi_slopes, scale, causal, rotary_dim, rotary_base, window, dropout_p, dropout_seed);
  const auto [cu_q, cu_k] = check_varlen_kernel_arguments(kVarlenBackwardOp, q, k, v, cu_seqlens_q, cu_seqlens_k, c);
  TORCH_INTERNAL_ASSERT(!cu_q.empty(), "a CPU kernel read no offsets");
  const int64_t T = q.size(0), H = q.size(1), M = v.size(2);
  for (const auto& [name, t] : {std::pair<const char*, const torch::Tensor*>{"grad_out", &grad_out}, {"out", &out}}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->sizes() == torch::IntArrayRef({T, H, M}), kVarlenBackwardOp,
                ": argument '", name, "' must be float32 of shape (", T, ", ", H, ", ", M, "), got ",
                detail::dtype_name(t->scalar_type()), " ", detail::shape_str(*t));
  }
  TORCH_CHECK(lse.scalar_type() == torch::kFloat && lse.sizes() == torch::IntArrayRef({H * T}) && lse.is_contiguous(),
              kVarlenBackwardOp, ": argument 'lse' must be contiguous float32 of shape (", H * T, "), got ",
              detail::dtype_name(lse.scalar_type()), " ", detail::shape_str(lse));
  // Grouped-query heads: the kernel writes each query head's share of dk
  // and dv (kernels/softmax_attention.h), summed over each group below.
  // Everything is read and written in place, in the packed layout (the
  // kernel copies each head whose rows are not adjacent).
  const int64_t group = detail::kv_group(q, k);  // dimension 1: heads, packed too
  auto dq = torch::empty_like(q, torch::MemoryFormat::Contiguous);
  auto dk = torch::empty({k.size(0), group > 1 ? H : k.size(1), k.size(2)}, k.options());
  auto dv = torch::empty({v.size(0), group > 1 ? H : v.size(1), v.size(2)}, v.options());
  for (std::size_t b = 0; b + 1 < cu_q.size(); ++b) {
    const detail::PackedSequence s(cu_q, cu_k, b);
    kernels::SoftmaxAttentionBackwardParams p;
    static_cast<kernels::SoftmaxAttentionParams&>(p) =
        make_params(s.of(q), s.keys(k), s.keys(v), {}, {}, c, s.of(out), s.row_stats(lse, H), static_cast<int64_t>(b));
    detail::bind(p.dout, p.dout_stride, s.of(grad_out));
    detail::bind(p.dq, p.dq_stride, s.of(dq));
    detail::bind(p.dk, p.dk_stride, s.keys(dk));
    detail::bind(p.dv, p.dv_stride, s.keys(dv));
    kernels::softmax_attention_backward(p);
  }
  if (group > 1) {  // as the op on one sequence sums them: bitwise the same
    dk = detail::packed_rows(detail::sum_over_groups(detail::sequence_view(dk, 0, dk.size(0)), group));
    dv = detail::packed_rows(detail::sum_over_groups(detail::sequence_view(dv, 0, dv.size(0)), group));
  }
  return {dq, dk, dv};
}

/// Exact attention over a packed batch by the kernel ops above.
class VarlenSoftmaxFunction : public torch::autograd::Function<VarlenSoftmaxFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& cu_seqlens_q,
                               const torch::Tensor& cu_seqlens_k, const SoftmaxConstants& c) {
    static const auto op = detail::kernel_op<VarlenForwardSignature>("attnkit::_varlen_attention_forward");
    auto [out, lse] = op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, detail::as_optional(c.alibi_slopes), c.scale,
                              c.causal, c.rotary_dim, c.rotary_base, c.window, c.dropout_p, c.dropout_seed);
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, c.alibi_slopes});
    save_constants(ctx, c);
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    static const auto op = detail::kernel_op<VarlenBackwardSignature>("attnkit::_varlen_attention_backward");
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const SoftmaxConstants c = saved_constants(ctx, torch::Tensor(), saved[7]);
    auto [dq, dk, dv] = op.call(grads[0], q, k, v, out, lse, saved[5], saved[6], detail::as_optional(c.alibi_slopes),
                                c.scale, c.causal, c.rotary_dim, c.rotary_base, c.window, c.dropout_p, c.dropout_seed);
    return detail::once_differentiable(kVarlenOp, {dq, dk, dv, torch::Tensor(), torch::Tensor(), torch::Tensor()},
                                       {q, k, v, grads[0]});
  }
};

/// The options with dropout's seed set: as given, or drawn from torch's
/// default CPU generator when dropout is on and none was given (only then,
/// so that calls without dropout leave the generator's stream alone).
/// A tracer (torch.compile, torch.export) would draw the seed once, while
/// tracing, and bake it into the graph: every call would drop the same
/// entries. There the seed must be an input.
SoftmaxAttentionFuncOptions with_dropout_seed(const char* op, const torch::Tensor& q,
                                              SoftmaxAttentionFuncOptions options) {
  if (options.dropout_p() > 0 && !options.dropout_seed()) {
    TORCH_CHECK(detail::has_data(q), op,
                ": attention dropout under torch.compile or torch.export (on tensors without data, or of a "
                "tensor subclass) needs an explicit dropout_seed (a seed drawn while tracing would be the same "
                "in every call of the compiled graph)");
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    options.dropout_seed(static_cast<int64_t>(generator.get<at::CPUGeneratorImpl>()->random64()));
  }
  return options;
}

}  // namespace

torch::Tensor attention_dropout_mask(int64_t N, int64_t H, int64_t L, int64_t S, double dropout_p, int64_t seed) {
  constexpr const char* op = "attention_dropout_mask";
  TORCH_CHECK(N >= 0 && H >= 0 && L >= 0 && S >= 0, op, ": sizes must be >= 0, got (N, H, L, S) = (", N, ", ", H,
              ", ", L, ", ", S, ")");
  detail::check_dropout(op, dropout_p);
  auto keep = torch::empty({N, H, L, S}, torch::kBool);
  kernels::DropoutMaskParams p;
  p.N = N, p.H = H, p.L = L, p.S = S;
  p.p = dropout_p;
  p.seed = static_cast<uint64_t>(seed);
  p.keep = reinterpret_cast<uint8_t*>(keep.data_ptr<bool>());
  kernels::attention_dropout_mask(p);
  return keep;
}

torch::Tensor alibi_slopes(int64_t heads) {
  TORCH_CHECK(heads >= 1, "alibi_slopes: heads must be >= 1, got ", heads);
  // The largest power of two p <= heads takes 2^(-8 h / p), h = 1..p; the
  // remaining heads - p take every other slope of 2p heads: 2^(-4 (2h - 1) / p).
  // In float64, rounded once to float32; made by tensor ops rather than from
  // host data, so that a tracer (torch.compile, torch.export) can follow it.
  int64_t p = 1;
  while (2 * p <= heads) p *= 2;
  const auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  auto exponents = torch::arange(1, p + 1, f64).mul(-8.0).div(static_cast<double>(p));
  if (heads > p) {
    const auto h = torch::arange(1, heads - p + 1, f64);
    exponents = torch::cat({exponents, h.mul(2.0).sub(1.0).mul(-4.0).div(static_cast<double>(p))});
  }
  return torch::exp2(exponents).to(torch::kFloat);
}

Dispatch softmax_attention_dispatch(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const SoftmaxAttentionFuncOptions& options) {
  check_arguments(q, k, v, options);
  // check_qkv and check_bias made q, k, v and the bias one floating dtype.
  if (q.scalar_type() == torch::kBFloat16) {
    const std::string why = bf16_fallback_reason(q, k, options);
    if (why.empty()) return Dispatch::kernel("bf16 on AMX tiles");
    return Dispatch::kernel("bf16 converted to float32 (" + why + ")");
  }
  if (q.scalar_type() != torch::kFloat)
    return Dispatch::composite("q, k and v are " + detail::dtype_name(q.scalar_type()) +
                               "; the kernels are float32 and bfloat16 only (convert them, and "
                               "the bias, to float32 to take the float32 kernel)");
  return Dispatch::kernel();
}

namespace {

/// The sinks as the kernel reads them (float32, contiguous; autograd converts
/// their gradient back), or undefined.
torch::Tensor float_sinks(const SoftmaxAttentionFuncOptions& options) {
  const auto& sinks = options.sinks();
  return sinks.defined() ? sinks.to(torch::kFloat).contiguous() : sinks;
}

/// The kernel's constants of validated options (with dropout's seed set).
SoftmaxConstants kernel_constants(const torch::Tensor& q, const SoftmaxAttentionFuncOptions& options) {
  auto key_lengths = options.key_lengths();
  if (key_lengths.defined()) key_lengths = key_lengths.contiguous();
  auto slopes = options.alibi_slopes();
  if (slopes.defined()) slopes = slopes.to(torch::kFloat).contiguous();
  return {key_lengths, detail::scale_or_default(options.scale(), q.size(3)), options.causal(), slopes,
          options.rotary_dim(), options.rotary_base(), options.window(), options.dropout_p(),
          options.dropout_seed().value_or(0), options.block_mask(), options.softcap()};
}

}  // namespace

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const SoftmaxAttentionFuncOptions& given) {
  // Validated (by the dispatch) before dropout's seed is drawn: a refused
  // call leaves torch's generator as it was.
  const bool kernel = softmax_attention_dispatch(q, k, v, given).uses_kernel();
  const SoftmaxAttentionFuncOptions options = with_dropout_seed(kSoftmaxOp, q, given);
  if (!kernel) return reference::softmax_attention(q, k, v, options);
  const SoftmaxConstants c = kernel_constants(q, options);
  if (q.scalar_type() == torch::kBFloat16) {
    if (bf16_fallback_reason(q, k, options).empty())
      return SoftmaxAttentionFunction::run(q, k, v, torch::Tensor(), torch::Tensor(), c)[0];
    // The float32 kernel on converted inputs; autograd converts the gradients back.
    auto converted = options;
    converted.scale(c.scale);
    if (options.bias().defined()) converted.bias(options.bias().to(torch::kFloat));
    return softmax_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), converted)
        .to(torch::kBFloat16);
  }
  return SoftmaxAttentionFunction::run(q, k, v, options.bias(), float_sinks(options), c)[0];
}

std::tuple<torch::Tensor, torch::Tensor> softmax_attention_with_lse(const torch::Tensor& q, const torch::Tensor& k,
                                                                    const torch::Tensor& v,
                                                                    const SoftmaxAttentionFuncOptions& given) {
  const bool kernel = softmax_attention_dispatch(q, k, v, given).uses_kernel();
  const SoftmaxAttentionFuncOptions options = with_dropout_seed(kSoftmaxOp, q, given);
  if (!kernel) {
    torch::Tensor lse;
    auto out = reference::softmax_attention(q, k, v, options, nullptr, 0, &lse);
    return {out, lse};
  }
  if (q.scalar_type() == torch::kBFloat16) {  // the float32 kernel: lse keeps float32
    auto converted = options;
    converted.scale(detail::scale_or_default(options.scale(), q.size(3)));
    if (options.bias().defined()) converted.bias(options.bias().to(torch::kFloat));
    auto [out, lse] =
        softmax_attention_with_lse(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), converted);
    return {out.to(torch::kBFloat16), lse};
  }
  auto result = SoftmaxAttentionFunction::run(q, k, v, options.bias(), float_sinks(options),
                                              kernel_constants(q, options));
  return {result[0], result[1]};
}

std::tuple<torch::Tensor, torch::Tensor> merge_attention(const std::vector<torch::Tensor>& outputs,
                                                         const std::vector<torch::Tensor>& lses) {
  constexpr const char* op = "merge_attention";
  TORCH_CHECK(!outputs.empty() && outputs.size() == lses.size(), op,
              ": give one lse per output and at least one of each, got ", outputs.size(), " outputs and ",
              lses.size(), " lses");
  for (size_t t = 0; t < outputs.size(); ++t) {
    TORCH_CHECK(outputs[t].dim() == 4 && outputs[t].sizes() == outputs[0].sizes(), op, ": outputs[", t,
                "] must be (N, H, L, M) as outputs[0] ", detail::shape_str(outputs[0]), ", got ",
                detail::shape_str(outputs[t]));
    TORCH_CHECK(lses[t].sizes() == outputs[0].sizes().slice(0, 3), op, ": lses[", t, "] must be (N, H, L) = ",
                detail::shape_str(outputs[0].narrow(3, 0, 0).squeeze(3)), ", got ", detail::shape_str(lses[t]));
    TORCH_CHECK(outputs[t].is_floating_point() && lses[t].is_floating_point(), op,
                ": outputs and lses must be floating, got ", outputs[t].scalar_type(), " and ", lses[t].scalar_type());
  }
  // lse = log sum_t exp(lse_t), by the largest one: rows no part sees keep
  // -inf and weights of 0 (never NaN: -inf - -inf is replaced by -inf).
  const auto stacked = torch::stack(lses);  // (T, N, H, L)
  const auto top = std::get<0>(stacked.max(0)).detach();
  const auto finite_top = top.masked_fill(torch::isinf(top) & (top < 0), 0.0);
  const auto weights = torch::exp(stacked - finite_top);  // exp(-inf) = 0
  const auto total = weights.sum(0);
  const auto lse = torch::log(total) + finite_top;
  const auto share = (weights / total.clamp_min(std::numeric_limits<float>::min())).unsqueeze(-1);
  auto out = (share.to(outputs[0].scalar_type()) * torch::stack(outputs)).sum(0);
  return {out, lse};
}

torch::Tensor varlen_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                               const SoftmaxAttentionFuncOptions& given) {
  auto [cu_q, cu_k] = check_varlen_arguments(kVarlenOp, q, k, v, cu_seqlens_q, cu_seqlens_k, given);
  const SoftmaxAttentionFuncOptions options = with_dropout_seed(kVarlenOp, q, given);
  if (q.scalar_type() == torch::kBFloat16) {  // the float32 kernel, the result rounded once
    return varlen_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), cu_seqlens_q,
                            cu_seqlens_k, options)
        .to(torch::kBFloat16);
  }
  if (q.scalar_type() != torch::kFloat) {  // the composite, sequence by sequence
    TORCH_CHECK(!cu_q.empty(), kVarlenOp, ": ", detail::dtype_name(q.scalar_type()),
                " inputs take the composite, which reads the offsets to cut the batch and so cannot be traced "
                "(torch.compile, torch.export); float32 and bfloat16 can");
    int64_t batch = 0;  // each_sequence calls in sequence order: sequence b draws batch b's mask
    return detail::each_sequence(q, k, v, cu_q, cu_k, [&](const auto& qb, const auto& kb, const auto& vb) {
      return reference::softmax_attention(qb, kb, vb, options, nullptr, batch++);
    });
  }
  auto slopes = options.alibi_slopes();
  if (slopes.defined()) slopes = slopes.to(torch::kFloat).contiguous();
  const SoftmaxConstants c{torch::Tensor(), detail::scale_or_default(options.scale(), q.size(2)),
                           options.causal(), slopes, options.rotary_dim(), options.rotary_base(),
                           options.window(), options.dropout_p(), options.dropout_seed().value_or(0)};
  return VarlenSoftmaxFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, c);
}

namespace {

/// The options of softmax_attention's schema (and softmax_attention_with_lse's).
SoftmaxAttentionFuncOptions options_of(const torch::Tensor& q, const torch::Tensor& k, c10::optional<double> scale,
                                       bool causal, const c10::optional<torch::Tensor>& key_lengths,
                                       const c10::optional<torch::Tensor>& bias,
                                       const c10::optional<torch::Tensor>& alibi_slopes, int64_t rotary_dim,
                                       double rotary_base, int64_t window, double dropout_p,
                                       c10::optional<int64_t> dropout_seed, const OptionalTensor& block_kinds,
                                       const OptionalTensor& block_partial_index, const OptionalTensor& block_bits,
                                       c10::IntArrayRef block_size, const OptionalTensor& sinks, double softcap) {
  return SoftmaxAttentionFuncOptions()
                                        .scale(scale)
                                        .causal(causal)
                                        .key_lengths(key_lengths.value_or(torch::Tensor()))
                                        .bias(bias.value_or(torch::Tensor()))
                                        .alibi_slopes(alibi_slopes.value_or(torch::Tensor()))
                                        .rotary_dim(rotary_dim)
                                        .rotary_base(rotary_base)
                                        .window(window)
                                        .dropout_p(dropout_p)
                                        .dropout_seed(dropout_seed)
                                        .block_mask(block_mask_of(kSoftmaxOp, block_kinds, block_partial_index,
                                                                  block_bits, block_size, detail::size_or_zero(q, 2),
                                                                  detail::size_or_zero(k, 2)))
                                        .sinks(sinks.value_or(torch::Tensor()))
                                        .softcap(softcap);
}

template <class... Args>
torch::Tensor softmax_attention_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   Args... args) {
  return softmax_attention(q, k, v, options_of(q, k, args...));
}

template <class... Args>
std::tuple<torch::Tensor, torch::Tensor> softmax_attention_with_lse_op(const torch::Tensor& q, const torch::Tensor& k,
                                                                       const torch::Tensor& v, Args... args) {
  return softmax_attention_with_lse(q, k, v, options_of(q, k, args...));
}

/// The argument types of softmax_attention's schema after q, k, v.
#define ATTNKIT_SOFTMAX_OP_TYPES                                                                                 \
  c10::optional<double>, bool, const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&,       \
      const c10::optional<torch::Tensor>&, int64_t, double, int64_t, double, c10::optional<int64_t>,           \
      const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, c10::IntArrayRef, const OptionalTensor&,  \
      double

torch::Tensor varlen_attention_op(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                  c10::optional<double> scale, bool causal,
                                  const c10::optional<torch::Tensor>& alibi_slopes, int64_t rotary_dim,
                                  double rotary_base, int64_t window, double dropout_p,
                                  c10::optional<int64_t> dropout_seed) {
  return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k,
                          SoftmaxAttentionFuncOptions()
                              .scale(scale)
                              .causal(causal)
                              .alibi_slopes(alibi_slopes.value_or(torch::Tensor()))
                              .rotary_dim(rotary_dim)
                              .rotary_base(rotary_base)
                              .window(window)
                              .dropout_p(dropout_p)
                              .dropout_seed(dropout_seed));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  // The schemas' defaults are the SoftmaxAttentionFuncOptions' (ops.h), written once there.
  using detail::schema_float;
  const SoftmaxAttentionFuncOptions soft;
  const std::string softmax_arguments =
      "(Tensor q, Tensor k, Tensor v, *, float? scale=None, bool causal=False, "
      "Tensor? key_lengths=None, Tensor? bias=None, Tensor? alibi_slopes=None, int rotary_dim=" +
      std::to_string(soft.rotary_dim()) + ", float rotary_base=" + schema_float(soft.rotary_base()) +
      ", int window=" + std::to_string(soft.window()) + ", float dropout_p=" + schema_float(soft.dropout_p()) +
      ", int? dropout_seed=None, " ATTNKIT_BLOCK_MASK_ARGUMENTS ", Tensor? sinks=None, float softcap=" +
      schema_float(soft.softcap()) + ")";
  m.def(("softmax_attention" + softmax_arguments + " -> Tensor").c_str(),
        &softmax_attention_op<ATTNKIT_SOFTMAX_OP_TYPES>);
  m.def(("softmax_attention_with_lse" + softmax_arguments + " -> (Tensor out, Tensor lse)").c_str(),
        &softmax_attention_with_lse_op<ATTNKIT_SOFTMAX_OP_TYPES>);
  m.def("merge_attention(Tensor[] outputs, Tensor[] lses) -> (Tensor out, Tensor lse)", &merge_attention);
  m.def(("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, *, "
         "float? scale=None, bool causal=False, Tensor? alibi_slopes=None, int rotary_dim=" +
         std::to_string(soft.rotary_dim()) + ", float rotary_base=" + schema_float(soft.rotary_base()) +
         ", int window=" + std::to_string(soft.window()) + ", float dropout_p=" + schema_float(soft.dropout_p()) +
         ", int? dropout_seed=None) -> Tensor")
            .c_str(),
        &varlen_attention_op);
  m.def("attention_dropout_mask(int N, int H, int L, int S, float dropout_p, int seed) -> Tensor");
  m.def("alibi_slopes(int heads) -> Tensor", &alibi_slopes);
  m.def(kSoftmaxForwardSchema);
  m.def(kSoftmaxBackwardSchema);
  m.def(
      "_varlen_attention_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor? alibi_slopes, float scale, bool causal, int rotary_dim, float rotary_base, int window, "
      "float dropout_p, int dropout_seed) -> (Tensor out, Tensor lse)");
  m.def(
      "_varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? alibi_slopes, float scale, bool causal, "
      "int rotary_dim, float rotary_base, int window, float dropout_p, int dropout_seed) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
}

// A factory has no tensor argument to dispatch on: its kernel is registered
// as CompositeExplicitAutograd, which the dispatcher also runs when no
// argument names a backend (edge_pattern, ops/sparse_attention.cpp, too). A
// tracer shapes their outputs with the fake implementations
// python/attnkit/_compile.py registers (torch's fake tensors treat a
// one-tensor factory as a constructor taking a device, which these are not,
// so a Meta kernel would not be reached).
TORCH_LIBRARY_IMPL(attnkit, CompositeExplicitAutograd, m) {
  m.impl("attention_dropout_mask", &attention_dropout_mask);
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl(kSoftmaxForwardOp, &softmax_forward_cpu);
  m.impl(kSoftmaxBackwardOp, &softmax_backward_cpu);
  m.impl(kVarlenForwardOp, &varlen_forward_cpu);
  m.impl(kVarlenBackwardOp, &varlen_backward_cpu);
}

TORCH_LIBRARY_IMPL(attnkit, Meta, m) {
  m.impl(kSoftmaxForwardOp, &softmax_forward_meta);
  m.impl(kSoftmaxBackwardOp, &softmax_backward_meta);
  m.impl(kVarlenForwardOp, &varlen_forward_meta);
  m.impl(kVarlenBackwardOp, &varlen_backward_meta);
}

}  // namespace attnkit
