// experiments::GraphAttentionNetwork (experiments/models/graph_attention.h):
// "input" over a complete graph equals "full"; "input" sees only the graph
// (a node's logits ignore nodes more than `layers` hops away); output shapes
// per spec and mode; SAC's sampled structures keep every input edge;
// "input+random" is the union of the graph and edges::random (checked
// against a std::set union); the oracle's edges and "self"; gradients reach every network parameter, and
// sac_reinforce reaches the predictor's; validate() and forward() refusals;
// a one-node graph.
#include <attnkit/nn/sac.h>
#include <attnkit/tasks/task.h>
#include <attnkit/train/trainer.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "models/graph_attention.h"
#include "test_util.h"

namespace attnkit::experiments::graph_attention_test {
namespace {

using testing::expect_error;
using testing::max_abs;
using testing::rel_err;
using Rows = std::vector<std::vector<int64_t>>;

constexpr int64_t kFeatures = 6, kClasses = 3;

/// The rows of head `h` of an edge list (a shared list has head 0 only).
Rows rows_of(const EdgeList& e, int64_t h = 0) { return testing::edge_rows(e, h); }

EdgeList list_of(const Rows& rows) { return testing::edge_list_from_rows(rows); }

/// An undirected graph as NodeGraph stores it: both directions and self-edges.
EdgeList undirected(int64_t n, const std::vector<std::pair<int64_t, int64_t>>& pairs) {
  std::vector<std::set<int64_t>> rows(n);
  for (int64_t i = 0; i < n; ++i) rows[i].insert(i);
  for (auto [a, b] : pairs) rows[a].insert(b), rows[b].insert(a);
  Rows out;
  for (const auto& r : rows) out.emplace_back(r.begin(), r.end());
  return list_of(out);
}

/// A small graph of 8 nodes: a cycle 0..5, a chord 1 - 4, and 6 - 7 apart.
EdgeList small_graph() { return undirected(8, {{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}, {5, 0}, {1, 4}, {6, 7}}); }

/// Binary bag-of-words features, float32 (n, kFeatures).
torch::Tensor features(int64_t n, uint64_t seed = 5) {
  torch::manual_seed(seed);
  return (torch::rand({n, kFeatures}) < 0.5).to(torch::kFloat32);
}

/// The options of a model over `kind`: a structure ("input", "input+random...")
/// or an attention mechanism ("full", "sac...", anything else).
GraphAttentionOptions options(const std::string& kind) {
  auto o = GraphAttentionOptions(kFeatures, kClasses).width(8).heads(2).layers(2).dropout(0);
  return kind.rfind("input", 0) == 0 || kind.rfind("self", 0) == 0 ? o.structure(kind) : o.attention(kind);
}

GraphAttentionNetwork make(const GraphAttentionOptions& o, uint64_t seed = 3) {
  torch::manual_seed(seed);
  return GraphAttentionNetwork(o);
}

bool same_list(const EdgeList& a, const EdgeList& b) {
  return torch::equal(a.offsets, b.offsets) && torch::equal(a.columns, b.columns);
}

// Over a complete graph, attention over the graph's edges is exact attention.
// Both are float32 kernels summing the same terms in another order (scores,
// softmax, value sums over <= 8 keys), through two layers and the output
// projection: 1e-5 relative to the largest logit.
TEST(GraphAttention, InputOverACompleteGraphEqualsFull) {
  for (bool residual : {false, true}) {
    SCOPED_TRACE(residual ? "residual" : "no residual");
    const int64_t n = 8;
    auto input = make(options("input").residual(residual), 3);
    auto full = make(options("full").residual(residual), 4);  // other weights, then copied over
    {
      torch::NoGradGuard no_grad;
      const auto from = input->named_parameters();
      auto to = full->named_parameters();
      ASSERT_EQ(from.size(), to.size());
      for (const auto& p : from) to[p.key()].copy_(p.value());
    }
    input->eval();
    full->eval();
    const auto x = features(n);
    const auto a = input->forward(x, edges::full(n, n));
    const auto b = full->forward(x, small_graph());  // "full" ignores the graph
    ASSERT_EQ(a.sizes(), (std::vector<int64_t>{1, n, kClasses}));
    ASSERT_EQ(b.sizes(), a.sizes());
    EXPECT_LT(rel_err(a, b), 1e-5);
    // Not a comparison that cannot fail: over the sparse graph "input" differs.
    EXPECT_GT(rel_err(input->forward(x, small_graph()), b), 1e-3);
  }
}

// With 2 layers a node's logits depend on the nodes within 2 hops only: on
// the path 0 - 1 - ... - 7, changing node 7's features moves the logits of
// nodes 5, 6, 7 and leaves nodes 0..4 as they were (their computation never
// reads node 7: equal up to 1e-6 relative, the rounding of a different GEMM
// blocking at most).
TEST(GraphAttention, InputAttendsOnlyAlongTheGraph) {
  const int64_t n = 8;
  std::vector<std::pair<int64_t, int64_t>> path;
  for (int64_t i = 0; i + 1 < n; ++i) path.emplace_back(i, i + 1);
  const auto graph = undirected(n, path);
  auto model = make(options("input"));
  model->eval();
  auto x = features(n);
  const auto before = model->forward(x, graph);
  x[7] = 1 - x[7];
  const auto after = model->forward(x, graph);
  EXPECT_LT(rel_err(after.narrow(1, 0, 5), before.narrow(1, 0, 5)), 1e-6);
  for (int64_t i = 5; i < n; ++i)
    EXPECT_GT(max_abs(after.select(1, i) - before.select(1, i)), 1e-5) << "node " << i;
}

TEST(GraphAttention, ShapesInEvalMode) {
  const int64_t n = 8;
  const auto graph = small_graph();
  for (const std::string spec : {"input", "full", "input+random:alpha=2,seed=1", "sac:alpha=1,hidden=8"}) {
    SCOPED_TRACE(spec);
    auto model = make(options(spec).samples(3));
    model->eval();
    torch::NoGradGuard no_grad;
    const auto logits = model->forward(features(n), graph);
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{1, n, kClasses}));
    EXPECT_EQ(logits.scalar_type(), torch::kFloat32);
    EXPECT_TRUE(testing::all_finite(logits));
    EXPECT_EQ(model->structures().size(), spec == "full" ? 0u : 1u);
    EXPECT_EQ(static_cast<bool>(model->edge_predictor()), spec.rfind("sac", 0) == 0);
  }
}

