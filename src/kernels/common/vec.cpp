#include "kernels/common/vec.h"

#include <algorithm>

ATTNKIT_KERNELS_BEGIN
namespace vec {

void exp_array(const float* x, float* y, int64_t n) {
#ifdef __AVX512F__
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, k, exp16(_mm512_maskz_loadu_ps(k, x + i)));
  }
#elif ATTNKIT_AVX2
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    const __m256i k = tail_mask8(n - i);
    _mm256_maskstore_ps(y + i, k, exp8(_mm256_maskload_ps(x + i, k)));
  }
#else
  for (int64_t i = 0; i < n; ++i) y[i] = exp(x[i]);
#endif
}

float softmax_exp_array(const float* x, float* y, int64_t n, float shift) {
  std::copy(x, x + n, y);
  return exp_shift_sum(y, n, shift);
}

}  // namespace vec
ATTNKIT_KERNELS_END
