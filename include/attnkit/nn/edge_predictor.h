// The SAC edge predictor (the SAC paper, section 4): a one-layer LSTM that
// emits node indices with a pointer softmax over the node representations, two
// at a time, origin then destination; each
// (origin, destination) pair is an edge: the origin (a query row) attends to the
// destination (a key column).
//
// For nodes x_1..x_n (rows of `nodes`, (n, width)) the pointer vectors are
// w_i = W x_i (W: hidden x width, no bias). At step t the LSTM reads the
// representation of the node chosen at step t-1 (a learned start vector at
// t = 0) and its output g_t scores the nodes:
//   origin steps:       p(y_t = i) = softmax_i(g_t . w_i)
//   destination steps:  p(y_t = j) = softmax_j(g_t . (w_j + v_{d(o, j)}))
// where o is the origin just chosen, d(o, j) = min(|o - j|, max_distance) (or a
// given distance matrix, e.g. shortest paths on a graph, clipped the same way)
// and v_0..v_max are learned vectors (the paper's distance encoding V; only with
// max_distance > 0). One sequence has 2 alpha n steps, i.e. alpha n edges, alpha
// per node on average.
//
// Variants (the paper's section 4.2):
//  - shared_structure (the paper's default): one sequence, one EdgeList shared
//    by every head and layer.
//  - all_connected: the origins are not predicted but fed: node i is the origin
//    of steps 2 (alpha i + r), r = 0..alpha-1 (its alpha edges are consecutive),
//    only destinations are sampled and scored; every node gets alpha edges.
//  - head_adaptive: one sequence per head, run one after the other with the LSTM
//    state carried over (each head sees the previous heads' choices); each head's
//    sequence starts again from the start vector and a learned head embedding
//    is appended to every LSTM input of that head. The result is a per-head
//    EdgeList (offsets (heads, n+1)).
//
// The EdgeList (include/attnkit/ops.h) is square over the n nodes, each row's
// columns sorted and deduplicated (a pair predicted twice is one edge). With
// self_edges (the default) every node ALWAYS also attends to itself, so no row
// is empty; without it a node that is never an origin has an empty row (it
// outputs zeros in sparse_attention). With symmetric, each predicted edge is
// added in both directions (the paper's undirected option).
//
// Not differentiable in the choices: sample() returns the summed
// log-probability of its choices, differentiable in the predictor's parameters
// (and in `nodes` when they require grad; detach them to keep the policy
// gradient out of the main network), for REINFORCE (reinforce_loss below).
#pragma once

#include <ATen/core/Generator.h>
#include <attnkit/ops.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/rnn.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

namespace attnkit::nn {

enum class EdgePredictorVariant { shared_structure, all_connected, head_adaptive };

/// Parses "shared" | "all-connected" | "head-adaptive"; throws naming the
/// accepted values otherwise.
EdgePredictorVariant edge_predictor_variant_from_string(const std::string& name);
std::string to_string(EdgePredictorVariant variant);

struct EdgePredictorOptions {
  EdgePredictorOptions(int64_t width, int64_t hidden_size)
      : width_(width), hidden_size_(hidden_size) {}
  /// Width of a node representation (the LSTM input, with the head embedding).
  TORCH_ARG(int64_t, width);
  /// LSTM hidden size, also the width of the pointer vectors w_i.
  TORCH_ARG(int64_t, hidden_size);
  /// Edges per node on average (alpha >= 1): 2 alpha n steps per sequence.
  TORCH_ARG(int64_t, alpha) = 1;
  TORCH_ARG(EdgePredictorVariant, variant) = EdgePredictorVariant::shared_structure;
  /// head_adaptive only: the number of heads (sequences) and the width of the
  /// head embedding appended to the LSTM input. Ignored by the other variants.
  TORCH_ARG(int64_t, heads) = 1;
  TORCH_ARG(int64_t, head_embedding_dim) = 8;
  /// Distances are clipped at this value (max_distance + 1 learned vectors).
  /// 0 disables the distance encoding.
  TORCH_ARG(int64_t, max_distance) = 0;
  /// Every node also attends to itself (always added, whatever was predicted).
  TORCH_ARG(bool, self_edges) = true;
  /// Each predicted edge (o, d) also adds (d, o).
  TORCH_ARG(bool, symmetric) = false;
};

/// One decoded structure.
struct EdgeSample {
  /// The sampled or decoded structure (shared, or per head for head_adaptive).
  EdgeList edges;
  /// Summed log-probability of the predicted steps (destinations only for
  /// all_connected): a differentiable scalar from sample(), a constant from
  /// beam_search().
  torch::Tensor log_prob;
  /// int64 (sequences, 2 alpha n): the node of every step, origins at even
  /// positions, destinations at odd ones; sequences = heads for head_adaptive,
  /// else 1.
  torch::Tensor tokens;
};

/// Structures for a batch of graphs, one per graph (EdgePredictor::sample_batch).
struct EdgeSampleBatch {
  /// edges[b]: the structure of graph b (shared, or per head for head_adaptive).
  std::vector<EdgeList> edges;
  /// (B): the summed log-probability of each graph's predicted steps,
  /// differentiable in the predictor's parameters.
  torch::Tensor log_prob;
  /// (B, sequences, 2 alpha n): the log-probability of every step (0 at the
  /// fed origins of all_connected), differentiable; log_prob is its sum per
  /// graph. For credit assignment per edge (an edge (o, d) changes row o).
  torch::Tensor step_log_prob;
  /// int64 (B, sequences, 2 alpha n): the steps of every graph.
  torch::Tensor tokens;
  /// (B): the entropies (nats) of the predicted steps' distributions, summed
  /// over the steps like log_prob, differentiable: what an entropy bonus
  /// raises to keep the policy exploring.
  torch::Tensor entropy;
};

class EdgePredictorImpl : public torch::nn::Cloneable<EdgePredictorImpl> {
 public:
  explicit EdgePredictorImpl(const EdgePredictorOptions& options);
  /// Start vector, head embeddings and distance vectors normal with standard
  /// deviation 1/sqrt(their width),
  /// W uniform(+-1/sqrt(width)), the LSTM torch's default.
  void reset() override;