// SAC in training mode: one row of logits per sampled structure; each is the
// input graph plus predicted edges, so adding the graph again changes nothing.
TEST(GraphAttention, SacSamplesStructuresThatKeepTheInputEdges) {
  const int64_t n = 8, S = 3;
  const auto graph = small_graph();
  for (const std::string variant : {"shared", "all-connected", "head-adaptive"}) {
    SCOPED_TRACE(variant);
    auto model = make(options("sac:alpha=1,hidden=8,variant=" + variant).samples(S));
    model->train();
    const auto logits = model->forward(features(n), graph);
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{S, n, kClasses}));
    const auto& sac = model->sac_structures();
    ASSERT_EQ(sac.edges.size(), static_cast<size_t>(S));
    ASSERT_EQ(model->structures().size(), static_cast<size_t>(S));
    ASSERT_TRUE(sac.log_prob.defined());
    EXPECT_EQ(sac.log_prob.sizes(), (std::vector<int64_t>{S}));
    EXPECT_TRUE(sac.log_prob.requires_grad());
    EXPECT_EQ(sac.tokens.sizes(), (std::vector<int64_t>{S, variant == "head-adaptive" ? 2 : 1, 2 * n}));
    const auto graph_rows = rows_of(graph);
    for (int64_t s = 0; s < S; ++s) {
      const auto& e = sac.edges[s];
      EXPECT_EQ(e.per_head(), variant == "head-adaptive");
      check_edge_list(e, n, n, 2);
      if (!e.per_head()) {
        EXPECT_TRUE(same_list(edges::merge(graph, e), e)) << "structure " << s;
      }
      // Row by row (and head by head): every input edge is there.
      for (int64_t h = 0; h < (e.per_head() ? 2 : 1); ++h) {
        const auto rows = rows_of(e, h);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j : graph_rows[i])
            EXPECT_TRUE(std::binary_search(rows[i].begin(), rows[i].end(), j))
                << "structure " << s << " head " << h << " lacks " << i << " -> " << j;
      }
    }
    // The samples differ (3 draws of 8+ predictions over 8 nodes).
    EXPECT_FALSE(torch::equal(sac.tokens[0], sac.tokens[1]) && torch::equal(sac.tokens[1], sac.tokens[2]));
  }
}

