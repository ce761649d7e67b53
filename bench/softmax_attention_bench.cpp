// The exact softmax attention kernel (src/kernels/softmax_attention.*) at the
// issue's target shape family: N = 1, H = 8, S = L, M = E, on num_threads()
// threads (set OMP_NUM_THREADS). Counters: GFLOP/s (forward 4 L S E per head,
// halved when causal; backward 2.5x that) and the sgemm peak measured in the
// same process (1024^3), to divide by.
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>

#include "base/memory.h"
#include "kernels/common/gemm.h"
#include "kernels/peak.h"
#include "kernels/softmax_attention.h"

namespace {

using attnkit::kernels::Buffer;

double sgemm_peak() {
  static const double peak = attnkit::kernels::sgemm_peak_gflops();
  return peak;
}

/// Inputs, outputs and gradients of one problem, contiguous (N, H, rows, cols).
struct Problem {
  Buffer<float> q, k, v, out, lse, dout, dq, dk, dv;
  attnkit::kernels::SoftmaxAttentionBackwardParams p;

  Problem(int64_t L, int64_t E, bool causal)
      : q(8 * L * E), k(8 * L * E), v(8 * L * E), out(8 * L * E), lse(8 * L),
        dout(8 * L * E), dq(8 * L * E), dk(8 * L * E), dv(8 * L * E) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (Buffer<float>* t : {&q, &k, &v, &dout})
      for (std::size_t i = 0; i < t->size(); ++i) (*t)[i] = normal(rng);
    const auto strides = [&](int64_t* s) { s[0] = 8 * L * E, s[1] = L * E, s[2] = E, s[3] = 1; };
    p.q = q.data(), p.k = k.data(), p.v = v.data(), p.out = out.data(), p.lse = lse.data();
    p.dout = dout.data(), p.dq = dq.data(), p.dk = dk.data(), p.dv = dv.data();
    for (int64_t* s : {p.q_stride, p.k_stride, p.v_stride, p.out_stride, p.dout_stride,
                       p.dq_stride, p.dk_stride, p.dv_stride})
      strides(s);
    p.N = 1, p.H = 8, p.L = L, p.S = L, p.E = E, p.M = E;
    p.scale = 1.f / std::sqrt(static_cast<float>(E));
    p.causal = causal;
  }

  double forward_flops() const { return 4.0 * 8 * p.L * p.S * p.E * (p.causal ? 0.5 : 1.0); }
};

void set_counters(benchmark::State& state, double flops) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
  state.counters["sgemm_peak_GFLOP/s"] = sgemm_peak();
}

// Args: L, E, causal.
void BM_SoftmaxAttentionForward(benchmark::State& state) {
  Problem problem(state.range(0), state.range(1), state.range(2) != 0);
  sgemm_peak();
  for (auto _ : state) {
    attnkit::kernels::softmax_attention_forward(problem.p);
    benchmark::DoNotOptimize(problem.out.data());
  }
  set_counters(state, problem.forward_flops());
}

void BM_SoftmaxAttentionBackward(benchmark::State& state) {
  Problem problem(state.range(0), state.range(1), state.range(2) != 0);
  sgemm_peak();
  attnkit::kernels::softmax_attention_forward(problem.p);
  for (auto _ : state) {
    attnkit::kernels::softmax_attention_backward(problem.p);
    benchmark::DoNotOptimize(problem.dq.data());
  }
  set_counters(state, 2.5 * problem.forward_flops());
}

void shapes(benchmark::internal::Benchmark* b) {
  for (int64_t L : {1024, 4096})
    for (int64_t causal : {0, 1}) b->Args({L, 64, causal});
  b->Args({4096, 128, 0});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}
BENCHMARK(BM_SoftmaxAttentionForward)->Apply(shapes);
BENCHMARK(BM_SoftmaxAttentionBackward)->Apply(shapes);

}  // namespace

BENCHMARK_MAIN();
