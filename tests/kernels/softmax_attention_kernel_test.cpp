// The exact softmax attention kernel (src/kernels/softmax_attention.*), called
// through its Params structs, against a float64 reference written out in plain
// loops below; and the vectorised exp of src/kernels/common/vec.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/common/isa.h"
#include "kernels/common/threading.h"
#include "kernels/common/vec.h"
#include "kernels/softmax_attention.h"

namespace softmax_attention_kernel_test {

namespace {

namespace kernels = attnkit::kernels;

// Tolerance of every kernel result (out, lse, dq, dk, dv) against the float64
// reference: |kernel - reference| <= kTolerance * mag per element, where mag is
// the element's error scale (the sum of the absolute values of its terms, see
// Result below; for lse, 1 + sigma + |lse|). The longest sums here have 1000
// terms; float32 sums of n terms typically err by sqrt(n) u = 32 u (u = 2^-24,
// the unit roundoff), so allow twice that: 64 u = 3.8e-6. Measured worst over
// every case in this file: out 3.6 u, lse 2.5 u, dq 0.9 u, dk 2.1 u, dv 4.5 u.
constexpr double kTolerance = 64.0 / (1 << 24);
// vec::exp: error in ulps of the result, over [-87, 88] (see vec.h).
constexpr double kExpMaxUlp = 2.0;

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------
// Strided float tensors of rank 4
// ---------------------------------------------------------------------------

/// How a tensor of logical shape (N, H, rows, cols) is laid out in memory.
enum class Layout {
  contiguous,   // (N, H, rows, cols)
  seq_major,    // stored (N, rows, H, cols): the usual (N, L, H, E) projection output
  transposed,   // stored (N, H, cols, rows): columns not contiguous, the kernel packs
  padded,       // contiguous with 5 unused floats after every row
  cache,        // the first `rows` rows of a contiguous (N, H, rows + 37, cols) buffer:
                // a decoding cache viewed as big.narrow(2, 0, rows)
};

const char* name(Layout layout) {
  switch (layout) {
    case Layout::contiguous: return "contiguous";
    case Layout::seq_major: return "seq_major";
    case Layout::transposed: return "transposed";
    case Layout::padded: return "padded";
    case Layout::cache: return "cache";
  }
  return "?";
}

struct Tensor4 {
  std::array<int64_t, 4> shape{};
  std::array<int64_t, 4> stride{};
  std::vector<float> data;

  float& at(int64_t a, int64_t b, int64_t c, int64_t d) {
    return data[a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]];
  }
  float at(int64_t a, int64_t b, int64_t c, int64_t d) const {
    return data[a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]];
  }
};

/// A tensor of the given shape and layout, every element (and the padding) NaN,
/// so that anything the kernel fails to write shows up.
Tensor4 make_tensor(std::array<int64_t, 4> shape, Layout layout) {
  // Storage order of the logical dimensions, outermost first.
  std::array<int, 4> order = {0, 1, 2, 3};
  if (layout == Layout::seq_major) order = {0, 2, 1, 3};
  if (layout == Layout::transposed) order = {0, 1, 3, 2};
  const int64_t pad = layout == Layout::padded ? 5 : 0;
  const int64_t spare_rows = layout == Layout::cache ? 37 : 0;
  Tensor4 t;
  t.shape = shape;
  int64_t size = 1;
  for (int d = 3; d >= 0; --d) {
    t.stride[order[d]] = size;
    size *= shape[order[d]] + (d == 3 ? pad : 0) + (order[d] == 2 ? spare_rows : 0);
  }
  t.data.assign(static_cast<std::size_t>(size), std::numeric_limits<float>::quiet_NaN());
  return t;
}

void fill_normal(Tensor4& t, std::mt19937& rng, float gain = 1.f) {
  std::normal_distribution<float> normal(0.f, gain);
  for (int64_t a = 0; a < t.shape[0]; ++a)
    for (int64_t b = 0; b < t.shape[1]; ++b)
      for (int64_t c = 0; c < t.shape[2]; ++c)
        for (int64_t d = 0; d < t.shape[3]; ++d) t.at(a, b, c, d) = normal(rng);
}

// ---------------------------------------------------------------------------
// A problem: sizes, masks, inputs
// ---------------------------------------------------------------------------

/// Which dimensions of (N, H, L, S) the bias has; the others broadcast.
enum class BiasShape { none, full, rows_keys, rows, batch_keys };

struct Case {
  int64_t N = 1, H = 1, L = 1, S = 1, E = 16, M = 16;
  bool causal = false;
  std::vector<int64_t> key_lengths;  // empty: none
  BiasShape bias = BiasShape::none;
  double bias_inf_fraction = 0.0;    // share of bias entries that are -inf
  int64_t bias_inf_keys = 0;         // the bias hides keys [0, bias_inf_keys) too
  Layout layout = Layout::contiguous;
  float q_gain = 1.f;                // larger: peakier softmax, larger max jumps

  std::string str() const {
    std::ostringstream s;
    s << "N=" << N << " H=" << H << " L=" << L << " S=" << S << " E=" << E << " M=" << M
      << " causal=" << causal << " key_lengths=[";
    for (auto k : key_lengths) s << k << ",";
    s << "] bias=" << static_cast<int>(bias) << " inf=" << bias_inf_fraction
      << " hidden_keys=" << bias_inf_keys << " layout=" << name(layout) << " q_gain=" << q_gain;
    return s.str();
  }
};

