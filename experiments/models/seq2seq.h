// A recurrent encoder-decoder with global attention (Luong, Pham and Manning
// 2015; the seq2seq setting of *Attention in a Nutshell*), taking any score
// function of the classic zoo (attnkit/nn/zoo.h), or none:
//
//   H   = GRU_enc(embed_src(x))                  (N, S, k)  both directions side by side
//   s_0 = tanh(W_b [final forward state; final backward state])       (N, k)
//   s_t = GRU_dec(embed_tgt(y_{t-1}), s_{t-1})   y_0 = kBos, teacher forcing in training
//   c_t = sum_j a_tj h_j,  a_t = softmax_j(score(s_t, h_j)) over the source's positions
//   o_t = tanh(W_c [c_t; s_t]),  p(y_t) = softmax(W_o o_t)
//
// score: additive (v^T tanh(W s + U h)), general (s^T W h), dot (s^T h),
// scaled dot (s^T h / sqrt(k)), location (softmax(W s) over positions, the
// keys unread); none keeps the same layers with c_t = 0, so that the decoder
// sees the source only through s_0: the classic encoder-decoder without
// attention, with the same parameter count as dot attention.
//
// k = 2 * hidden (the encoder is bidirectional), which the decoder's state has
// too, so that dot scores need no projection.
//
// The decoder's attention reads s_t, not s_{t-1} (Luong's global attention, no
// input feeding): in training one GRU call runs the whole target and one
// attention call scores every (t, j), which is what makes the model cheap on a
// CPU. Greedy decoding runs the same layers step by step.
#pragma once

#include <attnkit/nn/dense.h>
#include <attnkit/nn/zoo.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <string>

namespace attnkit::experiments {

enum class Score { none, additive, general, dot, scaled_dot, location };
/// "none" | "additive" | "general" | "dot" | "scaled-dot" | "location";
/// anything else throws, listing them.
Score score_from_string(const std::string& name);
std::string to_string(Score score);

struct Seq2SeqOptions {
  Seq2SeqOptions(int64_t vocab, int64_t max_source) : vocab_(vocab), max_source_(max_source) {}
  /// Characters in the vocabulary (source and target share it), V.
  TORCH_ARG(int64_t, vocab);
  /// The longest source: location scores have one output per position.
  TORCH_ARG(int64_t, max_source);
  TORCH_ARG(int64_t, embedding) = 64;
  /// Hidden size of each encoder direction; k = 2 * hidden.
  TORCH_ARG(int64_t, hidden) = 128;
  TORCH_ARG(Score, score) = Score::additive;
};

/// The encoder's states and the decoder's first state.
struct Encoded {
  torch::Tensor states;          ///< H (N, S, k), zero at padded positions
  torch::Tensor lengths;         ///< int64 (N)
  torch::Tensor decoder_initial; ///< s_0 as the GRU takes it: (1, N, k)
};

struct Seq2SeqOutput {
  torch::Tensor logits;   ///< (N, T, V)
  torch::Tensor weights;  ///< a (N, T, S); undefined for Score::none
};

/// Greedy decoding's outputs: ids (N, T') up to and including each row's kEos
/// (kPad after it), and the attention weights of every step.
struct Decoded {
  torch::Tensor ids;      ///< int64 (N, T')
  torch::Tensor logits;   ///< (N, T', V)
  torch::Tensor weights;  ///< (N, T', S); undefined for Score::none
};

class Seq2SeqImpl : public torch::nn::Cloneable<Seq2SeqImpl> {
 public:
  explicit Seq2SeqImpl(const Seq2SeqOptions& options);
  void reset() override;

  int64_t state_size() const { return 2 * options.hidden(); }
  /// source int64 (N, S) ids, kPad after each row's length; lengths int64 (N), in [1, S].
  Encoded encode(const torch::Tensor& source, const torch::Tensor& lengths);
  /// The attention and output layers on decoder states (N, T, k).
  Seq2SeqOutput read_out(const torch::Tensor& decoder_states, const Encoded& encoded);
  /// Teacher forcing: the logits of every target position given the previous
  /// ones (decoder_input (N, T): kBos then the target).
  Seq2SeqOutput forward(const torch::Tensor& source, const torch::Tensor& lengths,
                        const torch::Tensor& decoder_input);
  /// The most probable character at each step (ties to the lowest id), for at
  /// most max_steps steps or until every row has produced kEos.
  Decoded greedy(const torch::Tensor& source, const torch::Tensor& lengths, int64_t max_steps);

  Seq2SeqOptions options;
  torch::nn::Embedding embed_source{nullptr}, embed_target{nullptr};
  torch::nn::GRU encoder{nullptr}, decoder{nullptr};
  nn::Linear bridge{nullptr}, combine{nullptr}, output{nullptr};
  // One of these, by options.score (none for none, dot and scaled dot's have no weights).
  nn::AdditiveAttention additive{nullptr};
  nn::GeneralAttention general{nullptr};
  nn::DotAttention dot{nullptr};
  nn::LocationAttention location{nullptr};
};
TORCH_MODULE(Seq2Seq);

}  // namespace attnkit::experiments
