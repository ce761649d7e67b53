// A score modifier as the kernels run it: a straight-line program over the
// lanes of a tile row, traced once from a plain Python function
// (python/attnkit/score_mods.py; docs/MATH.md, "Score modifiers", gives the
// op set and its rules). Torch-free.
//
// Instruction t writes register t, a row of lanes (one per key of the tile
// row); its operands are earlier registers. Values are float32; integers
// (indices, their arithmetic, booleans as 0 and 1) are floats holding exact
// integers, exact up to 2^24 in magnitude. The last instruction is the
// modifier's output. Captured tensors (a bias table) are read through one
// flat float32 buffer, `tables`: a gather's operand is an index into it.
#pragma once

#include <atomic>
#include <cstdint>

namespace attnkit::kernels {

/// The opcodes (their numbers are the program format: python/attnkit/score_mods.py
/// writes the same). a, b, c are operand registers; `value` a constant.
enum class ScoreOp : int32_t {
  // Inputs: the scaled score, then the indices torch's score_mod receives.
  kScore = 0,   // scale q . k
  kBatch = 1,   // b
  kHead = 2,    // h (the query head)
  kQuery = 3,   // q_idx
  kKey = 4,     // kv_idx
  kConst = 5,   // value
  // Unary, on a.
  kNeg = 10,
  kAbs = 11,
  kExp = 12,
  kLog = 13,
  kTanh = 14,
  kSigmoid = 15,
  kSqrt = 16,
  kFloor = 17,
  kCeil = 18,
  kTrunc = 19,  // a float's conversion to an integer type (toward zero)
  kNot = 20,    // logical not of a boolean
  kRound = 21,  // half to even, as torch.round
  // Binary, on a and b.
  kAdd = 30,
  kSub = 31,
  kMul = 32,
  kDiv = 33,       // true division
  kFloorDiv = 34,  // floor(a / b), Python's //
  kMod = 35,       // a - b floor(a / b), Python's % (torch.remainder)
  kPow = 36,
  kMinimum = 37,   // torch.minimum: ties split the gradient in halves
  kMaximum = 38,
  kClampMin = 39,  // max(a, b) with b a bound: the gradient passes to a where a >= b
  kClampMax = 40,  // min(a, b) with b a bound: the gradient passes to a where a <= b
  kLt = 41,
  kLe = 42,
  kGt = 43,
  kGe = 44,
  kEq = 45,
  kNe = 46,
  kAnd = 47,
  kOr = 48,
  // where(a, b, c): b where a is true, else c.
  kWhere = 60,
  // index(a) along a dimension of `value` entries: a + value where a < 0
  // (Python's negative indices); outside [-value, value) it is an error
  // (ScoreProgram::error), and 0 is used.
  kIndex = 70,
  // tables[a]: a is a flat index into `tables` (made of kIndex results and
  // the table's offset and strides by integer arithmetic).
  kGather = 71,
};

struct ScoreInstr {
  int32_t op, a, b, c;  // operand registers, -1 when unused
  float value;
};

/// A program, its captured tensors and where its errors go. size 0: none.
struct ScoreProgram {
  const ScoreInstr* code = nullptr;
  int32_t size = 0;
  const float* tables = nullptr;  // captured tensors, flattened and concatenated
  int64_t tables_numel = 0;
  // Set to t + 1 by the first instruction t that meets an index out of range
  // (or a gather outside `tables`); the op checks it after the kernel.
  std::atomic<int32_t>* error = nullptr;

  bool active() const { return size > 0; }
};

}  // namespace attnkit::kernels