struct Inputs {
  Tensor4 q, k, v, dout, bias;
  float scale = 1.f;
};

Inputs make_inputs(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Inputs in;
  in.q = make_tensor({c.N, c.H, c.L, c.E}, c.layout);
  in.k = make_tensor({c.N, c.H, c.S, c.E}, c.layout);
  in.v = make_tensor({c.N, c.H, c.S, c.M}, c.layout);
  in.dout = make_tensor({c.N, c.H, c.L, c.M}, c.layout);
  fill_normal(in.q, rng, c.q_gain);
  fill_normal(in.k, rng);
  fill_normal(in.v, rng);
  fill_normal(in.dout, rng);
  in.scale = 1.f / std::sqrt(static_cast<float>(c.E));
  if (c.bias != BiasShape::none) {
    std::array<int64_t, 4> shape = {c.N, c.H, c.L, c.S};
    if (c.bias == BiasShape::rows_keys) shape = {1, 1, c.L, c.S};
    if (c.bias == BiasShape::rows) shape = {c.N, c.H, c.L, 1};
    if (c.bias == BiasShape::batch_keys) shape = {c.N, 1, 1, c.S};
    in.bias = make_tensor(shape, Layout::contiguous);
    fill_normal(in.bias, rng);
    std::bernoulli_distribution hide(c.bias_inf_fraction);
    for (float& b : in.bias.data) b = hide(rng) ? -std::numeric_limits<float>::infinity() : b;
    for (int64_t a = 0; a < shape[0]; ++a)
      for (int64_t b = 0; b < shape[1]; ++b)
        for (int64_t i = 0; i < shape[2]; ++i)
          for (int64_t j = 0; j < std::min(c.bias_inf_keys, shape[3]); ++j)
            in.bias.at(a, b, i, j) = -std::numeric_limits<float>::infinity();
    for (int d = 0; d < 4; ++d)
      if (shape[d] == 1) in.bias.stride[d] = 0;  // stride 0: broadcast
  }
  return in;
}

// ---------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------

struct Outputs {
  Tensor4 out, dq, dk, dv;
  std::vector<float> lse;
};

class ThreadSetting {
 public:
  explicit ThreadSetting(int threads) : previous_(kernels::num_threads()) {
    kernels::set_num_threads(threads);
  }
  ~ThreadSetting() { kernels::set_num_threads(previous_); }

 private:
  int previous_;
};

void set_strides(int64_t (&to)[4], const Tensor4& t) { std::copy(t.stride.begin(), t.stride.end(), to); }

Outputs run_kernel(const Case& c, const Inputs& in, int threads) {
  ThreadSetting setting(threads);
  Outputs o;
  o.out = make_tensor({c.N, c.H, c.L, c.M}, c.layout);
  o.dq = make_tensor({c.N, c.H, c.L, c.E}, c.layout);
  o.dk = make_tensor({c.N, c.H, c.S, c.E}, c.layout);
  o.dv = make_tensor({c.N, c.H, c.S, c.M}, c.layout);
  o.lse.assign(static_cast<std::size_t>(c.N * c.H * c.L), std::numeric_limits<float>::quiet_NaN());

  kernels::SoftmaxAttentionBackwardParams p;
  p.q = in.q.data.data();
  set_strides(p.q_stride, in.q);
  p.k = in.k.data.data();
  set_strides(p.k_stride, in.k);
  p.v = in.v.data.data();
  set_strides(p.v_stride, in.v);
  p.out = o.out.data.data();
  set_strides(p.out_stride, o.out);
  p.lse = o.lse.data();
  p.N = c.N, p.H = c.H, p.L = c.L, p.S = c.S, p.E = c.E, p.M = c.M;
  p.scale = in.scale;
  p.causal = c.causal;
  p.key_lengths = c.key_lengths.empty() ? nullptr : c.key_lengths.data();
  if (c.bias != BiasShape::none) {
    p.bias = in.bias.data.data();
    set_strides(p.bias_stride, in.bias);
  }
  kernels::softmax_attention_forward(p);

  p.dout = in.dout.data.data();
  set_strides(p.dout_stride, in.dout);
  p.dq = o.dq.data.data();
  set_strides(p.dq_stride, o.dq);
  p.dk = o.dk.data.data();
  set_strides(p.dk_stride, o.dk);
  p.dv = o.dv.data.data();
  set_strides(p.dv_stride, o.dv);
  kernels::softmax_attention_backward(p);
  return o;
}

// ---------------------------------------------------------------------------
// The float64 reference, straight from docs/MATH.md, "Exact softmax attention"
// ---------------------------------------------------------------------------

/// Each result with the scale of its float32 rounding error. `mag` holds, per
/// element, the sum of the absolute values of the terms that make it up, each
/// term's P weighted by (1 + sigma_i), sigma_i = max_j (scale sum_e |q_ie k_je|
/// + |bias_ij|): a score, and so log P, carries an absolute rounding error of
/// about u * sigma_i. In dS = P (dP - D), dP_ij and D_i count with the sums of
/// |dO_im v_jm| and P_ij |dO_im v_jm|. The float32 error of an element is a
/// modest multiple of u = 2^-24 times its mag, however much the terms cancel.
struct Result {
  std::vector<double> value, mag;  // contiguous (N, H, rows, cols)
};

struct Reference {
  Result out, dq, dk, dv;
  std::vector<double> lse;       // (N, H, L)
  std::vector<double> lse_mag;   // (N, H, L): 1 + sigma_i + |lse_i|
  std::vector<bool> row_masked;  // (N, H, L): no visible key
  std::vector<bool> key_unseen;  // (N, H, S): visible to no query
};

