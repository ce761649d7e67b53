// The transformer block (src/models/block.h).
#include "models/block.h"

#include <cmath>

#include "ops/checks.h"

namespace attnkit::models {

namespace {

int64_t agglomerative_classes(const nn::MechanismSpec& spec, int64_t heads) {
  const int64_t classes = spec.get_int("classes", 0);
  return classes > 0 ? classes : heads;
}

}  // namespace

FeatureNormImpl::FeatureNormImpl(int64_t width, Normalization kind, bool bias) : kind_(kind) {
  weight = register_parameter("weight", torch::ones({width}));
  if (kind == Normalization::layer && bias) this->bias = register_parameter("bias", torch::zeros({width}));
}

torch::Tensor FeatureNormImpl::forward(const torch::Tensor& x) {
  if (kind_ == Normalization::layer) return torch::layer_norm(x, {weight.size(0)}, weight, bias, kLayerEps);
  // 16-bit inputs are normalised in float32; float32 and float64 in their own type.
  const bool narrow = x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf;
  const auto wide = narrow ? x.to(torch::kFloat) : x;
  const auto scaled = wide * torch::rsqrt(wide.square().mean(-1, /*keepdim=*/true) + kRmsEps);
  return scaled.to(x.scalar_type()) * weight;
}

TransformerBlockImpl::TransformerBlockImpl(const TransformerOptions& options, const std::string& spec,
                                           bool causal, bool cross)
    : options_(options), causal_(causal), spec_(spec) {
  const int64_t d = options.width(), H = options.heads();
  const auto [info, parsed] = nn::resolve_mechanism(spec);
  info_ = info;
  if (has(options.positions(), Positions::relative)) {
    kind_ = Kind::relative;
    relative_ = register_module(
        "self_attention",
        nn::RelativePositionAttention(nn::RelativePositionAttentionOptions(d, H, options.relative_clip())));
  } else if (info->layer == nn::MechanismLayer::class_projections) {
    kind_ = Kind::agglomerative;
    agglomerative_ = register_module(
        "self_attention",
        nn::AgglomerativeAttention(nn::AgglomerativeAttentionOptions(d, agglomerative_classes(parsed, H))
                                       .dropout(options.dropout())
                                       .clip(parsed.get_double("clip", AgglomerativeAttentionFuncOptions().clip()))));
  } else {
    kind_ = Kind::multihead;
    self_ = register_module("self_attention",
                            nn::MultiheadAttention(nn::MultiheadAttentionOptions(d, H)
                                                       .kv_heads(options.kv_heads())
                                                       .bias(options.bias())
                                                       .alibi(has(options.positions(), Positions::alibi))
                                                       .rotary_dim(options.rotary_dim())
                                                       .dropout(options.attention_dropout())
                                                       .attention(spec)));
    sac_ = dynamic_cast<nn::SacAttentionImpl*>(self_->attention.get());
  }
  const auto norm = [&] { return FeatureNorm(d, options.normalization(), options.bias()); };
  norm_self_ = register_module("norm_self", norm());
  if (cross) {
    cross_ = register_module("cross_attention",
                             nn::MultiheadAttention(nn::MultiheadAttentionOptions(d, H)
                                                        .kv_heads(options.kv_heads())
                                                        .bias(options.bias())
                                                        .dropout(options.attention_dropout())
                                                        .attention(options.cross_attention())));
    norm_cross_ = register_module("norm_cross", norm());
  }
  const auto linear = [&](int64_t in, int64_t out) {
    return nn::Linear(torch::nn::LinearOptions(in, out).bias(options.bias()));
  };
  ff1_ = register_module("ff1", linear(d, options.ffn()));
  ff2_ = register_module("ff2", linear(options.ffn(), d));
  if (options.feed_forward() == FeedForward::swiglu) ff3_ = register_module("ff3", linear(d, options.ffn()));
  norm_ff_ = register_module("norm_ff", norm());
}

template <typename F>
torch::Tensor TransformerBlockImpl::sublayer(const torch::Tensor& x, FeatureNorm& norm, F&& f) {
  const double p = options_.dropout();
  if (options_.norm() == Norm::pre) return x + torch::dropout(f(norm(x)), p, is_training());
  return norm(x + torch::dropout(f(x), p, is_training()));
}

torch::Tensor TransformerBlockImpl::feed_forward(const torch::Tensor& h) {
  if (ff3_) return ff2_(torch::silu(ff1_(h)) * ff3_(h));
  return ff2_(torch::relu(ff1_(h)));
}

torch::Tensor TransformerBlockImpl::self_attention(const torch::Tensor& h,
                                                   const torch::Tensor& key_lengths) {
  switch (kind_) {
    case Kind::relative:
      return relative_(h, key_lengths, causal_);
    case Kind::agglomerative:
      TORCH_CHECK(!key_lengths.defined(), "Transformer: agglomerative attention does not support "
                  "padded inputs (key_lengths); give sequences of equal length");
      return agglomerative_->forward(h, torch::Tensor(), causal_);
    case Kind::multihead:
      // A causal pattern is causal by construction and takes no flag.
      return self_(h, h, h, key_lengths, causal_ && info_->supports.causal);
  }
  TORCH_CHECK(false, "unreachable");
}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& key_lengths,
                                            const torch::Tensor& memory,
                                            const torch::Tensor& memory_lengths) {
  auto y = sublayer(x, norm_self_, [&](const torch::Tensor& h) { return self_attention(h, key_lengths); });
  if (cross_) {
    TORCH_CHECK(memory.defined(), "Transformer: a cross-attention block needs the encoder output");
    y = sublayer(y, norm_cross_, [&](const torch::Tensor& h) {
      return cross_(h, memory, memory, memory_lengths, false);
    });
  }
  return sublayer(y, norm_ff_, [&](const torch::Tensor& h) { return feed_forward(h); });
}

