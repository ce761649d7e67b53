// A window inside exact attention (SoftmaxAttentionFuncOptions::window):
// query i sees the keys within window - 1 of its position i + S - L, before
// it when causal, on both sides otherwise; the kernel skips the tiles outside
// the band. Checked:
// - against the float64 reference (which masks the band), values and the
//   gradients of q, k, v and a bias, on awkward shapes: window 1, windows
//   wider than the keys, L != S both ways, key lengths with an empty row,
//   bands that cross several 128 x 256 tiles at offsets that are not
//   multiples of them, a bias per head and one shared by the heads, grouped
//   heads, strided views, ALiBi and rotary positions together, and the shapes
//   that take the forward's key split and the backward's key parts;
// - a window that covers every key (>= max(L, S)) is no window, bitwise (the
//   op drops it, and the kernel takes its dense tiles);
// - the band given as a -inf bias instead (to rounding);
// - bitwise the same on 1 and 2 threads;
// - the registry's full:window=W: its decoding state, one step at a time,
//   equals the causal forward and holds O(W) rows; its FLOP count;
// - the refusals.
#include <attnkit/nn/decoding.h>
#include <attnkit/nn/registry.h>
#include <attnkit/ops.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>
#include <vector>

#include "ops/softmax_attention_cases.h"
#include "test_util.h"

namespace softmax_attention_window_test {

namespace {

using attnkit::SoftmaxAttentionFuncOptions;
using attnkit::testing::f64;
using namespace attnkit::testing::softmax;

// float32 kernel against float64, as without a window
// (tests/ops/softmax_attention_gqa_test.cpp): 2e-5. A window only removes
// terms from the sums.
constexpr double kTolerance = 2e-5;

struct WindowCase : Case {
  int64_t window = 2;
  bool positions = false;  // with ALiBi slopes and rotary positions too
};

std::vector<WindowCase> cases() {
  std::vector<WindowCase> c;
  const auto add = [&](Case shape, int64_t window, bool positions = false) {
    c.push_back({std::move(shape), window, positions});
  };
  add({"symmetric window 2"}, 2);
  add({"causal L = S, window 3", 2, 4, 4, 6, 6, 4, 3, true}, 3);
  add({"causal L < S, window 2", 2, 4, 4, 4, 9, 4, 3, true}, 2);
  add({"causal L > S, key lengths (an empty row), window 3", 2, 4, 4, 7, 5, 4, 3, true, {5, 0}}, 3);
  add({"window 1: each query itself", 1, 2, 2, 9, 9, 4, 3, true}, 1);
  add({"symmetric window 1 with L < S", 1, 2, 2, 4, 9, 4, 3, false}, 1);
  add({"a window wider than the keys", 1, 2, 2, 5, 7, 4, 3, false}, 50);
  add({"causal 300 x 300, window 40, E != M", 1, 2, 2, 300, 300, 16, 8, true}, 40);
  add({"symmetric 600 x 600, window 200", 1, 2, 2, 600, 600, 8, 5, false}, 200);
  add({"symmetric 130 x 700 (L < S), window 300", 1, 2, 2, 130, 700, 8, 4, false}, 300);
  add({"a bias per head with its gradient", 2, 4, 4, 5, 7, 4, 3, false, {}, {1, 4, 1, 7}}, 2);
  add({"a bias shared by the heads with its gradient", 2, 4, 4, 130, 300, 4, 3, true, {}, {2, 1, 130, 300}}, 50);
  add({"grouped heads", 2, 6, 2, 5, 7, 4, 3, true}, 2);
  add({"strided views", 2, 4, 4, 5, 7, 6, 3, false, {7, 3}, {}, true}, 3);
  add({"with ALiBi and rotary positions", 1, 4, 4, 260, 260, 8, 4, true}, 100, true);
  // N H ceil(L / 128) < 64 and S >= 2048: the forward splits the keys; N H < 8
  // without a bias: the backward splits each head's keys into parts.
  add({"long keys: key split and backward parts", 1, 2, 2, 3, 2100, 8, 4, true}, 700);
  add({"long keys, symmetric window inside one chunk", 1, 2, 2, 1, 2100, 8, 4, false}, 300);
  return c;
}

Inputs make(const WindowCase& c) { return make_inputs(c, 29); }

SoftmaxAttentionFuncOptions windowed(const WindowCase& c) {
  auto o = SoftmaxAttentionFuncOptions().window(c.window);
  if (c.positions) o.alibi_slopes(attnkit::alibi_slopes(c.H).to(torch::kDouble)).rotary_dim(c.E);
  return o;
}

TEST(SoftmaxAttentionWindow, MatchesTheFloat64Reference) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_matches_reference(c, make(c), windowed(c), kTolerance);
  }
}

TEST(SoftmaxAttentionWindow, AWindowWiderThanEverythingIsNoWindow) {
  for (const auto& c : cases()) {
    if (c.positions) continue;
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto cot = torch::randn({c.N, c.H, c.L, c.M}, f64());
    const auto wide = run(c, x, SoftmaxAttentionFuncOptions().window(c.L + c.S), torch::kFloat, cot, false);
    const auto none = run(c, x, {}, torch::kFloat, cot, false);
    for (size_t i = 0; i < wide.size(); ++i) EXPECT_TRUE(torch::equal(wide[i], none[i])) << i;
  }
}