Reference reference(const Case& c, const Inputs& in) {
  const int64_t N = c.N, H = c.H, L = c.L, S = c.S, E = c.E, M = c.M;
  Reference r;
  for (auto [result, size] : {std::pair{&r.out, N * H * L * M}, std::pair{&r.dq, N * H * L * E},
                              std::pair{&r.dk, N * H * S * E}, std::pair{&r.dv, N * H * S * M}}) {
    result->value.assign(size, 0.0);
    result->mag.assign(size, 0.0);
  }
  r.lse.assign(N * H * L, -kInf);
  r.lse_mag.assign(N * H * L, 0.0);
  r.row_masked.assign(N * H * L, true);
  r.key_unseen.assign(N * H * S, true);
  std::vector<double> s(S), p(S), dp(S), dp_mag(S);
  std::vector<bool> visible(S);
  const double scale = in.scale;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        const int64_t row = (n * H + h) * L + i;
        double mx = -kInf, sigma = 0.0;
        for (int64_t j = 0; j < S; ++j) {
          const double b = c.bias == BiasShape::none ? 0.0 : in.bias.at(n, h, i, j);
          visible[j] = (c.key_lengths.empty() || j < c.key_lengths[n]) &&
                       (!c.causal || j <= i + S - L) && b != -kInf;
          if (!visible[j]) continue;
          double dot = 0.0, dot_mag = 0.0;
          for (int64_t e = 0; e < E; ++e) {
            dot += double(in.q.at(n, h, i, e)) * in.k.at(n, h, j, e);
            dot_mag += std::fabs(double(in.q.at(n, h, i, e)) * in.k.at(n, h, j, e));
          }
          s[j] = scale * dot + b;
          mx = std::max(mx, s[j]);
          sigma = std::max(sigma, scale * dot_mag + std::fabs(b));
        }
        if (mx == -kInf) continue;  // no visible key: zeros, lse = -inf
        r.row_masked[row] = false;
        double sum = 0.0;
        for (int64_t j = 0; j < S; ++j) sum += visible[j] ? std::exp(s[j] - mx) : 0.0;
        r.lse[row] = mx + std::log(sum);
        r.lse_mag[row] = 1.0 + sigma + std::fabs(r.lse[row]);
        const double weight = 1.0 + sigma;  // P's relative error, in units of u
        double d = 0.0, d_mag = 0.0;       // D_i = sum_j P_ij dP_ij = dO_i . O_i
        for (int64_t j = 0; j < S; ++j) {
          p[j] = visible[j] ? std::exp(s[j] - mx) / sum : 0.0;
          dp[j] = dp_mag[j] = 0.0;
          if (!visible[j]) continue;
          r.key_unseen[(n * H + h) * S + j] = false;
          for (int64_t m = 0; m < M; ++m) {
            const double vjm = in.v.at(n, h, j, m), g = in.dout.at(n, h, i, m);
            r.out.value[row * M + m] += p[j] * vjm;
            r.out.mag[row * M + m] += weight * p[j] * std::fabs(vjm);
            dp[j] += g * vjm;
            dp_mag[j] += std::fabs(g * vjm);
          }
          d += p[j] * dp[j];
          d_mag += p[j] * dp_mag[j];
        }
        for (int64_t j = 0; j < S; ++j) {
          if (!visible[j]) continue;
          const double ds = p[j] * (dp[j] - d), ds_mag = weight * p[j] * (dp_mag[j] + d_mag);
          const int64_t key = (n * H + h) * S + j;
          for (int64_t m = 0; m < M; ++m) {
            const double g = in.dout.at(n, h, i, m);
            r.dv.value[key * M + m] += p[j] * g;
            r.dv.mag[key * M + m] += weight * p[j] * std::fabs(g);
          }
          for (int64_t e = 0; e < E; ++e) {
            const double kje = in.k.at(n, h, j, e), qie = in.q.at(n, h, i, e);
            r.dq.value[row * E + e] += scale * ds * kje;
            r.dq.mag[row * E + e] += scale * ds_mag * std::fabs(kje);
            r.dk.value[key * E + e] += scale * ds * qie;
            r.dk.mag[key * E + e] += scale * ds_mag * std::fabs(qie);
          }
        }
      }
  return r;
}

// ---------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------

/// max over elements of |got - value| / mag (see Result); infinite for a NaN,
/// or for any difference where mag is 0 (there the result must be exactly 0).
double relative_error(const Tensor4& got, const Result& ref) {
  double worst = 0.0;
  const auto& sh = got.shape;
  for (int64_t a = 0, idx = 0; a < sh[0]; ++a)
    for (int64_t b = 0; b < sh[1]; ++b)
      for (int64_t c = 0; c < sh[2]; ++c)
        for (int64_t d = 0; d < sh[3]; ++d, ++idx) {
          const double diff = std::fabs(got.at(a, b, c, d) - ref.value[idx]);
          if (std::isnan(diff)) return kInf;
          if (diff > 0.0) worst = std::max(worst, ref.mag[idx] > 0.0 ? diff / ref.mag[idx] : kInf);
        }
  return worst;
}

