// The transformer builder: a decoder-only language model, an encoder, or an
// encoder-decoder, with the attention of every block taken from the mechanism
// registry by spec string (include/attnkit/nn/registry.h), and incremental
// decoding with a per-block state.
//
// Layout (seed 003): token embeddings scaled by sqrt(width), a position scheme,
// then `layers` blocks of self-attention (+ cross-attention in the decoder of
// an encoder-decoder) and a position-wise feed-forward network, each sub-layer
// wrapped in a residual connection and layer norm (pre-norm: x + f(LN(x)), with
// a final LN; post-norm: LN(x + f(x))), dropout on every sub-layer output.
// The block practitioners train today swaps in RMSNorm, a SwiGLU network, no
// biases and rotary positions (TransformerOptions::llama_block).
//
//   auto model = attnkit::models::Transformer(
//       attnkit::models::TransformerOptions(27).layers(4).width(256).heads(4)
//           .attention({"full", "full", "improved-clustered:clusters=25", "causal-linear"}));
//   auto logits = model->forward(tokens);                   // (N, L) -> (N, L, 27)
//   auto text = model->generate(prompt, GenerateOptions().tokens(100).top_k(5));
#pragma once

#include <attnkit/nn/agglomerative_attention.h>
#include <attnkit/nn/dense.h>
#include <attnkit/nn/edge_predictor.h>
#include <attnkit/nn/sac.h>
#include <attnkit/nn/multihead.h>
#include <attnkit/nn/zoo.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace attnkit::models {

enum class Architecture {
  decoder,          ///< causal language model over one token sequence
  encoder,          ///< every position sees the whole input (e.g. the copy task)
  encoder_decoder,  ///< encoder over a source, causal decoder with cross-attention
};

