// SAC's REINFORCE step for the edge predictor (docs/MATH.md, "SAC") and the
// statistics of the structures it samples.
#include "train/sac_reinforce.h"

#include <attnkit/nn/edge_predictor.h>

namespace attnkit::train {

SacReinforce sac_reinforce(nn::EdgePredictorImpl& predictor, const models::SacStructures& sac,
                          const torch::Tensor& logits, const tasks::Batch& batch, const nn::SacOptions& options) {
  const bool edge_credit = options.reward == "edge";
  TORCH_CHECK(sac.log_prob.defined() && sac.step_log_prob.defined() && sac.tokens.defined(),
              "sac_reinforce: the structures were not sampled (a model in training mode samples them)");
  const auto lp = tasks::target_log_probs(logits, batch);
  const auto w = batch.weight.to(torch::kFloat64);
  const int64_t N = lp.size(0);
  torch::Tensor rewards, scored, log_probs;  // matching shapes
  if (edge_credit) {
    // The destination step of edge k (step 2k + 1) earns its origin's reward.
    const int64_t S = sac.tokens.size(1), P = sac.tokens.size(2) / 2;
    const auto origins = sac.tokens.view({N, S, P, 2}).select(3, 0).reshape({N, S * P});
    rewards = lp.gather(1, origins).view({N, S, P});
    scored = w.gather(1, origins).view({N, S, P}) > 0;
    log_probs = sac.step_log_prob.view({N, S, P, 2}).select(3, 1);
  } else {
    // The paper's R: the sequence's mean log-probability of its scored labels.
    const auto counts = w.sum(1);
    rewards = (lp * w).sum(1) / counts.clamp_min(1);
    scored = counts > 0;
    log_probs = sac.log_prob;
  }
  SacReinforce out;
  if (!scored.any().item<bool>()) return out;
  const auto earned = rewards.masked_select(scored);
  out.mean_reward = earned.mean().item<double>();
  out.baseline = predictor.update_baseline(earned);
  const auto advantage = torch::where(scored, rewards - out.baseline, torch::zeros_like(rewards));
  out.surrogate = -(advantage.to(log_probs.scalar_type()) * log_probs).sum() / static_cast<double>(N);
  if (options.entropy > 0) out.surrogate = out.surrogate - options.entropy * sac.entropy.mean();
  return out;
}

void count_structure(const EdgeList& edges, const std::vector<int64_t>& partner, const torch::Tensor& weight,
                     StructureStats& stats) {
  const auto scored = weight.to(torch::kFloat32).contiguous();
  const float* w = scored.data_ptr<float>();
  const auto offsets = edges.offsets.reshape({-1, edges.num_queries() + 1}).contiguous();
  const auto columns = edges.columns.contiguous();
  const int64_t* col = columns.data_ptr<int64_t>();
  const int64_t n = edges.num_queries();
  for (int64_t h = 0; h < offsets.size(0); ++h) {
    const int64_t* off = offsets[h].data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      bool self = false, found = false;
      const int64_t want = i < static_cast<int64_t>(partner.size()) && w[i] > 0 ? partner[i] : -1;
      for (int64_t e = off[i]; e < off[i + 1]; ++e) {
        self |= col[e] == i;
        found |= col[e] == want;
      }
      const double count = static_cast<double>(off[i + 1] - off[i]);
      stats.nodes += 1;
      stats.edges += count;
      if (want >= 0) {
        stats.partner_rows += 1;
        stats.partner_found += found;
        stats.predicted_edges += count - self;
      }
    }
  }
}

}  // namespace attnkit::train
