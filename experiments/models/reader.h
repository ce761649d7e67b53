// A recurrent reader for cloze questions (the cheap-linear-attention paper,
// section 5, after Hermann et al. 2015's attentive reader), with the paper's
// four read-outs of the document.
//
//   H = GRU_doc(embed(document))          (N, n, k)  the hidden states h_t
//   q = GRU_query(embed(query)) at the placeholder   (N, k)
//       (the final state when no placeholder id is set)
//   r = read-out of the document for q:
//     none     the document GRU's final state (no attention)
//     linear   C q / n,  C = H^T H = sum_t h_t h_t^T                (section 3)
//     gated    C q / n,  C = sum_t f_t f_t^T, f_t = sigmoid(W h_t + b) * h_t
//                                                                  (section 4)
//     softmax  H^T softmax(H q)                                    (section 2)
//   g = tanh(W_r r + W_q q)
//   score(w) = o_w . g + b_w  over the candidate words w (the others get -inf)
//
// When bidirectional, each GRU runs both ways and k = 2 * hidden: h_t is the
// two directions' states at t side by side, q the two states at the
// placeholder, the "none" read-out the two final states side by side.
//
// The query is read at its placeholder because that state summarises exactly
// the context that identifies the answer's position (the words on either side
// of the blank); a final state would have to remember where in the query the
// blank was. The query is still encoded on its own, without the document, as
// the paper requires for a query-independent document representation.
//
// The answer is scored from r and q only, with output word vectors o_w: the
// document reaches the answer only through r, so the read-out is the whole
// difference between the four models. (A pointer-sum over document positions,
// as in the attention-sum reader, would itself be a softmax attention over H
// and give every read-out, "none" included, direct access to the states.)
//
// The 1/n of the linear read-outs is a constant for documents of a fixed
// length n: it rescales C q to the size of a mean rather than a sum of n
// terms, so that tanh does not start saturated; it is the same as dividing
// W_r by n and changes neither the mechanism nor what the model can represent.
#pragma once

#include <attnkit/nn/dense.h>
#include <attnkit/nn/linear_attention.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <string>

namespace attnkit::experiments {

enum class Readout { none, linear, gated, softmax };
/// "none" | "linear" | "gated" | "softmax"; anything else throws, listing them.
Readout readout_from_string(const std::string& name);
std::string to_string(Readout readout);

/// The linear read-out C q with C = H^T H, through linear_attention (keys =
/// values = H, identity map, no normaliser): H (N, n, k), q (N, k) -> (N, k).
/// Differentiable in H and q. (Without the reader's 1/n.)
torch::Tensor linear_readout(const torch::Tensor& H, const torch::Tensor& q);
/// H^T softmax(H q) through softmax_attention with scale 1 (the paper's form):
/// H (N, n, k), q (N, k) -> (N, k).
torch::Tensor softmax_readout(const torch::Tensor& H, const torch::Tensor& q);

struct ReaderOptions {
  explicit ReaderOptions(int64_t vocab) : vocab_(vocab) {}
  /// Words in the vocabulary, V.
  TORCH_ARG(int64_t, vocab);
  TORCH_ARG(int64_t, embedding) = 64;
  /// Hidden size of each GRU direction.
  TORCH_ARG(int64_t, hidden) = 64;
  TORCH_ARG(bool, bidirectional) = true;
  TORCH_ARG(Readout, readout) = Readout::softmax;
  /// The placeholder's word id: q is the query GRU's state there (each query
  /// must hold it; the first occurrence counts). < 0: q is the final state.
  TORCH_ARG(int64_t, placeholder) = -1;
  /// One GRU (and its weights) encodes both the document and the query, so
  /// that h_t and q start in the same space; the document's states still do
  /// not depend on the query. False: two GRUs, as in the paper.
  TORCH_ARG(bool, shared_encoder) = false;
  /// gated only: the gate's bias b starts at this value in every component
  /// (4: sigmoid = 0.98, so C starts near linear's H^T H rather than at about
  /// a quarter of it); unset: the linear layer's own initialisation.
  TORCH_ARG(c10::optional<double>, gate_bias) = c10::nullopt;
};

class ReaderImpl : public torch::nn::Cloneable<ReaderImpl> {
 public:
  explicit ReaderImpl(const ReaderOptions& options);
  void reset() override;

  /// k: the size of h_t, q and r.
  int64_t state_size() const;
  /// Document ids (N, n) -> H (N, n, k) and the final state (N, k).
  std::pair<torch::Tensor, torch::Tensor> encode_document(const torch::Tensor& document);
  /// Query ids (N, m) -> q (N, k): the state at the placeholder (or the final state).
  torch::Tensor encode_query(const torch::Tensor& query);
  /// The read-out r (N, k) of H (N, n, k) for q (N, k); `final` (N, k) is used by "none".
  torch::Tensor read(const torch::Tensor& H, const torch::Tensor& final, const torch::Tensor& q);
  /// Scores of every word (N, V); words where `candidate` (bool (N, V)) is
  /// false get -inf. document (N, n), query (N, m) int64 ids in [0, V).
  torch::Tensor forward(const torch::Tensor& document, const torch::Tensor& query,
                        const torch::Tensor& candidate);

  ReaderOptions options;
  torch::nn::Embedding embed{nullptr};
  torch::nn::GRU document_rnn{nullptr}, query_rnn{nullptr};  // the same module when shared_encoder
  nn::GatedLinearAttention gate{nullptr};  // gated only
  nn::Linear from_readout{nullptr}, from_query{nullptr};
  torch::nn::Embedding output{nullptr};  // o_w
  torch::Tensor output_bias;             // b_w
};
TORCH_MODULE(Reader);

}  // namespace attnkit::experiments
