// nn::EdgePredictor (the SAC edge predictor): log-probabilities recomputed from
// the LSTM equations by hand, valid EdgeLists with the expected edges, beam
// search against brute-force enumeration, seeded sampling, and the REINFORCE
// estimator against finite differences of the expected reward.
#include <ATen/CPUGeneratorImpl.h>
#include <attnkit/nn/edge_predictor.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "nn/edge_predictor_util.h"
#include "test_util.h"

namespace attnkit::nn::edge_predictor_test {
namespace {

using testing::expect_error;
using testing::f64;

// float64 computations of the same sums in another order: rounding only.
constexpr double kDoubleTol = 1e-12;

using testing::generator;
EdgePredictor make(const EdgePredictorOptions& o, uint64_t seed = 0) { return testing::make_predictor(o, seed); }

int64_t sequences(const EdgePredictorOptions& o) {
  return o.variant() == EdgePredictorVariant::head_adaptive ? o.heads() : 1;
}

// The log-probability of `tokens` written out from the LSTM cell equations
// (torch's gate order i, f, g, o) and the pointer / distance definitions.
torch::Tensor hand_log_prob(EdgePredictor& p, const torch::Tensor& nodes, const torch::Tensor& tokens) {
  const auto& o = p->options;
  const int64_t n = nodes.size(0), Hd = o.hidden_size();
  const auto w = torch::matmul(nodes, p->pointer.t());  // (n, hidden)
  auto h = torch::zeros({Hd}, f64()), c = torch::zeros({Hd}, f64());
  torch::Tensor total = torch::zeros({}, f64());
  for (int64_t s = 0; s < tokens.size(0); ++s) {
    for (int64_t t = 0; t < tokens.size(1); ++t) {
      auto x = t == 0 ? p->start : nodes[tokens[s][t - 1].item<int64_t>()];
      if (o.variant() == EdgePredictorVariant::head_adaptive) x = torch::cat({x, p->head_embedding[s]});
      const auto gates = torch::matmul(p->lstm->weight_ih, x) + p->lstm->bias_ih +
                         torch::matmul(p->lstm->weight_hh, h) + p->lstm->bias_hh;
      const auto i = torch::sigmoid(gates.slice(0, 0, Hd));
      const auto f = torch::sigmoid(gates.slice(0, Hd, 2 * Hd));
      const auto g = torch::tanh(gates.slice(0, 2 * Hd, 3 * Hd));
      const auto og = torch::sigmoid(gates.slice(0, 3 * Hd, 4 * Hd));
      c = f * c + i * g;
      h = og * torch::tanh(c);
      const bool destination = t % 2 == 1;
      if (o.variant() == EdgePredictorVariant::all_connected && !destination) continue;
      auto logits = torch::matmul(w, h);
      if (destination && o.max_distance() > 0) {
        const int64_t origin = tokens[s][t - 1].item<int64_t>();
        std::vector<torch::Tensor> terms;
        for (int64_t j = 0; j < n; ++j) {
          const int64_t d = std::min<int64_t>(std::abs(origin - j), o.max_distance());
          terms.push_back(torch::dot(p->distance[d], h));
        }
        logits = logits + torch::stack(terms);
      }
      total = total + torch::log_softmax(logits, 0)[tokens[s][t].item<int64_t>()];
    }
  }
  return total;
}

std::vector<EdgePredictorOptions> variants() {
  return {
      EdgePredictorOptions(3, 5).alpha(1),
      EdgePredictorOptions(3, 5).alpha(2).max_distance(2),
      EdgePredictorOptions(3, 5).alpha(2).variant(EdgePredictorVariant::all_connected).max_distance(1),
      EdgePredictorOptions(3, 5).alpha(1).variant(EdgePredictorVariant::head_adaptive).heads(3)
          .head_embedding_dim(2).max_distance(3),
  };
}

TEST(EdgePredictor, LogProbMatchesHandRecomputationInValueAndGradient) {
  uint64_t seed = 1;
  for (const auto& o : variants()) {
    SCOPED_TRACE(to_string(o.variant()) + " max_distance=" + std::to_string(o.max_distance()));
    auto p = make(o, seed);
    const auto nodes = torch::randn({4, 3}, f64());
    const auto sample = p->sample(nodes, generator(seed++));
    ASSERT_EQ(sample.tokens.sizes(), torch::IntArrayRef({sequences(o), 2 * o.alpha() * 4}));
    const auto hand = hand_log_prob(p, nodes, sample.tokens);
    EXPECT_NEAR(sample.log_prob.item<double>(), hand.item<double>(), kDoubleTol);
    EXPECT_NEAR(p->log_prob(nodes, sample.tokens).item<double>(), hand.item<double>(), kDoubleTol);
    EXPECT_LT(sample.log_prob.item<double>(), 0.0);

    // Gradients of the sampled log-probability against the hand graph's.
    const auto params = p->parameters();
    const auto g_sample = torch::autograd::grad({sample.log_prob}, params);
    const auto g_hand = torch::autograd::grad({hand}, params, {}, false, false, /*allow_unused=*/true);
    for (size_t k = 0; k < params.size(); ++k) {
      ASSERT_TRUE(g_hand[k].defined()) << "parameter " << k << " unused by the hand computation";
      EXPECT_LT((g_sample[k] - g_hand[k]).abs().max().item<double>(), kDoubleTol) << "parameter " << k;
    }
  }
}

// The edge set of a token sequence, written independently of the module.
std::vector<std::set<int64_t>> expected_rows(const torch::Tensor& tokens, int64_t s, int64_t n,
                                             bool self_edges, bool symmetric) {
  std::vector<std::set<int64_t>> rows(n);
  for (int64_t t = 0; t < tokens.size(1); t += 2) {
    const int64_t o = tokens[s][t].item<int64_t>(), d = tokens[s][t + 1].item<int64_t>();
    rows[o].insert(d);
    if (symmetric) rows[d].insert(o);
  }
  if (self_edges)
    for (int64_t i = 0; i < n; ++i) rows[i].insert(i);
  return rows;
}

TEST(EdgePredictor, SampledEdgesAreValidEdgeListsOfThePredictedPairs) {
  uint64_t seed = 100;
  for (auto o : variants()) {
    for (const bool self_edges : {true, false}) {
      for (const bool symmetric : {false, true}) {
        for (const int64_t n : {1, 2, 7}) {
          o.self_edges(self_edges).symmetric(symmetric);
          SCOPED_TRACE(to_string(o.variant()) + " self=" + std::to_string(self_edges) +
                       " symmetric=" + std::to_string(symmetric) + " n=" + std::to_string(n));
          auto p = make(o, seed);
          const auto nodes = torch::randn({n, 3}, f64());
          const auto sample = p->sample(nodes, generator(seed++));
          const int64_t S = sequences(o);
          const auto& e = sample.edges;
          EXPECT_EQ(e.per_head(), o.variant() == EdgePredictorVariant::head_adaptive);
          check_edge_list(e, n, n, S, "EdgePredictorTest");
          // Count bound per sequence: alpha n predicted pairs (twice when
          // symmetric) plus n self-edges; at least n self-edges when added.
          const int64_t pairs = o.alpha() * n * (symmetric ? 2 : 1);
          const int64_t bound = pairs + (self_edges ? n : 0);
          const auto off = e.offsets.view({S, n + 1});
          for (int64_t s = 0; s < S; ++s) {
            const int64_t count = off[s][n].item<int64_t>() - off[s][0].item<int64_t>();
            EXPECT_LE(count, bound);
            EXPECT_GE(count, self_edges ? n : 1);
            const auto rows = expected_rows(sample.tokens, s, n, self_edges, symmetric);
            for (int64_t i = 0; i < n; ++i) {
              const auto cols = e.columns.slice(0, off[s][i].item<int64_t>(), off[s][i + 1].item<int64_t>());
              std::vector<int64_t> got(cols.data_ptr<int64_t>(), cols.data_ptr<int64_t>() + cols.numel());
              EXPECT_EQ(got, std::vector<int64_t>(rows[i].begin(), rows[i].end())) << "row " << i;
            }
            if (o.variant() == EdgePredictorVariant::all_connected) {
              for (int64_t t = 0; t < sample.tokens.size(1); t += 2)
                EXPECT_EQ(sample.tokens[s][t].item<int64_t>(), (t / 2) / o.alpha());
            }
          }
        }
      }
    }
  }
}

TEST(EdgePredictor, SamplingIsSeeded) {
  for (const auto& o : variants()) {
    SCOPED_TRACE(to_string(o.variant()));
    auto p = make(o, 7);
    const auto nodes = torch::randn({6, 3}, f64());
    const auto a = p->sample(nodes, generator(42));
    const auto b = p->sample(nodes, generator(42));
    EXPECT_TRUE(torch::equal(a.tokens, b.tokens));
    EXPECT_EQ(a.log_prob.item<double>(), b.log_prob.item<double>());
    EXPECT_TRUE(torch::equal(a.edges.offsets, b.edges.offsets));
    EXPECT_TRUE(torch::equal(a.edges.columns, b.edges.columns));
    // Another seed gives another sequence (each of >= 6 predictions is over 6
    // nodes of a near-uniform initial policy: a repeat has probability ~1e-5).
    const auto c = p->sample(nodes, generator(43));
    EXPECT_FALSE(torch::equal(a.tokens, c.tokens));
  }
}

// Every token sequence of the predictor for n nodes (origins forced for
// all_connected), by brute force.
std::vector<torch::Tensor> all_sequences(const EdgePredictorOptions& o, int64_t n) {
  const int64_t T = 2 * o.alpha() * n, S = sequences(o);
  std::vector<std::vector<int64_t>> seqs{{}};
  for (int64_t k = 0; k < S * T; ++k) {
    const int64_t t = k % T;
    std::vector<std::vector<int64_t>> next;
    for (const auto& prefix : seqs) {
      if (o.variant() == EdgePredictorVariant::all_connected && t % 2 == 0) {
        next.push_back(prefix);
        next.back().push_back((t / 2) / o.alpha());
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        next.push_back(prefix);
        next.back().push_back(j);
      }
    }
    seqs = std::move(next);
  }
  std::vector<torch::Tensor> out;
  for (const auto& s : seqs) out.push_back(torch::tensor(s, torch::kInt64).view({S, T}));
  return out;
}

// Beam search keeps the `width` best prefixes; when width is at least the
// number of prefixes before the last prediction it is exact, so it must return
// the brute-force argmax.
TEST(EdgePredictor, BeamSearchReturnsTheMostProbableSequence) {
  struct Case {
    EdgePredictorOptions options;
    int64_t n;
    int64_t width;
  };
  const std::vector<Case> cases = {
      // N = 3, 1 edge per node: 6 predictions, 3^5 = 243 prefixes before the last.
      {EdgePredictorOptions(3, 5).alpha(1), 3, 243},
      {EdgePredictorOptions(3, 5).alpha(1).max_distance(1), 3, 243},
      // All-connected N = 3: 3 predictions, 9 prefixes before the last.
      {EdgePredictorOptions(3, 5).variant(EdgePredictorVariant::all_connected).max_distance(2), 3, 9},
      // The paper's width 5 is exact here: 2 predictions over 2 nodes.
      {EdgePredictorOptions(3, 5).variant(EdgePredictorVariant::all_connected), 2, 5},
      // Two heads, 2 nodes: 8 predictions, 2^7 = 128 prefixes.
      {EdgePredictorOptions(3, 5).variant(EdgePredictorVariant::head_adaptive).heads(2)
           .head_embedding_dim(2).max_distance(1), 2, 128},
  };
  uint64_t seed = 300;
  for (const auto& cs : cases) {
    for (int rep = 0; rep < 3; ++rep) {
      SCOPED_TRACE(to_string(cs.options.variant()) + " n=" + std::to_string(cs.n) +
                   " seed=" + std::to_string(seed));
      auto p = make(cs.options, seed++);
      // Larger node vectors make the policy peaked, so the optimum is distinct.
      const auto nodes = 3.0 * torch::randn({cs.n, 3}, f64());
      torch::NoGradGuard no_grad;
      double best = -INFINITY, second = -INFINITY;
      torch::Tensor argmax;
      double total = 0.0;
      std::vector<std::pair<std::vector<int64_t>, double>> table;  // flat tokens, probability
      for (const auto& seq : all_sequences(cs.options, cs.n)) {
        const double lp = p->log_prob(nodes, seq).item<double>();
        total += std::exp(lp);
        const auto f = seq.view(-1);
        table.emplace_back(std::vector<int64_t>(f.data_ptr<int64_t>(), f.data_ptr<int64_t>() + f.numel()),
                           std::exp(lp));
        if (lp > best) {
          second = best;
          best = lp;
          argmax = seq;
        } else if (lp > second) {
          second = lp;
        }
      }
      ASSERT_NEAR(total, 1.0, 1e-12);  // the enumeration is complete
      ASSERT_GT(best - second, 1e-9);  // a unique optimum
      const auto beam = p->beam_search(nodes, cs.width);
      EXPECT_TRUE(torch::equal(beam.tokens, argmax)) << beam.tokens << "\nvs\n" << argmax;
      EXPECT_NEAR(beam.log_prob.item<double>(), best, kDoubleTol);
      const auto edges = p->edges_from_tokens(argmax, cs.n);
      EXPECT_TRUE(torch::equal(beam.edges.offsets, edges.offsets));
      EXPECT_TRUE(torch::equal(beam.edges.columns, edges.columns));

      // Width 1 is greedy decoding: at each predicted step the node with the
      // largest conditional probability given the greedy prefix, i.e. the
      // largest prefix marginal, summed over the enumerated sequences.
      const auto greedy = p->beam_search(nodes, 1);
      const auto gt = greedy.tokens.view(-1);
      const std::vector<int64_t> gflat(gt.data_ptr<int64_t>(), gt.data_ptr<int64_t>() + gt.numel());
      for (size_t k = 0; k < gflat.size(); ++k) {
        std::vector<double> marginal(cs.n, 0.0);
        for (const auto& [f, prob] : table) {
          if (!std::equal(f.begin(), f.begin() + k, gflat.begin())) continue;
          marginal[f[k]] += prob;
        }
        const int64_t pick = gflat[k];
        for (int64_t j = 0; j < cs.n; ++j)
          EXPECT_LE(marginal[j], marginal[pick] + 1e-12) << "step " << k << " node " << j;
      }
      EXPECT_NEAR(greedy.log_prob.item<double>(), p->log_prob(nodes, greedy.tokens).item<double>(),
                  kDoubleTol);
      EXPECT_LE(greedy.log_prob.item<double>(), best + kDoubleTol);
    }
  }
}

// REINFORCE on a two-action policy p = softmax(theta), rewards R_a: the
// estimator sum grad log p(a) (R_a - b) has expectation grad J, J = sum_a p_a R_a,
// whatever the baseline b. Exact expectation and a Monte Carlo average against
// central finite differences of J.
TEST(EdgePredictor, ReinforceGradientMatchesFiniteDifferencesOnTwoActions) {
  const std::vector<double> R = {1.0, 3.0};
  const auto theta = torch::tensor({0.3, -0.4}, f64()).requires_grad_(true);
  auto J = [&](const torch::Tensor& th) {
    const auto p = torch::softmax(th, 0);
    return p[0].item<double>() * R[0] + p[1].item<double>() * R[1];
  };
  const double eps = 1e-6;
  std::vector<double> fd(2);
  for (int k = 0; k < 2; ++k) {
    auto plus = theta.detach().clone(), minus = theta.detach().clone();
    plus[k] += eps;
    minus[k] -= eps;
    fd[k] = (J(plus) - J(minus)) / (2 * eps);
  }
  for (const double b : {0.0, 0.5, 2.0}) {
    SCOPED_TRACE("baseline " + std::to_string(b));
    // Per-action estimator g_a = -grad reinforce_loss(log p_a, R_a, b).
    const auto p = torch::softmax(theta, 0).detach();
    std::vector<torch::Tensor> g(2);
    for (int a = 0; a < 2; ++a) {
      const auto loss = reinforce_loss(torch::log_softmax(theta, 0)[a], R[a], b);
      g[a] = -torch::autograd::grad({loss}, {theta})[0];
    }
    const auto exact = p[0] * g[0] + p[1] * g[1];
    for (int k = 0; k < 2; ++k) EXPECT_NEAR(exact[k].item<double>(), fd[k], 1e-8);

    // Monte Carlo: K draws; the mean's standard error from the estimator's variance.
    const int64_t K = 20000;
    auto gen = generator(11);
    const auto draws = torch::multinomial(p, K, /*replacement=*/true, gen);
    const double n1 = draws.sum().item<double>();
    const auto mean = ((K - n1) * g[0] + n1 * g[1]) / double(K);
    const auto var = p[0] * g[0] * g[0] + p[1] * g[1] * g[1] - exact * exact;
    for (int k = 0; k < 2; ++k) {
      const double se = std::sqrt(var[k].item<double>() / K);
      EXPECT_NEAR(mean[k].item<double>(), fd[k], 5 * se) << "se " << se;
    }
  }
}

// The same estimator through the predictor itself: all-connected, 2 nodes, 1
// edge per node (two predicted destinations, four outcomes); reward = edges that
// hit the partner node (0 -> 1, 1 -> 0). The exact expectation of
// -grad reinforce_loss against finite differences of the expected reward over
// every parameter; sample() draws outcomes with the model's probabilities.
TEST(EdgePredictor, ReinforceGradientOfThePredictorMatchesFiniteDifferences) {
  const auto o = EdgePredictorOptions(2, 3).variant(EdgePredictorVariant::all_connected).max_distance(1);
  auto p = make(o, 21);
  const auto nodes = torch::randn({2, 2}, f64());
  const auto seqs = all_sequences(o, 2);
  ASSERT_EQ(seqs.size(), 4u);
  auto reward = [](const torch::Tensor& tokens) {
    return double((tokens[0][1].item<int64_t>() == 1) + (tokens[0][3].item<int64_t>() == 0));
  };
  auto expected_reward = [&] {
    torch::NoGradGuard no_grad;
    double J = 0;
    for (const auto& s : seqs) J += std::exp(p->log_prob(nodes, s).item<double>()) * reward(s);
    return J;
  };
  const double b = 0.7;
  const auto params = p->parameters();
  // Exact expectation of the estimator, and per-outcome estimates for the
  // Monte Carlo check below.
  std::vector<std::vector<torch::Tensor>> per_outcome;
  std::vector<double> prob;
  std::vector<torch::Tensor> exact;
  for (const auto& s : seqs) {
    const auto lp = p->log_prob(nodes, s);
    prob.push_back(std::exp(lp.item<double>()));
    auto g = torch::autograd::grad({reinforce_loss(lp, reward(s), b)}, params);
    for (auto& t : g) t = -t;
    per_outcome.push_back(g);
  }
  for (size_t k = 0; k < params.size(); ++k) {
    auto e = torch::zeros_like(params[k]);
    for (size_t s = 0; s < seqs.size(); ++s) e += prob[s] * per_outcome[s][k];
    exact.push_back(e);
  }
  const double eps = 1e-6;
  double max_err = 0, max_grad = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    torch::NoGradGuard no_grad;
    auto flat = params[k].view(-1);
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double v = flat[i].item<double>();
      flat[i] = v + eps;
      const double jp = expected_reward();
      flat[i] = v - eps;
      const double jm = expected_reward();
      flat[i] = v;
      const double fd = (jp - jm) / (2 * eps);
      max_err = std::max(max_err, std::abs(exact[k].view(-1)[i].item<double>() - fd));
      max_grad = std::max(max_grad, std::abs(fd));
    }
  }
  // Central differences in float64 with eps 1e-6: truncation ~eps^2, rounding
  // ~1e-16 / eps = 1e-10.
  EXPECT_LT(max_err, 1e-8);
  EXPECT_GT(max_grad, 1e-3);  // the check is not vacuous