/// Rows of a (N, H, rows, cols) tensor flagged in `zero_rows` must be exactly 0.
int64_t nonzero_in_rows(const Tensor4& t, const std::vector<bool>& zero_rows) {
  int64_t bad = 0;
  for (int64_t a = 0; a < t.shape[0]; ++a)
    for (int64_t b = 0; b < t.shape[1]; ++b)
      for (int64_t c = 0; c < t.shape[2]; ++c) {
        if (!zero_rows[(a * t.shape[1] + b) * t.shape[2] + c]) continue;
        for (int64_t d = 0; d < t.shape[3]; ++d) bad += t.at(a, b, c, d) != 0.f;
      }
  return bad;
}

/// The kernel's outputs o against the float64 reference r.
void expect_outputs_match(const Outputs& o, const Reference& r) {
  EXPECT_LE(relative_error(o.out, r.out), kTolerance) << "out";
  EXPECT_LE(relative_error(o.dq, r.dq), kTolerance) << "dq";
  EXPECT_LE(relative_error(o.dk, r.dk), kTolerance) << "dk";
  EXPECT_LE(relative_error(o.dv, r.dv), kTolerance) << "dv";
  double lse_err = 0.0;
  int64_t lse_bad = 0;
  for (std::size_t i = 0; i < r.lse.size(); ++i) {
    if (r.lse[i] == -kInf)
      lse_bad += o.lse[i] != -std::numeric_limits<float>::infinity();
    else
      lse_err = std::max(lse_err, std::fabs(o.lse[i] - r.lse[i]) / r.lse_mag[i]);
  }
  EXPECT_LE(lse_err, kTolerance) << "lse";  // a NaN makes this fail too
  EXPECT_EQ(lse_bad, 0) << "rows without a visible key must have lse = -inf";
  // Rows without a visible key: output and dq exactly 0; keys no row sees:
  // dk and dv exactly 0.
  EXPECT_EQ(nonzero_in_rows(o.out, r.row_masked), 0) << "out of fully masked rows";
  EXPECT_EQ(nonzero_in_rows(o.dq, r.row_masked), 0) << "dq of fully masked rows";
  EXPECT_EQ(nonzero_in_rows(o.dk, r.key_unseen), 0) << "dk of unseen keys";
  EXPECT_EQ(nonzero_in_rows(o.dv, r.key_unseen), 0) << "dv of unseen keys";
}

void expect_matches_reference(const Case& c, uint32_t seed = 1, int threads = 2) {
  SCOPED_TRACE(c.str());
  const Inputs in = make_inputs(c, seed);
  expect_outputs_match(run_kernel(c, in, threads), reference(c, in));
}

/// Bitwise equality of float arrays; NaN equals NaN (the padding and the spare
/// rows that no one writes stay NaN).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](float x, float y) {
    return (x == y && std::signbit(x) == std::signbit(y)) || (std::isnan(x) && std::isnan(y));
  });
}

