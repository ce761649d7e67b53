// Attention dropout's keep mask written out (kernels/common/dropout.h draws
// it): what attnkit::attention_dropout_mask returns, and the mask the float64
// reference multiplies its weights by. Torch-free.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

struct DropoutMaskParams {
  int64_t N = 0, H = 0, L = 0, S = 0;
  double p = 0.0;                 // in [0, 1)
  uint64_t seed = 0;
  int64_t batch_offset = 0;       // the batch index of n = 0
  uint8_t* keep = nullptr;        // (N, H, L, S) contiguous: 1 kept, 0 dropped
};

/// Writes keep. Threads: num_threads() over rows; elementwise, so the result
/// does not depend on the thread count (nor on the ISA level).
void attention_dropout_mask(const DropoutMaskParams& p);

}  // namespace attnkit::kernels
