// The band kernels of sparse attention (sparse_attention.cpp): one block of
// up to 32 consecutive query rows, each attending to one run of consecutive
// keys, all inside a window of at most 256 keys, computed in vector registers
// with the block's rows in the lanes. A banded pattern (a local window of span
// w) is made of such blocks; sgemm ran their small products slower than the
// exact kernel's large tiles and packed both operands on every call
// (docs/PERFORMANCE.md, "Why the kernels' constants"), so these kernels keep
// the block in registers and pack only its queries (and, backward, its output
// gradients), transposed.
#pragma once

#include <cstdint>

#include "base/isa_namespace.h"
#include "kernels/common/simd.h"

/// The kernels exist at avx2 and above; below, sparse_attention.cpp computes
/// band blocks as sgemm tiles.
#if defined(__AVX512F__) || ATTNKIT_AVX2
#define ATTNKIT_BAND_KERNELS 1
#else
#define ATTNKIT_BAND_KERNELS 0
#endif

ATTNKIT_KERNELS_BEGIN
namespace band {


constexpr int64_t kRows = 32;      // a block's rows, padded: two 16-lane or four 8-lane vectors
constexpr int64_t kMaxKeys = 256;  // a block's keys

/// Rows of floats, row i at data + i * ld.
struct Rows {
  const float* data;
  int64_t ld;
  const float* row(int64_t i) const { return data + i * ld; }
};

/// `rows` <= kRows query rows over the keys [0, keys), keys <= kMaxKeys; row r
/// attends to the keys [first[r], last[r]) (first == last: none). first and
/// last hold kRows entries each, the padding rows' empty; the rows of every
/// key operand (Rows) start at the block's key 0. `ld * kRows` must fit in
/// 32 bits for the query and output-gradient operands (the AVX-512 kernels
/// gather them with 32-bit offsets).
struct Block {
  int64_t rows, keys;
  const int32_t* first;
  const int32_t* last;
  /// ALiBi: the score of row r and key c gets -slope |from + r - c| (from:
  /// row 0's position minus key 0's), added where the scores are made, in
  /// both passes. slope 0: none.
  float slope = 0.f;
  int64_t from = 0;
  /// A block mask's bits over the block, transposed for the lanes: bit c % 32
  /// of bits[(c / 32) * kRows + r] is set when row r sees key c, which it
  /// then does only inside its run too. nullptr: every key of the runs.
  /// Applied in both passes, as a score of -inf. 64-byte aligned.
  const uint32_t* bits = nullptr;
  /// Soft-capping of the scores (SoftmaxAttentionParams::softcap) before ALiBi
  /// and the bits, in forward_transposed and forward; `backward` requires 0
  /// (sparse attention's only caller has no soft-capping). 0: none.
  float softcap = 0.f;
};

/// The caller's scratch: qt (E x kRows) and dot (M x kRows) for the queries
/// and output gradients transposed, s and ds (kMaxKeys x kRows each) for a
/// key's scores, probabilities and their gradients over the block's rows. The
/// forward uses qt and s only. 64-byte aligned.
struct Scratch {
  float *qt, *dot, *s, *ds;
};

/// Forward: P = exp(scale q k^T - alibi - m) on the rows' runs, 0 elsewhere; u = P v
/// (rows x M, row stride M, written); m[r] and l[r] (kRows each) the row's
/// largest score and sum of P: -inf and 0 for a row without keys.
void forward(const Block& b, Rows q, Rows k, Rows v, int64_t E, int64_t M, float scale,
             const Scratch& w, float* u, float* m, float* l);

/// The forward in two steps, for a block of queries that meets many blocks of
/// keys (the exact kernel's rows over all of S, 256 keys at a time): its
/// queries transposed once into qt (E x kRows, 64-byte aligned; 0 in the
/// padding rows), then forward_transposed per block of keys, which is
/// `forward` without the transpose (w.qt unused).
void transpose_queries(Rows q, int64_t rows, int64_t E, float* qt);
void forward_transposed(const Block& b, const float* qt, Rows k, Rows v, int64_t E, int64_t M, float scale,
                        const Scratch& w, float* u, float* m, float* l);

/// Backward, with P = exp(scale q k^T - alibi - lse) on the runs (0 elsewhere) and
/// dS = P (dout v^T - d): dv_j += P^T dout and dk_j += scale dS^T q for the
/// block's keys (rows of M and E floats, ld_v and ld_k apart), and
/// dq = scale dS k (rows x E, row stride E, written). lse and d hold the
/// block's `rows` entries.
void backward(const Block& b, Rows q, Rows k, Rows v, Rows dout, int64_t E, int64_t M,
              float scale, const float* lse, const float* d, const Scratch& w, float* dq,
              float* dk, int64_t ld_k, float* dv, int64_t ld_v);

}  // namespace band
ATTNKIT_KERNELS_END
