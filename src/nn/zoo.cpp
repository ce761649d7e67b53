// The classic attention zoo (docs/MATH.md, "The classic zoo").
#include <attnkit/nn/zoo.h>
#include <attnkit/ops.h>

#include <cmath>

#include "ops/checks.h"
#include "reference/masking.h"

namespace attnkit::nn {

namespace {

/// Checks (N,L,Dq), (N,S,Dk), (N,S,Dv) inputs of a scoring module. A dimension
/// of 0 is not checked; key_dim < 0 means "the query's feature size".
void check_inputs(const char* module, const torch::Tensor& s, const torch::Tensor& h,
                  const torch::Tensor& values, int64_t query_dim, int64_t key_dim) {
  detail::check_float_tensor(module, "query", s, 3);
  detail::check_float_tensor(module, "keys", h, 3);
  detail::check_float_tensor(module, "values", values, 3);
  detail::check_same_dtype(module, "keys", h, "query", s);
  detail::check_same_dtype(module, "values", values, "query", s);
  if (key_dim < 0) key_dim = s.size(2);
  if (query_dim > 0) detail::check_dim(module, "query", s, 2, query_dim, "feature size");
  if (key_dim > 0) detail::check_dim(module, "keys", h, 2, key_dim, "feature size");
  detail::check_dim(module, "keys", h, 0, s.size(0), "batch size N");
  detail::check_dim(module, "values", values, 0, s.size(0), "batch size N");
  detail::check_dim(module, "values", values, 1, h.size(1), "key count S");
}

/// Masked softmax of (N, L, S) scores and the weighted sum of values.
AttentionOutput attend(const torch::Tensor& scores, const torch::Tensor& values,
                       const torch::Tensor& key_lengths) {
  const int64_t N = scores.size(0), L = scores.size(1), S = scores.size(2);
  auto visible = detail::visibility(N, L, S, /*causal=*/false, key_lengths).squeeze(1);
  auto weights = detail::masked_softmax(scores, visible);
  return {torch::bmm(weights, values), weights};
}

}  // namespace

// --- Additive ------------------------------------------------------------------------
AdditiveAttentionImpl::AdditiveAttentionImpl(const AdditiveAttentionOptions& options_)
    : options(options_) {
  reset();
}

void AdditiveAttentionImpl::reset() {
  TORCH_CHECK(options.query_dim() > 0 && options.key_dim() > 0 && options.hidden_dim() > 0,
              "AdditiveAttention: query_dim, key_dim and hidden_dim must be positive");
  W = register_module("W", Linear(options.query_dim(), options.hidden_dim()));
  U = register_module(
      "U", Linear(torch::nn::LinearOptions(options.key_dim(), options.hidden_dim()).bias(false)));
  v = register_parameter("v", torch::empty({options.hidden_dim()}).uniform_(
                                  -1.0 / std::sqrt(double(options.hidden_dim())),
                                  1.0 / std::sqrt(double(options.hidden_dim()))));
}

torch::Tensor AdditiveAttentionImpl::scores(const torch::Tensor& s, const torch::Tensor& h) {
  // (N, L, 1, hidden) + (N, 1, S, hidden) -> tanh -> . v
  return torch::tanh(W(s).unsqueeze(2) + U(h).unsqueeze(1)).matmul(v);
}

AttentionOutput AdditiveAttentionImpl::forward(const torch::Tensor& s, const torch::Tensor& h,
                                               const torch::Tensor& values,
                                               const torch::Tensor& key_lengths) {
  check_inputs("AdditiveAttention", s, h, values, options.query_dim(), options.key_dim());
  detail::check_parameter_dtype("AdditiveAttention", "query", s, v);
  detail::check_lengths("AdditiveAttention", "key_lengths", key_lengths, s.size(0), h.size(1));
  return attend(scores(s, h), values, key_lengths);
}

// --- General -------------------------------------------------------------------------
GeneralAttentionImpl::GeneralAttentionImpl(const GeneralAttentionOptions& options_)
    : options(options_) {
  reset();
}

void GeneralAttentionImpl::reset() {
  TORCH_CHECK(options.query_dim() > 0 && options.key_dim() > 0,
              "GeneralAttention: query_dim and key_dim must be positive");
  const double bound = 1.0 / std::sqrt(double(options.key_dim()));
  W = register_parameter("W", torch::empty({options.query_dim(), options.key_dim()}).uniform_(-bound, bound));
}

torch::Tensor GeneralAttentionImpl::scores(const torch::Tensor& s, const torch::Tensor& h) {
  return torch::matmul(attnkit::linear(s, W.t()), h.transpose(1, 2));  // (s W) h^T
}

AttentionOutput GeneralAttentionImpl::forward(const torch::Tensor& s, const torch::Tensor& h,
                                              const torch::Tensor& values,
                                              const torch::Tensor& key_lengths) {
  check_inputs("GeneralAttention", s, h, values, options.query_dim(), options.key_dim());
  detail::check_parameter_dtype("GeneralAttention", "query", s, W);
  detail::check_lengths("GeneralAttention", "key_lengths", key_lengths, s.size(0), h.size(1));
  return attend(scores(s, h), values, key_lengths);
}

// --- Dot ---------------------------------------------------------------------------------
DotAttentionImpl::DotAttentionImpl(const DotAttentionOptions& options_) : options(options_) {}

torch::Tensor DotAttentionImpl::scores(const torch::Tensor& s, const torch::Tensor& h) {
  auto e = torch::bmm(s, h.transpose(1, 2));
  return options.scaled() ? e / std::sqrt(double(s.size(2))) : e;
}

AttentionOutput DotAttentionImpl::forward(const torch::Tensor& s, const torch::Tensor& h,
                                          const torch::Tensor& values,
                                          const torch::Tensor& key_lengths) {
  check_inputs("DotAttention", s, h, values, 0, /*key_dim: as the query*/ -1);
  detail::check_lengths("DotAttention", "key_lengths", key_lengths, s.size(0), h.size(1));
  return attend(scores(s, h), values, key_lengths);
}

// --- Location ------------------------------------------------------------------------------
LocationAttentionImpl::LocationAttentionImpl(const LocationAttentionOptions& options_)
    : options(options_) {
  reset();
}

void LocationAttentionImpl::reset() {
  TORCH_CHECK(options.query_dim() > 0 && options.max_source_length() > 0,
              "LocationAttention: query_dim and max_source_length must be positive");
  W = register_module("W", Linear(options.query_dim(), options.max_source_length()));
}

AttentionOutput LocationAttentionImpl::forward(const torch::Tensor& s, const torch::Tensor& values,
                                               const torch::Tensor& key_lengths) {
  constexpr const char* module = "LocationAttention";
  detail::check_float_tensor(module, "query", s, 3);
  detail::check_float_tensor(module, "values", values, 3);
  detail::check_parameter_dtype(module, "query", s, W->weight);
  detail::check_dim(module, "query", s, 2, options.query_dim(), "feature size");
  detail::check_dim(module, "values", values, 0, s.size(0), "batch size N");
  const int64_t S = values.size(1);
  TORCH_CHECK(S <= options.max_source_length(), module, ": source length ", S,
              " exceeds max_source_length ", options.max_source_length());
  detail::check_lengths(module, "key_lengths", key_lengths, s.size(0), S);
  return attend(W(s).narrow(2, 0, S), values, key_lengths);
}

// --- Sinusoidal positions --------------------------------------------------------------------
SinusoidalPositionalEncodingImpl::SinusoidalPositionalEncodingImpl(
    const SinusoidalPositionalEncodingOptions& options_)
    : options(options_) {
  reset();
}

void SinusoidalPositionalEncodingImpl::reset() {
  const int64_t d = options.width(), T = options.max_length();
  TORCH_CHECK(d > 0 && T > 0, "SinusoidalPositionalEncoding: width and max_length must be positive");
  auto position = torch::arange(T, torch::kDouble).unsqueeze(1);           // (T, 1)
  auto two_i = torch::arange(0, d, 2, torch::kDouble);                     // 2i
  auto angle = position / torch::pow(10000.0, two_i / double(d));         // (T, ceil(d/2))
  auto pe = torch::zeros({T, d}, torch::kDouble);
  pe.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, d, 2)}, torch::sin(angle));
  pe.index_put_({torch::indexing::Slice(), torch::indexing::Slice(1, d, 2)},
                torch::cos(angle).narrow(1, 0, d / 2));
  table = register_buffer("table", pe.to(torch::kFloat));
}

