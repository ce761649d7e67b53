// Validation shared by every op boundary. Each check raises one c10::Error whose
// message names the op, the argument, what was expected and what came.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace attnkit::detail {

/// The dtype as users write it: float32, float64, float16, bfloat16, ...
inline std::string dtype_name(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    default: return c10::toString(type);
  }
}

inline std::string shape_str(const torch::Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

/// t.size(d), or 0 when t is undefined or has no dimension d (for sizes
/// read before t is validated).
inline int64_t size_or_zero(const torch::Tensor& t, int64_t d) {
  return t.defined() && t.dim() > d ? t.size(d) : 0;
}

/// A dense (strided) tensor: kernels and composites read strides, and sparse or
/// mkldnn tensors have none.
inline void check_strided(const char* op, const char* name, const torch::Tensor& t) {
  TORCH_CHECK(t.layout() == torch::kStrided, op, ": argument '", name,
              "' must be a dense (strided) tensor, got layout ", t.layout(),
              "; convert it with .to_dense()");
}

/// float32 (the kernels), float64 and bfloat16 (the composites). float16 is
/// refused here rather than deep inside a composite: libtorch's CPU operators
/// have no float16 forms of most of what the composites call (bmm, softmax,
/// exp, cumsum), so it would fail with "... not implemented for 'Half'".
inline void check_supported_dtype(const char* op, const char* name, const torch::Tensor& t) {
  const auto type = t.scalar_type();
  TORCH_CHECK(type == torch::kFloat || type == torch::kDouble || type == torch::kBFloat16, op,
              ": argument '", name, "' has dtype ", dtype_name(type),
              "; supported dtypes are float32, float64 and bfloat16 (float16 has no CPU "
              "kernels in libtorch's matmul and softmax: convert with .float())");
}

/// A defined, dense, floating CPU tensor of a supported dtype (any rank).
inline void check_float_cpu(const char* op, const char* name, const torch::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": argument '", name, "' is undefined");
  check_strided(op, name, t);
  TORCH_CHECK(t.device().is_cpu(), op, ": argument '", name,
              "' must be on the CPU, got device ", t.device());
  TORCH_CHECK(t.is_floating_point(), op, ": argument '", name,
              "' must be a floating tensor, got dtype ", t.scalar_type());
  check_supported_dtype(op, name, t);
}

/// A defined, dense, floating, CPU tensor of the given rank.
inline void check_float_tensor(const char* op, const char* name, const torch::Tensor& t,
                               int64_t rank) {
  check_float_cpu(op, name, t);
  TORCH_CHECK(t.dim() == rank, op, ": argument '", name, "' must have ", rank,
              " dimensions, got shape ", shape_str(t));
}

/// `t` must have the dtype of argument `like_name` (`like`).
inline void check_same_dtype(const char* op, const char* name, const torch::Tensor& t,
                             const char* like_name, const torch::Tensor& like) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": argument '", name, "' must have dtype ",
              like.scalar_type(), " like argument '", like_name, "', got ", t.scalar_type());
}

/// A module's input must have the dtype of its parameters (`parameter`, any
/// of them): said here, in the module's words, rather than by an op inside.
inline void check_parameter_dtype(const char* module, const char* name, const torch::Tensor& t,
                                  const torch::Tensor& parameter) {
  TORCH_CHECK(t.scalar_type() == parameter.scalar_type(), module, ": argument '", name, "' has dtype ",
              t.scalar_type(), " but the module's parameters have dtype ", parameter.scalar_type(),
              " (convert one of them, e.g. module.to(", t.scalar_type(), "))");
}

inline void check_dim(const char* op, const char* name, const torch::Tensor& t, int64_t dim,
                      int64_t expected, const char* what) {
  TORCH_CHECK(t.size(dim) == expected, op, ": argument '", name, "' has ", what, " ",
              t.size(dim), " at dimension ", dim, ", expected ", expected, " (shape ",
              shape_str(t), ")");
}

/// q (N,H,L,E), k (N,H,S,E), v (N,H,S,M): ranks, dtypes and matching sizes.
/// With grouped_heads, k and v may have fewer heads than q, a divisor of H
/// (grouped-query attention), the same for both.
inline void check_qkv(const char* op, const torch::Tensor& q, const torch::Tensor& k,
                      const torch::Tensor& v, bool grouped_heads = false) {
  check_float_tensor(op, "q", q, 4);
  check_float_tensor(op, "k", k, 4);
  check_float_tensor(op, "v", v, 4);
  check_same_dtype(op, "k", k, "q", q);
  check_same_dtype(op, "v", v, "q", q);
  check_dim(op, "k", k, 0, q.size(0), "batch size N");
  if (grouped_heads) {
    const int64_t H = q.size(1), Hkv = k.size(1);
    TORCH_CHECK(Hkv == H || (Hkv > 0 && H % Hkv == 0), op, ": argument 'k' has head count ", Hkv,
                ", which must divide q's head count ", H, " (grouped-query heads; shapes ", shape_str(q),
                " and ", shape_str(k), ")");
    check_dim(op, "v", v, 1, Hkv, "head count (k's)");
  } else {
    check_dim(op, "k", k, 1, q.size(1), "head count H");
  }
  check_dim(op, "k", k, 3, q.size(3), "feature size E");
  check_dim(op, "v", v, 0, q.size(0), "batch size N");
  if (!grouped_heads) check_dim(op, "v", v, 1, q.size(1), "head count H");
  check_dim(op, "v", v, 2, k.size(2), "key count S");
  TORCH_CHECK(q.size(3) > 0 && v.size(3) > 0, op,
              ": feature sizes E and M must be positive, got E = ", q.size(3),
              ", M = ", v.size(3));
}

