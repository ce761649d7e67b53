// The kernels' entry points as the rest of the library calls them: each one
// runs the build of the current ISA level (isa.h). This file is the table of
// contents of that dispatch: every entry point, and the levels it is built
// for. Compiled once, for the library's default target.
//
// The signatures repeat the kernels' headers; one that differs leaves a level's
// symbol undefined, and since the declarations here are hidden (as the level
// code is, CMakeLists.txt), linking libattnkit.so reports it.
#include <stdexcept>
#include <string>

#include "kernels/agglomerative_attention.h"
#include "kernels/clustered_attention.h"
#include "kernels/common/isa.h"
#include "kernels/common/vec.h"
#include "kernels/dropout.h"
#include "kernels/gated_linear_attention.h"
#include "kernels/hashing.h"
#include "kernels/kmeans.h"
#include "kernels/dense.h"
#include "kernels/linear_attention.h"
#include "kernels/rotary_embedding.h"
#include "kernels/softmax_attention.h"
#include "kernels/softmax_attention_bf16.h"
#include "kernels/sparse_attention.h"

namespace attnkit::kernels {

namespace {

/// The float32 kernels are built at baseline, avx2 and avx512: the levels
/// above avx512 add only bf16 instructions, which they do not use.
[[maybe_unused]] isa::Level float32_level() {
  const isa::Level level = isa::current();
  return level < isa::Level::avx512 ? level : isa::Level::avx512;
}

}  // namespace

/// A level's entry point, defined in its own (hidden) objects.
#define ATTNKIT_LEVEL_DECLARATION __attribute__((visibility("hidden")))

#if defined(__x86_64__) || defined(_M_X64)

/// Declares NAME in each float32 level's namespace and defines the
/// attnkit::kernels NAME, which calls the current level's.
#define ATTNKIT_FLOAT32_KERNEL(RETURN, NAME, PARAMETERS, ARGUMENTS) \
  namespace isa_baseline {                                         \
  ATTNKIT_LEVEL_DECLARATION RETURN NAME PARAMETERS;                \
  }                                                                \
  namespace isa_avx2 {                                             \
  ATTNKIT_LEVEL_DECLARATION RETURN NAME PARAMETERS;                \
  }                                                                \
  namespace isa_avx512 {                                           \
  ATTNKIT_LEVEL_DECLARATION RETURN NAME PARAMETERS;                \
  }                                                                \
  RETURN NAME PARAMETERS {                                         \
    switch (float32_level()) {                                     \
      case isa::Level::baseline: return isa_baseline::NAME ARGUMENTS; \
      case isa::Level::avx2: return isa_avx2::NAME ARGUMENTS;      \
      default: return isa_avx512::NAME ARGUMENTS;                  \
    }                                                              \
  }

/// The same for kernels built at the amx level alone; below it they throw.
#define ATTNKIT_AMX_KERNEL(RETURN, NAME, PARAMETERS, ARGUMENTS)                         \
  namespace isa_amx {                                                                  \
  ATTNKIT_LEVEL_DECLARATION RETURN NAME PARAMETERS;                                    \
  }                                                                                    \
  RETURN NAME PARAMETERS {                                                             \
    if (isa::current() < isa::Level::amx)                                              \
      throw std::logic_error(#NAME ": built for the amx level, running at " +         \
                             std::string(isa::name(isa::current())));                  \
    return isa_amx::NAME ARGUMENTS;                                                    \
  }

#else  // other architectures build the baseline level alone

#define ATTNKIT_FLOAT32_KERNEL(RETURN, NAME, PARAMETERS, ARGUMENTS) \
  namespace isa_baseline {                                         \
  ATTNKIT_LEVEL_DECLARATION RETURN NAME PARAMETERS;                \
  }                                                                \
  RETURN NAME PARAMETERS {                                         \
    isa::current();                                                \
    return isa_baseline::NAME ARGUMENTS;                           \
  }

#define ATTNKIT_AMX_KERNEL(RETURN, NAME, PARAMETERS, ARGUMENTS)        \
  RETURN NAME PARAMETERS {                                            \
    (void)(ARGUMENTS);                                                \
    throw std::logic_error(#NAME ": not built on this architecture"); \
  }

#endif

// Exact attention (softmax_attention.h, softmax_attention_bf16.h).
ATTNKIT_FLOAT32_KERNEL(void, softmax_attention_forward, (const SoftmaxAttentionParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(int64_t, softmax_attention_forward_key_chunks,
                       (const SoftmaxAttentionParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(void, softmax_attention_backward, (const SoftmaxAttentionBackwardParams& p),
                       (p))
ATTNKIT_AMX_KERNEL(void, softmax_attention_forward_bf16, (const SoftmaxAttentionBf16Params& p), (p))
ATTNKIT_AMX_KERNEL(void, softmax_attention_backward_bf16,
                   (const SoftmaxAttentionBf16BackwardParams& p), (p))
bool softmax_attention_bf16_available() { return isa::current() >= isa::Level::amx; }

// Rotary positions as an op of their own (rotary_embedding.h).
ATTNKIT_FLOAT32_KERNEL(void, rotary_embedding, (const RotaryParams& p), (p))

// Attention dropout's keep mask written out (dropout.h).
ATTNKIT_FLOAT32_KERNEL(void, attention_dropout_mask, (const DropoutMaskParams& p), (p))

// Sparse attention over edge lists (sparse_attention.h).
ATTNKIT_FLOAT32_KERNEL(void, sparse_attention_forward, (const SparseAttentionParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(void, sparse_attention_backward, (const SparseAttentionBackwardParams& p), (p))

// Linear and gated linear attention (linear_attention.h, gated_linear_attention.h).
ATTNKIT_FLOAT32_KERNEL(void, linear_attention_forward, (const LinearAttentionParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(void, linear_attention_backward, (const LinearAttentionBackwardParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(void, gated_linear_attention_forward, (const GatedLinearAttentionParams& p),
                       (p))
ATTNKIT_FLOAT32_KERNEL(void, gated_linear_attention_backward,
                       (const GatedLinearAttentionBackwardParams& p), (p))

// Agglomerative attention (agglomerative_attention.h).
ATTNKIT_FLOAT32_KERNEL(void, agglomerative_forward, (const AgglomerativeParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(void, agglomerative_backward, (const AgglomerativeBackwardParams& p), (p))

// Clustered attention and its parts (clustered_attention.h, hashing.h, kmeans.h).
ATTNKIT_FLOAT32_KERNEL(void, cluster_queries, (const ClusterParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(void, clustered_attention_forward, (const ClusteredAttentionParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(void, clustered_attention_backward,
                       (const ClusteredAttentionBackwardParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(void, select_top_keys,
                       (const float* scores, int64_t valid, int64_t S, int64_t k, int64_t* top),
                       (scores, valid, S, k, top))
ATTNKIT_FLOAT32_KERNEL(void, hash_planes,
                       (int64_t bits, int64_t E, int64_t seed, bool hash_bias, float* planes),
                       (bits, E, seed, hash_bias, planes))
ATTNKIT_FLOAT32_KERNEL(void, hash_queries, (const HashParams& p), (p))
ATTNKIT_FLOAT32_KERNEL(void, hamming_kmeans, (const KMeansParams& p), (p))

// The dense layer (dense.h).
ATTNKIT_FLOAT32_KERNEL(void, linear_forward, (const LinearParams& p, float* y, int64_t y_row_stride),
                       (p, y, y_row_stride))
ATTNKIT_FLOAT32_KERNEL(void, linear_forward,
                       (const LinearParamsBf16& p, bf16* y, int64_t y_row_stride),
                       (p, y, y_row_stride))
ATTNKIT_FLOAT32_KERNEL(void, linear_backward,
                       (const LinearParams& p, const float* dy, int64_t dy_row_stride,
                        const LinearGradients& grads),
                       (p, dy, dy_row_stride, grads))
ATTNKIT_FLOAT32_KERNEL(void, linear_backward,
                       (const LinearParamsBf16& p, const bf16* dy, int64_t dy_row_stride,
                        const LinearGradientsBf16& grads),
                       (p, dy, dy_row_stride, grads))

// The vector helpers' exponentials, for the tests of their accuracy (vec.h):
// by hand, since they sit in a namespace of their own inside each level's.
#define ATTNKIT_VEC_DECLARATIONS                                                   \
  ATTNKIT_LEVEL_DECLARATION void exp_array(const float* x, float* y, int64_t n); \
  ATTNKIT_LEVEL_DECLARATION float softmax_exp_array(const float* x, float* y, int64_t n, float shift);
#if defined(__x86_64__) || defined(_M_X64)
namespace isa_baseline::vec { ATTNKIT_VEC_DECLARATIONS }
namespace isa_avx2::vec { ATTNKIT_VEC_DECLARATIONS }
namespace isa_avx512::vec { ATTNKIT_VEC_DECLARATIONS }
void vec_exp_array(const float* x, float* y, int64_t n) {
  switch (float32_level()) {
    case isa::Level::baseline: return isa_baseline::vec::exp_array(x, y, n);
    case isa::Level::avx2: return isa_avx2::vec::exp_array(x, y, n);
    default: return isa_avx512::vec::exp_array(x, y, n);
  }
}
float vec_softmax_exp_array(const float* x, float* y, int64_t n, float shift) {
  switch (float32_level()) {
    case isa::Level::baseline: return isa_baseline::vec::softmax_exp_array(x, y, n, shift);
    case isa::Level::avx2: return isa_avx2::vec::softmax_exp_array(x, y, n, shift);
    default: return isa_avx512::vec::softmax_exp_array(x, y, n, shift);
  }
}
#else
namespace isa_baseline::vec { ATTNKIT_VEC_DECLARATIONS }
void vec_exp_array(const float* x, float* y, int64_t n) { isa_baseline::vec::exp_array(x, y, n); }
float vec_softmax_exp_array(const float* x, float* y, int64_t n, float shift) {
  return isa_baseline::vec::softmax_exp_array(x, y, n, shift);
}
#endif
#undef ATTNKIT_VEC_DECLARATIONS

}  // namespace attnkit::kernels