TEST(SoftmaxAttentionWindow, EqualsTheBandAsABias) {
  for (const auto& c : cases()) {
    if (c.positions || !c.bias_shape.empty()) continue;
    SCOPED_TRACE(c.name);
    const auto x = make(c);
    const auto q = x.q.to(torch::kFloat), k = x.k.to(torch::kFloat), v = x.v.to(torch::kFloat);
    const auto query_at = torch::arange(c.L, torch::kLong).add(c.S - c.L).view({c.L, 1});
    const auto outside = (query_at - torch::arange(c.S, torch::kLong).view({1, c.S})).abs() >= c.window;
    const auto band = torch::zeros({c.L, c.S}).masked_fill(outside, -std::numeric_limits<float>::infinity());
    const auto plain = SoftmaxAttentionFuncOptions().causal(c.causal).key_lengths(x.key_lengths);
    auto o = plain;
    const auto as_bias = attnkit::softmax_attention(q, k, v, o.bias(band));
    auto w = plain;
    EXPECT_LE(relative_error(attnkit::softmax_attention(q, k, v, w.window(c.window)), as_bias), 1e-6);
  }
}

TEST(SoftmaxAttentionWindow, BitwiseTheSameOnOneAndTwoThreads) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_same_on_one_and_two_threads(c, make(c), windowed(c));
  }
}

TEST(SoftmaxAttentionWindow, TheRegistrysDecodingStateKeepsTheWindow) {
  torch::manual_seed(30);
  const int64_t H = 2, T = 50, E = 8, W = 6;
  const auto q = torch::randn({1, H, T, E}), k = torch::randn({1, H, T, E}), v = torch::randn({1, H, T, E});
  const auto [info, spec] = attnkit::nn::resolve_mechanism("full:window=6");
  const auto full = attnkit::nn::attend("full:window=6", q, k, v, {true});
  EXPECT_TRUE(torch::equal(full, attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true).window(W))));
  auto state = info->start_decoding(spec);
  for (int64_t t = 0; t < T; ++t) {
    const auto out = state->step(q.select(2, t), k.select(2, t), v.select(2, t));
    EXPECT_LE(relative_error(out, full.select(2, t)), 1e-6) << "t " << t;
  }
  // The cache forgets positions before the window: O(W) rows, not T.
  const auto& cached = dynamic_cast<const attnkit::nn::CachedSoftmaxState&>(*state).cache();
  EXPECT_LE(cached.capacity(), 4 * W);
  // FLOPs: 2 (E + M) per visible pair; causal window 6 over 50 positions:
  // 1 + 2 + ... + 6 for the first six, then 6 each.
  attnkit::nn::AttentionShape shape;
  shape.H = H, shape.L = T, shape.S = T, shape.E = E, shape.M = E;
  EXPECT_DOUBLE_EQ(*info->flops(shape, true, spec), 2.0 * H * (21 + 44 * 6) * (2 * E));
}

TEST(SoftmaxAttentionWindow, DispatchAndRefusals) {
  const auto q = torch::randn({1, 4, 3, 8}), k = torch::randn({1, 4, 5, 8}), v = torch::randn({1, 4, 5, 8});
  const auto o = SoftmaxAttentionFuncOptions().window(2);
  EXPECT_TRUE(attnkit::softmax_attention_dispatch(q, k, v, o).uses_kernel());
  const auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16); };
  EXPECT_EQ(attnkit::softmax_attention_dispatch(bf(q), bf(k), bf(v), o).reason, "bf16 converted to float32 (a window)");
  using attnkit::testing::expect_error;
  expect_error([&] { attnkit::softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().window(-1)); },
               {"softmax_attention", "option 'window' must be >= 0 (0: no window), got -1"});
  expect_error([] { attnkit::nn::resolve_mechanism("full:window=-2"); }, {"full", "window", "-2"});
}

}  // namespace

// A NaN score reaches its query's output and lse, whichever path takes the
// band: one tile by columns, the row-major tiles (with ALiBi), and the
// forward's key split (L = 1 over 2100 keys), where a chunk whose maximum
// lost the NaN would be merged as empty.
TEST(SoftmaxAttentionWindow, ANaNScoreReachesItsQuery) {
  struct Shape {
    int64_t L, S, window;
    bool alibi;
  };
  for (const Shape s : {Shape{40, 40, 8, false}, Shape{40, 40, 8, true}, Shape{1, 2100, 700, false}}) {
    torch::manual_seed(5);
    auto q = torch::randn({1, 2, s.L, 8}), k = torch::randn({1, 2, s.S, 8}), v = torch::randn({1, 2, s.S, 8});
    q[0][1][s.L - 1][3] = std::numeric_limits<float>::quiet_NaN();
    auto o = SoftmaxAttentionFuncOptions().window(s.window).causal(true);
    if (s.alibi) o.alibi_slopes(attnkit::alibi_slopes(2));
    const auto out = attnkit::softmax_attention(q, k, v, o);
    const std::string what = "L " + std::to_string(s.L) + ", S " + std::to_string(s.S) + (s.alibi ? ", ALiBi" : "");
    EXPECT_TRUE(torch::isnan(out[0][1][s.L - 1]).all().item<bool>()) << what;
    EXPECT_TRUE(torch::isfinite(out[0][0]).all().item<bool>()) << what;  // the other head is untouched
    if (s.L > 1) EXPECT_TRUE(torch::isfinite(out[0][1].slice(0, 0, s.L - 1)).all().item<bool>()) << what;
  }
}

}  // namespace softmax_attention_window_test