// "input+random:alpha=A,seed=S": every row is the union of the graph's row and
// edges::random(n, A, S)'s row (the expectation built with std::set).
TEST(GraphAttention, InputPlusRandomIsTheUnionWithRandomStructure) {
  const int64_t n = 8;
  const auto graph = small_graph();
  for (auto [alpha, seed] : {std::pair<int64_t, int64_t>{1, 0}, {2, 7}, {3, 11}}) {
    SCOPED_TRACE("alpha " + std::to_string(alpha) + " seed " + std::to_string(seed));
    auto model = make(options("input+random:alpha=" + std::to_string(alpha) + ",seed=" + std::to_string(seed)));
    for (bool training : {true, false}) {
      model->train(training);
      const auto logits = model->forward(features(n), graph);
      EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{1, n, kClasses}));
      ASSERT_EQ(model->structures().size(), 1u);
      const auto got = rows_of(model->structures()[0]);
      const auto g = rows_of(graph), r = rows_of(edges::random(n, alpha, seed));
      Rows want(n);
      for (int64_t i = 0; i < n; ++i) {
        std::set<int64_t> u(g[i].begin(), g[i].end());
        u.insert(r[i].begin(), r[i].end());
        want[i].assign(u.begin(), u.end());
      }
      EXPECT_EQ(got, want);
    }
  }
  // The default seed is 0 and the default alpha 1.
  auto plain = make(options("input+random"));
  plain->forward(features(n), graph);
  auto explicit_ = make(options("input+random:alpha=1,seed=0"));
  explicit_->forward(features(n), graph);
  EXPECT_TRUE(same_list(plain->structures()[0], explicit_->structures()[0]));
  // Another seed, another structure.
  auto other = make(options("input+random:alpha=1,seed=1"));
  other->forward(features(n), graph);
  EXPECT_FALSE(same_list(plain->structures()[0], other->structures()[0]));
}

// oracle_edges: each node sees itself and one other node of its class (itself
// only when alone in it), drawn by the seed; "input+oracle" attends over the
// union with the graph and needs the labels first.
TEST(GraphAttention, TheOracleAddsOneEdgeToANodeOfTheSameClass) {
  const auto labels = torch::tensor({0, 1, 0, 2, 1, 0, 1, 0}, torch::kInt64);  // class 2: node 3 alone
  const auto a = oracle_edges(labels, 4), b = oracle_edges(labels, 4);
  EXPECT_TRUE(same_list(a, b));
  check_edge_list(a, 8, 8, 1);
  const auto rows = rows_of(a);
  bool other_seed_differs = false;
  for (uint64_t seed = 5; seed < 12; ++seed) other_seed_differs |= !same_list(oracle_edges(labels, seed), a);
  EXPECT_TRUE(other_seed_differs);
  for (int64_t i = 0; i < 8; ++i) {
    SCOPED_TRACE("node " + std::to_string(i));
    ASSERT_TRUE(std::binary_search(rows[i].begin(), rows[i].end(), i));
    if (i == 3) {
      EXPECT_EQ(rows[i], std::vector<int64_t>{3});
      continue;
    }
    ASSERT_EQ(rows[i].size(), 2u);
    const auto j = rows[i][0] == i ? rows[i][1] : rows[i][0];
    EXPECT_EQ(labels[j].item<int64_t>(), labels[i].item<int64_t>());
  }
  // Every other member of a class is drawn for some seed (class 0: nodes 0, 2, 5, 7).
  std::set<int64_t> drawn;
  for (uint64_t seed = 0; seed < 40; ++seed) {
    const auto r = rows_of(oracle_edges(labels, seed))[0];
    drawn.insert(r[1]);
  }
  EXPECT_EQ(drawn, (std::set<int64_t>{2, 5, 7}));

  const auto graph = small_graph();
  auto model = make(options("input+oracle:seed=4"));
  expect_error([&] { model->forward(features(8), graph); }, {"needs the labels", "set_labels"});
  model->set_labels(labels);
  model->forward(features(8), graph);
  EXPECT_TRUE(same_list(model->structures()[0], edges::merge(graph, a)));
  expect_error([&] { make(options("input"))->set_labels(labels); }, {"labels are for structure input+oracle"});
  expect_error([] { oracle_edges(torch::zeros({3}), 0); }, {"oracle_edges", "int64"});
}