void expect_same_bits(const Outputs& a, const Outputs& b) {
  EXPECT_TRUE(same_bits(a.out.data, b.out.data)) << "out";
  EXPECT_TRUE(same_bits(a.lse, b.lse)) << "lse";
  EXPECT_TRUE(same_bits(a.dq.data, b.dq.data)) << "dq";
  EXPECT_TRUE(same_bits(a.dk.data, b.dk.data)) << "dk";
  EXPECT_TRUE(same_bits(a.dv.data, b.dv.data)) << "dv";
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

// Every (L, S) pair of the sizes around the block sizes (1, a prime, 64 +- 1,
// 257, 1000), each with a different mix of head dims, masks, bias and layout.
TEST(SoftmaxKernel, SweepMatchesFloat64Reference) {
  const int64_t sizes[] = {1, 7, 63, 64, 65, 257, 1000};
  const std::array<int64_t, 2> dims[] = {{16, 64}, {64, 16}, {80, 128},
                                         {128, 80}, {64, 80}, {16, 128}};
  const BiasShape biases[] = {BiasShape::none, BiasShape::full, BiasShape::rows_keys,
                              BiasShape::rows, BiasShape::batch_keys};
  const Layout layouts[] = {Layout::contiguous, Layout::seq_major, Layout::transposed,
                            Layout::padded};
  int index = 0;
  for (int64_t L : sizes)
    for (int64_t S : sizes) {
      Case c;
      c.L = L;
      c.S = S;
      c.N = 2;
      c.H = L * S >= 64 * 1000 ? 1 : 2;  // keeps the float64 reference fast
      c.E = dims[index % 6][0];
      c.M = dims[index % 6][1];
      c.causal = index % 2 == 1;
      switch (index / 2 % 3) {
        case 0: break;
        case 1: c.key_lengths = {S, std::max<int64_t>(1, 2 * S / 3)}; break;
        case 2: c.key_lengths = {0, std::max<int64_t>(1, S / 3)}; break;
      }
      c.bias = biases[index % 5];
      c.bias_inf_fraction = index % 3 == 0 ? 0.1 : 0.0;
      c.layout = layouts[index / 3 % 4];
      c.q_gain = index % 4 == 3 ? 6.f : 1.f;
      expect_matches_reference(c, 100 + index);
      ++index;
    }
}

TEST(SoftmaxKernel, HeadDims256) {
  Case c;
  c.L = 130, c.S = 200, c.E = 256, c.M = 256, c.causal = true;
  expect_matches_reference(c);
  c.E = 256, c.M = 16, c.causal = false, c.bias = BiasShape::full;
  expect_matches_reference(c);
}

// Rows with no visible key, from each cause: key_lengths = 0, causal with
// L > S (the first L - S queries), and a bias row that is all -inf. They give
// out = 0, lse = -inf and zero gradients, never NaN (checked in
// expect_matches_reference), and do not disturb the other rows.
TEST(SoftmaxKernel, FullyMaskedRowsAreZero) {
  Case c;
  c.N = 2, c.H = 2, c.L = 150, c.S = 70, c.E = 64, c.M = 80;
  c.causal = true;
  c.key_lengths = {0, 33};
  expect_matches_reference(c);

  c.causal = false;
  c.key_lengths = {};
  c.bias = BiasShape::rows;  // (N, H, L, 1): one entry per row, broadcast over keys
  c.bias_inf_fraction = 0.3;
  expect_matches_reference(c);

  c.bias = BiasShape::full;
  c.bias_inf_fraction = 1.0;  // every score hidden
  expect_matches_reference(c);
}

TEST(SoftmaxKernel, EveryLayoutWithMasksAndBias) {
  for (Layout layout : {Layout::contiguous, Layout::seq_major, Layout::transposed, Layout::padded}) {
    Case c;
    c.N = 2, c.H = 3, c.L = 129, c.S = 300, c.E = 80, c.M = 16;
    c.causal = true;
    c.key_lengths = {300, 190};
    c.bias = BiasShape::batch_keys;
    c.bias_inf_fraction = 0.05;
    c.layout = layout;
    expect_matches_reference(c);
  }
}

// Without a bias tensor, dropout or a window the forward takes its tiles with
// the band kernels where they exist (avx2 and above; softmax_attention.cpp,
// by_lanes): blocks of 32 query rows over tiles of 256 keys, each tile's
// softmax joined to the block's state. Rows around the block's 32 and keys
// around the tile's 256, both alignments of the causal diagonal, key lengths
// ending inside a tile, head dims that are not multiples of 16, every layout,
// and peaky scores (q_gain) whose maximum moves from tile to tile.
TEST(SoftmaxKernel, LaneBlocksOverKeyTilesMatchTheReference) {
  const int64_t rows[] = {1, 31, 33, 96};
  const int64_t keys[] = {255, 256, 257, 700};
  const std::array<int64_t, 2> dims[] = {{64, 64}, {48, 80}, {20, 13}, {128, 32}};
  const Layout layouts[] = {Layout::contiguous, Layout::seq_major, Layout::transposed, Layout::padded};
  int index = 0;
  for (int64_t L : rows)
    for (int64_t S : keys) {
      Case c;
      c.N = 2, c.H = 2, c.L = L, c.S = S;
      c.E = dims[index % 4][0], c.M = dims[index % 4][1];
      c.causal = index % 2 == 0;
      if (index % 3 == 1) c.key_lengths = {S - 1, 129};
      c.layout = layouts[index / 2 % 4];
      c.q_gain = index % 4 == 1 ? 8.f : 1.f;
      expect_matches_reference(c, 300 + index);
      ++index;
    }
}

// A NaN score (here from a NaN in one key) makes the rows that see that key
// NaN, out and lse, and leaves the others finite: causal rows before the key,
// and the other batch element; in the first, a middle and the last key tile.
TEST(SoftmaxKernel, NaNKeyMakesTheRowsThatSeeItNaN) {
  Case c;
  c.N = 2, c.H = 1, c.L = 600, c.S = 600, c.E = 16, c.M = 16;
  c.causal = true;
  for (int64_t key : {0, 300, 599}) {
    SCOPED_TRACE("NaN key " + std::to_string(key));
    Inputs in = make_inputs(c, 60);
    in.k.at(0, 0, key, 5) = std::numeric_limits<float>::quiet_NaN();
    const Outputs o = run_kernel(c, in, 2);
    for (int64_t i = 0; i < c.L; ++i) {
      ASSERT_EQ(std::isnan(o.lse[i]), i >= key) << "row " << i;
      ASSERT_TRUE(std::isfinite(o.lse[c.L + i])) << "row " << i << " of batch 1";
      for (int64_t m = 0; m < c.M; ++m) {
        ASSERT_EQ(std::isnan(o.out.at(0, 0, i, m)), i >= key) << "row " << i << " column " << m;
        ASSERT_TRUE(std::isfinite(o.out.at(1, 0, i, m))) << "row " << i << " column " << m;
      }
    }
  }
}

// Each head (backward) and query block (forward) is computed by one thread in a
// fixed order, so the thread count does not change a single bit. (Here the
// forward also groups query blocks into work items differently for 1 and 2
// threads, which must not matter either.)
TEST(SoftmaxKernel, OneAndTwoThreadsAgreeBitwise) {
  Case c;
  c.N = 2, c.H = 1, c.L = 1000, c.S = 257, c.E = 64, c.M = 80;
  c.causal = true;
  c.key_lengths = {257, 100};
  c.bias = BiasShape::rows_keys;
  c.bias_inf_fraction = 0.05;
  c.layout = Layout::seq_major;
  const Inputs in = make_inputs(c, 7);
  expect_same_bits(run_kernel(c, in, 1), run_kernel(c, in, 2));
}

// With N H < 8 and no bias the backward splits each head's keys into parts
// (softmax_attention.cpp, backward_parts): here 4 parts of a head, their dq
// summed in part order, so two threads run it in parallel and must still give
// the one-thread bits; and the float64 reference holds (also with key lengths
// ending inside a part and a part of keys no query sees).
TEST(SoftmaxKernel, KeyPartsOfOneHeadMatchTheReferenceOnOneAndTwoThreads) {
  for (const bool causal : {false, true}) {
    Case c;
    c.N = 1, c.H = 1, c.L = 300, c.S = 1000, c.E = 48, c.M = 80;
    c.causal = causal;
    c.key_lengths = {600};
    c.layout = Layout::seq_major;
    SCOPED_TRACE(c.str());
    const Inputs in = make_inputs(c, 17);
    const Outputs one = run_kernel(c, in, 1), two = run_kernel(c, in, 2);
    expect_outputs_match(one, reference(c, in));
    expect_same_bits(one, two);
  }
}

// ---------------------------------------------------------------------------
// Decoding: few queries over many keys, where the forward splits the keys of
// each (batch, head, query block) into chunks and merges them (see
// softmax_attention.h). Same tolerance as above: the longest sums here have
// 20000 terms, but the kernel adds them in blocks of at most 256 keys (inside
// sgemm; 16 lanes of 16 terms in exp_shift_sum) and adds the block results of
// a row in sequence (at most 79 blocks at S = 20000, spread over chunks that
// are merged in order), so no chain of roundings is longer than 256 + 79
// additions: sqrt(335) u = 18 u typically, within the 64 u set for sums of
// 1000 terms. Measured worst over these tests (both thread counts): out 0.7 u,
// lse 0.8 u, dq 0.2 u, dk 1.2 u, dv 3.6 u.
// ---------------------------------------------------------------------------

/// How many chunks the forward cuts each item's keys into for c's shape.
int64_t key_chunks(const Case& c) {
  kernels::SoftmaxAttentionParams p;
  p.N = c.N, p.H = c.H, p.L = c.L, p.S = c.S, p.E = c.E, p.M = c.M;
  return kernels::softmax_attention_forward_key_chunks(p);
}

/// c against the float64 reference on one and on two threads, and the two
/// bitwise equal (the chunking depends on the shape alone).
void expect_decode_case(const Case& c, uint32_t seed) {
  SCOPED_TRACE(c.str() + " chunks=" + std::to_string(key_chunks(c)));
  const Inputs in = make_inputs(c, seed);
  const Reference r = reference(c, in);
  const Outputs one = run_kernel(c, in, 1), two = run_kernel(c, in, 2);
  {
    SCOPED_TRACE("1 thread");
    expect_outputs_match(one, r);
  }
  {
    SCOPED_TRACE("2 threads");
    expect_outputs_match(two, r);
  }
  expect_same_bits(one, two);
}

// L = 1, 2, 3 queries over S keys, N H = 1, 2, 3, each case with a different
// mix of head dims (E != M), masks (causal with L < S, key_lengths with 0 and
// with lengths shorter than a chunk), bias, a peaked softmax and strided
// layouts: a decoding cache viewed as big.narrow(2, 0, S), transposed
// (packed) columns, and the (N, L, H, E) projection layout.
TEST(SoftmaxKernelDecode, SweepMatchesFloat64ReferenceOnOneAndTwoThreads) {
  const int64_t key_counts[] = {1, 7, 64, 1000, 4097, 20000};
  const std::array<int64_t, 2> batch_heads[] = {{1, 1}, {2, 1}, {1, 3}};  // (N, H)
  const std::array<int64_t, 2> dims[] = {{64, 32}, {16, 80}, {80, 64}};    // (E, M)
  const Layout layouts[] = {Layout::cache, Layout::transposed, Layout::seq_major};
  const BiasShape biases[] = {BiasShape::none, BiasShape::batch_keys, BiasShape::none,
                              BiasShape::full};
  int index = 0;
  for (int64_t L : {1, 2, 3})
    for (int64_t S : key_counts)
      for (const auto& nh : batch_heads) {
        Case c;
        c.N = nh[0], c.H = nh[1], c.L = L, c.S = S;
        c.E = dims[index / 3 % 3][0], c.M = dims[index / 3 % 3][1];
        c.causal = index % 2 == 0;
        for (int64_t n = 0; n < c.N; ++n) {
          switch (index / 2 % 4) {
            case 0: break;                                                       // none
            case 1: c.key_lengths.push_back(n == 0 ? 0 : std::min<int64_t>(S, 300)); break;
            case 2: c.key_lengths.push_back(std::min<int64_t>(S, 5 + 1000 * n)); break;
            case 3: c.key_lengths.push_back(std::max<int64_t>(1, S - 1 - n)); break;
          }
        }
        c.bias = biases[index % 4];
        c.bias_inf_fraction = index % 3 == 1 ? 0.1 : 0.0;
        c.layout = layouts[(index / 3 + index) % 3];  // all three at every (L, S)
        c.q_gain = index % 5 == 4 ? 6.f : 1.f;
        // Every shape here has under 64 items, so exactly the long ones split.
        EXPECT_EQ(key_chunks(c) > 1, S >= 2048) << c.str();
        expect_decode_case(c, 200 + index);
        ++index;
      }
}

// key_lengths around the chunk edges (here 8 chunks of 2560 keys): empty,
// shorter than a block, ending just before, at and after a chunk edge; with
// the causal mask, and one to three threads.
TEST(SoftmaxKernelDecode, KeyLengthsAroundChunkEdges) {
  Case c;
  c.N = 8, c.H = 1, c.L = 2, c.S = 20000, c.E = 32, c.M = 48;
  c.key_lengths = {0, 1, 255, 2559, 2560, 2561, 12345, 20000};
  c.layout = Layout::cache;
  ASSERT_EQ(key_chunks(c), 8);
  for (bool causal : {false, true}) {
    c.causal = causal;
    expect_decode_case(c, 31);
    const Inputs in = make_inputs(c, 32);
    expect_same_bits(run_kernel(c, in, 1), run_kernel(c, in, 3));
  }
}

// A bias of -inf hides whole chunks (here 4 chunks of 1280 keys): the first
// two and most of the third, all but the last key, or every key. The merge
// must skip the empty chunks and give zeros (lse -inf) when all are empty.
TEST(SoftmaxKernelDecode, ChunksHiddenByTheBias) {
  Case c;
  c.N = 2, c.H = 1, c.L = 1, c.S = 4097, c.E = 64, c.M = 64;
  c.bias = BiasShape::batch_keys;
  ASSERT_EQ(key_chunks(c), 4);
  for (int64_t hidden : {3000, 4096, 4097}) {
    c.bias_inf_keys = hidden;
    expect_decode_case(c, 40);
  }
  c.bias_inf_keys = 0;
  c.bias = BiasShape::full;
  c.L = 3;
  c.causal = true;
  c.bias_inf_fraction = 0.999;  // most rows see a handful of keys, scattered over the chunks
  expect_decode_case(c, 41);
}

// A NaN score in any chunk makes its row's out and lse NaN, as without the
// split (softmax_attention.h); rows of the other batch element stay finite.
TEST(SoftmaxKernelDecode, NaNScoreInAnyChunkMakesTheRowNaN) {
  Case c;
  c.N = 2, c.H = 1, c.L = 1, c.S = 4097, c.E = 16, c.M = 16;
  ASSERT_EQ(key_chunks(c), 4);
  for (int64_t key : {0, 1279, 1280, 3000, 4096}) {
    SCOPED_TRACE("NaN key " + std::to_string(key));
    Inputs in = make_inputs(c, 50);
    in.k.at(0, 0, key, 3) = std::numeric_limits<float>::quiet_NaN();
    const Outputs o = run_kernel(c, in, 2);
    EXPECT_TRUE(std::isnan(o.lse[0]));
    EXPECT_TRUE(std::isfinite(o.lse[1]));
    for (int64_t m = 0; m < c.M; ++m) {
      EXPECT_TRUE(std::isnan(o.out.at(0, 0, 0, m))) << m;
      EXPECT_TRUE(std::isfinite(o.out.at(1, 0, 0, m))) << m;
    }
  }
}

// Which shapes split: S >= 2048 with under 64 (batch, head, query block)
// items; the chunks are whole 256-key blocks of at least 1024 keys.
TEST(SoftmaxKernelDecode, WhichShapesSplit) {
  Case c;
  c.N = 1, c.H = 1, c.L = 1;
  c.S = 2047;
  EXPECT_EQ(key_chunks(c), 1);
  c.S = 2048;
  EXPECT_EQ(key_chunks(c), 2);
  c.S = 16384;
  EXPECT_EQ(key_chunks(c), 16);  // 64 items wanted, 1024-key chunks
  c.H = 4;
  EXPECT_EQ(key_chunks(c), 16);  // 4 x 16 = 64 items
  c.H = 8;
  EXPECT_EQ(key_chunks(c), 8);
  c.H = 64;
  EXPECT_EQ(key_chunks(c), 1);  // 64 items already
  c.H = 1, c.L = 129;
  EXPECT_EQ(key_chunks(c), 16);  // two query blocks, 32 chunks wanted, 16 at most
  c.L = 64 * 128;
  EXPECT_EQ(key_chunks(c), 1);
  c.L = 1, c.N = 0;
  EXPECT_EQ(key_chunks(c), 1);
}

// ---------------------------------------------------------------------------
// vec::exp
// ---------------------------------------------------------------------------

/// |got - exp(x)| in units of the float spacing at exp(x) (normal results).
double exp_error_ulp(float x, float got) {
  const double want = std::exp(static_cast<double>(x));
  return std::fabs(got - want) / std::ldexp(1.0, std::ilogb(want) - 23);
}

TEST(SoftmaxKernelExp, AccurateOverTheSoftmaxRange) {
  // Every 37th float in [-87, 0] (3e7 values), random samples up to 88, and
  // every float in [88.37, 88.72], the largest finite results: where n =
  // round(x / ln 2) reaches 128 and AVX2's exp8 builds 2^n as 2^127 * 2.
  std::vector<float> x;
  for (uint32_t bits = 0x80000000u;; bits += 37) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    if (f < -87.f) break;
    x.push_back(f);
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> wide(-87.f, 88.f);
  for (int i = 0; i < 1000000; ++i) x.push_back(wide(rng));
  for (float f = 88.37f; f <= 88.72f; f = std::nextafter(f, 89.f)) x.push_back(f);
  std::vector<float> y(x.size());
  kernels::vec_exp_array(x.data(), y.data(), static_cast<int64_t>(x.size()));
  double worst = 0.0;
  float worst_x = 0.f;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double err = exp_error_ulp(x[i], y[i]);
    if (!(err <= worst)) worst = err, worst_x = x[i];
  }
  EXPECT_LE(worst, kExpMaxUlp) << "at x = " << worst_x << " (" << kernels::isa::describe() << ")";
}