torch::Tensor SinusoidalPositionalEncodingImpl::encoding(int64_t L, int64_t offset) const {
  TORCH_CHECK(offset >= 0 && L >= 0 && offset + L <= options.max_length(),
              "SinusoidalPositionalEncoding: positions [", offset, ", ", offset + L,
              ") exceed max_length ", options.max_length());
  return table.narrow(0, offset, L);
}

torch::Tensor SinusoidalPositionalEncodingImpl::forward(const torch::Tensor& x, int64_t offset) {
  detail::check_float_tensor("SinusoidalPositionalEncoding", "x", x, 3);
  detail::check_dim("SinusoidalPositionalEncoding", "x", x, 2, options.width(), "feature size");
  return x + encoding(x.size(1), offset).to(x.scalar_type());
}

// --- Relative positions (Shaw) ------------------------------------------------------------------
RelativePositionAttentionImpl::RelativePositionAttentionImpl(
    const RelativePositionAttentionOptions& options_)
    : options(options_) {
  reset();
}

void RelativePositionAttentionImpl::reset() {
  const int64_t d = options.width(), h = options.heads(), K = options.max_relative();
  TORCH_CHECK(d > 0 && h > 0 && d % h == 0, "RelativePositionAttention: width (", d,
              ") must be a positive multiple of heads (", h, ")");
  TORCH_CHECK(K >= 0, "RelativePositionAttention: max_relative must be >= 0, got ", K);
  q_proj = register_module("q_proj", Linear(d, d));
  k_proj = register_module("k_proj", Linear(d, d));
  v_proj = register_module("v_proj", Linear(d, d));
  out_proj = register_module("out_proj", Linear(d, d));
  const int64_t dz = d / h;
  const double bound = 1.0 / std::sqrt(double(dz));
  wK = register_parameter("wK", torch::empty({2 * K + 1, dz}).uniform_(-bound, bound));
  wV = register_parameter("wV", torch::empty({2 * K + 1, dz}).uniform_(-bound, bound));
}

