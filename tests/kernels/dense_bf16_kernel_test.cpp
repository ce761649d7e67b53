// bfloat16 dense layer: kernels::gemm_bf16 (oneDNN's matmul, or float32
// conversion) against float64, and attnkit::linear on bf16 inputs against
// float64 by the FlashAttention accuracy rule, on every path this machine has
// (the native one, and the float32 conversion forced by force_bf16_float32).
//
// The accuracy rule (issue 17): on the same bf16 inputs, the error of our bf16
// output and of each bf16 gradient against the float64 computation is at most
// 2x the error of libtorch's own bf16 composite (torch::linear in bf16 and its
// autograd) against the same float64 result. Both round every result to bf16
// (relative rounding error up to 2^-8), which dominates the float32
// accumulation error, so the ratio is about 1 when we accumulate in float32.
// Measured here (AMX machine, ratio = our max |error| / torch's max |error|,
// worst over the cases and 1 and 2 threads): see kMeasured below.
//
// ctest also runs these tests with ATTNKIT_MAX_ISA=avx512_bf16 (the
// AVX512_BF16 kernels of a CPU without AMX) and ATTNKIT_MAX_ISA=avx512 (a CPU
// without AVX512_BF16: the op must find the float32 path by itself), and
// scripts/test runs the whole unit suite at every lower level; see
// tests/CMakeLists.txt.
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "kernels/common/isa.h"
#include "kernels/gemm_bf16.h"
#include "test_util.h"

namespace attnkit::dense_bf16_kernel_test {
namespace {

using kernels::bf16;
using testing::expect_error;
using testing::f64;

/// Forces the float32 conversion path for its lifetime.
class ForceFloat32 {
 public:
  ForceFloat32() : previous_(kernels::force_bf16_float32(true)) {}
  ~ForceFloat32() { kernels::force_bf16_float32(previous_); }

