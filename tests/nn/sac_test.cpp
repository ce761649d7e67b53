// SAC inside a model: the batched sampler against teacher forcing, the
// REINFORCE baseline, edges::random, the "sac"
// per-head module over given structures, and the transformer that predicts
// them (sampled in training, beam search in eval, no gradient into the
// network from the predictor, swaps and mixed specs refused).
#include <ATen/CPUGeneratorImpl.h>
#include <attnkit/models/transformer.h>
#include <attnkit/nn/sac.h>

#include <cmath>
#include <vector>

#include "reference/reference.h"
#include "nn/edge_predictor_util.h"
#include "test_util.h"

namespace attnkit::nn::sac_test {
namespace {

using testing::expect_error;
using testing::f64;

// float64 computations of the same sums in another order: rounding only.
constexpr double kDoubleTol = 1e-12;

using testing::generator;
EdgePredictor make(const EdgePredictorOptions& o) { return testing::make_predictor(o, 7); }

// Each graph of a batch is scored against its own nodes: the batched
// log-probabilities equal teacher-forced ones graph by graph, in value and in
// the gradient of every parameter.
TEST(SacBatch, EachGraphMatchesTeacherForcingInValueAndGradient) {
  for (auto variant : {EdgePredictorVariant::shared_structure, EdgePredictorVariant::all_connected,
                       EdgePredictorVariant::head_adaptive}) {
    SCOPED_TRACE(to_string(variant));
    auto p = make(EdgePredictorOptions(4, 6).alpha(1).variant(variant).heads(3).max_distance(2));
    const int64_t B = 3, n = 7;
    const auto nodes = torch::randn({B, n, 4}, f64());
    const auto batch = p->sample_batch(nodes, generator(11));
    ASSERT_EQ(batch.tokens.sizes(), (std::vector<int64_t>{B, p->sequences(), p->steps(n)}));
    ASSERT_EQ(batch.edges.size(), static_cast<size_t>(B));
    const auto weights = torch::randn({B}, f64());
    const auto params = p->parameters();
    const auto g_batch = torch::autograd::grad({(batch.log_prob * weights).sum()}, params);
    torch::Tensor forced_sum = torch::zeros({}, f64());
    EXPECT_LT(testing::rel_err(batch.step_log_prob.sum({1, 2}), batch.log_prob), 1e-14);
    // Summed entropies of distributions over n nodes: in [0, steps log n].
    const double steps = variant == EdgePredictorVariant::all_connected ? p->steps(n) / 2 : p->steps(n);
    EXPECT_EQ(batch.entropy.sizes(), (std::vector<int64_t>{B}));
    EXPECT_TRUE((batch.entropy > 0).all().item<bool>() &&
                (batch.entropy <= p->sequences() * steps * std::log(double(n)) + 1e-9).all().item<bool>());
    if (variant == EdgePredictorVariant::all_connected)  // fed origins cost nothing
      EXPECT_EQ(testing::max_abs(batch.step_log_prob.select(2, 0)), 0.0);
    for (int64_t b = 0; b < B; ++b) {
      const auto forced = p->log_prob(nodes[b], batch.tokens[b]);
      EXPECT_NEAR(batch.log_prob[b].item<double>(), forced.item<double>(), kDoubleTol) << "graph " << b;
      forced_sum = forced_sum + forced * weights[b];
      const auto edges = p->edges_from_tokens(batch.tokens[b], n);
      EXPECT_TRUE(torch::equal(edges.offsets, batch.edges[b].offsets));
      EXPECT_TRUE(torch::equal(edges.columns, batch.edges[b].columns));
    }
    const auto g_forced = torch::autograd::grad({forced_sum}, params);
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_LT(testing::rel_err(g_batch[i], g_forced[i]), 1e-10) << "parameter " << i;
    // Different graphs, different draws (7 nodes, 7+ steps: a tie is 7^-7 likely).
    EXPECT_FALSE(torch::equal(batch.tokens[0], batch.tokens[1]));
  }
}

// sample_many(nodes, S) is sample_batch of S contiguous copies of nodes, minus
// the copies: with identically seeded generators the same tokens and edges,
// and log-probabilities, step log-probabilities and entropies (float64: the
// same sums in another order, so 1e-6 absolute is a wide bound) that agree in
// value and in the gradient of every parameter.
TEST(SacBatch, SampleManyMatchesSampleBatchOfCopies) {
  constexpr double kTol = 1e-6;
  const int64_t S = 4, n = 6, dim = 4;
  torch::manual_seed(3);
  const auto nodes = torch::randn({n, dim}, f64());
  // Hop distances of a graph (any non-negative matrix will do), clipped by the predictor.
  const auto hops = torch::randint(0, 5, {n, n}, torch::kInt64);
  for (auto variant : {EdgePredictorVariant::shared_structure, EdgePredictorVariant::all_connected,
                       EdgePredictorVariant::head_adaptive})
    for (int64_t max_distance : {0, 3})
      for (bool given : {false, true}) {
        if (max_distance == 0 && given) continue;  // distances need the encoding
        SCOPED_TRACE(to_string(variant) + " max_distance " + std::to_string(max_distance) +
                     (given ? " with distances" : " without distances"));
        auto p = make(EdgePredictorOptions(dim, 5).alpha(2).variant(variant).heads(2).max_distance(max_distance));
        const auto d = given ? hops : torch::Tensor();
        const auto many = p->sample_many(nodes, S, generator(21), d);
        const auto copies = nodes.unsqueeze(0).expand({S, n, dim}).contiguous();
        const auto batch = p->sample_batch(copies, generator(21), d);
        ASSERT_EQ(many.tokens.sizes(), (std::vector<int64_t>{S, p->sequences(), p->steps(n)}));
        EXPECT_TRUE(torch::equal(many.tokens, batch.tokens));
        ASSERT_EQ(many.edges.size(), static_cast<size_t>(S));
        for (int64_t b = 0; b < S; ++b) {
          EXPECT_TRUE(torch::equal(many.edges[b].offsets, batch.edges[b].offsets)) << "sample " << b;
          EXPECT_TRUE(torch::equal(many.edges[b].columns, batch.edges[b].columns)) << "sample " << b;
        }
        EXPECT_EQ(many.log_prob.sizes(), (std::vector<int64_t>{S}));
        EXPECT_LT(testing::max_abs(many.log_prob - batch.log_prob), kTol);
        EXPECT_LT(testing::max_abs(many.step_log_prob - batch.step_log_prob), kTol);
        EXPECT_LT(testing::max_abs(many.entropy - batch.entropy), kTol);
        // Independent draws: the samples differ (>= 12 predictions over 6 nodes each).
        EXPECT_FALSE(torch::equal(many.tokens[0], many.tokens[1]));
        // Each sample's log-probability is its tokens' teacher-forced one.
        for (int64_t b = 0; b < S; ++b)
          EXPECT_NEAR(many.log_prob[b].item<double>(), p->log_prob(nodes, many.tokens[b], d).item<double>(), kTol);
        const auto weights = torch::randn({S}, f64());
        const auto params = p->parameters();
        const auto g_many = torch::autograd::grad({(many.log_prob * weights).sum()}, params);
        const auto g_batch = torch::autograd::grad({(batch.log_prob * weights).sum()}, params);
        for (size_t i = 0; i < params.size(); ++i)
          EXPECT_LT(testing::max_abs(g_many[i] - g_batch[i]), kTol) << "parameter " << i;
        // One sample is sample().
        const auto one = p->sample_many(nodes, 1, generator(5), d);
        const auto single = p->sample(nodes, generator(5), d);
        EXPECT_TRUE(torch::equal(one.tokens[0], single.tokens));
        EXPECT_NEAR(one.log_prob[0].item<double>(), single.log_prob.item<double>(), kTol);
      }
  auto p = make(EdgePredictorOptions(dim, 5));
  expect_error([&] { p->sample_many(nodes, 0); }, {"EdgePredictor.sample_many", "'samples' must be >= 1", "got 0"});
  expect_error([&] { p->sample_many(nodes, -2); }, {"'samples' must be >= 1", "got -2"});
  expect_error([&] { p->sample_many(nodes.unsqueeze(0), 2); }, {"EdgePredictor.sample_many", "'nodes' must be 2-D"});
}

TEST(SacBatch, BaselineIsAMovingAverageKeptInABuffer) {
  auto p = make(EdgePredictorOptions(4, 6));
  EXPECT_EQ(p->baseline(), 0.0);
  // The first batch: its own mean is the baseline it is compared with.
  EXPECT_DOUBLE_EQ(p->update_baseline(torch::tensor({-2.0, -4.0}, f64())), -3.0);
  EXPECT_DOUBLE_EQ(p->baseline(), -3.0);
  // Then the average before the update.
  EXPECT_DOUBLE_EQ(p->update_baseline(torch::tensor({-1.0}, f64()), 0.5), -3.0);
  EXPECT_DOUBLE_EQ(p->baseline(), -2.0);
  const auto buffers = p->named_buffers();
  ASSERT_TRUE(buffers.contains("reward_baseline"));
  EXPECT_EQ(buffers["reward_baseline"][1].item<double>(), 2.0);
  expect_error([&] { p->update_baseline(torch::tensor({std::nan("")}, f64())); }, {"update_baseline", "nan"});
  expect_error([&] { p->update_baseline(torch::tensor({1.0}, f64()), 1.0); }, {"decay", "[0, 1)"});
}

TEST(SacStructure, RandomStructureIsSeededWithSelfEdges) {
  const auto a = edges::random(9, 2, 4), b = edges::random(9, 2, 4), c = edges::random(9, 2, 5);
  EXPECT_TRUE(torch::equal(a.columns, b.columns) && torch::equal(a.offsets, b.offsets));
  EXPECT_FALSE(torch::equal(a.offsets, c.offsets) && torch::equal(a.columns, c.columns));
  check_edge_list(a, 9, 9, 1);
  const auto off = a.offsets.accessor<int64_t, 1>();
  const auto col = a.columns.accessor<int64_t, 1>();
  for (int64_t i = 0; i < 9; ++i) {
    const int64_t count = off[i + 1] - off[i];
    EXPECT_GE(count, 1);
    EXPECT_LE(count, 3);
    bool self = false;
    for (int64_t e = off[i]; e < off[i + 1]; ++e) self |= col[e] == i;
    EXPECT_TRUE(self) << "row " << i;
  }
}

// Given structures, the module is sparse attention per sequence; without,
// the functional form over edges::random.
TEST(SacStructure, ModuleAttendsOverTheStructuresItIsGiven) {
  auto module = std::dynamic_pointer_cast<SacAttentionImpl>(make_mechanism("sac:alpha=2,seed=3"));
  ASSERT_TRUE(module);
  const int64_t N = 3, H = 2, L = 6;
  auto q = torch::randn({N, H, L, 4}, f64()), k = torch::randn({N, H, L, 4}, f64()),
       v = torch::randn({N, H, L, 5}, f64());
  EXPECT_LT(testing::rel_err(module->forward(q, k, v), attend("sac:alpha=2,seed=3", q, k, v)), 1e-15);
  std::vector<EdgeList> structures;
  for (int64_t b = 0; b < N; ++b) structures.push_back(edges::random(L, 1 + b, 10 + b));
  module->set_structures(structures);
  const auto out = module->forward(q, k, v);
  for (int64_t b = 0; b < N; ++b) {
    const auto expected = reference::sparse_attention(q.narrow(0, b, 1), k.narrow(0, b, 1), v.narrow(0, b, 1),
                                                      structures[b], {});
    EXPECT_LT(testing::rel_err(out.narrow(0, b, 1), expected), 1e-12) << "sequence " << b;
  }
  // Grouped-query heads (k and v with 1 head for 2 query heads) and ALiBi
  // slopes reach sparse attention over each sequence's structure.
  const auto slopes = alibi_slopes(H).to(torch::kDouble);
  const auto k1 = k.narrow(1, 0, 1), v1 = v.narrow(1, 0, 1);
  const auto grouped = module->forward(q, k1, v1, {false, {}, slopes});
  for (int64_t b = 0; b < N; ++b) {
    const auto expected = reference::sparse_attention(q.narrow(0, b, 1), k1.narrow(0, b, 1), v1.narrow(0, b, 1),
                                                      structures[b], SparseAttentionFuncOptions().alibi_slopes(slopes));
    EXPECT_LT(testing::rel_err(grouped.narrow(0, b, 1), expected), 1e-12) << "sequence " << b;
  }
  expect_error([&] { module->forward(q.narrow(0, 0, 2), k.narrow(0, 0, 2), v.narrow(0, 0, 2)); },
               {"sac", "3 structures", "batch of 2"});
  expect_error([] { resolve_mechanism("sac:variant=star"); }, {"variant", "shared, all-connected, head-adaptive"});
  expect_error([] { resolve_mechanism("sac:alpha=0"); }, {"'alpha' must be >= 1"});
  expect_error([] { resolve_mechanism("sac:reward=row"); }, {"reward", "sequence or edge", "'row'"});
  expect_error([] { resolve_mechanism("sac:reward=edge"); }, {"reward=edge", "variant=all-connected"});
  EXPECT_NO_THROW(resolve_mechanism("sac:reward=edge,variant=all-connected"));
  EXPECT_NO_THROW(resolve_mechanism("sac:max_distance=0"));
}

models::TransformerOptions sac_encoder(const std::string& spec) {
  return models::TransformerOptions(12)
      .architecture(models::Architecture::encoder)
      .layers(2)
      .width(16)
      .heads(2)
      .ffn(32)
      .dropout(0)
      .attention({spec});
}

TEST(SacModel, PredictsOneStructurePerSequenceAndTrainsOnlyThePredictorByIt) {
  for (const std::string variant : {"shared", "all-connected", "head-adaptive"}) {
    SCOPED_TRACE(variant);
    torch::manual_seed(2);
    models::Transformer model(sac_encoder("sac:alpha=1,hidden=8,max_distance=4,variant=" + variant));
    ASSERT_TRUE(model->edge_predictor());
    const auto tokens = torch::randint(12, {3, 9}, torch::kInt64);
    model->train();
    const auto logits = model->forward(tokens);
    const auto& sac = model->sac_structures();
    ASSERT_EQ(sac.edges.size(), 3u);
    EXPECT_EQ(sac.edges[0].per_head(), variant == "head-adaptive");
    for (const auto& e : sac.edges) check_edge_list(e, 9, 9, 2);
    ASSERT_TRUE(sac.log_prob.defined());
    EXPECT_EQ(sac.log_prob.sizes(), (std::vector<int64_t>{3}));
    // The policy gradient reaches the predictor only; the likelihood reaches
    // the network only.
    sac.log_prob.sum().backward({}, /*retain_graph=*/true);
    for (const auto& p : model->named_parameters()) {
      const bool predictor = p.key().rfind("edge_predictor.", 0) == 0;
      const bool has = p.value().grad().defined() && testing::max_abs(p.value().grad()) > 0;
      if (predictor) EXPECT_TRUE(has) << p.key();
      else EXPECT_FALSE(has) << p.key();
    }
    model->zero_grad();
    logits.sum().backward();
    for (const auto& p : model->named_parameters())
      if (p.key().rfind("edge_predictor.", 0) == 0)
        EXPECT_FALSE(p.value().grad().defined() && testing::max_abs(p.value().grad()) > 0) << p.key();

    // Eval: beam search, the same structure every time, no log-probability.
    model->eval();
    torch::NoGradGuard no_grad;
    const auto a = model->forward(tokens);
    const auto first = model->sac_structures().edges;
    EXPECT_FALSE(model->sac_structures().log_prob.defined());
    const auto b = model->forward(tokens);
    EXPECT_TRUE(torch::equal(a, b));
    for (size_t i = 0; i < first.size(); ++i)
      EXPECT_TRUE(torch::equal(first[i].columns, model->sac_structures().edges[i].columns));
  }
}

/// The columns of every structure of the model's last forward, in order.
std::vector<torch::Tensor> structure_columns(models::Transformer& model) {
  std::vector<torch::Tensor> columns;
  for (const auto& e : model->sac_structures().edges) columns.push_back(e.columns.clone());
  return columns;
}

bool same_structures(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!a[i].equal(b[i])) return false;
  return true;
}

TEST(SacModel, EvaluatesWithBeamSearchOrASeededSampleOfTheSamePredictor) {
  torch::manual_seed(8);
  const std::string trained = "sac:alpha=2,hidden=8,max_distance=4,variant=all-connected";
  models::Transformer model(sac_encoder(trained));
  model->eval();
  torch::NoGradGuard no_grad;
  const auto tokens = torch::randint(12, {4, 11}, torch::kInt64);
  model->forward(tokens);
  const auto beam = structure_columns(model);

  // decode=sample: a pure function of the batch for a given seed, another
  // structure for another seed, and not the beam's most probable one.
  model->set_attention({trained + ",decode=sample,seed=3"});
  EXPECT_EQ(model->sac_options().decode, "sample");
  model->forward(tokens);
  const auto sampled = structure_columns(model);
  for (size_t i = 0; i < sampled.size(); ++i) check_edge_list(model->sac_structures().edges[i], 11, 11, 1);
  model->forward(tokens);
  EXPECT_TRUE(same_structures(structure_columns(model), sampled));
  EXPECT_FALSE(same_structures(sampled, beam));
  model->set_attention({trained + ",decode=sample,seed=4"});
  model->forward(tokens);
  EXPECT_FALSE(same_structures(structure_columns(model), sampled));

  // Back to beam search: the structures it had.
  model->set_attention({trained});
  model->forward(tokens);
  EXPECT_TRUE(same_structures(structure_columns(model), beam));

  // A spec the predictor was not trained under is refused.
  expect_error([&] { model->set_attention({"sac:alpha=3,hidden=8,max_distance=4,variant=all-connected"}); },
               {"only beam, decode and seed may change"});
  expect_error([] { models::Transformer(sac_encoder("sac:decode=greedy")); }, {"decode", "greedy"});
}

TEST(SacModel, TakesAlibiAndGroupedHeads) {
  // ALiBi and one key/value head for the two query heads: the blocks pass
  // both to the sparse kernel (no repeated heads), for every variant.
  for (const std::string variant : {"shared", "head-adaptive"}) {
    SCOPED_TRACE(variant);
    torch::manual_seed(3);
    models::Transformer model(
        sac_encoder("sac:alpha=2,hidden=8,variant=" + variant).kv_heads(1).positions(models::Positions::alibi));
    model->eval();
    const auto logits = model->forward(torch::randint(12, {2, 9}, torch::kInt64));
    EXPECT_EQ(logits.size(0), 2);
    EXPECT_EQ(logits.size(1), 9);
    EXPECT_TRUE(testing::all_finite(logits));
  }
}

TEST(SacModel, RefusesWhatItCannotDo) {
  expect_error([] { models::Transformer(sac_encoder("sac").architecture(models::Architecture::decoder)); },
               {"sac"});
  expect_error([] { models::Transformer(sac_encoder("sac").attention({"sac:alpha=1", "sac:alpha=2"})); },
               {"share one edge predictor", "sac:alpha=1", "sac:alpha=2"});
  models::Transformer mixed(sac_encoder("sac").attention({"full", "sac:alpha=2"}));
  // Its exact block may be swapped; its SAC block only for SAC under the same predictor.
  EXPECT_NO_THROW(mixed->set_attention({"linear", "sac:alpha=2,beam=3"}));
  expect_error([&] { mixed->set_attention({"sac:alpha=2", "sac:alpha=2"}); }, {"into SAC"});
  models::Transformer with(sac_encoder("sac")), without(sac_encoder("full"));
  EXPECT_NO_THROW(with->set_attention({"sac"}));  // what it has: nothing to swap
  expect_error([&] { with->set_attention({"full"}); }, {"out of SAC", "edge predictor"});
  expect_error([&] { without->set_attention({"sac"}); }, {"into SAC", "edge predictor"});
  EXPECT_FALSE(without->edge_predictor());
  EXPECT_TRUE(without->sac_structures().edges.empty());
}

}  // namespace
}  // namespace attnkit::nn::sac_test
