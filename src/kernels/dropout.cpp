#include "kernels/dropout.h"

#include "kernels/common/dropout.h"
#include "kernels/common/parallel.h"

ATTNKIT_KERNELS_BEGIN

void attention_dropout_mask(const DropoutMaskParams& p) {
  const AttentionDropout dropout(p.p, p.seed, p.batch_offset);
  const int64_t chunk = AttentionDropout::kMaxKeys;
  parallel_for(p.N * p.H * p.L, 0, [&](int64_t row, float*) {
    const int64_t n = row / (p.H * p.L), h = row / p.L % p.H, i = row % p.L;
    const uint64_t key = dropout.row(n, h, i);
    uint8_t* out = p.keep + row * p.S;
    uint16_t bits[AttentionDropout::kMaxKeys / 16];
    for (int64_t j0 = 0; j0 < p.S; j0 += chunk) {
      const int64_t cols = std::min(chunk, p.S - j0);
      dropout.keep_bits(key, j0, cols, bits);
      for (int64_t c = 0; c < cols; ++c) out[j0 + c] = (bits[c / 16] >> (c % 16)) & 1u;
    }
  });
}

ATTNKIT_KERNELS_END