// exp(-inf) and everything below exp(-87) is exactly 0 (vec.h flushes there
// rather than produce subnormals); overflow gives +inf; NaN stays NaN.
TEST(SoftmaxKernelExp, SpecialValuesAndUnderflow) {
  const float inf = std::numeric_limits<float>::infinity();
  const float in[] = {-inf, -1e30f, -200.f, -104.f, -95.f, -87.01f, -0.f, 0.f, 89.f, inf};
  const float want[] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 1.f, 1.f, inf, inf};
  constexpr int count = sizeof in / sizeof in[0];
  float out[count];
  kernels::vec_exp_array(in, out, count);
  for (int i = 0; i < count; ++i) EXPECT_EQ(out[i], want[i]) << "exp(" << in[i] << ")";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float nan_out = 0.f;
  kernels::vec_exp_array(&nan, &nan_out, 1);
  EXPECT_TRUE(std::isnan(nan_out));
  // Just above the flush threshold the result is a normal float, and accurate.
  const float edge = -87.f;
  float edge_out = 0.f;
  kernels::vec_exp_array(&edge, &edge_out, 1);
  EXPECT_GE(edge_out, std::numeric_limits<float>::min());
  EXPECT_LE(exp_error_ulp(edge, edge_out), kExpMaxUlp);
}