  // sample() frequencies: K draws, each outcome within 5 standard errors.
  const int64_t K = 4000;
  auto gen = generator(5);
  std::map<std::vector<int64_t>, int64_t> counts;
  {
    torch::NoGradGuard no_grad;
    for (int64_t k = 0; k < K; ++k) {
      const auto t = p->sample(nodes, gen).tokens.view(-1);
      counts[std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel())]++;
    }
  }
  for (size_t s = 0; s < seqs.size(); ++s) {
    const auto t = seqs[s].view(-1);
    const double freq =
        double(counts[std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel())]) / K;
    EXPECT_NEAR(freq, prob[s], 5 * std::sqrt(prob[s] * (1 - prob[s]) / K)) << "outcome " << s;
  }
}

TEST(EdgePredictor, Errors) {
  expect_error([] { EdgePredictor(EdgePredictorOptions(3, 5).alpha(0)); }, {"EdgePredictor", "alpha", "got 0"});
  expect_error([] { EdgePredictor(EdgePredictorOptions(0, 5)); }, {"EdgePredictor", "width"});
  expect_error([] { EdgePredictor(EdgePredictorOptions(3, 5).max_distance(-1)); }, {"max_distance", "-1"});
  expect_error([] { edge_predictor_variant_from_string("dense"); }, {"shared", "head-adaptive", "'dense'"});
  EXPECT_EQ(edge_predictor_variant_from_string("all-connected"), EdgePredictorVariant::all_connected);
  auto p = make(EdgePredictorOptions(3, 5).max_distance(2));
  expect_error([&] { p->sample(torch::randn({4, 2}, f64())); }, {"EdgePredictor.sample", "nodes", "width = 3", "got 2"});
  expect_error([&] { p->sample(torch::randn({4, 3})); }, {"EdgePredictor.sample", "dtype", "Float"});
  expect_error([&] { p->sample(torch::randn({3}, f64())); }, {"nodes", "2-D", "1-D"});
  expect_error([&] { p->beam_search(torch::randn({4, 3}, f64()), 0); }, {"beam_search", "beam", "got 0"});
  expect_error([&] { p->sample(torch::randn({4, 3}, f64()), c10::nullopt, torch::zeros({4, 3}, torch::kInt64)); },
               {"distances", "(4, 4)"});
  expect_error([&] { p->sample(torch::randn({4, 3}, f64()), c10::nullopt, -torch::ones({4, 4}, torch::kInt64)); },
               {"distances", "non-negative"});
  expect_error([&] { p->log_prob(torch::randn({2, 3}, f64()), torch::tensor({{0, 1, 2, 0}}, torch::kInt64)); },
               {"log_prob", "tokens[0][2]", "[0, 2)", "got 2"});
  auto q = make(EdgePredictorOptions(3, 5));
  expect_error([&] { q->sample(torch::randn({4, 3}, f64()), c10::nullopt, torch::zeros({4, 4}, torch::kInt64)); },
               {"distances", "max_distance = 0"});
  auto ac = make(EdgePredictorOptions(3, 5).variant(EdgePredictorVariant::all_connected));
  expect_error([&] { ac->log_prob(torch::randn({2, 3}, f64()), torch::tensor({{1, 1, 1, 0}}, torch::kInt64)); },
               {"all-connected origin", "must be 0", "got 1"});
}

