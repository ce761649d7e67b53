// The transformer builder (include/attnkit/models/transformer.h).
#include <attnkit/models/transformer.h>
#include <attnkit/ops.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "ops/checks.h"
#include "models/block.h"

namespace attnkit::models {

DecodingState::DecodingState() = default;
DecodingState::~DecodingState() = default;
DecodingState::DecodingState(DecodingState&&) noexcept = default;
DecodingState& DecodingState::operator=(DecodingState&&) noexcept = default;

namespace {

constexpr const char* kModel = "Transformer";

void check_tokens(const char* name, const torch::Tensor& tokens, int64_t dims, int64_t vocab) {
  TORCH_CHECK(tokens.defined() && tokens.dim() == dims && tokens.scalar_type() == torch::kLong, kModel,
              ": argument '", name, "' must be int64 token ids of ", dims, " dimensions, got ",
              tokens.defined() ? detail::shape_str(tokens) + " " + std::string(c10::toString(tokens.scalar_type()))
                               : std::string("an undefined tensor"));
  // The ids' range where they can be read: a tracer's fake tensors have none
  // (the compiled graph runs this check on the real ids, python/attnkit/_compile.py).
  if (tokens.numel() == 0 || !detail::has_data(tokens)) return;
  const int64_t lo = tokens.min().item<int64_t>(), hi = tokens.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < vocab, kModel, ": argument '", name, "' holds ids in [", lo, ", ", hi,
              "], outside the vocabulary [0, ", vocab, ")");
}

/// Causal convolution of width w over x_padded (N, T + w - 1, d) -> (N, T, d):
/// output t sees inputs t .. t + w - 1 of the padded sequence, as one GEMM
/// over the unfolded windows (N, T, d * w).
torch::Tensor causal_conv(nn::Linear& conv, const torch::Tensor& x_padded, int64_t w) {
  const int64_t N = x_padded.size(0), T = x_padded.size(1) - w + 1, d = x_padded.size(2);
  return conv(x_padded.unfold(1, w, 1).reshape({N, T, d * w}));
}

torch::nn::Embedding make_embedding(int64_t vocab, int64_t d) {
  torch::nn::Embedding e(torch::nn::EmbeddingOptions(vocab, d));
  // Scaled by sqrt(d) on the way in, the embeddings start at unit variance;
  // tied to the output layer, they give logits of unit scale too.
  torch::NoGradGuard no_grad;
  e->weight.normal_(0, 1.0 / std::sqrt(double(d)));
  return e;
}

}  // namespace

TransformerImpl::TransformerImpl(const TransformerOptions& options) : options_(options) {
  validate(options_);
  const int64_t d = options_.width(), w = options_.conv_width();
  const bool enc_dec = options_.architecture() == Architecture::encoder_decoder;
  embedding_ = register_module("embedding", make_embedding(options_.vocab_size(), d));
  if (enc_dec && options_.source_vocab_size() > 0 && options_.source_vocab_size() != options_.vocab_size())
    source_embedding_ = register_module("source_embedding", make_embedding(options_.source_vocab_size(), d));
  // (Relative positions live inside the blocks.)
  const auto positions = options_.positions();
  if (has(positions, Positions::learned))
    position_table_ = register_parameter("positions", torch::randn({options_.max_length(), d}) * 0.02);
  if (has(positions, Positions::sinusoidal))
    sinusoidal_ = register_module(
        "sinusoidal", nn::SinusoidalPositionalEncoding(nn::SinusoidalPositionalEncodingOptions(d, options_.max_length())));
  if (has(positions, Positions::conv)) {
    conv_ = register_module("conv", nn::Linear(d * w, d));
    if (enc_dec) source_conv_ = register_module("source_conv", nn::Linear(d * w, d));
  }

  // One block per layer, or with shared weights one block applied at every layer.
  auto stack = [&](const char* name, bool causal, bool cross) {
    std::vector<std::shared_ptr<TransformerBlockImpl>> blocks;
    const auto& specs = options_.attention();
    for (int64_t i = 0; i < options_.layers(); ++i) {
      if (options_.shared_weights() && i > 0) {
        blocks.push_back(blocks.front());
        continue;
      }
      const auto& spec = specs.size() == 1 ? specs[0] : specs[i];
      const std::string key = std::string(name) + (options_.shared_weights() ? "_shared" : "_" + std::to_string(i));
      blocks.push_back(register_module(key, std::make_shared<TransformerBlockImpl>(options_, spec, causal, cross)));
    }
    return blocks;
  };
  const auto arch = options_.architecture();
  if (arch != Architecture::decoder) encoder_blocks_ = stack("encoder", false, false);
  if (arch != Architecture::encoder) decoder_blocks_ = stack("decoder", true, enc_dec);
  if (options_.norm() == Norm::pre) {
    const auto norm = [&] { return std::make_shared<FeatureNormImpl>(d, options_.normalization(), options_.bias()); };
    if (!encoder_blocks_.empty()) encoder_norm_ = register_module("encoder_norm", norm());
    if (!decoder_blocks_.empty()) decoder_norm_ = register_module("decoder_norm", norm());
  }
  if (!options_.tie_embeddings())
    output_ = register_module(
        "output", nn::Linear(torch::nn::LinearOptions(d, options_.vocab_size()).bias(options_.bias())));
  for (const auto& spec : options_.attention()) {
    const auto [info, parsed] = nn::resolve_mechanism(spec);
    if (info->node_spans) extra_nodes_ = parsed.name;  // (validate: then every block's)
    if (!info->model_structures) continue;  // (validate: every such spec is the same)
    sac_options_ = nn::SacOptions::from_spec(parsed);
    edge_predictor_ =
        register_module("edge_predictor", nn::EdgePredictor(sac_options_.predictor(d, options_.heads())));
    break;
  }
}

