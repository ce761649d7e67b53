// SAC attention (the SAC paper): softmax attention over a sparse structure,
// one EdgeList per sequence, that an nn::EdgePredictor learns to predict.
//
// As a registry mechanism, "sac:alpha=A,variant=V,max_distance=D,hidden=H,beam=W"
// is two things:
//  - inside models::Transformer (the normal use): the model builds one
//    EdgePredictor from these options, predicts one structure per sequence from
//    the token embeddings (sampled while training, beam search of width W in
//    eval mode), hands it to every SAC block (the paper's shared structure; a
//    per-head structure with variant=head-adaptive), and the trainer adds the
//    predictor's REINFORCE loss (docs/TRAINING.md, "SAC").
//  - alone (attend("sac", ...), a MultiheadAttention of its own, the bench):
//    attention over edges::random(L, alpha, seed), the cost of SAC's
//    attention at alpha edges per node without the predictor.
#pragma once

#include <attnkit/nn/edge_predictor.h>
#include <attnkit/nn/registry.h>
#include <attnkit/ops.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace attnkit::nn {

/// The options of a "sac" spec.
struct SacOptions {
  int64_t alpha = 1;  ///< predicted edges per node on average (plus the self-edge)
  EdgePredictorVariant variant = EdgePredictorVariant::shared_structure;
  int64_t max_distance = 16;  ///< distance encoding clip (0: off)
  int64_t hidden = 64;        ///< the predictor's LSTM width
  int64_t beam = 5;           ///< beam width at evaluation (decode "beam")
  /// The structure at evaluation: "beam" (the paper: beam search of width
  /// `beam`, the most probable structure) or "sample" (one structure drawn
  /// from the predictor per sequence, from a generator seeded with `seed` at
  /// every forward, so a pure function of the batch).
  std::string decode = "beam";
  /// edges::random's seed when no predictor supplies one; the draws of decode "sample".
  uint64_t seed = 0;
  /// REINFORCE credit: "sequence" (the paper: every step of a sequence gets
  /// its reward, the mean log-probability of the sequence's scored labels) or
  /// "edge" (each destination step gets the log-probability of its origin's
  /// label, the row the edge feeds; edges from unscored positions get none;
  /// needs variant=all-connected, whose origins are fed, not predicted).
  std::string reward = "sequence";
  /// Weight of an entropy bonus on the predictor's step distributions, per
  /// step (the surrogate subtracts entropy x sum_t H_t, averaged over the
  /// batch; 0: the paper's plain REINFORCE); keeps the policy exploring.
  double entropy = 0;

  /// Reads a resolved "sac" spec (the registry has checked keys and numbers).
  static SacOptions from_spec(const MechanismSpec& spec);
  /// True when `other` differs at most in the keys that act only at
  /// evaluation (beam, decode, seed): a predictor trained under one serves the
  /// other, so a trained model may be evaluated under either.
  bool same_training(const SacOptions& other) const;
  /// The predictor of a model of `width` with `heads` heads.
  EdgePredictorOptions predictor(int64_t width, int64_t heads) const;
};

/// The per-head module of "sac": sparse_attention over the structures its
/// model set, else over edges::random.
class SacAttentionImpl : public MechanismImpl {
 public:
  explicit SacAttentionImpl(MechanismSpec spec);

  /// The structures of the following forward calls: one EdgeList per batch
  /// element (shared by the heads, or per head), over L nodes. Empty: back
  /// to edges::random.
  void set_structures(std::vector<EdgeList> structures) { structures_ = std::move(structures); }
  const std::vector<EdgeList>& structures() const { return structures_; }

  /// q (N, H, L, E), k (N, H, L, E), v (N, H, L, M) -> (N, H, L, M).
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttendArgs& args = {}) override;
  std::shared_ptr<MechanismImpl> copy(const c10::optional<torch::Device>& device) const override;
  void pretty_print(std::ostream& stream) const override;

  const SacOptions& options() const { return options_; }

 private:
  MechanismSpec spec_;
  SacOptions options_;
  std::vector<EdgeList> structures_;
};

}  // namespace attnkit::nn
