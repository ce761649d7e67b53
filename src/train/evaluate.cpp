// Evaluation of a model on a task's split, in one process or split over the
// ranks of a data-parallel job.
#include "train/evaluate.h"

#include <algorithm>

#include "train/sac_reinforce.h"

namespace attnkit::train {

namespace {

/// Logits as scored: a bfloat16 model's in float32 (its log-softmax would
/// otherwise run in bfloat16), any other as they are.
torch::Tensor scoring_logits(const torch::Tensor& logits) {
  return logits.scalar_type() == torch::kBFloat16 ? logits.to(torch::kFloat32) : logits;
}

}  // namespace

tasks::Metrics allreduce_metrics(Communicator& comm, const tasks::Metrics& m, const char* what) {
  auto t = torch::tensor({m.loss_sum, m.correct, m.scored, m.positions}, torch::kFloat64);
  comm.allreduce_sum(t, what);
  const auto a = t.accessor<double, 1>();
  tasks::Metrics out;
  out.loss_sum = a[0];
  out.correct = a[1];
  out.scored = a[2];
  out.positions = a[3];
  return out;
}

tasks::Metrics evaluate_distributed(Communicator& comm, models::Transformer& model, const tasks::Task& task,
                                    tasks::Split split, int64_t batch, int64_t context, int64_t max_batches) {
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  tasks::Metrics local;
  const auto batches = task.eval_batches(split, batch, context);
  const std::size_t n = max_batches > 0 ? std::min<std::size_t>(batches.size(), max_batches) : batches.size();
  for (std::size_t i = comm.rank(); i < n; i += comm.world_size())
    local += tasks::score(scoring_logits(model->forward(batches[i].input)), batches[i]);
  model->train(was_training);
  return allreduce_metrics(comm, local, "validation all-reduce");
}

tasks::Metrics evaluate(models::Transformer& model, const tasks::Task& task, tasks::Split split,
                        int64_t batch, int64_t context, int64_t max_batches, StructureStats* structure) {
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  tasks::Metrics total;
  const auto batches = task.eval_batches(split, batch, context);
  const std::size_t n = max_batches > 0 ? std::min<std::size_t>(batches.size(), max_batches) : batches.size();
  const auto partner = structure ? task.partners(context) : std::vector<int64_t>{};
  for (std::size_t i = 0; i < n; ++i) {
    total += tasks::score(scoring_logits(model->forward(batches[i].input)), batches[i]);
    if (structure) {
      const auto& edges = model->sac_structures().edges;
      for (size_t b = 0; b < edges.size(); ++b)
        count_structure(edges[b], partner, batches[i].weight[static_cast<int64_t>(b)], *structure);
    }
  }
  model->train(was_training);
  return total;
}

}  // namespace attnkit::train