void TransformerImpl::predict_structures(const torch::Tensor& x) {
  // The predictor reads the embeddings without sending gradients into them:
  // REINFORCE trains the predictor, the likelihood trains the network.
  const auto nodes = x.detach();
  sac_structures_ = {};
  if (is_training()) {
    auto sample = edge_predictor_->sample_batch(nodes);
    sac_structures_.edges = std::move(sample.edges);
    sac_structures_.log_prob = sample.log_prob;
    sac_structures_.tokens = sample.tokens;
    sac_structures_.step_log_prob = sample.step_log_prob;
    sac_structures_.entropy = sample.entropy;
  } else if (sac_options_.decode == "sample") {
    torch::NoGradGuard no_grad;
    auto generator = at::make_generator<at::CPUGeneratorImpl>(sac_options_.seed);
    sac_structures_.edges = edge_predictor_->sample_batch(nodes, generator).edges;
  } else {
    for (int64_t b = 0; b < nodes.size(0); ++b)
      sac_structures_.edges.push_back(edge_predictor_->beam_search(nodes[b], sac_options_.beam).edges);
  }
  for (auto* blocks : {&encoder_blocks_, &decoder_blocks_})
    for (auto& block : *blocks) block->set_structures(sac_structures_.edges);
}

torch::Tensor TransformerImpl::embed(const torch::Tensor& tokens, bool source, int64_t offset) {
  const int64_t N = tokens.size(0), d = options_.width();
  auto& table = source && source_embedding_ ? source_embedding_ : embedding_;
  auto x = table(tokens) * std::sqrt(double(d));
  if (conv_) {
    const int64_t w = options_.conv_width();
    auto padded = torch::cat({torch::zeros({N, w - 1, d}, x.options()), x}, 1);
    x = causal_conv(source && source_conv_ ? source_conv_ : conv_, padded, w);
  }
  return torch::dropout(add_position_table(x, offset), options_.dropout(), is_training());
}

torch::Tensor TransformerImpl::add_position_table(const torch::Tensor& x, int64_t offset) {
  if (!position_table_.defined() && !sinusoidal_) return x;
  const int64_t L = x.size(1);
  TORCH_CHECK(offset + L <= options_.max_length(), kModel, ": position ", offset + L - 1, " is beyond max_length ",
              options_.max_length(), " of the ", position_table_.defined() ? "learned" : "sinusoidal",
              " position table");
  return position_table_.defined() ? x + position_table_.narrow(0, offset, L) : sinusoidal_(x, offset);
}

torch::Tensor TransformerImpl::logits(const torch::Tensor& hidden) {
  return options_.tie_embeddings() ? attnkit::linear(hidden, embedding_->weight) : output_(hidden);
}

void TransformerImpl::set_attention_probe(AttentionProbe probe) {
  probe_ = std::move(probe);
  if (probe_) return;  // forward() points each block at it, numbering the applications
  for (auto* blocks : {&encoder_blocks_, &decoder_blocks_})
    for (auto& block : *blocks) block->set_self_attention_probe({});
}

void TransformerImpl::probe_layer(TransformerBlockImpl& block, int64_t layer) {
  if (!probe_) return;
  block.set_self_attention_probe(
      [this, layer](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
        probe_(layer, q, k, v);
      });
}