// float32 (the attnkit::linear kernel for the pointer products) against the
// same parameters in float64: sampling and beam search run, and the sampled
// log-probabilities agree. A sequence sums 16 to 48 float32 log_softmax picks
// over 8 nodes (log-probabilities down to -99, float32 rounding ~1e-7 relative
// per term); measured maximum difference 6.9e-6; 1e-4 still catches a wrong
// step (errors of 1e-1 or more).
TEST(EdgePredictor, Float32MatchesFloat64) {
  for (const auto& o : variants()) {
    SCOPED_TRACE(to_string(o.variant()));
    torch::manual_seed(13);
    EdgePredictor p32(o);
    auto p64 = make(o, 13);
    const auto nodes = torch::randn({8, 3}, f64());
    const auto sample = p32->sample(nodes.to(torch::kFloat), generator(3));
    EXPECT_EQ(sample.log_prob.scalar_type(), torch::kFloat);
    EXPECT_NEAR(sample.log_prob.item<double>(), p64->log_prob(nodes, sample.tokens).item<double>(), 1e-4);
    const auto beam = p32->beam_search(nodes.to(torch::kFloat));
    check_edge_list(beam.edges, 8, 8, sequences(o), "EdgePredictorTest");
    EXPECT_NEAR(beam.log_prob.item<double>(), p64->log_prob(nodes, beam.tokens).item<double>(), 1e-4);
  }
}

// A given distance matrix (e.g. shortest paths on a graph) replaces |i - j|.
TEST(EdgePredictor, GivenDistancesReplaceSequenceDistances) {
  auto p = make(EdgePredictorOptions(3, 5).max_distance(3), 9);
  const auto nodes = torch::randn({4, 3}, f64());
  const auto i = torch::arange(4, torch::kInt64);
  const auto seq = (i.unsqueeze(1) - i.unsqueeze(0)).abs();
  const auto tokens = p->sample(nodes, generator(1)).tokens;
  torch::NoGradGuard no_grad;
  EXPECT_NEAR(p->log_prob(nodes, tokens, seq).item<double>(), p->log_prob(nodes, tokens).item<double>(),
              kDoubleTol);
  // Reversing the order of the nodes in the distances changes the policy.
  const auto rev = (i.unsqueeze(1) + i.unsqueeze(0) - 3).abs();
  EXPECT_GT(std::abs(p->log_prob(nodes, tokens, rev).item<double>() - p->log_prob(nodes, tokens).item<double>()),
            1e-6);
}

}  // namespace
}  // namespace attnkit::nn::edge_predictor_test