torch::Tensor RelativePositionAttentionImpl::forward(const torch::Tensor& x,
                                                     const torch::Tensor& key_lengths, bool causal) {
  constexpr const char* module = "RelativePositionAttention";
  detail::check_float_tensor(module, "x", x, 3);
  detail::check_parameter_dtype(module, "x", x, wK);
  detail::check_dim(module, "x", x, 2, options.width(), "feature size");
  const int64_t N = x.size(0), L = x.size(1), H = options.heads(), K = options.max_relative();
  const int64_t dz = options.width() / H;
  detail::check_lengths(module, "key_lengths", key_lengths, N, L);
  auto split = [&](const torch::Tensor& t) { return t.view({N, L, H, dz}).transpose(1, 2); };
  auto q = split(q_proj(x)), k = split(k_proj(x)), v = split(v_proj(x));  // (N,H,L,dz)
  // Bucket of each (i, j): clip(j - i, -K, K) + K, shape (L, L).
  auto pos = torch::arange(L, torch::kLong);
  auto bucket = (pos.view({1, L}) - pos.view({L, 1})).clamp(-K, K) + K;
  auto bucket4 = bucket.view({1, 1, L, L}).expand({N, H, L, L});
  // q_i . wK[bucket]: per-bucket products (N,H,L,2K+1) gathered, no (L,L,dz) tensor.
  // The products with parameters go through our GEMM (attnkit::linear), as
  // every dense layer's do: libtorch's matmul picks its path by whether the
  // parameter requires grad (torch 2), so it would compute a loaded,
  // gradient-free copy of the module in other bits than the module itself.
  auto rel = attnkit::linear(q, wK).gather(3, bucket4);
  auto scores = (torch::matmul(q, k.transpose(2, 3)) + rel) / std::sqrt(double(dz));
  auto alpha = detail::masked_softmax(scores, detail::visibility(N, L, L, causal, key_lengths));
  // sum_j alpha_ij wV[bucket_ij] = (alpha summed per bucket) @ wV.
  auto per_bucket = torch::zeros({N, H, L, 2 * K + 1}, alpha.options()).scatter_add(3, bucket4, alpha);
  auto z = torch::matmul(alpha, v) + attnkit::linear(per_bucket, wV.t());  // (N,H,L,dz)
  return out_proj(z.transpose(1, 2).reshape({N, L, options.width()}));
}

}  // namespace attnkit::nn