// "self": every node attends to itself only, so a node's logits depend on its
// own features and on no other node's, whatever the graph.
TEST(GraphAttention, SelfSeesOnlyItsOwnFeatures) {
  auto model = make(options("self"));
  model->eval();
  const auto x = features(8);
  const auto logits = model->forward(x, small_graph());
  EXPECT_EQ(rows_of(model->structures()[0]), rows_of(edges::local(8, 0)));
  EXPECT_TRUE(torch::equal(model->forward(x, undirected(8, {{0, 7}, {2, 5}})), logits));
  auto y = x.clone();
  y[6] = 1 - y[6];
  const auto moved = (model->forward(y, small_graph()) - logits).abs().amax(2)[0];
  for (int64_t i = 0; i < 8; ++i) {
    if (i == 6) EXPECT_GT(moved[i].item<double>(), 0);
    else EXPECT_EQ(moved[i].item<double>(), 0) << "node " << i;
  }
}

// The loss reaches every parameter of the network (dropout on, training mode).
TEST(GraphAttention, GradientsReachEveryParameter) {
  const int64_t n = 8;
  for (const std::string spec : {"input", "full", "input+random:alpha=2"}) {
    SCOPED_TRACE(spec);
    auto model = make(options(spec).dropout(0.2));
    model->train();
    const auto logits = model->forward(features(n), small_graph());
    tasks::Batch batch;
    batch.target = torch::tensor({0, 1, 2, 0, 1, 2, 0, 1}, torch::kLong).unsqueeze(0);
    batch.weight = torch::ones({1, n});
    tasks::loss(logits, batch).backward();
    const auto params = model->named_parameters();
    EXPECT_EQ(params.size(), 2u * 4);  // input, qkv0, qkv1, output: weight and bias each
    for (const auto& p : params)
      EXPECT_TRUE(p.value().grad().defined() && max_abs(p.value().grad()) > 0) << p.key();
  }
}

// SAC: sac_reinforce's surrogate sends gradients into the predictor only; the
// task loss into the network only (the predictor reads h_0 detached).
TEST(GraphAttention, SacReinforceTrainsThePredictor) {
  const int64_t n = 8, S = 3;
  auto model = make(options("sac:alpha=1,hidden=8,max_distance=3").samples(S));
  model->train();
  const auto logits = model->forward(features(n), small_graph());
  tasks::Batch batch;
  batch.target = torch::tensor({0, 1, 2, 0, 1, 2, 0, 1}, torch::kLong).unsqueeze(0).expand({S, n}).contiguous();
  batch.weight = torch::ones({S, n});
  auto& predictor = model->edge_predictor();
  ASSERT_TRUE(predictor);
  const auto r = train::sac_reinforce(*predictor, model->sac_structures(), logits.detach(), batch,
                                      model->sac_options());
  ASSERT_TRUE(r.surrogate.defined());
  r.surrogate.backward();
  int predictor_params = 0;
  for (const auto& p : model->named_parameters()) {
    const bool in_predictor = p.key().rfind("edge_predictor.", 0) == 0;
    const bool has = p.value().grad().defined() && max_abs(p.value().grad()) > 0;
    EXPECT_EQ(has, in_predictor) << p.key();
    predictor_params += in_predictor;
  }
  EXPECT_EQ(predictor_params, 7);  // lstm (4), start, pointer, distance
  model->zero_grad();
  tasks::loss(logits, batch).backward();
  for (const auto& p : model->named_parameters()) {
    const bool in_predictor = p.key().rfind("edge_predictor.", 0) == 0;
    const bool has = p.value().grad().defined() && max_abs(p.value().grad()) > 0;
    EXPECT_EQ(has, !in_predictor) << p.key();
  }
}