/// How a model sees positions: a set of schemes, composable with '+' in text
/// ("conv+learned", "conv+relative", "alibi"). In the embedding they apply in
/// the order conv, then the absolute table (sinusoidal or learned: at most
/// one); relative and alibi act inside the blocks (one of them). "none" is the
/// empty set.
enum class Positions : unsigned {
  none = 0,
  sinusoidal = 1 << 0,  ///< fixed PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...), added
  learned = 1 << 1,     ///< a trained (max_length, width) table, added
  relative = 1 << 2,    ///< Shaw et al.: per-block relative key/value tables (exact attention only)
  conv = 1 << 3,        ///< causal 1-D convolution of width conv_width over the embeddings
                        ///< (the agglomerative paper's front end)
  alibi = 1 << 4,       ///< ALiBi (Press et al.): every self-attention penalises each head's
                        ///< scores by slope_h x the query-key distance, inside the kernel
                        ///< (mechanisms with MechanismSupports::alibi); no table, so no
                        ///< max_length limit of its own
  rope = 1 << 5,        ///< rotary positions (Su et al.): every self-attention turns each head's
                        ///< queries and keys to their positions (rotary_fraction of the head's
                        ///< features), inside the kernel for exact attention; no table either
};
constexpr Positions operator|(Positions a, Positions b) {
  return static_cast<Positions>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
/// True when the set `positions` holds `scheme` (a single scheme).
constexpr bool has(Positions positions, Positions scheme) {
  return (static_cast<unsigned>(positions) & static_cast<unsigned>(scheme)) != 0;
}

enum class Norm { pre, post };

/// The normalisation of every sub-layer (and the final one of pre-norm):
/// layer norm (Ba et al.: mean and variance, a scale and a shift) or RMSNorm
/// (Zhang and Sennrich: x / sqrt(mean(x^2) + 1e-6), a scale only).
enum class Normalization { layer, rms };

/// The position-wise feed-forward network: relu, ff2(relu(ff1 h)) (seed
/// 003), or swiglu, ff2(silu(ff1 h) * ff3 h) (Shazeer's GLU variant, as
/// LLaMA): three matrices instead of two, so at hidden width 2/3 ffn it has
/// the parameters of relu at ffn.
enum class FeedForward { relu, swiglu };

Architecture architecture_from_string(const std::string& name);  ///< decoder|encoder|encoder-decoder
/// "none", or schemes joined by '+' from sinusoidal|learned|relative|conv, each
/// once, with at most one of sinusoidal and learned (to_string writes them in
/// that order).
Positions positions_from_string(const std::string& name);
Norm norm_from_string(const std::string& name);             ///< pre|post
Normalization normalization_from_string(const std::string& name);  ///< layer|rms
FeedForward feed_forward_from_string(const std::string& name);     ///< relu|swiglu
std::string to_string(Architecture value);
std::string to_string(Positions value);
std::string to_string(Norm value);
std::string to_string(Normalization value);
std::string to_string(FeedForward value);

struct TransformerOptions {
  explicit TransformerOptions(int64_t vocab_size = 0) : vocab_size_(vocab_size) {}
  TORCH_ARG(Architecture, architecture) = Architecture::decoder;
  /// Token ids in [0, vocab_size) (the decoder's, and the encoder's unless
  /// source_vocab_size is set).
  TORCH_ARG(int64_t, vocab_size);
  /// encoder-decoder only: the source vocabulary; 0 means vocab_size.
  TORCH_ARG(int64_t, source_vocab_size) = 0;
  TORCH_ARG(int64_t, layers) = 2;
  TORCH_ARG(int64_t, width) = 64;
  TORCH_ARG(int64_t, heads) = 4;
  /// Key/value heads of the multi-head blocks (self- and cross-attention):
  /// grouped-query attention when it divides heads (1: multi-query); 0, the
  /// default, as many as heads. The decoding cache of exact attention keeps
  /// kv_heads heads. Not with relative positions or agglomerative blocks.
  TORCH_ARG(int64_t, kv_heads) = 0;
  TORCH_ARG(int64_t, ffn) = 256;  ///< hidden width of the feed-forward network
  TORCH_ARG(double, dropout) = 0.1;
  /// Attention dropout on every self- and cross-attention's weights, in
  /// training (MultiheadAttentionOptions::dropout); its mechanisms must take
  /// it (MechanismSupports::dropout). 0: none.
  TORCH_ARG(double, attention_dropout) = 0.0;
  /// Self-attention of the blocks as registry specs: one spec for every block,
  /// or one per block (bottom first). "agglomerative[:classes=m]" makes a block
  /// an agglomerative-attention layer (its own class projections; m defaults to heads).
  TORCH_ARG(std::vector<std::string>, attention) = {"full"};
  /// encoder-decoder only: the decoder's cross-attention spec.
  TORCH_ARG(std::string, cross_attention) = "full";
  TORCH_ARG(Positions, positions) = Positions::sinusoidal;
  /// Longest sequence for the learned and sinusoidal tables.
  TORCH_ARG(int64_t, max_length) = 2048;
  /// relative positions: offsets are clipped to [-K, K].
  TORCH_ARG(int64_t, relative_clip) = 16;
  /// conv positions: filter width over the embeddings (the paper uses 8).
  TORCH_ARG(int64_t, conv_width) = 8;
  /// rope positions: the fraction of each head's features rotated, rounded
  /// down to an even count of at least 2 (rotary_dim()); the rest carry no
  /// position (GPT-NeoX rotates a quarter).
  TORCH_ARG(double, rotary_fraction) = 1.0;
  TORCH_ARG(Norm, norm) = Norm::pre;
  TORCH_ARG(Normalization, normalization) = Normalization::layer;
  TORCH_ARG(FeedForward, feed_forward) = FeedForward::relu;
  /// Biases in the blocks' linear layers (attention projections, feed-forward
  /// network), their layer norms' shifts and the untied output layer; false
  /// leaves them out, as LLaMA does.
  TORCH_ARG(bool, bias) = true;
  /// The output layer reuses the (target) embedding matrix.
  TORCH_ARG(bool, tie_embeddings) = true;
  /// Universal transformer: one block's weights applied `layers` times
  /// (requires a single attention spec).
  TORCH_ARG(bool, shared_weights) = false;

 public:  // (TORCH_ARG leaves the access private)
  /// The options as JSON (what a checkpoint stores) and back; from_json
  /// refuses unknown keys and wrong types with an error naming the key.
  std::string to_json() const;
  static TransformerOptions from_json(const std::string& json);
  /// The rotated features per head with rope positions (0 without them):
  /// rotary_fraction of width / heads, rounded down to an even count.
  int64_t rotary_dim() const;
  /// The block of LLaMA-style decoders: pre-norm RMSNorm, a SwiGLU
  /// feed-forward network, no biases and rotary positions (with conv if set);
  /// the rest (kv_heads, ffn, ...) stays as given.
  TransformerOptions& llama_block();
};

/// Checks `options` as the builder does and throws the builder's error:
/// width not divisible by heads, a mechanism without causal support in a
/// decoder, relative positions with a mechanism other than exact attention,
/// agglomerative classes that do not divide the width, per-block specs whose
/// count is not `layers`, ...
void validate(const TransformerOptions& options);

/// True for the patterns that add nodes to a token sequence: "sparse-bp-tree"
/// (t - 1 span nodes over t tokens) and "sparse-star" (one relay node). In an
/// encoder built with one of them, the extra nodes follow the tokens, each
/// starting as the mean of the embeddings of the tokens it spans, every block
/// attends over tokens and extra nodes, and the output keeps the tokens.
bool adds_nodes(const std::string& mechanism);
/// The token span [lo, hi) of each extra node of `mechanism` over `tokens`
/// tokens, in node order (node t + i spans the i-th).
std::vector<std::pair<int64_t, int64_t>> extra_node_spans(const std::string& mechanism, int64_t tokens);
/// The nodes a block of `mechanism` attends over for `tokens` tokens: tokens
/// plus the extra nodes of a pattern that adds some.
int64_t attention_nodes(const std::string& mechanism, int64_t tokens);
/// x (N, t, d) followed by the extra nodes of `mechanism` over its t tokens:
/// (N, t + extra, d), each extra node the mean of the rows of its span
/// (sums from prefix sums, O(t d)).
torch::Tensor append_extra_nodes(const torch::Tensor& x, const std::string& mechanism);

/// Sampling settings of generate().
struct GenerateOptions {
  TORCH_ARG(int64_t, tokens) = 100;     ///< new tokens per stream
  TORCH_ARG(double, temperature) = 1.0; ///< 0 means greedy (argmax)
  TORCH_ARG(int64_t, top_k) = 0;        ///< sample among the k most likely; 0: all
  TORCH_ARG(uint64_t, seed) = 0;
};

class TransformerBlockImpl;
class FeatureNormImpl;
struct BlockState;

/// The structures SAC blocks attended over in a forward pass (models with a
/// "sac" attention spec; nn/sac.h).
struct SacStructures {
  /// One EdgeList per sequence of the batch (shared by the SAC blocks; per
  /// head for variant=head-adaptive).
  std::vector<EdgeList> edges;
  /// (N): the log-probability of each sequence's sampled structure,
  /// differentiable in the edge predictor's parameters; undefined when the
  /// structures were decoded by beam search (eval mode).
  torch::Tensor log_prob;
  /// Training only: (N, sequences, 2 alpha n) the predictor's steps (origins at
  /// even positions) and their log-probabilities (EdgeSampleBatch).
  torch::Tensor tokens, step_log_prob;
  /// Training only: (N) the summed entropy of each sequence's predicted steps.
  torch::Tensor entropy;
};

/// Everything incremental decoding of a batch of streams carries from one
/// token to the next: per block the mechanism's state (a key/value cache for
/// exact and windowed sparse attention; (S, z) for causal linear attention; the
/// running class sums for agglomerative attention), the conv front end's last
/// inputs, and for an encoder-decoder the encoder's output.
class DecodingState {
 public:
  DecodingState();
  ~DecodingState();
  DecodingState(DecodingState&&) noexcept;
  DecodingState& operator=(DecodingState&&) noexcept;
  /// Tokens stepped so far.
  int64_t position() const { return position_; }
  int64_t batch() const { return batch_; }

 private:
  friend class TransformerImpl;
  int64_t position_ = 0, batch_ = 0;
  std::vector<std::unique_ptr<BlockState>> blocks_;
  torch::Tensor conv_window_;  // (N, conv_width - 1, width): the last embeddings
  torch::Tensor memory_, memory_lengths_;
};

class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(const TransformerOptions& options);

  /// decoder / encoder: tokens (N, L) -> logits (N, L, vocab_size).
  /// encoder-decoder: tokens are the decoder's inputs and `source` (N, S) the
  /// encoder's, `source_lengths` (int64 (N), optional) its padding.
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& source = {},
                        const torch::Tensor& source_lengths = {});

  /// Replaces the self-attention of every block (`spec`) or of each block
  /// (one spec per block) behind the same trained projections, e.g. to
  /// evaluate a trained model with an approximation. Validated as the builder
  /// validates; agglomerative blocks, whose parameters differ, cannot be
  /// swapped to or from.
  void set_attention(const std::vector<std::string>& specs);

  /// Incremental decoding (decoder and encoder-decoder). `start_decoding` runs
  /// the encoder once for an encoder-decoder. Each step feeds tokens (N) at the
  /// next position and returns their logits (N, vocab_size); the steps of a
  /// sequence equal forward() of the whole sequence, position by position.
  DecodingState start_decoding(int64_t batch, const torch::Tensor& source = {},
                               const torch::Tensor& source_lengths = {});
  torch::Tensor step(const torch::Tensor& tokens, DecodingState& state);

  /// prompt (N, P), P >= 1 -> (N, P + options.tokens()): the prompt followed
  /// by sampled tokens. Runs in eval mode without autograd.
  torch::Tensor generate(const torch::Tensor& prompt, const GenerateOptions& options = {},
                         const torch::Tensor& source = {}, const torch::Tensor& source_lengths = {});

  /// Called by every forward() with the per-head inputs of each multi-head
  /// self-attention: layer (applications bottom first, the encoder's before
  /// the decoder's; a shared-weights stack counts each application), q
  /// (N, H, L, D/H), k and v (N, H, S, D/H). Relative-position and
  /// agglomerative blocks are not reported. An empty function removes it.
  using AttentionProbe = std::function<void(int64_t layer, const torch::Tensor& q,
                                            const torch::Tensor& k, const torch::Tensor& v)>;
  void set_attention_probe(AttentionProbe probe);

  /// The edge predictor of a model with "sac" blocks (null otherwise). It
  /// reads the token embeddings (detached: the main network learns only from
  /// its loss) and predicts one structure per sequence at every forward():
  /// sampled in training mode, beam search in eval mode.
  nn::EdgePredictor& edge_predictor() { return edge_predictor_; }
  /// The structures of the last forward() (empty for a model without SAC).
  const SacStructures& sac_structures() const { return sac_structures_; }
  /// The options of the model's "sac" spec (meaningful with an edge predictor).
  const nn::SacOptions& sac_options() const { return sac_options_; }

  /// Parameters (a tied embedding counted once).
  int64_t parameter_count() const;
  const TransformerOptions& options() const { return options_; }

 private:
  torch::Tensor embed(const torch::Tensor& tokens, bool source, int64_t offset);
  /// x (N, L, d) plus the absolute position table's rows offset..offset+L-1
  /// (x itself without a table).
  torch::Tensor add_position_table(const torch::Tensor& x, int64_t offset);
  torch::Tensor encode(const torch::Tensor& source, const torch::Tensor& source_lengths);
  torch::Tensor logits(const torch::Tensor& hidden);
  /// Points `block`'s self-attention probe at probe_ as `layer` (when a probe is set).
  void probe_layer(TransformerBlockImpl& block, int64_t layer);
  /// SAC: predicts the structures of a batch from its embeddings x (N, L, d)
  /// and hands them to the SAC blocks.
  void predict_structures(const torch::Tensor& x);

  TransformerOptions options_;
  torch::nn::Embedding embedding_{nullptr}, source_embedding_{nullptr};
  torch::Tensor position_table_;  // learned: (max_length, width) parameter
  nn::SinusoidalPositionalEncoding sinusoidal_{nullptr};
  nn::Linear conv_{nullptr}, source_conv_{nullptr};  // (width * conv_width) -> width
  std::vector<std::shared_ptr<TransformerBlockImpl>> encoder_blocks_, decoder_blocks_;
  std::shared_ptr<FeatureNormImpl> encoder_norm_, decoder_norm_;  // pre-norm only
  nn::Linear output_{nullptr};  // untied output layer
  AttentionProbe probe_;
  nn::EdgePredictor edge_predictor_{nullptr};
  nn::SacOptions sac_options_;
  std::string extra_nodes_;  // the blocks' mechanism when it adds nodes (adds_nodes), else ""
  SacStructures sac_structures_;
};
TORCH_MODULE(Transformer);

}  // namespace attnkit::models
