#include "kernels/rotary_embedding.h"

#include "kernels/common/parallel.h"
#include "kernels/common/rotary.h"
#include "kernels/common/strided.h"

ATTNKIT_KERNELS_BEGIN

void rotary_embedding(const RotaryParams& p) {
  if (p.N == 0 || p.H == 0 || p.T == 0) return;
  const RotaryTable table(p.dim, p.base, p.offset, p.T);
  parallel_for(p.N * p.H, 0, [&](int64_t nh, float*) {
    const Strided x = head_matrix(p.x, p.x_stride, nh / p.H, nh % p.H);
    float* y = p.y + nh * p.T * p.E;
    for (int64_t t = 0; t < p.T; ++t)
      table.rotate(x.row(t), x.cs, p.E, p.offset + t, p.inverse, y + t * p.E);
  });
}

ATTNKIT_KERNELS_END
