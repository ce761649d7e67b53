// `attnkit bench-model`'s baseline: the same Transformer written in plain
// libtorch (TorchBaseline, declared in bench_model.h).
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>

#include "bench_model.h"

namespace attnkit::cli::bench_model {

TorchBaselineImpl::TorchBaselineImpl(const ModelConfig& c, int64_t max_length) : c_(c) {
  const int64_t d = c.width;
  embedding_ = register_module("embedding", torch::nn::Embedding(c.vocab, d));
  {
    torch::NoGradGuard no_grad;
    embedding_->weight.normal_(0, 1.0 / std::sqrt(double(d)));
  }
  if (c.positions == "sinusoidal") {
    // PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d)).
    auto p = torch::arange(max_length, torch::kFloat).unsqueeze(1);
    auto rate = torch::exp(torch::arange(0, d, 2, torch::kFloat) * (-std::log(10000.0) / d));
    auto table = torch::zeros({max_length, d});
    table.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 2)},
                     torch::sin(p * rate));
    table.index_put_({torch::indexing::Slice(), torch::indexing::Slice(1, torch::indexing::None, 2)},
                     torch::cos(p * rate).narrow(1, 0, d / 2));
    table_ = register_buffer("sinusoidal", table);
  } else if (c.positions == "learned") {
    table_ = register_parameter("positions", torch::randn({max_length, d}) * 0.02);
  }
  for (int64_t i = 0; i < c.layers; ++i) {
    Block b;
    const std::string n = "block_" + std::to_string(i) + "_";
    b.q = register_module(n + "q", torch::nn::Linear(d, d));
    const int64_t kv_width = (c.kv_heads > 0 ? c.kv_heads : c.heads) * (d / c.heads);
    b.k = register_module(n + "k", torch::nn::Linear(d, kv_width));
    b.v = register_module(n + "v", torch::nn::Linear(d, kv_width));
    b.out = register_module(n + "out", torch::nn::Linear(d, d));
    b.ff1 = register_module(n + "ff1", torch::nn::Linear(d, c.ffn));
    b.ff2 = register_module(n + "ff2", torch::nn::Linear(c.ffn, d));
    b.norm_self = register_module(n + "norm_self", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    b.norm_ff = register_module(n + "norm_ff", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    blocks_.push_back(b);
  }
  norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
}

torch::Tensor TorchBaselineImpl::forward(const torch::Tensor& tokens) {
  const int64_t N = tokens.size(0), L = tokens.size(1), d = c_.width, H = c_.heads, dh = d / H;
  const double p = c_.dropout;
  auto x = embedding_(tokens) * std::sqrt(double(d));
  if (table_.defined()) x = x + table_.narrow(0, 0, L);
  x = torch::dropout(x, p, is_training());
  torch::Tensor mask;  // 0 where a query sees the key, -inf above the diagonal
  if (causal_model(c_))
    mask = torch::full({L, L}, -std::numeric_limits<float>::infinity()).triu(1);
  auto heads = [&](const torch::Tensor& t) { return t.view({N, L, H, dh}).transpose(1, 2); };
  // Grouped-query heads: each key/value head repeated over its group.
  const int64_t Hk = c_.kv_heads > 0 ? c_.kv_heads : H;
  auto kv_heads = [&](const torch::Tensor& t) {
    return t.view({N, L, Hk, dh}).transpose(1, 2).repeat_interleave(H / Hk, 1);
  };
  for (auto& b : blocks_) {
    auto h = b.norm_self(x);
    auto scores = torch::matmul(heads(b.q(h)), kv_heads(b.k(h)).transpose(-2, -1)) / std::sqrt(double(dh));
    if (mask.defined()) scores = scores + mask;
    auto a = torch::matmul(torch::softmax(scores, -1), kv_heads(b.v(h)));
    x = x + torch::dropout(b.out(a.transpose(1, 2).reshape({N, L, d})), p, is_training());
    x = x + torch::dropout(b.ff2(torch::relu(b.ff1(b.norm_ff(x)))), p, is_training());
  }
  return torch::matmul(norm_(x), embedding_->weight.t());
}

int64_t TorchBaselineImpl::parameter_count() const {
  int64_t n = 0;
  for (const auto& t : parameters()) n += t.numel();
  return n;
}

}  // namespace attnkit::cli::bench_model
