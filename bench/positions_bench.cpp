// What positions cost inside the exact kernel (docs/PERFORMANCE.md, "Modern
// features"): N = 1, H = 8, L = S = 4096, E = M = 64, not causal, on
// num_threads() threads (OMP_NUM_THREADS=1 for the one thread). Each
// benchmark is one way to give the scores positions, timed for the forward
// and for forward + backward:
//   plain          no positions (the baseline of every ratio);
//   rotary         rotary_dim = E inside the kernel (q and k rotated as loaded);
//   rotary_apart   q and k rotated by the rotary kernel into buffers first (and,
//                  with the backward, dq and dk rotated back after it): what a
//                  kernel without rotary positions costs a caller;
//   alibi          ALiBi slopes inside the kernel;
//   alibi_bias     the same penalties as an (H, L, S) bias tensor (512 MiB).
// Counter: the forward's GFLOP/s at 4 L S E per head (2.5x that with the
// backward), the same count for every variant, so their ratios are the time
// ratios.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdlib>
#include <random>

#include "base/memory.h"
#include "kernels/rotary_embedding.h"
#include "kernels/softmax_attention.h"

namespace {

using attnkit::kernels::Buffer;

constexpr int64_t kH = 8, kL = 4096, kE = 64;

enum Variant { plain, rotary, rotary_apart, alibi, alibi_bias };

struct Problem {
  Buffer<float> q, k, v, out, lse, dout, dq, dk, dv, q_rot, k_rot, slopes, bias;
  attnkit::kernels::SoftmaxAttentionBackwardParams p;
  attnkit::kernels::RotaryParams rotate_q, rotate_k, unrotate_dq, unrotate_dk;
  Variant variant;

  explicit Problem(Variant v_)
      : q(kH * kL * kE), k(kH * kL * kE), v(kH * kL * kE), out(kH * kL * kE), lse(kH * kL),
        dout(kH * kL * kE), dq(kH * kL * kE), dk(kH * kL * kE), dv(kH * kL * kE), slopes(kH), variant(v_) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (Buffer<float>* t : {&q, &k, &v, &dout})
      for (std::size_t i = 0; i < t->size(); ++i) (*t)[i] = normal(rng);
    for (int64_t h = 0; h < kH; ++h) slopes[h] = std::exp2(-8.f * (h + 1) / kH);
    const auto strides = [](int64_t* s) { s[0] = kH * kL * kE, s[1] = kL * kE, s[2] = kE, s[3] = 1; };
    p.q = q.data(), p.k = k.data(), p.v = v.data(), p.out = out.data(), p.lse = lse.data();
    p.dout = dout.data(), p.dq = dq.data(), p.dk = dk.data(), p.dv = dv.data();
    for (int64_t* s : {p.q_stride, p.k_stride, p.v_stride, p.out_stride, p.dout_stride, p.dq_stride, p.dk_stride,
                       p.dv_stride})
      strides(s);
    p.N = 1, p.H = kH, p.L = kL, p.S = kL, p.E = kE, p.M = kE;
    p.scale = 1.f / std::sqrt(static_cast<float>(kE));
    if (variant == rotary) p.rotary_dim = kE;
    if (variant == alibi) p.alibi_slopes = slopes.data();
    if (variant == alibi_bias) {
      bias = Buffer<float>(kH * kL * kL);
      for (int64_t h = 0; h < kH; ++h)
        for (int64_t i = 0; i < kL; ++i)
          for (int64_t j = 0; j < kL; ++j) bias[(h * kL + i) * kL + j] = -slopes[h] * std::abs(float(i - j));
      p.bias = bias.data();
      p.bias_stride[0] = kH * kL * kL, p.bias_stride[1] = kL * kL, p.bias_stride[2] = kL, p.bias_stride[3] = 1;
    }
    if (variant == rotary_apart) {
      q_rot = Buffer<float>(kH * kL * kE), k_rot = Buffer<float>(kH * kL * kE);
      const auto pass = [&](const float* from, float* to, bool inverse) {
        attnkit::kernels::RotaryParams r;
        r.x = from, r.y = to, r.N = 1, r.H = kH, r.T = kL, r.E = kE, r.dim = kE, r.inverse = inverse;
        strides(r.x_stride);
        return r;
      };
      rotate_q = pass(q.data(), q_rot.data(), false), rotate_k = pass(k.data(), k_rot.data(), false);
      // The backward's dq and dk come out for the rotated rows; the caller
      // rotates them back (into the buffers the rotation used: they are free).
      unrotate_dq = pass(dq.data(), q_rot.data(), true), unrotate_dk = pass(dk.data(), k_rot.data(), true);
      p.q = q_rot.data(), p.k = k_rot.data();
    }
  }

  void forward() {
    if (variant == rotary_apart) {
      attnkit::kernels::rotary_embedding(rotate_q);
      attnkit::kernels::rotary_embedding(rotate_k);
    }
    attnkit::kernels::softmax_attention_forward(p);
  }

  void backward() {
    attnkit::kernels::softmax_attention_backward(p);
    if (variant == rotary_apart) {
      attnkit::kernels::rotary_embedding(unrotate_dq);
      attnkit::kernels::rotary_embedding(unrotate_dk);
      // (rotate_q and rotate_k will write q_rot and k_rot again next forward)
    }
  }
};

constexpr double kForwardFlops = 4.0 * kH * kL * kL * kE;

void BM_PositionsForward(benchmark::State& state, Variant variant) {
  Problem problem(variant);
  for (auto _ : state) {
    problem.forward();
    benchmark::DoNotOptimize(problem.out.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(kForwardFlops, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}

void BM_PositionsForwardBackward(benchmark::State& state, Variant variant) {
  Problem problem(variant);
  for (auto _ : state) {
    problem.forward();
    problem.backward();
    benchmark::DoNotOptimize(problem.dq.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(3.5 * kForwardFlops, benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}

#define ATTNKIT_POSITIONS_BENCH(VARIANT)                                                           \
  BENCHMARK_CAPTURE(BM_PositionsForward, VARIANT, VARIANT)->Unit(benchmark::kMillisecond)->UseRealTime(); \
  BENCHMARK_CAPTURE(BM_PositionsForwardBackward, VARIANT, VARIANT)->Unit(benchmark::kMillisecond)->UseRealTime();
ATTNKIT_POSITIONS_BENCH(plain)
ATTNKIT_POSITIONS_BENCH(rotary)
ATTNKIT_POSITIONS_BENCH(rotary_apart)
ATTNKIT_POSITIONS_BENCH(alibi)
ATTNKIT_POSITIONS_BENCH(alibi_bias)

}  // namespace

BENCHMARK_MAIN();