// --- Decoding -----------------------------------------------------------------------------

std::unique_ptr<BlockState> TransformerBlockImpl::start_decoding(const torch::Tensor& memory,
                                                                 const torch::Tensor& memory_lengths) {
  auto state = std::make_unique<BlockState>();
  if (kind_ == Kind::multihead) {
    TORCH_CHECK(info_->start_decoding, "Transformer: attention '", spec_,
                "' has no incremental decoding state");
    state->self = info_->start_decoding(nn::resolve_mechanism(spec_).second);
    if (self_->options.alibi()) state->self->set_alibi_slopes(self_->alibi_slopes());
    if (self_->options.rotary_dim() > 0)
      state->self_rotates = state->self->rotate_inside(self_->options.rotary_dim(), self_->options.rotary_base());
  }
  if (cross_) {
    TORCH_CHECK(memory.defined(), "Transformer: decoding a cross-attention block needs the encoder output");
    const int64_t N = memory.size(0), S = memory.size(1), Hk = cross_->kv_head_count();
    const int64_t dh = options_.width() / options_.heads();
    auto heads = [&](const torch::Tensor& t) {
      return cross_->for_mechanism(t.view({N, S, Hk, dh}).transpose(1, 2));
    };
    state->cross_keys = heads(cross_->k_proj(memory));
    state->cross_values = heads(cross_->v_proj(memory));
    state->memory_lengths = memory_lengths;
  }
  return state;
}