  /// Samples a structure for `nodes` (n, width), floating point of the
  /// parameters' dtype. `distances` (optional, int64 (n, n), non-negative)
  /// replaces |i - j| in the distance encoding. Deterministic for a given
  /// generator state (unset: torch's default generator).
  EdgeSample sample(const torch::Tensor& nodes,
                    c10::optional<at::Generator> generator = c10::nullopt,
                    const torch::Tensor& distances = {});

  /// sample() for B graphs of n nodes at once, `nodes` (B, n, width), one
  /// `distances` matrix for all: the B sequences advance together (one LSTM
  /// step of the whole batch per step), which is what makes the predictor
  /// affordable inside a model's training step. Deterministic for a given
  /// generator state; with B = 1 it draws what sample() draws.
  EdgeSampleBatch sample_batch(const torch::Tensor& nodes,
                               c10::optional<at::Generator> generator = c10::nullopt,
                               const torch::Tensor& distances = {});

  /// `samples` independent structures for one graph `nodes` (n, width):
  /// sample_batch of `samples` copies of it, without the copies (the pointer
  /// scores of all rows are one product with the one graph's W x, so time and
  /// the memory kept for the backward pass grow with samples x n, not samples
  /// x n x hidden). Deterministic for a given generator state.
  EdgeSampleBatch sample_many(const torch::Tensor& nodes, int64_t samples,
                              c10::optional<at::Generator> generator = c10::nullopt,
                              const torch::Tensor& distances = {});

  /// The REINFORCE baseline b: a moving average of past rewards,
  /// b <- decay b + (1 - decay) mean(rewards), starting at the first batch's
  /// mean. Kept in the buffer `reward_baseline` ([b, updates], float64), so a
  /// checkpoint carries it and a resumed run continues with the same b.
  /// Returns the baseline to use for `rewards` (the one before this update).
  double update_baseline(const torch::Tensor& rewards, double decay = 0.9);
  /// The current baseline (0 before the first update).
  double baseline() const;

  /// Beam search (the paper's test-time decoding, beam width 5) over whole
  /// sequences (all heads' for head_adaptive); returns the most probable
  /// surviving sequence. Ties are broken by beam order, then by the smaller
  /// node index, so the result is deterministic. No gradients.
  EdgeSample beam_search(const torch::Tensor& nodes, int64_t beam = 5,
                         const torch::Tensor& distances = {});

  /// The summed log-probability of a given token sequence (the layout of
  /// EdgeSample::tokens), teacher-forced; differentiable like sample()'s.
  torch::Tensor log_prob(const torch::Tensor& nodes, const torch::Tensor& tokens,
                         const torch::Tensor& distances = {});

  /// The EdgeList of a token sequence for n nodes (the options' self_edges and
  /// symmetric rules).
  EdgeList edges_from_tokens(const torch::Tensor& tokens, int64_t n) const;

  /// Steps per sequence (2 alpha n) and sequences (heads or 1).
  int64_t steps(int64_t n) const { return 2 * options.alpha() * n; }
  int64_t sequences() const;

  EdgePredictorOptions options;
  torch::nn::LSTMCell lstm{nullptr};
  torch::Tensor start;           // (width)
  torch::Tensor pointer;         // W: (hidden, width)
  torch::Tensor head_embedding;  // (heads, head_embedding_dim), head_adaptive only
  torch::Tensor distance;        // (max_distance + 1, hidden), max_distance > 0 only
  torch::Tensor reward_baseline; // buffer, float64 (2): [b, updates]

 private:
  struct Context;
  // `nodes` (n, width), or (B, n, width) when `batched`.
  Context context(const torch::Tensor& nodes, const torch::Tensor& distances, const char* op,
                  bool batched = false) const;
  // Log-probabilities (B, n) for B hidden states g and B current origins (used
  // on destination steps): row b scores the nodes of graph b, or of the one
  // graph for every row when the context holds one (beam search).
  torch::Tensor step_log_probs(const Context& ctx, const torch::Tensor& g,
                               const std::vector<int64_t>& origins) const;
  // Samples `rows` structures: one per graph of the context, or `rows` of its
  // one graph.
  EdgeSampleBatch sample_from(const Context& ctx, c10::optional<at::Generator> generator, int64_t rows);
  // The LSTM input of step t of head `head`: the start vector at t = 0, else
  // the nodes chosen at t - 1 (row b from graph b, or from the one graph).
  torch::Tensor step_input(const Context& ctx, int64_t head, int64_t t,
                           const std::vector<int64_t>& previous) const;
};
TORCH_MODULE(EdgePredictor);

/// The REINFORCE surrogate loss: -(reward - baseline) * log_prob, with reward
/// and baseline constants, so that its gradient is the policy-gradient estimate
/// -sum_t grad log p(y_t | y_<t) (R - b) (minimise it to ascend the expected
/// reward). `log_prob` a scalar from EdgePredictor::sample.
torch::Tensor reinforce_loss(const torch::Tensor& log_prob, double reward, double baseline);

}  // namespace attnkit::nn
