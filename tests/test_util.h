// Helpers shared by the test files: random inputs, error measures, a float64
// finite-difference gradient checker, and an error-message matcher.
#pragma once

#include <attnkit/dispatch.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace attnkit::testing {

/// Restores attnkit's thread count when it goes out of scope; given a count,
/// sets it first.
class ThreadsGuard {
 public:
  ThreadsGuard() : previous_(num_threads()) {}
  explicit ThreadsGuard(int threads) : ThreadsGuard() { set_num_threads(threads); }
  ~ThreadsGuard() { set_num_threads(previous_); }
  ThreadsGuard(const ThreadsGuard&) = delete;
  ThreadsGuard& operator=(const ThreadsGuard&) = delete;

 private:
  int previous_;
};

inline torch::TensorOptions f64() { return torch::TensorOptions().dtype(torch::kDouble); }
inline torch::TensorOptions f32() { return torch::TensorOptions().dtype(torch::kFloat); }

/// max |a - b| / max(max |b|, tiny): one number for "how far apart", scale-free.
inline double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto a64 = a.detach().to(torch::kDouble), b64 = b.detach().to(torch::kDouble);
  EXPECT_EQ(a64.sizes(), b64.sizes());
  if (a64.numel() == 0) return 0.0;
  const double scale = std::max(b64.abs().max().item<double>(), 1e-300);
  return (a64 - b64).abs().max().item<double>() / scale;
}

/// max |a - b| / max(max |b|, 1), in float64; b is the reference: the error
/// relative to the largest entry, in absolute terms where entries are below 1.
inline double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const auto a64 = a.detach().to(torch::kDouble), b64 = b.detach().to(torch::kDouble);
  EXPECT_EQ(a64.sizes(), b64.sizes());
  if (b64.numel() == 0) return 0.0;
  return (a64 - b64).abs().max().item<double>() / std::max(b64.abs().max().item<double>(), 1.0);
}

/// max_i |a_i - b_i| / scale_i: the error of every element against its own
/// scale (broadcastable to b, positive). With scale_i the sum of the absolute
/// values of the terms that make b_i (term_magnitudes below), a float32 result
/// summed from n terms errs by at most about n u of it however small b_i is,
/// which rel_err, with one tensor-wide scale, checks only in absolute terms.
inline double scaled_err(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& scale) {
  auto a64 = a.detach().to(torch::kDouble), b64 = b.detach().to(torch::kDouble);
  EXPECT_EQ(a64.sizes(), b64.sizes());
  if (a64.numel() == 0) return 0.0;
  auto s64 = scale.detach().to(torch::kDouble).clamp_min(1e-300);
  return ((a64 - b64).abs() / s64).max().item<double>();
}

/// Error scales of f(x) and of its input gradients for the cotangent dout, when
/// f is a polynomial with non-negative coefficients in its inputs (a sum of
/// products: linear attention with the identity map and no normaliser, the
/// gated recurrence with gates >= 0, agglomerative output and dcq, dv): f(|x|)
/// is per element the sum of |terms| of f(x), and the gradient of
/// sum(|dout| f(|x|)) is the same for each input gradient. Returns
/// {scale of f, scale of df/dx_0, ...} in float64.
inline std::vector<torch::Tensor> term_magnitudes(
    const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
    const std::vector<torch::Tensor>& inputs, const torch::Tensor& dout) {
  std::vector<torch::Tensor> abs_inputs;
  for (const auto& x : inputs)
    abs_inputs.push_back(x.detach().to(torch::kDouble).abs().requires_grad_(true));
  auto out = f(abs_inputs);
  auto grads = torch::autograd::grad({(out * dout.to(torch::kDouble).abs()).sum()}, abs_inputs);
  std::vector<torch::Tensor> result{out.detach()};
  for (auto& g : grads) result.push_back(g);
  return result;
}

inline double max_abs(const torch::Tensor& t) {
  return t.numel() ? t.detach().abs().max().item<double>() : 0.0;
}

inline bool all_finite(const torch::Tensor& t) { return torch::isfinite(t).all().item<bool>(); }

/// An int64 tensor of the values (lengths, indices, labels).
inline torch::Tensor i64(const std::vector<int64_t>& values) {
  return torch::tensor(values, torch::TensorOptions().dtype(torch::kLong));
}

/// Checks the autograd gradients of sum(f(inputs) * cotangent) against central
/// differences, in float64, for every input with requires_grad. Inputs must be
/// small (each element is perturbed twice). Tolerance: |analytic - numeric| <=
/// atol + rtol * |numeric| element-wise, with defaults fitting eps = 1e-6 on
/// smooth float64 functions of O(1) values.
inline void expect_gradients_match(
    const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
    std::vector<torch::Tensor> inputs, double eps = 1e-6, double atol = 1e-6, double rtol = 1e-5) {
  for (auto& x : inputs)
    if (x.defined() && x.is_floating_point()) {
      ASSERT_EQ(x.scalar_type(), torch::kDouble) << "gradient checks run in float64";
      x = x.detach().clone().requires_grad_(true);
    }
  auto out = f(inputs);
  auto cot = torch::randn(out.sizes(), f64());
  auto loss = (out * cot).sum();
  std::vector<torch::Tensor> diff;
  for (auto& x : inputs)
    if (x.defined() && x.requires_grad()) diff.push_back(x);
  auto grads = torch::autograd::grad({loss}, diff, {}, /*retain_graph=*/false, /*create_graph=*/false,
                                     /*allow_unused=*/true);
  torch::NoGradGuard no_grad;
  for (size_t a = 0; a < diff.size(); ++a) {
    auto analytic = grads[a].defined() ? grads[a] : torch::zeros_like(diff[a]);
    auto flat = diff[a].view({-1});
    auto numeric = torch::zeros_like(flat);
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double x0 = flat[i].item<double>();
      flat[i] = x0 + eps;
      const double up = (f(inputs) * cot).sum().item<double>();
      flat[i] = x0 - eps;
      const double down = (f(inputs) * cot).sum().item<double>();
      flat[i] = x0;
      numeric[i] = (up - down) / (2 * eps);
    }
    numeric = numeric.view_as(diff[a]);
    auto bad = (analytic - numeric).abs() > atol + rtol * numeric.abs();
    EXPECT_FALSE(bad.any().item<bool>())
        << "gradient of input " << a << " differs from finite differences; max |diff| = "
        << (analytic - numeric).abs().max().item<double>() << "\nanalytic:\n" << analytic
        << "\nnumeric:\n" << numeric;
  }
}

