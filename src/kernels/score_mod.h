// Runs a traced score modifier (kernels/common/score_program.h) over one tile
// row, and takes a gradient back through it. Compiled per ISA level with the
// kernel that includes it; torch-free.
//
// A row is `cols` lanes: query i of head (n, h) against the keys j0, j0 + 1,
// ... The program runs instruction by instruction over the whole row, so its
// interpretation costs one dispatch per instruction and row, and each
// instruction is a loop the compiler vectorises (tanh and exp by vec.h's own
// polynomials). Registers are rows of `ld` floats.
//
// The backward recomputes the row's registers from its raw scores, then goes
// through the program in reverse, one derivative rule per op (the rules of
// docs/MATH.md, "Score modifiers", which are torch's). Where a lane's
// incoming gradient is 0 (a masked pair, a branch of `where` not taken) it
// adds nothing, even where a derivative is infinite or NaN there, so that a
// modifier's values at hidden pairs cannot reach the gradients.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/common/score_program.h"
#include "kernels/common/vec.h"

ATTNKIT_KERNELS_BEGIN
namespace score_mod {

/// Where a row sits: query i of head (n, h), keys [j0, j0 + cols).
struct RowSite {
  int64_t n, h, i, j0, cols;
};

inline void tanh_row(const float* x, float* y, int64_t n) {
  int64_t c = 0;
#ifdef __AVX512F__
  for (; c + 16 <= n; c += 16) _mm512_storeu_ps(y + c, vec::tanh16(_mm512_loadu_ps(x + c)));
#elif ATTNKIT_AVX2
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(y + c, vec::tanh8(_mm256_loadu_ps(x + c)));
#endif
  for (; c < n; ++c) y[c] = vec::tanh(x[c]);
}

inline void exp_row(const float* x, float* y, int64_t n) {
  int64_t c = 0;
#ifdef __AVX512F__
  for (; c + 16 <= n; c += 16) _mm512_storeu_ps(y + c, vec::exp16(_mm512_loadu_ps(x + c)));
#elif ATTNKIT_AVX2
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(y + c, vec::exp8(_mm256_loadu_ps(x + c)));
#endif
  for (; c < n; ++c) y[c] = vec::exp(x[c]);
}

inline void flag(const ScoreProgram& prog, int32_t t) {
  int32_t none = 0;
  prog.error->compare_exchange_strong(none, t + 1, std::memory_order_relaxed);
}

/// Registers 0 .. size - 1 of the row (each `ld` floats at regs + t ld) from
/// its scaled scores `raw`; the output is the last register.
inline void forward(const ScoreProgram& prog, const RowSite& at, const float* raw, float* regs, int64_t ld) {
  const int64_t cols = at.cols;
  for (int32_t t = 0; t < prog.size; ++t) {
    const ScoreInstr& in = prog.code[t];
    float* o = regs + t * ld;
    const float* a = in.a >= 0 ? regs + in.a * ld : nullptr;
    const float* b = in.b >= 0 ? regs + in.b * ld : nullptr;
    const float* c3 = in.c >= 0 ? regs + in.c * ld : nullptr;
#define ATTNKIT_LANES(expr) \
  for (int64_t c = 0; c < cols; ++c) o[c] = (expr);
    switch (static_cast<ScoreOp>(in.op)) {
      case ScoreOp::kScore: std::copy(raw, raw + cols, o); break;
      case ScoreOp::kBatch: std::fill(o, o + cols, static_cast<float>(at.n)); break;
      case ScoreOp::kHead: std::fill(o, o + cols, static_cast<float>(at.h)); break;
      case ScoreOp::kQuery: std::fill(o, o + cols, static_cast<float>(at.i)); break;
      case ScoreOp::kKey: ATTNKIT_LANES(static_cast<float>(at.j0 + c)) break;
      case ScoreOp::kConst: std::fill(o, o + cols, in.value); break;
      case ScoreOp::kNeg: ATTNKIT_LANES(-a[c]) break;
      case ScoreOp::kAbs: ATTNKIT_LANES(std::fabs(a[c])) break;
      case ScoreOp::kExp: exp_row(a, o, cols); break;
      case ScoreOp::kLog: ATTNKIT_LANES(std::log(a[c])) break;
      case ScoreOp::kTanh: tanh_row(a, o, cols); break;
      case ScoreOp::kSigmoid:
        for (int64_t c = 0; c < cols; ++c) o[c] = -a[c];
        exp_row(o, o, cols);
        ATTNKIT_LANES(1.f / (1.f + o[c]))
        break;
      case ScoreOp::kSqrt: ATTNKIT_LANES(std::sqrt(a[c])) break;
      case ScoreOp::kFloor: ATTNKIT_LANES(std::floor(a[c])) break;
      case ScoreOp::kCeil: ATTNKIT_LANES(std::ceil(a[c])) break;
      case ScoreOp::kTrunc: ATTNKIT_LANES(std::trunc(a[c])) break;
      case ScoreOp::kRound: ATTNKIT_LANES(std::nearbyint(a[c])) break;
      case ScoreOp::kNot: ATTNKIT_LANES(a[c] != 0.f ? 0.f : 1.f) break;
      case ScoreOp::kAdd: ATTNKIT_LANES(a[c] + b[c]) break;
      case ScoreOp::kSub: ATTNKIT_LANES(a[c] - b[c]) break;
      case ScoreOp::kMul: ATTNKIT_LANES(a[c] * b[c]) break;
      case ScoreOp::kDiv: ATTNKIT_LANES(a[c] / b[c]) break;
      // Integer // and % in double, exact for the integers floats hold.
      case ScoreOp::kFloorDiv:
        ATTNKIT_LANES(static_cast<float>(std::floor(static_cast<double>(a[c]) / b[c]))) break;
      case ScoreOp::kMod:
        ATTNKIT_LANES(static_cast<float>(a[c] - b[c] * std::floor(static_cast<double>(a[c]) / b[c]))) break;
      case ScoreOp::kPow: ATTNKIT_LANES(std::pow(a[c], b[c])) break;
      case ScoreOp::kMinimum:
      case ScoreOp::kClampMax:
        ATTNKIT_LANES(std::isnan(a[c]) || std::isnan(b[c]) ? a[c] + b[c] : std::min(a[c], b[c])) break;
      case ScoreOp::kMaximum:
      case ScoreOp::kClampMin:
        ATTNKIT_LANES(std::isnan(a[c]) || std::isnan(b[c]) ? a[c] + b[c] : std::max(a[c], b[c])) break;
      case ScoreOp::kLt: ATTNKIT_LANES(a[c] < b[c] ? 1.f : 0.f) break;
      case ScoreOp::kLe: ATTNKIT_LANES(a[c] <= b[c] ? 1.f : 0.f) break;
      case ScoreOp::kGt: ATTNKIT_LANES(a[c] > b[c] ? 1.f : 0.f) break;
      case ScoreOp::kGe: ATTNKIT_LANES(a[c] >= b[c] ? 1.f : 0.f) break;
      case ScoreOp::kEq: ATTNKIT_LANES(a[c] == b[c] ? 1.f : 0.f) break;
      case ScoreOp::kNe: ATTNKIT_LANES(a[c] != b[c] ? 1.f : 0.f) break;
      case ScoreOp::kAnd: ATTNKIT_LANES(a[c] != 0.f && b[c] != 0.f ? 1.f : 0.f) break;
      case ScoreOp::kOr: ATTNKIT_LANES(a[c] != 0.f || b[c] != 0.f ? 1.f : 0.f) break;
      case ScoreOp::kWhere: ATTNKIT_LANES(a[c] != 0.f ? b[c] : c3[c]) break;
      case ScoreOp::kIndex: {
        const float size = in.value;
        bool bad = false;
        for (int64_t c = 0; c < cols; ++c) {
          const float x = a[c] < 0.f ? a[c] + size : a[c];
          const bool inside = x >= 0.f && x < size;  // false for NaN too
          bad |= !inside;
          o[c] = inside ? x : 0.f;
        }
        if (bad) flag(prog, t);
        break;
      }
      case ScoreOp::kGather: {
        const float numel = static_cast<float>(prog.tables_numel);
        bool bad = false;
        for (int64_t c = 0; c < cols; ++c) {
          const bool inside = a[c] >= 0.f && a[c] < numel;
          bad |= !inside;
          o[c] = inside ? prog.tables[static_cast<int64_t>(a[c])] : 0.f;
        }
        if (bad) flag(prog, t);
        break;
      }
      default:  // the op checked every opcode: unreachable
        std::fill(o, o + cols, std::nanf(""));
        flag(prog, t);
    }
#undef ATTNKIT_LANES
  }
}

/// The row's scores through the program, in place: s = mod(s).
inline void apply(const ScoreProgram& prog, const RowSite& at, float* s, float* regs, int64_t ld) {
  forward(prog, at, s, regs, ld);
  const float* out = regs + (prog.size - 1) * ld;
  std::copy(out, out + at.cols, s);
}

/// ds (the gradient of the modified scores, in place) becomes the gradient of
/// the raw scores `raw`; each gather adds its share into dtables (the flat
/// tables' gradient) when it is given. adj is a second register file.
inline void backward(const ScoreProgram& prog, const RowSite& at, const float* raw, float* ds, float* regs,
                     float* adj, int64_t ld, float* dtables) {
  const int64_t cols = at.cols;
  forward(prog, at, raw, regs, ld);
  for (int32_t t = 0; t < prog.size; ++t) std::fill(adj + t * ld, adj + t * ld + cols, 0.f);
  std::copy(ds, ds + cols, adj + (prog.size - 1) * ld);
  std::fill(ds, ds + cols, 0.f);
  for (int32_t t = prog.size - 1; t >= 0; --t) {
    const ScoreInstr& in = prog.code[t];
    const float* g = adj + t * ld;
    const float* o = regs + t * ld;
    const float* a = in.a >= 0 ? regs + in.a * ld : nullptr;
    const float* b = in.b >= 0 ? regs + in.b * ld : nullptr;
    float* ga = in.a >= 0 ? adj + in.a * ld : nullptr;
    float* gb = in.b >= 0 ? adj + in.b * ld : nullptr;
    float* gc = in.c >= 0 ? adj + in.c * ld : nullptr;
    // Adds g * (expr) into `into` where g is not 0.
#define ATTNKIT_BACK(into, expr) \
  for (int64_t c = 0; c < cols; ++c) into[c] += g[c] != 0.f ? g[c] * (expr) : 0.f;
    switch (static_cast<ScoreOp>(in.op)) {
      case ScoreOp::kScore: ATTNKIT_BACK(ds, 1.f) break;
      case ScoreOp::kNeg: ATTNKIT_BACK(ga, -1.f) break;
      case ScoreOp::kAbs: ATTNKIT_BACK(ga, a[c] > 0.f ? 1.f : a[c] < 0.f ? -1.f : 0.f) break;
      case ScoreOp::kExp: ATTNKIT_BACK(ga, o[c]) break;
      case ScoreOp::kLog: ATTNKIT_BACK(ga, 1.f / a[c]) break;
      case ScoreOp::kTanh: ATTNKIT_BACK(ga, 1.f - o[c] * o[c]) break;
      case ScoreOp::kSigmoid: ATTNKIT_BACK(ga, o[c] * (1.f - o[c])) break;
      case ScoreOp::kSqrt: ATTNKIT_BACK(ga, 0.5f / o[c]) break;
      case ScoreOp::kAdd:
        ATTNKIT_BACK(ga, 1.f)
        ATTNKIT_BACK(gb, 1.f)
        break;
      case ScoreOp::kSub:
        ATTNKIT_BACK(ga, 1.f)
        ATTNKIT_BACK(gb, -1.f)
        break;
      case ScoreOp::kMul:
        ATTNKIT_BACK(ga, b[c])
        ATTNKIT_BACK(gb, a[c])
        break;
      case ScoreOp::kDiv:
        ATTNKIT_BACK(ga, 1.f / b[c])
        ATTNKIT_BACK(gb, -o[c] / b[c])
        break;
      case ScoreOp::kMod:  // torch.remainder: d/da 1, d/db -floor(a / b)
        ATTNKIT_BACK(ga, 1.f)
        ATTNKIT_BACK(gb, -static_cast<float>(std::floor(static_cast<double>(a[c]) / b[c])))
        break;
      case ScoreOp::kPow:  // torch.pow: d/da b a^(b-1) (0 where b is 0), d/db a^b log a (0 where a is 0 and b >= 0)
        ATTNKIT_BACK(ga, b[c] == 0.f ? 0.f : b[c] * std::pow(a[c], b[c] - 1.f))
        ATTNKIT_BACK(gb, a[c] == 0.f && b[c] >= 0.f ? 0.f : o[c] * std::log(a[c]))
        break;
      case ScoreOp::kMinimum:
        ATTNKIT_BACK(ga, a[c] < b[c] ? 1.f : a[c] == b[c] ? 0.5f : 0.f)
        ATTNKIT_BACK(gb, b[c] < a[c] ? 1.f : a[c] == b[c] ? 0.5f : 0.f)
        break;
      case ScoreOp::kMaximum:
        ATTNKIT_BACK(ga, a[c] > b[c] ? 1.f : a[c] == b[c] ? 0.5f : 0.f)
        ATTNKIT_BACK(gb, b[c] > a[c] ? 1.f : a[c] == b[c] ? 0.5f : 0.f)
        break;
      case ScoreOp::kClampMin: ATTNKIT_BACK(ga, a[c] >= b[c] ? 1.f : 0.f) break;
      case ScoreOp::kClampMax: ATTNKIT_BACK(ga, a[c] <= b[c] ? 1.f : 0.f) break;
      case ScoreOp::kWhere:
        ATTNKIT_BACK(gb, a[c] != 0.f ? 1.f : 0.f)
        ATTNKIT_BACK(gc, a[c] != 0.f ? 0.f : 1.f)
        break;
      case ScoreOp::kGather:
        if (dtables)
          for (int64_t c = 0; c < cols; ++c)
            if (g[c] != 0.f && a[c] >= 0.f && a[c] < static_cast<float>(prog.tables_numel))
              dtables[static_cast<int64_t>(a[c])] += g[c];
        break;
      default:  // inputs, constants, and ops whose gradient is 0 (rounding, comparisons, logic, indices)
        break;
    }
#undef ATTNKIT_BACK
  }
}

}  // namespace score_mod
ATTNKIT_KERNELS_END
