// The classic attention zoo (docs/MATH.md, "The classic zoo") as torch::nn modules.
//
// Every scoring module maps queries s (N, L, Dq), keys h (N, S, Dk) and values
// (N, S, Dv) to an AttentionOutput: the context (N, L, Dv) and the attention
// weights (N, L, S). Keys j >= key_lengths[n] are masked (int64 (N), optional);
// a query with no visible key gets a zero context and zero weights.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <attnkit/nn/dense.h>
#include <torch/nn/pimpl.h>

namespace attnkit::nn {

struct AttentionOutput {
  torch::Tensor context;  // (N, L, Dv)
  torch::Tensor weights;  // (N, L, S)
};

// --- Additive / concat (Bahdanau): e_ij = v^T tanh(W s_i + U h_j) -----------------
struct AdditiveAttentionOptions {
  AdditiveAttentionOptions(int64_t query_dim, int64_t key_dim, int64_t hidden_dim)
      : query_dim_(query_dim), key_dim_(key_dim), hidden_dim_(hidden_dim) {}
  TORCH_ARG(int64_t, query_dim);
  TORCH_ARG(int64_t, key_dim);
  TORCH_ARG(int64_t, hidden_dim);
};

class AdditiveAttentionImpl : public torch::nn::Cloneable<AdditiveAttentionImpl> {
 public:
  explicit AdditiveAttentionImpl(const AdditiveAttentionOptions& options);
  void reset() override;
  /// e (N, L, S) before masking.
  torch::Tensor scores(const torch::Tensor& s, const torch::Tensor& h);
  AttentionOutput forward(const torch::Tensor& s, const torch::Tensor& h,
                          const torch::Tensor& values, const torch::Tensor& key_lengths = {});

  AdditiveAttentionOptions options;
  Linear W{nullptr};  // query side, with bias
  Linear U{nullptr};  // key side, no bias
  torch::Tensor v;               // (hidden_dim)
};
TORCH_MODULE(AdditiveAttention);

// --- General (Luong): e_ij = s_i^T W h_j --------------------------------------------
struct GeneralAttentionOptions {
  GeneralAttentionOptions(int64_t query_dim, int64_t key_dim)
      : query_dim_(query_dim), key_dim_(key_dim) {}
  TORCH_ARG(int64_t, query_dim);
  TORCH_ARG(int64_t, key_dim);
};

class GeneralAttentionImpl : public torch::nn::Cloneable<GeneralAttentionImpl> {
 public:
  explicit GeneralAttentionImpl(const GeneralAttentionOptions& options);
  void reset() override;
  torch::Tensor scores(const torch::Tensor& s, const torch::Tensor& h);
  AttentionOutput forward(const torch::Tensor& s, const torch::Tensor& h,
                          const torch::Tensor& values, const torch::Tensor& key_lengths = {});

  GeneralAttentionOptions options;
  torch::Tensor W;  // (query_dim, key_dim)
};
TORCH_MODULE(GeneralAttention);

// --- Dot and scaled dot: e_ij = s_i^T h_j (/ sqrt(d) when scaled) ---------------------
struct DotAttentionOptions {
  TORCH_ARG(bool, scaled) = true;
};

class DotAttentionImpl : public torch::nn::Cloneable<DotAttentionImpl> {
 public:
  explicit DotAttentionImpl(const DotAttentionOptions& options = {});
  void reset() override {}
  torch::Tensor scores(const torch::Tensor& s, const torch::Tensor& h);
  AttentionOutput forward(const torch::Tensor& s, const torch::Tensor& h,
                          const torch::Tensor& values, const torch::Tensor& key_lengths = {});

  DotAttentionOptions options;
};
TORCH_MODULE(DotAttention);

// --- Location-based (Luong): a_i = softmax(W s_i) over source positions -----------------
// W maps the query to max_source_length position scores; positions >= S (and
// >= key_lengths[n]) are masked. The keys are not looked at.
struct LocationAttentionOptions {
  LocationAttentionOptions(int64_t query_dim, int64_t max_source_length)
      : query_dim_(query_dim), max_source_length_(max_source_length) {}
  TORCH_ARG(int64_t, query_dim);
  TORCH_ARG(int64_t, max_source_length);
};

class LocationAttentionImpl : public torch::nn::Cloneable<LocationAttentionImpl> {
 public:
  explicit LocationAttentionImpl(const LocationAttentionOptions& options);
  void reset() override;
  /// values (N, S, Dv) with S <= max_source_length.
  AttentionOutput forward(const torch::Tensor& s, const torch::Tensor& values,
                          const torch::Tensor& key_lengths = {});

  LocationAttentionOptions options;
  Linear W{nullptr};
};
TORCH_MODULE(LocationAttention);

// --- Sinusoidal positions: PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...) ------
struct SinusoidalPositionalEncodingOptions {
  SinusoidalPositionalEncodingOptions(int64_t width, int64_t max_length = 8192)
      : width_(width), max_length_(max_length) {}
  TORCH_ARG(int64_t, width);
  TORCH_ARG(int64_t, max_length);
};

class SinusoidalPositionalEncodingImpl
    : public torch::nn::Cloneable<SinusoidalPositionalEncodingImpl> {
 public:
  explicit SinusoidalPositionalEncodingImpl(const SinusoidalPositionalEncodingOptions& options);
  void reset() override;
  /// The table rows [offset, offset + L): (L, width).
  torch::Tensor encoding(int64_t L, int64_t offset = 0) const;
  /// x (N, L, width) + PE rows [offset, offset + L).
  torch::Tensor forward(const torch::Tensor& x, int64_t offset = 0);

  SinusoidalPositionalEncodingOptions options;
  torch::Tensor table;  // buffer (max_length, width)
};
TORCH_MODULE(SinusoidalPositionalEncoding);

// --- Relative position self-attention (Shaw et al. 2018), multi-head ----------------
// e_ij = q_i . (k_j + wK[clip(j - i, -K, K) + K]) / sqrt(dz),
// z_i  = sum_j alpha_ij (v_j + wV[clip(j - i, -K, K) + K]),
// tables shared across heads; output projected back to width.
struct RelativePositionAttentionOptions {
  RelativePositionAttentionOptions(int64_t width, int64_t heads, int64_t max_relative)
      : width_(width), heads_(heads), max_relative_(max_relative) {}
  TORCH_ARG(int64_t, width);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(int64_t, max_relative);  // K
};

class RelativePositionAttentionImpl
    : public torch::nn::Cloneable<RelativePositionAttentionImpl> {
 public:
  explicit RelativePositionAttentionImpl(const RelativePositionAttentionOptions& options);
  void reset() override;
  /// x (N, L, width) -> (N, L, width). Causal: query i sees keys j <= i.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& key_lengths = {},
                        bool causal = false);

  RelativePositionAttentionOptions options;
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, out_proj{nullptr};
  torch::Tensor wK, wV;  // (2K+1, dz)
};
TORCH_MODULE(RelativePositionAttention);

}  // namespace attnkit::nn