/// Checks second-order gradients of f in float64: the scalar
/// g(x) = sum_a <w_a, d/dx_a sum(f(x) * cot)> (random cot and w, the first-order
/// gradients taken with create_graph = true) has its autograd gradient checked
/// against central differences by expect_gradients_match. Any dropped
/// second-order term shows up there.
inline void expect_second_order_gradients_match(
    const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
    std::vector<torch::Tensor> inputs, double eps = 1e-6, double atol = 1e-6, double rtol = 1e-5) {
  torch::Tensor cot;
  std::vector<torch::Tensor> w;
  auto first_order = [&](const std::vector<torch::Tensor>& x) {
    torch::AutoGradMode on(true);  // expect_gradients_match probes under no_grad
    std::vector<torch::Tensor> diff;
    for (const auto& t : x)
      if (t.defined() && t.requires_grad()) diff.push_back(t);
    auto out = f(x);
    if (!cot.defined()) cot = torch::randn(out.sizes(), torch::TensorOptions().dtype(torch::kDouble));
    auto grads = torch::autograd::grad({(out * cot).sum()}, diff, {}, /*retain_graph=*/true,
                                       /*create_graph=*/true, /*allow_unused=*/true);
    if (w.empty())
      for (const auto& t : diff) w.push_back(torch::randn(t.sizes(), t.options().requires_grad(false)));
    auto total = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble));
    for (size_t a = 0; a < grads.size(); ++a)
      if (grads[a].defined()) total = total + (grads[a] * w[a]).sum();
    return total;
  };
  expect_gradients_match(first_order, std::move(inputs), eps, atol, rtol);
}

/// The name of the autograd node that made `t` ("" for a leaf or no-grad
/// result): tells which backend ran (the kernels' Functions are named
/// <Op>Function; composites leave libtorch's own nodes).
inline std::string grad_fn_name(const torch::Tensor& t) {
  return t.grad_fn() ? t.grad_fn()->name() : std::string();
}

/// Expects the kernel with no reason.
inline void expect_kernel(const Dispatch& d) {
  EXPECT_TRUE(d.uses_kernel()) << "composite taken: " << d.reason;
  EXPECT_EQ(d.reason, "");
}

/// Expects the composite with exactly `reason`.
inline void expect_composite(const Dispatch& d, const std::string& reason) {
  EXPECT_EQ(d.backend, Backend::composite);
  EXPECT_EQ(d.reason, reason);
}

/// Expects `body` to throw an error whose message contains every fragment:
/// a c10::Error (our checks), or the std::runtime_error that an autograd
/// Error node throws when a once-differentiable gradient is differentiated.
inline void expect_error(const std::function<void()>& body, const std::vector<std::string>& fragments) {
  auto check = [&](const std::string& msg) {
    for (const auto& frag : fragments)
      EXPECT_NE(msg.find(frag), std::string::npos) << "message lacks '" << frag << "': " << msg;
  };
  try {
    body();
  } catch (const c10::Error& e) {
    check(e.what_without_backtrace());
    return;
  } catch (const std::runtime_error& e) {
    check(e.what());
    return;
  }
  ADD_FAILURE() << "expected an error mentioning '" << (fragments.empty() ? "" : fragments[0]) << "'";
}

/// A shared edge list from its rows, each already sorted and duplicate-free
/// (built by hand, so that tests do not check the builders with themselves).
inline EdgeList edge_list_from_rows(const std::vector<std::vector<int64_t>>& rows) {
  std::vector<int64_t> offsets{0}, columns;
  for (const auto& r : rows) {
    columns.insert(columns.end(), r.begin(), r.end());
    offsets.push_back(static_cast<int64_t>(columns.size()));
  }
  return {torch::tensor(offsets, torch::kLong), torch::tensor(columns, torch::kLong)};
}

/// The rows of head `h` of an edge list (a shared list has head 0 only), each
/// as its list of columns.
inline std::vector<std::vector<int64_t>> edge_rows(const EdgeList& e, int64_t h = 0) {
  const auto off = (e.per_head() ? e.offsets[h] : e.offsets).contiguous();
  const auto col = e.columns.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t* c = col.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(off.numel() - 1);
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t p = o[i]; p < o[i + 1]; ++p) rows[i].push_back(c[p]);
  return rows;
}

/// A fresh, empty directory for one test's files (mkdtemp under the system's
/// temp dir, so parallel test processes never share one), removed with
/// everything in it.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "attnkit_test_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("ScratchDir: mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace attnkit::testing
