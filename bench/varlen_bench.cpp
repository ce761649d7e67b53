// Packed variable-length batches against padding (docs/PERFORMANCE.md,
// "Packed variable-length batches"): 16 sequences whose lengths are drawn
// log-uniformly from 64..4096 (std::mt19937 seed 1; the lengths are printed
// in the context), H = 8, E = M = 64, float32, on num_threads() threads
// (OMP_NUM_THREADS=1 for the one thread). Three ways to attend the
// same batch, through the ops (attnkit::varlen_attention, softmax_attention),
// each timed for the forward and for forward + backward, not causal and causal:
//   packed      varlen_attention on (T, H, E) with the offsets;
//   padded      softmax_attention on (16, H, Lmax, E) with key_lengths: every
//               sequence padded to the longest, padded query rows computed;
//   one_by_one  softmax_attention on each (1, H, Lb, E) sequence in turn,
//               each stored apart, heads-major and contiguous;
//   one_by_one_views
//               the same calls on each sequence's view of the packed
//               (T, H, E) tensors (a (1, H, Lb, E) view whose rows are H E
//               floats apart): one by one on the data the packed op reads.
//               Each view is a leaf of its own, so the backward writes each
//               sequence's gradients apart, as one_by_one does.
// Counter: GFLOP/s of the useful work, 4 E H sum_b Lb^2 for the forward
// (2.5x that more with the backward), the same count for all three, so
// their ratios are the time ratios.
#include <attnkit/ops.h>
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int64_t kSequences = 16, kH = 8, kE = 64;

std::vector<int64_t> lengths() {
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> log_length(std::log(64.0), std::log(4096.0));
  std::vector<int64_t> l;
  for (int64_t b = 0; b < kSequences; ++b) l.push_back(std::llround(std::exp(log_length(rng))));
  return l;
}

enum Layout { packed, padded, one_by_one, one_by_one_views };

struct Batch {
  std::vector<int64_t> lengths = ::lengths();
  int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::vector<torch::Tensor> q, k, v, dout;  // one entry per sequence, or one for packed and padded
  torch::Tensor cu, key_lengths;
  bool causal;
  Layout layout;

  Batch(Layout layout_, bool causal_) : causal(causal_), layout(layout_) {
    torch::manual_seed(1);
    std::vector<int64_t> offsets{0};
    for (int64_t n : lengths) offsets.push_back(offsets.back() + n);
    cu = torch::tensor(offsets, torch::kLong);
    key_lengths = torch::tensor(lengths, torch::kLong);
    auto make = [](std::vector<int64_t> shape) { return torch::randn(shape).requires_grad_(true); };
    if (layout == packed) {
      for (auto* t : {&q, &k, &v, &dout}) t->push_back(make({offsets.back(), kH, kE}));
    } else if (layout == padded) {
      for (auto* t : {&q, &k, &v, &dout}) t->push_back(make({kSequences, kH, longest, kE}));
    } else if (layout == one_by_one) {
      for (int64_t n : lengths)
        for (auto* t : {&q, &k, &v, &dout}) t->push_back(make({1, kH, n, kE}));
    } else {
      for (auto* t : {&q, &k, &v, &dout}) {
        const auto whole = torch::randn({offsets.back(), kH, kE});
        for (int64_t b = 0; b < kSequences; ++b)
          t->push_back(whole.slice(0, offsets[b], offsets[b + 1]).permute({1, 0, 2}).unsqueeze(0).requires_grad_(true));
      }
    }
    for (auto& t : dout) t = t.detach();
  }

  /// One forward (and backward, when asked) of the whole batch.
  void run(bool backward) {
    const auto options = attnkit::SoftmaxAttentionFuncOptions().causal(causal);
    for (std::size_t i = 0; i < q.size(); ++i) {
      torch::Tensor out;
      if (layout == packed) out = attnkit::varlen_attention(q[i], k[i], v[i], cu, cu, options);
      if (layout == padded)
        out = attnkit::softmax_attention(q[i], k[i], v[i], attnkit::SoftmaxAttentionFuncOptions(options).key_lengths(key_lengths));
      if (layout == one_by_one || layout == one_by_one_views) out = attnkit::softmax_attention(q[i], k[i], v[i], options);
      if (backward) {
        torch::autograd::grad({out}, {q[i], k[i], v[i]}, {dout[i]});
      }
      benchmark::DoNotOptimize(out.data_ptr<float>());
    }
  }

  double forward_flops() const {
    double pairs = 0;
    for (int64_t n : lengths) pairs += double(n) * double(n) * (causal ? 0.5 : 1.0);
    return 4.0 * kH * kE * pairs;
  }
};

void BM_Varlen(benchmark::State& state, Layout layout, bool causal, bool backward) {
  Batch batch(layout, causal);
  std::string text;
  for (int64_t n : batch.lengths) text += (text.empty() ? "" : ",") + std::to_string(n);
  state.SetLabel("lengths " + text);
  for (auto _ : state) batch.run(backward);
  state.counters["GFLOP/s"] =
      benchmark::Counter(batch.forward_flops() * (backward ? 3.5 : 1.0), benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}

#define ATTNKIT_VARLEN_BENCH(LAYOUT)                                                                      \
  BENCHMARK_CAPTURE(BM_Varlen, LAYOUT##_forward, LAYOUT, false, false)->Unit(benchmark::kMillisecond)->UseRealTime(); \
  BENCHMARK_CAPTURE(BM_Varlen, LAYOUT##_forward_backward, LAYOUT, false, true)                            \
      ->Unit(benchmark::kMillisecond)                                                                     \
      ->UseRealTime();                                                                                    \
  BENCHMARK_CAPTURE(BM_Varlen, LAYOUT##_causal_forward, LAYOUT, true, false)->Unit(benchmark::kMillisecond)->UseRealTime(); \
  BENCHMARK_CAPTURE(BM_Varlen, LAYOUT##_causal_forward_backward, LAYOUT, true, true)                      \
      ->Unit(benchmark::kMillisecond)                                                                     \
      ->UseRealTime();
ATTNKIT_VARLEN_BENCH(packed)
ATTNKIT_VARLEN_BENCH(padded)
ATTNKIT_VARLEN_BENCH(one_by_one)
ATTNKIT_VARLEN_BENCH(one_by_one_views)

}  // namespace

BENCHMARK_MAIN();