torch::Tensor TransformerImpl::encode(const torch::Tensor& source, const torch::Tensor& source_lengths) {
  const int64_t vocab = source_embedding_ ? options_.source_vocab_size() : options_.vocab_size();
  check_tokens("source", source, 2, vocab);
  detail::check_lengths(kModel, "source_lengths", source_lengths, source.size(0), source.size(1));
  auto x = embed(source, true, 0);
  const int64_t tokens = x.size(1);
  if (!extra_nodes_.empty()) x = append_extra_nodes(x, extra_nodes_);
  if (edge_predictor_) predict_structures(x);
  for (size_t i = 0; i < encoder_blocks_.size(); ++i) {
    probe_layer(*encoder_blocks_[i], static_cast<int64_t>(i));
    x = encoder_blocks_[i]->forward(x, source_lengths);
  }
  if (!extra_nodes_.empty()) x = x.narrow(1, 0, tokens);
  return encoder_norm_ ? encoder_norm_->forward(x) : x;
}

torch::Tensor TransformerImpl::forward(const torch::Tensor& tokens, const torch::Tensor& source,
                                       const torch::Tensor& source_lengths) {
  const auto arch = options_.architecture();
  TORCH_CHECK(arch == Architecture::encoder_decoder || !source.defined(), kModel,
              ": a source sequence is for an encoder-decoder; this model is an ", to_string(arch));
  if (arch == Architecture::encoder) return logits(encode(tokens, source_lengths));
  check_tokens("tokens", tokens, 2, options_.vocab_size());
  torch::Tensor memory;
  if (arch == Architecture::encoder_decoder) {
    TORCH_CHECK(source.defined(), kModel, ": an encoder-decoder needs the source sequence");
    TORCH_CHECK(source.size(0) == tokens.size(0), kModel, ": source has batch size ", source.size(0),
                " but tokens have ", tokens.size(0));
    memory = encode(source, source_lengths);
  }
  auto x = embed(tokens, false, 0);
  const auto first = static_cast<int64_t>(memory.defined() ? encoder_blocks_.size() : 0);
  for (size_t i = 0; i < decoder_blocks_.size(); ++i) {
    probe_layer(*decoder_blocks_[i], first + static_cast<int64_t>(i));
    x = decoder_blocks_[i]->forward(x, {}, memory, source_lengths);
  }
  return logits(decoder_norm_ ? decoder_norm_->forward(x) : x);
}

void TransformerImpl::set_attention(const std::vector<std::string>& specs) {
  if (specs == options_.attention()) return;  // what it has (e.g. eval --attention with the trained spec)
  auto changed = options_;
  changed.attention(specs);
  validate(changed);
  // Block by block: SAC stays SAC under a spec its trained predictor serves
  // (only the evaluation keys differ); nothing else becomes or stops being SAC.
  const auto per_block = [&](const std::vector<std::string>& v, int64_t i) { return v.size() == 1 ? v[0] : v[i]; };
  for (int64_t i = 0; i < options_.layers(); ++i) {
    const auto [before_info, before] = nn::resolve_mechanism(per_block(options_.attention(), i));
    const auto [after_info, after] = nn::resolve_mechanism(per_block(specs, i));
    TORCH_CHECK(before_info->model_structures == after_info->model_structures, kModel, ": cannot swap attention ",
                before_info->model_structures ? "out of" : "into",
                " SAC: its structures come from an edge predictor trained with the model");
    TORCH_CHECK(!before_info->model_structures || nn::SacOptions::from_spec(after).same_training(sac_options_), kModel,
                ": cannot swap '", before.str(), "' for '", after.str(),
                "': the edge predictor was trained under the first; only beam, decode and seed may change");
    TORCH_CHECK(extra_nodes_.empty() && !after_info->node_spans, kModel, ": cannot swap '",
                extra_nodes_.empty() ? after.name : extra_nodes_, "' ", extra_nodes_.empty() ? "in" : "out",
                ": it adds nodes of its own, and the model's node set is fixed when it is built");
  }
  auto swap = [&](std::vector<std::shared_ptr<TransformerBlockImpl>>& blocks) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (options_.shared_weights() && i > 0) break;
      blocks[i]->set_attention(per_block(specs, static_cast<int64_t>(i)));
    }
  };
  swap(encoder_blocks_);
  swap(decoder_blocks_);
  options_ = changed;
  for (const auto& spec : specs) {
    const auto [info, parsed] = nn::resolve_mechanism(spec);
    if (info->model_structures) sac_options_ = nn::SacOptions::from_spec(parsed);
  }
}

// --- Decoding -----------------------------------------------------------------------------

DecodingState TransformerImpl::start_decoding(int64_t batch, const torch::Tensor& source,
                                              const torch::Tensor& source_lengths) {
  const auto arch = options_.architecture();
  TORCH_CHECK(arch != Architecture::encoder, kModel,
              ": an encoder sees its whole input at once and does not decode token by token");
  TORCH_CHECK(batch >= 1, kModel, ": start_decoding needs batch >= 1, got ", batch);
  DecodingState state;
  state.batch_ = batch;
  if (arch == Architecture::encoder_decoder) {
    TORCH_CHECK(source.defined() && source.dim() == 2 && source.size(0) == batch, kModel,
                ": decoding an encoder-decoder needs the source (", batch, ", S)");
    state.memory_ = encode(source, source_lengths);
    state.memory_lengths_ = source_lengths;
  } else {
    TORCH_CHECK(!source.defined(), kModel, ": a source sequence is for an encoder-decoder");
  }
  for (auto& block : decoder_blocks_)
    state.blocks_.push_back(block->start_decoding(state.memory_, state.memory_lengths_));
  return state;
}

