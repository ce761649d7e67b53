// The cost of attention dropout inside the exact kernel (docs/PERFORMANCE.md,
// "Attention dropout"): softmax_attention at N = 1, H = 8, L = S = 4096,
// E = M = 64, float32, through the op (attnkit::softmax_attention), with
// dropout_p = 0 (the kernel without dropout) and 0.1 (seed fixed), for the
// forward and for forward + backward, not causal and causal, on num_threads()
// threads (OMP_NUM_THREADS=1 for the one thread). Dropout's share is
// the ratio of the medians of the p = 0.1 and p = 0 rows of one run.
// Counter: GFLOP/s of 4 E H L S (causal: about half) for the forward, 3.5x
// that with the backward, the same for both rates, so ratios are time ratios.
#include <attnkit/ops.h>
#include <benchmark/benchmark.h>
#include <torch/torch.h>

namespace {

constexpr int64_t kH = 8, kL = 4096, kE = 64;

void BM_Dropout(benchmark::State& state, double p, bool causal, bool backward) {
  torch::manual_seed(1);
  auto make = [] { return torch::randn({1, kH, kL, kE}).requires_grad_(true); };
  const auto q = make(), k = make(), v = make(), dout = torch::randn({1, kH, kL, kE});
  const auto options = attnkit::SoftmaxAttentionFuncOptions().causal(causal).dropout_p(p).dropout_seed(1);
  for (auto _ : state) {
    const auto out = attnkit::softmax_attention(q, k, v, options);
    if (backward) torch::autograd::grad({out}, {q, k, v}, {dout});
    benchmark::DoNotOptimize(out.data_ptr<float>());
  }
  const double pairs = double(kL) * double(kL) * (causal ? 0.5 : 1.0);
  state.counters["GFLOP/s"] = benchmark::Counter(4.0 * kH * kE * pairs * (backward ? 3.5 : 1.0),
                                                 benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}

#define ATTNKIT_DROPOUT_BENCH(NAME, P)                                                                        \
  BENCHMARK_CAPTURE(BM_Dropout, NAME##_forward, P, false, false)->Unit(benchmark::kMillisecond)->UseRealTime(); \
  BENCHMARK_CAPTURE(BM_Dropout, NAME##_forward_backward, P, false, true)                                      \
      ->Unit(benchmark::kMillisecond)                                                                         \
      ->UseRealTime();                                                                                        \
  BENCHMARK_CAPTURE(BM_Dropout, NAME##_causal_forward, P, true, false)                                        \
      ->Unit(benchmark::kMillisecond)                                                                         \
      ->UseRealTime();                                                                                        \
  BENCHMARK_CAPTURE(BM_Dropout, NAME##_causal_forward_backward, P, true, true)                                \
      ->Unit(benchmark::kMillisecond)                                                                         \
      ->UseRealTime();
ATTNKIT_DROPOUT_BENCH(p0, 0.0)
ATTNKIT_DROPOUT_BENCH(p01, 0.1)

}  // namespace

BENCHMARK_MAIN();