torch::Tensor TransformerBlockImpl::self_attention_step(const torch::Tensor& h_t, BlockState& state) {
  const int64_t N = h_t.size(0), d = options_.width(), H = options_.heads(), dh = d / H;
  if (kind_ == Kind::agglomerative) return agglomerative_->step(h_t, state.agglomerative);
  if (kind_ == Kind::multihead) {
    // Grouped heads reach a state that reads groups as they are: its cache
    // holds kv_heads heads.
    // Rotary positions turn the step's query and key at its position once,
    // so the cache holds rotated keys; unless the state rotates them itself.
    const int64_t Hk = self_->kv_head_count(), t = state.position;
    auto rotate = [&](const torch::Tensor& x) { return state.self_rotates ? x : self_->rotate(x, t); };
    auto q = rotate(self_->q_proj(h_t).view({N, H, 1, dh})).view({N, H, dh});
    auto k = self_->for_mechanism(rotate(self_->k_proj(h_t).view({N, Hk, 1, dh})).view({N, Hk, dh}));
    auto v = self_->for_mechanism(self_->v_proj(h_t).view({N, Hk, dh}));
    return self_->out_proj(state.self->step(q, k, v).reshape({N, d}));
  }
  // Relative positions, query t over keys j <= t: scores q . (k_j + wK[b_j]) /
  // sqrt(dh) with b_j = clip(j - t, -K, K) + K, values v_j + wV[b_j].
  const int64_t t = state.position, K = options_.relative_clip();
  auto q = relative_->q_proj(h_t).view({N, H, dh});
  state.relative.append(relative_->k_proj(h_t).view({N, H, dh}),
                        relative_->v_proj(h_t).view({N, H, dh}));
  const auto keys = state.relative.keys(), values = state.relative.values();  // (N, H, t+1, dh)
  auto bucket = (torch::arange(t + 1, torch::kLong) - t).clamp(-K, K) + K;       // (t+1)
  auto rel = torch::matmul(q, relative_->wK.t()).index_select(2, bucket);      // (N, H, t+1)
  auto scores = (torch::matmul(keys, q.unsqueeze(-1)).squeeze(-1) + rel) / std::sqrt(double(dh));
  auto alpha = torch::softmax(scores, -1);
  auto per_bucket = torch::zeros({N, H, 2 * K + 1}, alpha.options())
                        .index_add(2, bucket, alpha);
  auto z = torch::matmul(alpha.unsqueeze(-2), values).squeeze(-2) +
           torch::matmul(per_bucket, relative_->wV);  // (N, H, dh)
  return relative_->out_proj(z.reshape({N, d}));
}

torch::Tensor TransformerBlockImpl::cross_attention_step(const torch::Tensor& h_t, BlockState& state) {
  const int64_t N = h_t.size(0), d = options_.width(), H = options_.heads(), dh = d / H;
  auto q = cross_->q_proj(h_t).view({N, H, 1, dh});
  auto out = cross_->attention->forward(q, state.cross_keys, state.cross_values,
                                        nn::AttendArgs{false, state.memory_lengths});
  return cross_->out_proj(out.reshape({N, d}));
}

torch::Tensor TransformerBlockImpl::step(const torch::Tensor& x_t, BlockState& state) {
  auto y = sublayer(x_t, norm_self_, [&](const torch::Tensor& h) { return self_attention_step(h, state); });
  if (cross_)
    y = sublayer(y, norm_cross_, [&](const torch::Tensor& h) { return cross_attention_step(h, state); });
  ++state.position;
  return sublayer(y, norm_ff_, [&](const torch::Tensor& h) { return feed_forward(h); });
}

void TransformerBlockImpl::set_attention(const std::string& spec) {
  const auto [info, parsed] = nn::resolve_mechanism(spec);
  TORCH_CHECK(kind_ == Kind::multihead && info->layer == nn::MechanismLayer::multihead, "Transformer: cannot swap '",
              spec_, "' for '", spec, "': ",
              kind_ == Kind::relative ? "relative-position blocks hold exact attention only"
                                      : "agglomerative blocks hold class projections instead of "
                                        "query/key projections, so their weights do not carry over");
  // SAC to SAC (the model has checked that its predictor serves the new spec) keeps the structures' source.
  TORCH_CHECK((sac_ != nullptr) == info->model_structures, "Transformer: cannot swap '", spec_, "' for '", spec,
              "': SAC's structures come from an edge predictor trained with the model");
  self_->set_attention(spec);
  if (sac_) sac_ = dynamic_cast<nn::SacAttentionImpl*>(self_->attention.get());
  spec_ = spec;
  info_ = info;
}

}  // namespace attnkit::models