/// Whether t's values can be read here: false for meta tensors, for tensors
/// without storage, and for the stand-ins a tracer passes (torch.compile's
/// and torch.export's fake tensors, like any tensor subclass, carry the
/// Python dispatch key). A check
/// of values is skipped on such tensors; the kernel op that reads them checks
/// again when it runs on real ones (ops/softmax_attention.cpp).
inline bool has_data(const torch::Tensor& t) {
  return t.has_storage() && !t.is_meta() && !t.key_set().has(c10::DispatchKey::Python);
}

/// 0 <= lengths[n] <= limit, for lengths that check_lengths accepted; no
/// check where the values are not there to read (has_data).
inline void check_length_values(const char* op, const char* name, const torch::Tensor& lengths, int64_t limit) {
  if (!lengths.defined() || lengths.numel() == 0 || !has_data(lengths)) return;
  // A loop over the N entries rather than min() and max() ops: the check runs
  // twice per call of a kernel op (at its boundary and in its kernel), and two
  // reductions cost microseconds against a decoding step's tens.
  const auto values = lengths.contiguous();
  const int64_t* entry = values.data_ptr<int64_t>();
  int64_t lo = entry[0], hi = entry[0];
  for (int64_t n = 1; n < values.numel(); ++n) lo = std::min(lo, entry[n]), hi = std::max(hi, entry[n]);
  TORCH_CHECK(lo >= 0, op, ": argument '", name, "' has a negative entry ", lo);
  TORCH_CHECK(hi <= limit, op, ": argument '", name, "' has an entry ", hi, " larger than the sequence length ", limit);
}

/// Optional int64 (N) lengths with 0 <= lengths[n] <= limit.
inline void check_lengths(const char* op, const char* name, const torch::Tensor& lengths,
                          int64_t N, int64_t limit) {
  if (!lengths.defined()) return;
  check_strided(op, name, lengths);
  TORCH_CHECK(lengths.device().is_cpu(), op, ": argument '", name,
              "' must be on the CPU, got device ", lengths.device());
  TORCH_CHECK(lengths.scalar_type() == torch::kLong, op, ": argument '", name,
              "' must be int64, got dtype ", lengths.scalar_type());
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == N, op, ": argument '", name,
              "' must have shape (", N, "), got ", shape_str(lengths));
  check_length_values(op, name, lengths, limit);
}

inline void check_finite(const char* op, const char* name, double value) {
  TORCH_CHECK(std::isfinite(value), op, ": option '", name, "' must be finite, got ", value);
}

/// The largest finite value of a floating dtype.
inline double dtype_max(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return std::numeric_limits<float>::max();
    case c10::ScalarType::Half: return std::numeric_limits<c10::Half>::max();
    case c10::ScalarType::BFloat16: return std::numeric_limits<c10::BFloat16>::max();
    default: return std::numeric_limits<double>::max();
  }
}

/// The smallest positive normal number of a floating dtype (double for any other).
inline double dtype_min_normal(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return std::numeric_limits<float>::min();
    case c10::ScalarType::Half: return std::numeric_limits<c10::Half>::min();
    case c10::ScalarType::BFloat16: return std::numeric_limits<c10::BFloat16>::min();
    default: return std::numeric_limits<double>::min();
  }
}

/// A finite option that the op uses in the inputs' dtype (a float32 kernel
/// casts it to float): it must stay finite there. 1e39 is finite in float64
/// but infinite in float32, where a scale of it turns softmax weights into
/// zeros or NaN.
inline void check_finite_in(const char* op, const char* name, double value, c10::ScalarType type) {
  check_finite(op, name, value);
  const double limit = dtype_max(type);
  TORCH_CHECK(std::abs(value) <= limit, op, ": option '", name, "' must be finite in ",
              dtype_name(type), " for ", dtype_name(type), " inputs (|", name, "| <= ", limit,
              "), got ", value);
}

/// An optional scale, finite in the inputs' dtype.
inline void check_scale(const char* op, const c10::optional<double>& scale, c10::ScalarType type) {
  if (scale) check_finite_in(op, "scale", *scale, type);
}

/// Rotary positions on `dim` of E features (`name` the option, `base_name`
/// its base): 0 (none) or even in [2, E], and a finite base > 0.
inline void check_rotary(const char* op, const char* name, int64_t dim, const char* base_name,
                         double base, int64_t E) {
  TORCH_CHECK(dim == 0 || (dim >= 2 && dim % 2 == 0 && dim <= E), op, ": option '", name,
              "' must be 0 (no rotary positions) or an even number in [2, E] = [2, ", E, "], got ",
              dim, " (the entries rotate in pairs)");
  TORCH_CHECK(std::isfinite(base) && base > 0, op, ": option '", base_name,
              "' must be finite and > 0, got ", base);
}

/// Attention dropout's probability: in [0, 1) (NaN refused).
inline void check_dropout(const char* op, double p) {
  TORCH_CHECK(p >= 0 && p < 1, op, ": option 'dropout_p' must be in [0, 1), got ", p,
              " (0: no dropout; 1 would drop every weight)");
}

inline double scale_or_default(const c10::optional<double>& scale, int64_t E) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(E));
}

}  // namespace attnkit::detail
