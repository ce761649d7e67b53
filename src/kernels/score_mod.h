// Runs a traced score modifier (kernels/common/score_program.h) over one tile
// row, and takes a gradient back through it. Compiled per ISA level with the
// kernel that includes it; torch-free.
//
// A row is `cols` lanes: query i of head (n, h) against the keys j0, j0 + 1,
// ... The program runs instruction by instruction over the whole row, so its
// interpretation costs one dispatch per instruction and row, and each
// instruction is a loop the compiler vectorises (tanh and exp by vec.h's own
// polynomials). A register is a row of lanes, or one value for all of them:
// the constants, b, h, q_idx and whatever is computed from those alone (a
// head's slope, its row of a table) are computed once per row, not per lane.
// The score register is the row of scores itself (no copy), and the last
// instruction writes the modified scores in place.
//
// The backward recomputes the row's registers from its raw scores, then goes
// through the program in reverse, one derivative rule per op (the rules of
// docs/MATH.md, "Score modifiers", which are torch's). Where a lane's
// incoming gradient is 0 (a masked pair, a branch of `where` not taken) it
// adds nothing, even where a derivative is infinite or NaN there, so that a
// modifier's values at hidden pairs cannot reach the gradients. A one-value
// register's gradient is the sum over the row's lanes, in lane order.
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

/// The floats a row's run needs (forward or backward): each register's row,
/// a value and a kind, and one more row; the backward needs a second file for
/// the gradients (a row each, a derivative row, a sum and a flag each).
inline int64_t scratch_floats(int32_t size, int64_t ld) { return (size + 1) * ld + 2 * size; }

/// A register's value: a row of lanes, or `s` for every lane (row nullptr).
struct Reg {
  const float* row;
  float s;
};

enum Kind : int { kRow = 0, kScalar = 1, kRaw = 2 };

/// The register file laid out in a caller's scratch_floats().
struct File {
  float* rows;    // size x ld
  float* values;  // size: a one-value register's value
  float* kinds;   // size: Kind, as a float
  const float* raw;
  int64_t ld;