// The softmax's weights exp(x - shift), x <= shift, by 2^((x - shift)
// log2(e)) (vec.h, softmax_exp16): within 2 ulp where x - shift >= -1, and
// everywhere within kSoftmaxExpMaxAbs of the exact value in units of 2^-24,
// the spacing of floats just below the row's largest weight, 1 (measured:
// 1.50 ulp and 1.09 x 2^-24 at avx512 and avx2, 0.50 at the baseline's
// std::exp; exp16 of the difference, before, 1.26 ulp).
constexpr double kSoftmaxExpMaxAbs = 2.0;

TEST(SoftmaxKernelExp, SoftmaxWeightsAccurateNearTheMaximumAndSmallBelow) {
  const float shifts[] = {0.f, 3.25f, -17.5f, 60.f};
  for (const float shift : shifts) {
    // Every 97th float of x - shift in [-87, 0] (1.1e7 values), x rounded.
    std::vector<float> x;
    for (uint32_t bits = 0x80000000u;; bits += 97) {
      float d;
      std::memcpy(&d, &bits, sizeof d);
      if (d < -87.f) break;
      x.push_back(shift + d);
    }
    std::vector<float> y(x.size());
    kernels::vec_softmax_exp_array(x.data(), y.data(), static_cast<int64_t>(x.size()), shift);
    double worst_ulp = 0.0, worst_abs = 0.0;
    float worst_ulp_x = 0.f, worst_abs_x = 0.f;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double want = std::exp(static_cast<double>(x[i]) - shift);
      if (want < std::numeric_limits<float>::min()) {
        EXPECT_GE(y[i], 0.f);
        EXPECT_LE(y[i], 2 * std::numeric_limits<float>::min());
        continue;
      }
      const double abs_err = std::fabs(y[i] - want) * (1 << 24);
      if (!(abs_err <= worst_abs)) worst_abs = abs_err, worst_abs_x = x[i];
      if (static_cast<double>(x[i]) - shift >= -1.0) {
        const double ulp = std::fabs(y[i] - want) / std::ldexp(1.0, std::ilogb(want) - 23);
        if (!(ulp <= worst_ulp)) worst_ulp = ulp, worst_ulp_x = x[i];
      }
    }
    EXPECT_LE(worst_ulp, kExpMaxUlp) << "shift " << shift << ", x = " << worst_ulp_x << " ("
                                     << kernels::isa::describe() << ")";
    EXPECT_LE(worst_abs, kSoftmaxExpMaxAbs) << "shift " << shift << ", x = " << worst_abs_x << " ("
                                            << kernels::isa::describe() << ")";
    std::printf("[          ] shift %g: worst %.3f ulp near the maximum, %.3f x 2^-24 absolute\n", shift,
                worst_ulp, worst_abs);
  }
}

