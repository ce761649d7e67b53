// What the fuzz targets share: building tensors of fuzzer-chosen shape, layout,
// dtype and values, the invariants they check, and how a violation is reported.
//
// A violation aborts (libFuzzer then saves the input as crash-*), after
// printing what was violated; sanitizer reports abort by themselves
// (fuzz/sanitizer_options.cpp).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace attnkit::fuzz {

[[noreturn]] inline void violation(const std::string& what) {
  std::fprintf(stderr, "\n==== attnkit fuzz invariant violated: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

/// A value from a small table of awkward ones, or an arbitrary double.
inline double awkward_double(FuzzedDataProvider& in, double usual) {
  static const double table[] = {
      std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
      -std::numeric_limits<double>::infinity(), 0.0, -0.0, -1.0, 1e39, -1e39, 3.4e38, 1e-45,
      1e-300, 1e300, std::numeric_limits<double>::denorm_min(), 0.5, 2.0};
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return table[in.ConsumeIntegralInRange<size_t>(0, std::size(table) - 1)];
    case 1: return in.ConsumeFloatingPoint<double>();
    case 2: return in.ConsumeFloatingPointInRange<double>(-4.0, 4.0);
    default: return usual;
  }
}

/// An integer option: usually in [lo, hi], sometimes just outside, sometimes extreme.
inline int64_t awkward_int(FuzzedDataProvider& in, int64_t lo, int64_t hi) {
  switch (in.ConsumeIntegralInRange<int>(0, 9)) {
    case 0: return lo - 1;
    case 1: return hi + 1;
    case 2: {
      static const int64_t table[] = {std::numeric_limits<int64_t>::min(),
                                      std::numeric_limits<int64_t>::max(), int64_t{1} << 62,
                                      int64_t{1} << 31, -(int64_t{1} << 31), 1001, -7};
      return table[in.ConsumeIntegralInRange<size_t>(0, std::size(table) - 1)];
    }
    default: return in.ConsumeIntegralInRange<int64_t>(lo, hi);
  }
}

/// The data type of an op's floating inputs: mostly float32 (the fast kernels),
/// also float64 (the composite), bfloat16, and float16 (refused up front).
inline torch::ScalarType choose_dtype(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return torch::kDouble;
    case 1: return torch::kBFloat16;
    case 2: return torch::kHalf;
    default: return torch::kFloat;
  }
}

struct TensorMaker {
  FuzzedDataProvider& in;
  torch::Generator gen;

  /// A tensor of `sizes` (perhaps perturbed: a wrong size, rank or dtype, so
  /// that the checks are exercised too), laid out as the fuzzer says: contiguous,
  /// transposed, stepped, expanded or at a storage offset; values randn * magnitude with a
  /// few awkward entries; `nonnegative` takes absolute values first.
  torch::Tensor make(std::vector<int64_t> sizes, torch::ScalarType dtype, bool nonnegative = false) {
    const int perturb = in.ConsumeIntegralInRange<int>(0, 40);
    if (perturb == 0 && !sizes.empty()) sizes[in.ConsumeIntegralInRange<size_t>(0, sizes.size() - 1)] += 1;
    if (perturb == 1 && !sizes.empty()) sizes.pop_back();
    if (perturb == 2) sizes.insert(sizes.begin(), 1);
    if (perturb == 3) dtype = dtype == torch::kFloat ? torch::kDouble : torch::kFloat;
    if (perturb == 4) dtype = torch::kLong;

    const int rank = static_cast<int>(sizes.size());
    std::vector<int64_t> alloc = sizes;
    const int layout = in.ConsumeIntegralInRange<int>(0, 5);
    int a = 0, b = 0;
    if (layout == 1 && rank >= 2) {  // transposed: allocate with two dims swapped
      a = in.ConsumeIntegralInRange<int>(0, rank - 2);
      b = in.ConsumeIntegralInRange<int>(a + 1, rank - 1);
      std::swap(alloc[a], alloc[b]);
    } else if (layout == 2 && rank >= 1) {  // stepped: every other element of one dim
      a = in.ConsumeIntegralInRange<int>(0, rank - 1);
      alloc[a] = 2 * alloc[a] + 1;
    } else if (layout == 3 && rank >= 1) {  // expanded: size 1 broadcast along one dim
      a = in.ConsumeIntegralInRange<int>(0, rank - 1);
      alloc[a] = std::min<int64_t>(alloc[a], 1);
    } else if (layout == 4 && rank >= 1) {  // a storage offset
      alloc[0] += 1;
    }
    const double magnitude = choose_magnitude();
    auto t = torch::randn(alloc, gen, torch::TensorOptions().dtype(torch::kDouble)) * magnitude;
    if (nonnegative) t = t.abs();
    const int specials = in.ConsumeIntegralInRange<int>(0, 12) < 10 ? 0 : in.ConsumeIntegralInRange<int>(1, 3);
    if (t.numel() > 0) {
      auto flat = t.view(-1);
      for (int i = 0; i < specials; ++i) {
        static const double table[] = {std::numeric_limits<double>::quiet_NaN(),
                                       std::numeric_limits<double>::infinity(),
                                       -std::numeric_limits<double>::infinity(), 3e38, -3e38, 0.0,
                                       1e-45, 1e300};
        flat[in.ConsumeIntegralInRange<int64_t>(0, t.numel() - 1)] =
            table[in.ConsumeIntegralInRange<size_t>(0, std::size(table) - 1)];
      }
    }
    t = t.to(dtype);
    if (layout == 1 && rank >= 2) t = t.transpose(a, b);
    if (layout == 2 && rank >= 1) t = t.slice(a, 1, alloc[a], 2);
    if (layout == 3 && rank >= 1) t = t.expand(sizes);
    if (layout == 4 && rank >= 1) t = t.slice(0, 1);
    if (t.is_floating_point() && in.ConsumeBool()) t.requires_grad_(true);
    return t;
  }

  double choose_magnitude() {
    static const double table[] = {1.0, 1.0, 1.0, 0.5, 4.0, 1e-3, 30.0, 1e4, 1e20, 1e-30};
    return table[in.ConsumeIntegralInRange<size_t>(0, std::size(table) - 1)];
  }
};

/// Finite and of magnitude at most `bound` (every entry; an empty tensor is).
inline bool moderate(const torch::Tensor& t, double bound = 4.5) {
  if (!t.defined() || t.numel() == 0) return true;
  auto d = t.detach().to(torch::kDouble);
  return d.isfinite().all().item<bool>() && d.abs().max().item<double>() <= bound;
}

inline bool all_finite(const torch::Tensor& t) {
  return !t.defined() || t.numel() == 0 || t.detach().to(torch::kDouble).isfinite().all().item<bool>();
}

inline double max_abs(const torch::Tensor& t) {
  return !t.defined() || t.numel() == 0 ? 0.0 : t.detach().to(torch::kDouble).abs().max().item<double>();
}

/// A float64 copy without autograd history (the oracle's input).
inline torch::Tensor f64(const torch::Tensor& t) {
  return t.defined() && t.is_floating_point() ? t.detach().to(torch::kDouble) : t;
}
inline torch::Tensor abs64(const torch::Tensor& t) { return t.defined() ? f64(t).abs() : t; }

}  // namespace attnkit::fuzz