  File(float* scratch, int32_t size, int64_t ld_, const float* raw_)
      : rows(scratch), values(scratch + size * ld_), kinds(scratch + size * ld_ + size), raw(raw_), ld(ld_) {}
  int kind(int32_t t) const { return static_cast<int>(kinds[t]); }
  Reg get(int32_t t) const {
    switch (kind(t)) {
      case kScalar: return {nullptr, values[t]};
      case kRaw: return {raw, 0.f};
      default: return {rows + t * ld, 0.f};
    }
  }
  const float* row(int32_t t) const { return kind(t) == kRaw ? raw : rows + t * ld; }
  void set_scalar(int32_t t, float v) { kinds[t] = kScalar, values[t] = v; }
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

/// f over one operand, lane by lane into `row` (a row operand), or once (a
/// one-value operand, returned as one value). The forward's ops and the
/// backward's local derivatives both go through these two.
template <class F>
inline Reg map1(const Reg& x, float* row, int64_t n, F f) {
  if (!x.row) return {nullptr, f(x.s)};
  for (int64_t c = 0; c < n; ++c) row[c] = f(x.row[c]);
  return {row, 0.f};
}

/// f over two operands, as map1.
template <class F>
inline Reg map2(const Reg& x, const Reg& y, float* row, int64_t n, F f) {
  if (!x.row && !y.row) return {nullptr, f(x.s, y.s)};
  if (x.row && y.row) {
    for (int64_t c = 0; c < n; ++c) row[c] = f(x.row[c], y.row[c]);
  } else if (x.row) {
    const float b = y.s;
    for (int64_t c = 0; c < n; ++c) row[c] = f(x.row[c], b);
  } else {
    const float a = x.s;
    for (int64_t c = 0; c < n; ++c) row[c] = f(a, y.row[c]);
  }
  return {row, 0.f};
}

/// Register t = f(a) (into o, or one value).
template <class F>
inline void unary(File& file, int32_t t, const Reg& a, float* o, int64_t n, F f) {
  const Reg r = map1(a, o, n, f);
  if (!r.row) file.set_scalar(t, r.s);
}

/// Register t = f(a, b) (into o, or one value).
template <class F>
inline void binary(File& file, int32_t t, const Reg& a, const Reg& b, float* o, int64_t n, F f) {
  const Reg r = map2(a, b, o, n, f);
  if (!r.row) file.set_scalar(t, r.s);
}

inline float floor_div(float a, float b) { return static_cast<float>(std::floor(static_cast<double>(a) / b)); }
inline float nan_or(float a, float b, float v) { return std::isnan(a) || std::isnan(b) ? a + b : v; }

/// Runs the program over the row whose scaled scores are `raw`. The last
/// instruction's row goes to `out` when given (which may be raw itself:
/// every op reads a lane before it writes it); the others' into `file`.
inline void forward(const ScoreProgram& prog, const RowSite& at, File& file, float* out) {
  const int64_t n = at.cols;
  for (int32_t t = 0; t < prog.size; ++t) {
    const ScoreInstr& in = prog.code[t];
    file.kinds[t] = kRow;
    float* o = out && t == prog.size - 1 ? out : file.rows + t * file.ld;
    const Reg a = in.a >= 0 ? file.get(in.a) : Reg{nullptr, 0.f};
    const Reg b = in.b >= 0 ? file.get(in.b) : Reg{nullptr, 0.f};
    switch (static_cast<ScoreOp>(in.op)) {
      case ScoreOp::kScore: file.kinds[t] = kRaw; break;
      case ScoreOp::kBatch: file.set_scalar(t, static_cast<float>(at.n)); break;
      case ScoreOp::kHead: file.set_scalar(t, static_cast<float>(at.h)); break;
      case ScoreOp::kQuery: file.set_scalar(t, static_cast<float>(at.i)); break;
      case ScoreOp::kKey:
        for (int64_t c = 0; c < n; ++c) o[c] = static_cast<float>(at.j0 + c);
        break;
      case ScoreOp::kConst: file.set_scalar(t, in.value); break;
      case ScoreOp::kNeg: unary(file, t, a, o, n, [](float x) { return -x; }); break;
      case ScoreOp::kAbs: unary(file, t, a, o, n, [](float x) { return std::fabs(x); }); break;
      case ScoreOp::kExp:
        if (a.row) exp_row(a.row, o, n); else file.set_scalar(t, vec::exp(a.s));
        break;
      case ScoreOp::kLog: unary(file, t, a, o, n, [](float x) { return std::log(x); }); break;
      case ScoreOp::kTanh:
        if (a.row) tanh_row(a.row, o, n); else file.set_scalar(t, vec::tanh(a.s));
        break;
      case ScoreOp::kSigmoid:
        if (a.row) {
          for (int64_t c = 0; c < n; ++c) o[c] = -a.row[c];
          exp_row(o, o, n);
          for (int64_t c = 0; c < n; ++c) o[c] = 1.f / (1.f + o[c]);
        } else {
          file.set_scalar(t, 1.f / (1.f + vec::exp(-a.s)));
        }
        break;
      case ScoreOp::kSqrt: unary(file, t, a, o, n, [](float x) { return std::sqrt(x); }); break;
      case ScoreOp::kFloor: unary(file, t, a, o, n, [](float x) { return std::floor(x); }); break;
      case ScoreOp::kCeil: unary(file, t, a, o, n, [](float x) { return std::ceil(x); }); break;
      case ScoreOp::kTrunc: unary(file, t, a, o, n, [](float x) { return std::trunc(x); }); break;
      case ScoreOp::kRound: unary(file, t, a, o, n, [](float x) { return std::nearbyint(x); }); break;
      case ScoreOp::kNot: unary(file, t, a, o, n, [](float x) { return x != 0.f ? 0.f : 1.f; }); break;
      case ScoreOp::kAdd: binary(file, t, a, b, o, n, [](float x, float y) { return x + y; }); break;
      case ScoreOp::kSub: binary(file, t, a, b, o, n, [](float x, float y) { return x - y; }); break;
      case ScoreOp::kMul: binary(file, t, a, b, o, n, [](float x, float y) { return x * y; }); break;
      case ScoreOp::kDiv: binary(file, t, a, b, o, n, [](float x, float y) { return x / y; }); break;
      // Integer // and % in double, exact for the integers floats hold.
      case ScoreOp::kFloorDiv: binary(file, t, a, b, o, n, floor_div); break;
      case ScoreOp::kMod:
        binary(file, t, a, b, o, n, [](float x, float y) {
          return static_cast<float>(x - y * std::floor(static_cast<double>(x) / y));
        });
        break;
      case ScoreOp::kPow: binary(file, t, a, b, o, n, [](float x, float y) { return std::pow(x, y); }); break;
      case ScoreOp::kMinimum:
      case ScoreOp::kClampMax:
        binary(file, t, a, b, o, n, [](float x, float y) { return nan_or(x, y, std::min(x, y)); });
        break;
      case ScoreOp::kMaximum:
      case ScoreOp::kClampMin:
        binary(file, t, a, b, o, n, [](float x, float y) { return nan_or(x, y, std::max(x, y)); });
        break;
      case ScoreOp::kLt: binary(file, t, a, b, o, n, [](float x, float y) { return x < y ? 1.f : 0.f; }); break;
      case ScoreOp::kLe: binary(file, t, a, b, o, n, [](float x, float y) { return x <= y ? 1.f : 0.f; }); break;
      case ScoreOp::kGt: binary(file, t, a, b, o, n, [](float x, float y) { return x > y ? 1.f : 0.f; }); break;
      case ScoreOp::kGe: binary(file, t, a, b, o, n, [](float x, float y) { return x >= y ? 1.f : 0.f; }); break;
      case ScoreOp::kEq: binary(file, t, a, b, o, n, [](float x, float y) { return x == y ? 1.f : 0.f; }); break;
      case ScoreOp::kNe: binary(file, t, a, b, o, n, [](float x, float y) { return x != y ? 1.f : 0.f; }); break;
      case ScoreOp::kAnd:
        binary(file, t, a, b, o, n, [](float x, float y) { return x != 0.f && y != 0.f ? 1.f : 0.f; });
        break;
      case ScoreOp::kOr:
        binary(file, t, a, b, o, n, [](float x, float y) { return x != 0.f || y != 0.f ? 1.f : 0.f; });
        break;
      case ScoreOp::kWhere: {
        const Reg c3 = file.get(in.c);
        if (!a.row) {  // one condition for the row: the branch it takes
          const Reg& taken = a.s != 0.f ? b : c3;
          if (!taken.row) file.set_scalar(t, taken.s); else std::copy(taken.row, taken.row + n, o);
        } else {
          for (int64_t c = 0; c < n; ++c)
            o[c] = a.row[c] != 0.f ? (b.row ? b.row[c] : b.s) : (c3.row ? c3.row[c] : c3.s);
        }
        break;
      }
      case ScoreOp::kIndex: {
        const float size = in.value;
        bool bad = false;
        auto wrap = [&](float x) {
          const float y = x < 0.f ? x + size : x;
          const bool inside = y >= 0.f && y < size;  // false for NaN too
          bad |= !inside;
          return inside ? y : 0.f;
        };
        unary(file, t, a, o, n, wrap);
        if (bad) flag(prog, t);
        break;
      }
      case ScoreOp::kGather: {
        const float numel = static_cast<float>(prog.tables_numel);
        bool bad = false;
        auto read = [&](float x) {
          const bool inside = x >= 0.f && x < numel;
          bad |= !inside;
          return inside ? prog.tables[static_cast<int64_t>(x)] : 0.f;
        };
        unary(file, t, a, o, n, read);
        if (bad) flag(prog, t);
        break;
      }
      default:  // the op checked every opcode: unreachable
        std::fill(o, o + n, std::nanf(""));
        flag(prog, t);
    }
  }
}

/// The row's scores through the program, in place: s = mod(s). `scratch`
/// holds scratch_floats(prog.size, ld).
inline void apply(const ScoreProgram& prog, const RowSite& at, float* s, float* scratch, int64_t ld) {
  File file(scratch, prog.size, ld, s);
  forward(prog, at, file, s);
  const int32_t last = prog.size - 1;
  if (file.kind(last) == kScalar) std::fill(s, s + at.cols, file.values[last]);  // (kRaw: s already)
}

/// ds (the gradient of the modified scores, in place) becomes the gradient of
/// the raw scores `raw`; each gather adds its share into dtables (the flat
/// tables' gradient) when it is given. `scratch` and `adj_scratch` hold
/// scratch_floats(prog.size, ld) each.
///
/// Only registers that lead to the scores or to a gather whose table takes a
/// gradient get one. Each derivative is formed as a row (or one value) by a
/// loop of its own, then multiplied into the operand's gradient: both loops
/// are plain enough to vectorise.
inline void backward(const ScoreProgram& prog, const RowSite& at, const float* raw, float* ds, float* scratch,
                     float* adj_scratch, int64_t ld, float* dtables) {
  const int64_t n = at.cols;
  const int32_t size = prog.size, last = size - 1;
  File file(scratch, size, ld, raw);
  forward(prog, at, file, nullptr);
  // adj + t ld: register t's gradient row; tmp: a derivative row; adj_one[t]:
  // a one-value register's gradient (its lanes' sum, in lane order);
  // needs[t] != 0: t takes a gradient.
  float* adj = adj_scratch;
  float* tmp = adj_scratch + size * ld;
  float* adj_one = tmp + ld;
  float* needs = adj_one + size;
  for (int32_t t = 0; t < size; ++t) {
    const ScoreInstr& in = prog.code[t];
    bool need = false;
    switch (static_cast<ScoreOp>(in.op)) {
      case ScoreOp::kScore: need = true; break;
      case ScoreOp::kGather: need = dtables != nullptr; break;
      // Inputs, constants, rounding, comparisons, logic and indices pass no
      // gradient on.
      case ScoreOp::kBatch: case ScoreOp::kHead: case ScoreOp::kQuery: case ScoreOp::kKey: case ScoreOp::kConst:
      case ScoreOp::kFloor: case ScoreOp::kCeil: case ScoreOp::kTrunc: case ScoreOp::kRound: case ScoreOp::kNot:
      case ScoreOp::kFloorDiv: case ScoreOp::kLt: case ScoreOp::kLe: case ScoreOp::kGt: case ScoreOp::kGe:
      case ScoreOp::kEq: case ScoreOp::kNe: case ScoreOp::kAnd: case ScoreOp::kOr: case ScoreOp::kIndex:
        break;
      default:
        for (const int32_t r : {in.a, in.b, in.c}) need = need || (r >= 0 && needs[r] != 0.f);
    }
    needs[t] = need ? 1.f : 0.f;
    if (file.kind(t) == kScalar) adj_one[t] = 0.f; else if (need) std::fill(adj + t * ld, adj + t * ld + n, 0.f);
  }
  // The output's gradient is the incoming ds; ds becomes the raw scores'.
  if (file.kind(last) == kScalar) {
    for (int64_t c = 0; c < n; ++c) adj_one[last] += ds[c];
  } else if (file.kind(last) == kRow) {
    std::copy(ds, ds + n, adj + last * ld);
  }  // (kRaw: the program is the score itself, and ds is its gradient already)
  if (file.kind(last) != kRaw) std::fill(ds, ds + n, 0.f);
  const Reg unit{nullptr, 1.f}, minus{nullptr, -1.f};
  for (int32_t t = last; t >= 0; --t) {
    if (needs[t] == 0.f) continue;
    const ScoreInstr& in = prog.code[t];
    const bool one = file.kind(t) == kScalar;
    if (one && adj_one[t] == 0.f) continue;
    const float gone = one ? adj_one[t] : 0.f;
    const float* grow = one ? nullptr : adj + t * ld;
    const Reg a = in.a >= 0 ? file.get(in.a) : Reg{nullptr, 0.f};
    const Reg b = in.b >= 0 ? file.get(in.b) : Reg{nullptr, 0.f};
    const Reg o = file.get(t);
    // Adds g d into operand r's gradient (nothing in lanes where g is 0).
    auto add = [&](int32_t r, const Reg& d) {
      if (r < 0 || needs[r] == 0.f) return;
      if (one) {  // every operand of a one-value register is one value
        adj_one[r] += gone * d.s;
        return;
      }
      if (file.kind(r) == kScalar) {
        float sum = 0.f;
        if (d.row) {
          for (int64_t c = 0; c < n; ++c) sum += grow[c] != 0.f ? grow[c] * d.row[c] : 0.f;
        } else {
          const float k = d.s;
          for (int64_t c = 0; c < n; ++c) sum += grow[c] != 0.f ? grow[c] * k : 0.f;
        }
        adj_one[r] += sum;
        return;
      }
      float* into = file.kind(r) == kRaw ? ds : adj + r * ld;
      if (d.row) {
        for (int64_t c = 0; c < n; ++c) into[c] += grow[c] != 0.f ? grow[c] * d.row[c] : 0.f;
      } else {
        const float k = d.s;
        for (int64_t c = 0; c < n; ++c) into[c] += grow[c] != 0.f ? grow[c] * k : 0.f;
      }
    };
    switch (static_cast<ScoreOp>(in.op)) {
      case ScoreOp::kNeg: add(in.a, minus); break;
      case ScoreOp::kAbs:
        add(in.a, map1(a, tmp, n, [](float x) { return x > 0.f ? 1.f : x < 0.f ? -1.f : 0.f; }));
        break;
      case ScoreOp::kExp: add(in.a, o); break;
      case ScoreOp::kLog: add(in.a, map1(a, tmp, n, [](float x) { return 1.f / x; })); break;
      case ScoreOp::kTanh: add(in.a, map1(o, tmp, n, [](float y) { return 1.f - y * y; })); break;
      case ScoreOp::kSigmoid: add(in.a, map1(o, tmp, n, [](float y) { return y * (1.f - y); })); break;
      case ScoreOp::kSqrt: add(in.a, map1(o, tmp, n, [](float y) { return 0.5f / y; })); break;
      case ScoreOp::kAdd:
        add(in.a, unit);
        add(in.b, unit);
        break;
      case ScoreOp::kSub:
        add(in.a, unit);
        add(in.b, minus);
        break;
      case ScoreOp::kMul:
        add(in.a, b);
        add(in.b, a);
        break;
      case ScoreOp::kDiv:
        add(in.a, map1(b, tmp, n, [](float y) { return 1.f / y; }));
        add(in.b, map2(o, b, tmp, n, [](float q, float y) { return -q / y; }));
        break;
      case ScoreOp::kMod:  // torch.remainder: d/da 1, d/db -floor(a / b)
        add(in.a, unit);
        add(in.b, map2(a, b, tmp, n, [](float x, float y) { return -floor_div(x, y); }));
        break;
      case ScoreOp::kPow:  // torch.pow: d/da b a^(b-1) (0 where b is 0), d/db a^b log a (0 where a is 0 and b >= 0)
        add(in.a, map2(a, b, tmp, n, [](float x, float y) { return y == 0.f ? 0.f : y * std::pow(x, y - 1.f); }));
        add(in.b, map2(a, b, tmp, n, [](float x, float y) {
              return x == 0.f && y >= 0.f ? 0.f : std::pow(x, y) * std::log(x);
            }));
        break;
      case ScoreOp::kMinimum:
        add(in.a, map2(a, b, tmp, n, [](float x, float y) { return x < y ? 1.f : x == y ? 0.5f : 0.f; }));
        add(in.b, map2(a, b, tmp, n, [](float x, float y) { return y < x ? 1.f : x == y ? 0.5f : 0.f; }));
        break;
      case ScoreOp::kMaximum:
        add(in.a, map2(a, b, tmp, n, [](float x, float y) { return x > y ? 1.f : x == y ? 0.5f : 0.f; }));
        add(in.b, map2(a, b, tmp, n, [](float x, float y) { return y > x ? 1.f : x == y ? 0.5f : 0.f; }));
        break;
      case ScoreOp::kClampMin:
        add(in.a, map2(a, b, tmp, n, [](float x, float y) { return x >= y ? 1.f : 0.f; }));
        break;
      case ScoreOp::kClampMax:
        add(in.a, map2(a, b, tmp, n, [](float x, float y) { return x <= y ? 1.f : 0.f; }));
        break;
      case ScoreOp::kWhere:
        add(in.b, map1(a, tmp, n, [](float x) { return x != 0.f ? 1.f : 0.f; }));
        add(in.c, map1(a, tmp, n, [](float x) { return x != 0.f ? 0.f : 1.f; }));
        break;
      case ScoreOp::kGather:
        if (dtables) {
          const float numel = static_cast<float>(prog.tables_numel);
          if (one) {
            if (a.s >= 0.f && a.s < numel) dtables[static_cast<int64_t>(a.s)] += gone;
          } else {
            for (int64_t c = 0; c < n; ++c) {
              const float x = a.row ? a.row[c] : a.s;
              if (grow[c] != 0.f && x >= 0.f && x < numel) dtables[static_cast<int64_t>(x)] += grow[c];
            }
          }
        }
        break;
      default:  // the score itself (its gradient is summed in ds), and ops without one
        break;
    }
  }
}

}  // namespace score_mod
ATTNKIT_KERNELS_END
