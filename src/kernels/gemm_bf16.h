// bfloat16 GEMM with float32 accumulation, through oneDNN's matmul primitive
// (oneDNN 2.6 has no public bf16 GEMM function; its matmul takes bf16 sources
// and weights, accumulates in float32 and dispatches at run time to AMX tiles
// or AVX512_BF16 dot products). Torch-free.
//
// On a CPU without AVX512_BF16 (or when forced, see bf16_gemm_path) the same
// function converts its operands to float32, runs kernels::sgemm and rounds
// the result: slower, never wrong, and said by bf16_gemm_path().
#pragma once

#include <cstdint>

#include "base/bf16.h"
#include "kernels/common/isa.h"

namespace attnkit::kernels {

/// Converts n values (vectorised loops; threaded over the caller's OpenMP
/// team size, as oneDNN is, when n is large).
void to_float(const bf16* src, float* dst, int64_t n);
void to_bf16(const float* src, bf16* dst, int64_t n);

/// How bf16 products run.
///   amx          oneDNN's matmul with AMX tiles available (it still takes its
///                AVX512_BF16 kernels for shapes that do not fill a tile)
///   avx512_bf16  oneDNN's matmul on AVX512_BF16 dot products
///   float32      operands converted to float32, kernels::sgemm, rounded back
enum class Bf16Path { amx, avx512_bf16, float32 };
/// "amx", "avx512_bf16" or "float32 conversion".
const char* to_string(Bf16Path path);

/// What the CPU offers, decided once per process: the lower of the kernels'
/// ISA level (isa::current(), which ATTNKIT_MAX_ISA caps, oneDNN with it) and
/// oneDNN's effective ISA (lowered on its own by ONEDNN_MAX_CPU_ISA).
Bf16Path bf16_gemm_isa_path();

/// True when the float32 path is forced: by the environment variable
/// ATTNKIT_BF16_GEMM=float32 (read once; "auto", the default, takes the ISA's
/// path; any other value is an error), or by force_bf16_float32 (an internal
/// switch for tests; returns the previous setting of the switch).
bool bf16_float32_forced();
bool force_bf16_float32(bool on);

/// True when oneDNN, at its effective ISA (which the level decision caps),
/// can create a bf16 matmul: what torch's own bf16 products need, since
/// torch asks the CPU, not oneDNN, whether to use it. Does not decide the
/// level (safe inside isa::on_decision's function); call it after.
bool onednn_runs_bf16_matmul();

/// The path gemm_bf16 takes: float32 when forced, else the ISA's.
Bf16Path bf16_gemm_path();
/// True when bf16 products run natively (the ISA level and oneDNN's effective
/// ISA are both at least avx512_bf16, and float32 is not forced).
bool bf16_gemm_native();

/// C[m,n] = alpha * (op(A)[m,k] op(B)[k,n] + 1 bias^T) + beta * C, all row-major,
/// products accumulated in float32 and C rounded once (to bf16 in the second
/// form). op(X) = X^T when trans_x; lda/ldb/ldc are the row strides of A, B, C
/// as stored (at least their column counts). bias (n values, contiguous) may be
/// null. With beta = 0, C is not read. Operands whose rows are exactly their
/// column count (dense) get oneDNN's brgemm kernels (AMX); padded rows are
/// accepted and get oneDNN's jit gemm.
///
/// Matmul primitives are created once per (shapes, strides, C type, alpha,
/// beta, bias, thread count) and kept in a bounded, mutex-protected cache, so
/// repeated calls (training steps) pay only the execution. Each call runs on
/// the calling thread's oneDNN stream with the caller's OpenMP team size (as
/// kernels::sgemm does; inside a parallel region with one thread per team it
/// runs on that thread alone) and a scratchpad of its own, so concurrent calls
/// from several threads are safe.
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta, float* c,
               int64_t ldc, const bf16* bias = nullptr);
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta, bf16* c,
               int64_t ldc, const bf16* bias = nullptr);

/// Number of matmul primitives in the cache (for tests: a repeated call must
/// not add one).
int64_t gemm_bf16_cached_primitives();

}  // namespace attnkit::kernels