// A masked score (-inf) weighs exactly 0, as does anything below exp(-87);
// NaN stays NaN; exp of a difference too large for a float is +inf.
TEST(SoftmaxKernelExp, SoftmaxWeightsOfSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float shift = 2.5f;
  const float in[] = {-inf, -1e30f, -200.f, -87.01f + shift, shift, 89.f + shift, inf};
  const float want[] = {0.f, 0.f, 0.f, 0.f, 1.f, inf, inf};
  constexpr int count = sizeof in / sizeof in[0];
  float out[count];
  kernels::vec_softmax_exp_array(in, out, count, shift);
  for (int i = 0; i < count; ++i) EXPECT_EQ(out[i], want[i]) << "exp(" << in[i] << " - " << shift << ")";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float nan_out = 0.f;
  kernels::vec_softmax_exp_array(&nan, &nan_out, 1, shift);
  EXPECT_TRUE(std::isnan(nan_out));
  // The sum returned is the weights' (float sums of 16 or 8 lanes: 1e-6).
  std::vector<float> row(1000), weights(row.size());
  for (std::size_t i = 0; i < row.size(); ++i) row[i] = shift - 0.01f * static_cast<float>(i);
  const float sum = kernels::vec_softmax_exp_array(row.data(), weights.data(), static_cast<int64_t>(row.size()), shift);
  double total = 0.0;
  for (const float w : weights) total += w;
  EXPECT_NEAR(sum, total, 1e-6 * total);
  // Just above the flush threshold the weight is a normal float.
  const float edge = -86.6f + shift;
  float edge_out = 0.f;
  kernels::vec_softmax_exp_array(&edge, &edge_out, 1, shift);
  EXPECT_GE(edge_out, std::numeric_limits<float>::min());
}

}  // namespace

}  // namespace softmax_attention_kernel_test