torch::Tensor TransformerImpl::step(const torch::Tensor& tokens, DecodingState& state) {
  TORCH_CHECK(!state.blocks_.empty(), kModel, ": step needs a state from start_decoding");
  check_tokens("tokens", tokens, 1, options_.vocab_size());
  TORCH_CHECK(tokens.size(0) == state.batch_, kModel, ": the state decodes ", state.batch_,
              " streams, got ", tokens.size(0), " tokens");
  const int64_t N = tokens.size(0), d = options_.width(), t = state.position_;
  torch::Tensor x;
  if (conv_) {
    // The convolution sees this embedding and the previous w - 1 (zeros before the start).
    const int64_t w = options_.conv_width();
    auto e = embedding_(tokens) * std::sqrt(double(d));
    if (!state.conv_window_.defined()) state.conv_window_ = torch::zeros({N, w - 1, d}, e.options());
    auto window = torch::cat({state.conv_window_, e.unsqueeze(1)}, 1);  // (N, w, d)
    state.conv_window_ = window.narrow(1, 1, w - 1);
    x = torch::dropout(add_position_table(causal_conv(conv_, window, w), t).squeeze(1), options_.dropout(),
                       is_training());
  } else {
    x = embed(tokens.unsqueeze(1), false, t).squeeze(1);
  }
  for (size_t i = 0; i < decoder_blocks_.size(); ++i) x = decoder_blocks_[i]->step(x, *state.blocks_[i]);
  ++state.position_;
  return logits(decoder_norm_ ? decoder_norm_->forward(x) : x);
}

torch::Tensor TransformerImpl::generate(const torch::Tensor& prompt, const GenerateOptions& g,
                                        const torch::Tensor& source, const torch::Tensor& source_lengths) {
  check_tokens("prompt", prompt, 2, options_.vocab_size());
  TORCH_CHECK(prompt.size(1) >= 1, kModel, ": generate needs a prompt of at least one token");
  TORCH_CHECK(g.tokens() >= 0, kModel, ": generate: tokens must be >= 0, got ", g.tokens());
  TORCH_CHECK(g.temperature() >= 0 && std::isfinite(g.temperature()), kModel,
              ": generate: temperature must be finite and >= 0, got ", g.temperature());
  TORCH_CHECK(g.top_k() >= 0, kModel, ": generate: top_k must be >= 0, got ", g.top_k());
  const bool tabled = position_table_.defined() || sinusoidal_;
  TORCH_CHECK(!tabled || prompt.size(1) + g.tokens() <= options_.max_length(), kModel, ": generate: ",
              prompt.size(1), " prompt + ", g.tokens(), " new tokens exceed max_length ", options_.max_length());

  torch::NoGradGuard no_grad;
  const bool was_training = is_training();
  eval();
  struct RestoreMode {
    TransformerImpl* model;
    bool training;
    ~RestoreMode() { model->train(training); }
  } restore{this, was_training};

  const int64_t N = prompt.size(0), P = prompt.size(1);
  auto generator = at::detail::createCPUGenerator(g.seed());
  auto state = start_decoding(N, source, source_lengths);
  torch::Tensor next_logits;
  for (int64_t p = 0; p < P; ++p) next_logits = step(prompt.select(1, p).contiguous(), state);
  std::vector<torch::Tensor> out{prompt};
  for (int64_t i = 0; i < g.tokens(); ++i) {
    torch::Tensor next;
    if (g.temperature() == 0) {
      next = next_logits.argmax(-1);
    } else {
      auto scaled = next_logits.to(torch::kFloat64) / g.temperature();
      if (g.top_k() > 0 && g.top_k() < scaled.size(-1)) {
        const auto kth = std::get<0>(scaled.topk(g.top_k(), -1)).select(-1, g.top_k() - 1).unsqueeze(-1);
        scaled = scaled.masked_fill(scaled < kth, -std::numeric_limits<double>::infinity());
      }
      next = torch::multinomial(torch::softmax(scaled, -1), 1, false, generator).squeeze(-1);
    }
    out.push_back(next.unsqueeze(1));
    if (i + 1 < g.tokens()) next_logits = step(next, state);
  }
  return torch::cat(out, 1);
}

int64_t TransformerImpl::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace attnkit::models