TEST(GraphAttention, ValidateRefusesBadOptions) {
  const auto o = options("input");
  EXPECT_NO_THROW(validate(o));
  expect_error([&] { validate(options("sparse")); },
               {"GraphAttentionNetwork", "unknown attention 'sparse'", "full or sac"});
  expect_error([&] { validate(options("input").structure("random")); },
               {"GraphAttentionNetwork", "unknown structure 'random'", "input, input+random", "input+oracle", "self"});
  expect_error([&] { validate(options("self:alpha=1")); }, {"'self:alpha=1'", "takes no options"});
  expect_error([&] { validate(options("input+oracle:alpha=1")); }, {"unknown option 'alpha'", "takes seed"});
  // A mechanism replaces the structure's edges: it takes the input graph only.
  expect_error([&] { validate(options("full").structure("input+random")); },
               {"attention 'full'", "every pair", "structure 'input'", "got 'input+random'"});
  expect_error([&] { validate(options("sac").structure("input+random:alpha=2")); },
               {"attention 'sac'", "structure 'input'", "got 'input+random:alpha=2'"});
  expect_error([&] { validate(options("input:alpha=1")); },
               {"GraphAttentionNetwork", "'input:alpha=1'", "takes no options"});
  expect_error([&] { validate(options("full:seed=2")); }, {"'full:seed=2'", "takes no options"});
  expect_error([&] { validate(options("input+random:beta=2")); },
               {"GraphAttentionNetwork", "unknown option 'beta'", "alpha and seed"});
  expect_error([&] { validate(options("input+random:alpha=0")); }, {"alpha must be >= 1"});
  expect_error([&] { validate(options("input+random:alpha=two")); }, {"'alpha' must be an integer", "'two'"});
  expect_error([&] { validate(options("sac:alpha=0")); }, {"'alpha' must be >= 1"});
  expect_error([&] { validate(options("sac:variant=star")); }, {"variant", "shared, all-connected, head-adaptive"});
  expect_error([&] { validate(options("sac:colour=red")); }, {"'sac'", "no option 'colour'"});
  expect_error([&] { validate(options("sac:reward=edge")); }, {"reward=edge", "variant=all-connected"});
  // Sizes.
  expect_error([&] { validate(GraphAttentionOptions(0, 3)); }, {"GraphAttentionNetwork", "features >= 1", "0"});
  expect_error([&] { validate(GraphAttentionOptions(6, 1)); }, {"classes >= 2", "got 6 and 1"});
  expect_error([&] { validate(options("input").width(10).heads(3)); },
               {"width 10", "positive multiple of heads 3"});
  expect_error([&] { validate(options("input").heads(0)); }, {"multiple of heads 0"});
  expect_error([&] { validate(options("input").layers(0)); }, {"layers >= 1", "0"});
  expect_error([&] { validate(options("input").dropout(1.0)); }, {"dropout", "[0, 1)"});
  expect_error([&] { validate(options("input").dropout(-0.1)); }, {"dropout", "[0, 1)"});
  expect_error([&] { validate(options("input").samples(0)); }, {"samples must be >= 1", "0"});
  // The constructor validates too.
  expect_error([&] { GraphAttentionNetwork(options("sparse")); }, {"unknown attention 'sparse'"});
}

TEST(GraphAttention, ForwardRefusesBadInput) {
  const int64_t n = 8;
  auto model = make(options("sac:alpha=1,hidden=8"));
  const auto graph = small_graph();
  const auto x = features(n);
  expect_error([&] { model->forward(torch::ones({n, kFeatures + 1}), graph); },
               {"GraphAttentionNetwork", "features must have shape (n, 6)", "[8, 7]"});
  expect_error([&] { model->forward(torch::ones({kFeatures}), graph); }, {"features must have shape (n, 6)"});
  expect_error([&] { model->forward(x.to(torch::kFloat64), graph); }, {"features must be float32", "Double"});
  expect_error([&] { model->forward(torch::Tensor(), graph); }, {"features are undefined"});
  expect_error([&] { model->forward(x, undirected(n + 1, {})); }, {"GraphAttentionNetwork", "L + 1"});
  expect_error([&] { model->forward(x, list_of(Rows{{0, 9}, {}, {}, {}, {}, {}, {}, {}})); },
               {"GraphAttentionNetwork", "outside the key range"});
  const EdgeList per_head{graph.offsets.unsqueeze(0).expand({2, n + 1}).contiguous(), graph.columns};
  expect_error([&] { model->forward(x, per_head); }, {"GraphAttentionNetwork"});
  expect_error([&] { model->forward(x, graph, torch::zeros({n, n - 1}, torch::kLong)); },
               {"distances must have shape (8, 8)"});
}

// A graph of one node: its only edge is the self-edge; every spec works in
// both modes.
TEST(GraphAttention, OneNode) {
  const auto graph = list_of(Rows{{0}});
  for (const std::string spec : {"input", "full", "input+random:alpha=2", "sac:alpha=1,hidden=8",
                                 "sac:alpha=2,hidden=8,variant=head-adaptive"}) {
    SCOPED_TRACE(spec);
    auto model = make(options(spec).samples(2));
    for (bool training : {true, false}) {
      model->train(training);
      const auto logits = model->forward(features(1), graph);
      const int64_t rows = training && spec.rfind("sac", 0) == 0 ? 2 : 1;
      EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{rows, 1, kClasses}));
      EXPECT_TRUE(testing::all_finite(logits));
      for (const auto& e : model->structures()) EXPECT_EQ(rows_of(e, 0), (Rows{{0}}));
    }
  }
}

}  // namespace
}  // namespace attnkit::experiments::graph_attention_test
