#include "kernels/common/vec.h"

namespace attnkit::kernels::vec {

void exp_array(const float* x, float* y, int64_t n) {
#ifdef __AVX512F__
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, k, exp16(_mm512_maskz_loadu_ps(k, x + i)));
  }
#else
  for (int64_t i = 0; i < n; ++i) y[i] = exp(x[i]);
#endif
}

const char* isa() {
#ifdef __AVX512F__
  return "avx512";
#else
  return "scalar";
#endif
}

}  // namespace attnkit::kernels::vec