 private:
  bool previous_;
};

using testing::ThreadsGuard;

const bf16* bf16_data(const torch::Tensor& t) {
  return reinterpret_cast<const bf16*>(t.data_ptr<c10::BFloat16>());
}
bf16* bf16_data(torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<c10::BFloat16>()); }

// ---------------------------------------------------------------------------
// Conversions
// ---------------------------------------------------------------------------

TEST(Bf16Conversion, RoundsToNearestEvenLikeTorch) {
  // Random values over many binades, halfway cases (ties to even either way),
  // values that round up to the next binade or to infinity, signed zeros,
  // subnormals, infinities and NaN: every one as c10::BFloat16 rounds it.
  torch::manual_seed(11);
  auto values = torch::cat({torch::randn({4096}) * torch::exp(torch::randn({4096}) * 20),
                            torch::tensor({1.f + 1.f / 256, 1.f + 3.f / 256, -1.f - 1.f / 256,
                                           255.5f, 3.3895314e38f, 3.40282347e38f, 0.f, -0.f,
                                           1e-40f, -1e-41f, INFINITY, -INFINITY})});
  auto v = values.contiguous();
  const float* src = v.data_ptr<float>();
  std::vector<bf16> ours(v.numel());
  kernels::to_bf16(src, ours.data(), v.numel());
  const auto theirs = v.to(torch::kBFloat16);
  const auto* want = reinterpret_cast<const uint16_t*>(theirs.data_ptr<c10::BFloat16>());
  for (int64_t i = 0; i < v.numel(); ++i)
    ASSERT_EQ(ours[i].bits, want[i]) << "value " << src[i];
  // Back to float is exact.
  std::vector<float> back(v.numel());
  kernels::to_float(ours.data(), back.data(), v.numel());
  const auto theirs_back = theirs.to(torch::kFloat);
  for (int64_t i = 0; i < v.numel(); ++i) ASSERT_EQ(back[i], theirs_back[i].item<float>());
  // NaN stays NaN (torch's bit pattern for NaN may differ: only NaN-ness counts).
  EXPECT_TRUE(std::isnan(kernels::to_float(kernels::to_bf16(NAN))));
  EXPECT_TRUE(std::isnan(kernels::to_float(kernels::to_bf16(-NAN))));
}

// ---------------------------------------------------------------------------
// gemm_bf16 against float64
// ---------------------------------------------------------------------------

/// The inputs are bf16 values, so their products are exact in float32 and the
/// float64 result of the same formula is exact to 1e-16. A float32
/// accumulation of K products (plus bias and beta C: K + 2 terms) errs by at
/// most gamma_{K+2} = (K+2) u / (1 - (K+2) u), u = 2^-24, times the sum of the
/// terms' magnitudes, in any order; a bf16 C is then rounded once, adding at
/// most 2^-8 of the (accumulated) value. Checked per element; an indexing or
/// stride error shows as an O(1) violation.
struct GemmCase {
  bool trans_a, trans_b;
  int64_t m, n, k;
  int64_t pad_a, pad_b, pad_c;  // extra elements per stored row
  float alpha, beta;
  bool bias;
};

std::string describe(const GemmCase& c, bool c_bf16) {
  std::ostringstream s;
  s << (c.trans_a ? "A^T " : "A ") << (c.trans_b ? "B^T " : "B ") << "m=" << c.m << " n=" << c.n
    << " k=" << c.k << " pads=" << c.pad_a << "," << c.pad_b << "," << c.pad_c << " alpha=" << c.alpha
    << " beta=" << c.beta << (c.bias ? " bias" : "") << (c_bf16 ? " C bf16" : " C f32");
  return s.str();
}

void check_gemm(const GemmCase& c, bool c_bf16) {
  SCOPED_TRACE(describe(c, c_bf16));
  const int64_t a_rows = c.trans_a ? c.k : c.m, a_cols = c.trans_a ? c.m : c.k;
  const int64_t b_rows = c.trans_b ? c.n : c.k, b_cols = c.trans_b ? c.k : c.n;
  // Stored with padded rows; the padding holds NaN, which must never be read.
  auto a_store = torch::full({a_rows, a_cols + c.pad_a}, NAN).to(torch::kBFloat16);
  auto b_store = torch::full({b_rows, b_cols + c.pad_b}, NAN).to(torch::kBFloat16);
  a_store.slice(1, 0, a_cols).copy_(torch::randn({a_rows, a_cols}));
  b_store.slice(1, 0, b_cols).copy_(torch::randn({b_rows, b_cols}));
  auto bias = torch::randn({c.n}).to(torch::kBFloat16);
  auto c0 = torch::randn({c.m, c.n}).to(torch::kBFloat16);  // bf16 values, so exact in either C
  auto c_store = torch::full({c.m, c.n + c.pad_c}, c.beta == 0.f ? NAN : 0.f,
                             c_bf16 ? torch::kBFloat16 : torch::kFloat);
  c_store.slice(1, 0, c.n).copy_(c0);

  const auto a64 = a_store.slice(1, 0, a_cols).to(torch::kDouble);
  const auto b64 = b_store.slice(1, 0, b_cols).to(torch::kDouble);
  const auto opa = c.trans_a ? a64.t() : a64, opb = c.trans_b ? b64.t() : b64;
  auto product = torch::matmul(opa, opb), magnitude = torch::matmul(opa.abs(), opb.abs());
  if (c.bias) {
    product = product + bias.to(torch::kDouble);
    magnitude = magnitude + bias.to(torch::kDouble).abs();
  }
  auto want = c.alpha * product, scale = std::abs(c.alpha) * magnitude;
  if (c.beta != 0.f) {
    want = want + c.beta * c0.to(torch::kDouble);
    scale = scale + std::abs(c.beta) * c0.to(torch::kDouble).abs();
  }

  const bf16* bias_ptr = c.bias ? bf16_data(bias) : nullptr;
  if (c_bf16)
    kernels::gemm_bf16(c.trans_a, c.trans_b, c.m, c.n, c.k, c.alpha, bf16_data(a_store),
                       a_cols + c.pad_a, bf16_data(b_store), b_cols + c.pad_b, c.beta,
                       bf16_data(c_store), c.n + c.pad_c, bias_ptr);
  else
    kernels::gemm_bf16(c.trans_a, c.trans_b, c.m, c.n, c.k, c.alpha, bf16_data(a_store),
                       a_cols + c.pad_a, bf16_data(b_store), b_cols + c.pad_b, c.beta,
                       c_store.data_ptr<float>(), c.n + c.pad_c, bias_ptr);

  const auto got = c_store.slice(1, 0, c.n).to(torch::kDouble);
  const double u = std::ldexp(1.0, -24), terms = static_cast<double>(c.k + 2);
  const double gamma = terms * u / (1 - terms * u);
  auto limit = gamma * scale;
  if (c_bf16) limit = limit + std::ldexp(1.0, -8) * (want.abs() + limit);
  const auto err = (got - want).abs();
  EXPECT_TRUE((err <= limit + 1e-300).all().item<bool>())
      << "worst error is " << (err / (limit + 1e-300)).max().item<double>() << " times the bound";
  // The padding of C is untouched.
  if (c.pad_c > 0) {
    const auto pad = c_store.slice(1, c.n).to(torch::kFloat);
    EXPECT_TRUE(c.beta == 0.f ? pad.isnan().all().item<bool>() : (pad == 0).all().item<bool>());
  }
}

const std::vector<GemmCase>& gemm_cases() {
  static const std::vector<GemmCase> cases{
      // dense operands (oneDNN's brgemm, AMX where the shape fills tiles)
      {false, true, 64, 48, 40, 0, 0, 0, 1.f, 0.f, true},
      {false, false, 70, 33, 129, 0, 0, 0, 1.f, 0.f, false},
      {true, false, 33, 17, 300, 0, 0, 0, 1.f, 0.f, false},
      {true, true, 9, 31, 65, 0, 0, 0, 1.f, 0.f, false},
      {false, true, 1, 5, 7, 0, 0, 0, 1.f, 0.f, true},
      {false, true, 5, 1, 7, 0, 0, 0, 1.f, 0.f, true},
      // alpha (output scales), beta (sum post-op) and the bias together
      {false, false, 37, 65, 50, 0, 0, 0, 0.5f, 2.f, true},
      {true, false, 16, 16, 16, 0, 0, 0, -1.5f, 1.f, false},
      // padded rows (oneDNN's jit gemm)
      {false, true, 37, 65, 129, 3, 5, 7, 1.f, 0.f, true},
      {true, false, 20, 30, 40, 1, 2, 3, 1.f, 1.f, false},
      // K = 0: C = alpha bias + beta C
      {false, true, 4, 6, 0, 0, 0, 0, 2.f, 0.5f, true},
      {false, false, 4, 6, 0, 0, 0, 2, 1.f, 0.f, false},
  };
  return cases;
}

TEST(GemmBf16, MatchesFloat64OnEveryLayoutAndBothOutputTypes) {
  torch::manual_seed(3);
  for (const auto& c : gemm_cases())
    for (bool c_bf16 : {false, true}) check_gemm(c, c_bf16);
}

TEST(GemmBf16, Float32ConversionPathMatchesFloat64Too) {
  ForceFloat32 forced;
  ASSERT_EQ(kernels::bf16_gemm_path(), kernels::Bf16Path::float32);
  torch::manual_seed(4);
  for (const auto& c : gemm_cases())
    for (bool c_bf16 : {false, true}) check_gemm(c, c_bf16);
}

TEST(GemmBf16, EmptyShapesWriteNothing) {
  float c = 7.f;
  bf16 a{0}, b{0};
  kernels::gemm_bf16(false, false, 0, 1, 3, 1.f, &a, 3, &b, 1, 0.f, &c, 1);
  kernels::gemm_bf16(false, false, 1, 0, 3, 1.f, &a, 3, &b, 1, 0.f, &c, 1);
  EXPECT_EQ(c, 7.f);
}

TEST(GemmBf16, PrimitivesAreCreatedOncePerShape) {
  // Native path: the first call of a shape creates its primitive, repeats
  // reuse it. Float32 path: nothing is cached.
  auto a = torch::randn({23, 29}).to(torch::kBFloat16);
  auto b = torch::randn({29, 31}).to(torch::kBFloat16);
  auto c = torch::empty({23, 31});
  auto run = [&](int64_t m, int64_t n) {
    kernels::gemm_bf16(false, false, m, n, 29, 1.f, bf16_data(a), 29, bf16_data(b), 31, 0.f,
                       c.data_ptr<float>(), 31);
  };
  const bool native = kernels::bf16_gemm_native();
  const int64_t before = kernels::gemm_bf16_cached_primitives();
  run(23, 31);
  const int64_t after_first = kernels::gemm_bf16_cached_primitives();
  EXPECT_EQ(after_first, native ? before + 1 : before);
  const auto first = c.clone();
  for (int i = 0; i < 3; ++i) run(23, 31);
  EXPECT_EQ(kernels::gemm_bf16_cached_primitives(), after_first);
  EXPECT_TRUE(torch::equal(c, first));  // the same primitive: bitwise the same result
  // Many shapes: the cache stays bounded (256 primitives).
  for (int64_t m = 1; m <= 23; ++m)
    for (int64_t n : {1, 2, 3, 5, 8, 13, 21, 31}) run(m, n);
  EXPECT_LE(kernels::gemm_bf16_cached_primitives(), 256);
  if (native) EXPECT_GT(kernels::gemm_bf16_cached_primitives(), after_first);
}

// ---------------------------------------------------------------------------
// attnkit::linear on bf16: the FlashAttention rule
// ---------------------------------------------------------------------------

struct LinearCase {
  std::string name;
  std::vector<int64_t> x_shape;  // (..., in)
  int64_t out;
  bool bias;
  bool weight_transposed;  // weight = P.t() for an (in, out) parameter P
  bool x_strided;          // x is the first half of each row of a twice-as-wide tensor
};

struct Run {
  std::vector<torch::Tensor> values;  // y, dx, dW (of the parameter P), db when there is a bias
};

const char* kNames[] = {"y", "dx", "dW", "db"};

/// Leaves (bf16 unless the float64 reference is asked for) with the case's
/// layouts, from the same float32 draws.
struct Inputs {
  torch::Tensor x, param, bias, dy;
};

Run run_linear(const Inputs& in, const LinearCase& c, torch::ScalarType dtype, bool ours) {
  auto leaf = [&](const torch::Tensor& t) {
    return t.defined() ? t.detach().to(dtype).requires_grad_() : torch::Tensor();
  };
  // x: a strided view of a wider leaf, or the leaf itself.
  auto x_leaf = c.x_strided ? leaf(torch::cat({in.x, torch::zeros_like(in.x)}, -1)) : leaf(in.x);
  const int64_t features = in.x.size(-1);
  auto x = c.x_strided ? x_leaf.narrow(-1, 0, features) : x_leaf;
  auto p = leaf(in.param);
  auto w = c.weight_transposed ? p.t() : p;
  auto b = leaf(in.bias);
  auto y = ours ? attnkit::linear(x, w, b) : torch::linear(x, w, b);
  EXPECT_EQ(y.scalar_type(), dtype);
  std::vector<torch::Tensor> wrt{x_leaf, p};
  if (c.bias) wrt.push_back(b);
  auto grads = torch::autograd::grad({y}, wrt, {in.dy.to(dtype)});
  Run r;
  r.values.push_back(y.detach());
  r.values.push_back(c.x_strided ? grads[0].narrow(-1, 0, features) : grads[0]);
  r.values.push_back(grads[1]);
  if (c.bias) r.values.push_back(grads[2]);
  for (const auto& g : r.values) EXPECT_EQ(g.scalar_type(), dtype);
  return r;
}

double max_abs_err(const torch::Tensor& got, const torch::Tensor& want) {
  if (want.numel() == 0) return 0.0;
  return (got.to(torch::kDouble) - want).abs().max().item<double>();
}

const std::vector<LinearCase>& linear_cases() {
  static const std::vector<LinearCase> cases{
      {"one row", {1, 7}, 5, true, false, false},
      {"one row, wide", {1, 300}, 70, true, false, false},
      {"awkward sizes", {37, 129}, 65, true, false, false},
      {"three leading dims", {2, 3, 5, 50}, 33, false, false, false},
      {"transposed weight", {45, 70}, 23, true, true, false},
      {"strided x rows", {31, 48}, 40, true, false, true},
      {"strided x, transposed weight, no bias", {3, 11, 36}, 17, false, true, true},
      {"long reduction over rows", {1000, 24}, 17, true, false, false},
      {"tile-sized", {64, 96}, 128, true, false, false},
      {"larger", {300, 257}, 130, true, false, false},
  };
  return cases;
}

/// Ratio of our max |error| to torch's over every case, output and gradient.
struct Worst {
  double ratio = 0;
  std::string where;
};

Worst check_flash_attention_rule(const char* path) {
  Worst worst;
  torch::manual_seed(5);
  for (const auto& c : linear_cases()) {
    SCOPED_TRACE(c.name);
    const int64_t features = c.x_shape.back();
    Inputs in;
    // Inputs rounded to bf16 first: every computation sees the same values.
    auto bf = [](const torch::Tensor& t) { return t.to(torch::kBFloat16).to(torch::kFloat); };
    in.x = bf(torch::randn(c.x_shape));
    in.param = bf(c.weight_transposed ? torch::randn({features, c.out}) : torch::randn({c.out, features}));
    if (c.bias) in.bias = bf(torch::randn({c.out}));
    auto y_shape = c.x_shape;
    y_shape.back() = c.out;
    in.dy = bf(torch::randn(y_shape));

    const auto exact = run_linear(in, c, torch::kDouble, /*ours=*/false);
    const auto theirs = run_linear(in, c, torch::kBFloat16, /*ours=*/false);
    for (int threads : {1, 2}) {
      ThreadsGuard guard(threads);
      const auto ours = run_linear(in, c, torch::kBFloat16, /*ours=*/true);
      for (size_t i = 0; i < exact.values.size(); ++i) {
        const double e_ours = max_abs_err(ours.values[i], exact.values[i]);
        const double e_torch = max_abs_err(theirs.values[i], exact.values[i]);
        EXPECT_LE(e_ours, 2 * e_torch) << path << ", " << kNames[i] << ", " << threads
                                       << " threads: our error " << e_ours << ", torch's " << e_torch;
        const double ratio = e_torch > 0 ? e_ours / e_torch : (e_ours > 0 ? INFINITY : 0);
        if (ratio > worst.ratio) worst = {ratio, c.name + ", " + kNames[i]};
      }
    }
  }
  return worst;
}

// Measured worst ratios (our max |error| / torch's), over every case, output
// and gradient, on 1 and 2 threads; printed by the tests below:
//   native (AMX), this machine:                        1.00 (equal errors on most)
//   native (AVX512_BF16 kernels, oneDNN capped):       1.00
//   float32 conversion (forced, or oneDNN capped to AVX512_CORE): 1.00
// The bound is 2 (the rule), not these numbers.

TEST(LinearBf16, MeetsTheFlashAttentionRuleOnTheNativePath) {
  const auto path = kernels::to_string(kernels::bf16_gemm_path());
  const auto worst = check_flash_attention_rule(path);
  std::cout << "[ measured ] path " << path << ": worst error ratio to torch's bf16 " << worst.ratio
            << " (" << worst.where << ")\n";
}

TEST(LinearBf16, MeetsTheFlashAttentionRuleOnTheFloat32ConversionPath) {
  ForceFloat32 forced;
  ASSERT_EQ(kernels::bf16_gemm_path(), kernels::Bf16Path::float32);
  const auto worst = check_flash_attention_rule("float32 conversion");
  std::cout << "[ measured ] float32 conversion: worst error ratio to torch's bf16 " << worst.ratio
            << " (" << worst.where << ")\n";
}

// ---------------------------------------------------------------------------
// Dispatch, dtypes, refusals
// ---------------------------------------------------------------------------

TEST(LinearBf16, DispatchSaysWhichPathRuns) {
  auto x = torch::randn({3, 5}).to(torch::kBFloat16);
  auto w = torch::randn({4, 5}).to(torch::kBFloat16);
  const auto path = kernels::bf16_gemm_path();
  const auto d = attnkit::linear_dispatch(x, w);
  EXPECT_EQ(d.backend, Backend::kernel);
  if (path == kernels::Bf16Path::float32)
    EXPECT_EQ(d.reason, "bf16 converted to float32 (no AVX512_BF16)");
  else
    EXPECT_EQ(d.reason, std::string("bf16 via oneDNN matmul (") + kernels::to_string(path) + ")");

  // The path against the ISA level (which ctest caps with ATTNKIT_MAX_ISA;
  // tests/kernels/isa_test.cpp checks the level against the CPU's flags).
  if (!kernels::bf16_float32_forced() && !std::getenv("ONEDNN_MAX_CPU_ISA")) {
    const auto level = kernels::isa::current();
    if (level < kernels::isa::Level::avx512_bf16)
      EXPECT_EQ(path, kernels::Bf16Path::float32);
    else if (level == kernels::isa::Level::avx512_bf16)
      EXPECT_EQ(path, kernels::Bf16Path::avx512_bf16);
    else
      EXPECT_EQ(path, kernels::Bf16Path::amx);
  }

  {
    ForceFloat32 forced;
    const auto forced_reason = attnkit::linear_dispatch(x, w).reason;
    if (kernels::bf16_gemm_isa_path() == kernels::Bf16Path::float32)
      EXPECT_EQ(forced_reason, "bf16 converted to float32 (no AVX512_BF16)");
    else
      EXPECT_EQ(forced_reason, std::string("bf16 converted to float32 (forced, though the CPU has ") +
                                   kernels::to_string(kernels::bf16_gemm_isa_path()) + ")");
  }
  // float32 is the kernel with no reason; float64 the composite.
  testing::expect_kernel(attnkit::linear_dispatch(x.to(torch::kFloat), w.to(torch::kFloat)));
  testing::expect_composite(attnkit::linear_dispatch(x.to(torch::kDouble), w.to(torch::kDouble)),
                            "x is float64; the kernel is float32 and bfloat16 only");
  // What ran: our autograd node, not libtorch's.
  EXPECT_NE(testing::grad_fn_name(attnkit::linear(x.detach().requires_grad_(), w)).find("LinearFunction"),
            std::string::npos);
}

TEST(LinearBf16, MixedDtypesAreRefusedNamingTheArgument) {
  auto xb = torch::randn({3, 5}).to(torch::kBFloat16);
  auto w = torch::randn({4, 5});
  expect_error([&] { attnkit::linear(xb, w); }, {"linear", "'weight'", "BFloat16", "Float"});
  expect_error([&] { attnkit::linear(xb, w.to(torch::kBFloat16), torch::randn({4})); },
               {"linear", "'bias'", "BFloat16", "Float"});
  expect_error([&] { attnkit::linear(xb.to(torch::kFloat), w.to(torch::kBFloat16)); },
               {"linear", "'weight'", "Float", "BFloat16"});
}

TEST(LinearBf16, OnlyRequestedGradientsAndNoDoubleBackward) {
  auto x = torch::randn({3, 5}).to(torch::kBFloat16);
  auto w = torch::randn({4, 5}).to(torch::kBFloat16).requires_grad_();
  auto b = torch::randn({4}).to(torch::kBFloat16);
  attnkit::linear(x, w, b).sum().backward();
  EXPECT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().scalar_type(), torch::kBFloat16);
  EXPECT_FALSE(x.grad().defined());
  auto xg = x.detach().requires_grad_();
  auto y = attnkit::linear(xg, w).pow(2).sum();
  auto g = torch::autograd::grad({y}, {xg}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  expect_error([&] { torch::autograd::grad({g[0].sum()}, {w}); },
               {"linear", "double backward", "bfloat16 kernel"});
}

TEST(LinearBf16, EmptySizesGiveEmptyOrZeroResults) {
  auto w = torch::randn({4, 5}).to(torch::kBFloat16).requires_grad_();
  auto b = torch::randn({4}).to(torch::kBFloat16).requires_grad_();
  auto x = torch::randn({0, 5}).to(torch::kBFloat16).requires_grad_();
  auto y = attnkit::linear(x, w, b);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{0, 4}));
  y.sum().backward();
  EXPECT_TRUE((w.grad().to(torch::kFloat) == 0).all().item<bool>());
  EXPECT_TRUE((b.grad().to(torch::kFloat) == 0).all().item<bool>());
  // in = 0: y is the bias in every row.
  auto w0 = torch::randn({4, 0}).to(torch::kBFloat16);
  auto y0 = attnkit::linear(torch::randn({3, 0}).to(torch::kBFloat16), w0, b.detach());
  EXPECT_TRUE(torch::equal(y0, b.detach().expand({3, 4})));
}

}  // namespace
}  // namespace attnkit::dense_bf16_kernel_test
