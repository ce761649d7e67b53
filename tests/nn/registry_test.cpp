// The mechanism registry: spec strings, errors that list what is accepted, and
// every entry's functional form against its own float64 definition.
#include <attnkit/nn/clustered_attention.h>
#include <attnkit/nn/multihead.h>
#include <attnkit/nn/registry.h>
#include <attnkit/nn/sac.h>

#include <algorithm>

#include "test_util.h"

namespace attnkit::nn::registry_test {
namespace {

using testing::expect_error;
using testing::f64;

TEST(MechanismSpec, ParsesNameAndOptionsInOrder) {
  auto s = MechanismSpec::parse("improved-clustered:clusters=25, topk=32");
  EXPECT_EQ(s.name, "improved-clustered");
  ASSERT_EQ(s.options.size(), 2u);
  EXPECT_EQ(s.get_int("clusters", 0), 25);
  EXPECT_EQ(s.get_int("topk", 0), 32);
  EXPECT_EQ(s.get_int("bits", 63), 63);
  EXPECT_EQ(s.str(), "improved-clustered:clusters=25,topk=32");
  EXPECT_EQ(MechanismSpec::parse("full").str(), "full");
  EXPECT_TRUE(MechanismSpec::parse("linear:normalize=false").get_bool("normalize", true) == false);
  EXPECT_DOUBLE_EQ(MechanismSpec::parse("linear:eps=1e-3").get_double("eps", 0), 1e-3);
}

TEST(MechanismSpec, MalformedSpecsAreRefused) {
  expect_error([] { MechanismSpec::parse(""); }, {"NAME[:key=value,...]"});
  expect_error([] { MechanismSpec::parse(":clusters=3"); }, {"NAME[:key=value,...]"});
  expect_error([] { MechanismSpec::parse("clustered:clusters"); }, {"'clusters'", "key=value"});
  expect_error([] { MechanismSpec::parse("clustered:clusters=3,clusters=4"); }, {"'clusters' given twice"});
  expect_error([] { MechanismSpec::parse("linear:normalize=maybe").get_bool("normalize", true); },
               {"'normalize'", "true or false", "'maybe'"});
  expect_error([] { MechanismSpec::parse("linear:eps=inf").get_double("eps", 0); }, {"finite", "'inf'"});
}

TEST(Registry, UnknownNamesAndKeysListWhatIsAccepted) {
  std::vector<std::string> fragments{"unknown attention mechanism 'softmax'"};
  for (const auto& n : mechanism_names()) fragments.push_back(n);
  expect_error([] { resolve_mechanism("softmax"); }, fragments);
  expect_error([] { resolve_mechanism("improved-clustered:cluster=3"); },
               {"no option 'cluster'", "accepted: clusters, bits, iterations, hash_bias, seed, advance_seed, topk"});
  expect_error([] { resolve_mechanism("sparse-local:stride=3"); }, {"no option 'stride'", "accepted: span"});
  expect_error([] { resolve_mechanism("clustered:clusters=0"); }, {"'clusters' must be >= 1"});
  expect_error([] { resolve_mechanism("linear:feature_map=relu"); }, {"relu"});
}

TEST(Registry, OptionsAreCheckedByTypeAndRange) {
  // Integers: a count needs >= 1, a seed or an iteration count may be 0.
  EXPECT_NO_THROW(resolve_mechanism("clustered:seed=0,iterations=0"));
  expect_error([] { resolve_mechanism("clustered:bits=64"); }, {"'bits'", "must be in [1, 63]", "64"});
  expect_error([] { resolve_mechanism("clustered:clusters=2.5"); }, {"'clusters'", "integer", "'2.5'"});
  expect_error([] { resolve_mechanism("sparse-local:span=0"); }, {"'span'", "must be >= 1"});
  // Numbers: finite and in range.
  EXPECT_NO_THROW(resolve_mechanism("linear:eps=0"));
  expect_error([] { resolve_mechanism("linear:eps=-1e-3"); }, {"'eps'", "must be >= 0"});
  expect_error([] { resolve_mechanism("agglomerative:clip=nan"); }, {"'clip'", "finite"});
  // Ranges are the ops': clip must be positive, K-means iterations are capped.
  expect_error([] { resolve_mechanism("agglomerative:clip=0"); }, {"'clip'", "must be > 0"});
  expect_error([] { resolve_mechanism("clustered:iterations=5000"); }, {"'iterations'", "in [0, 1000]"});
  // Booleans and choices name what they accept.
  expect_error([] { resolve_mechanism("clustered:hash_bias=yes"); }, {"'hash_bias'", "true or false"});
  expect_error([] { resolve_mechanism("sac:variant=tree"); },
               {"'variant'", "shared, all-connected, head-adaptive", "'tree'"});
  // Checks across options: the entry's validate.
  expect_error([] { resolve_mechanism("sac:reward=edge"); }, {"reward=edge", "all-connected"});
  EXPECT_NO_THROW(resolve_mechanism("sac:reward=edge,variant=all-connected"));
}

TEST(Registry, DefaultsAreTheOpsAndModulesDefaults) {
  // One copy of each default: the registry reads the ops' and modules' options.
  auto default_of = [](const std::string& mechanism, const std::string& key) {
    for (const auto& o : find_mechanism(mechanism).options)
      if (o.key == key) return o.default_value;
    ADD_FAILURE() << mechanism << " has no option " << key;
    return std::string();
  };
  const ClusteredAttentionFuncOptions op;
  EXPECT_EQ(default_of("clustered", "clusters"), std::to_string(op.clusters()));
  EXPECT_EQ(default_of("clustered", "bits"), std::to_string(op.bits()));
  EXPECT_EQ(default_of("improved-clustered", "iterations"), std::to_string(op.iterations()));
  EXPECT_EQ(default_of("clustered", "advance_seed"),
            ClusteredAttentionOptions().advance_seed() ? "true" : "false");
  EXPECT_EQ(default_of("linear", "eps"), "1e-6");
  EXPECT_EQ(std::stod(default_of("linear", "eps")), LinearAttentionFuncOptions().eps());
  EXPECT_EQ(std::stod(default_of("agglomerative", "clip")), AgglomerativeAttentionFuncOptions().clip());
  EXPECT_EQ(default_of("sac", "hidden"), std::to_string(SacOptions().hidden));
}

// (That `attnkit mechanisms` lists every entry and option with its default:
// tests/python/test_models.py, test_cli_mechanisms_table_lists_every_option.)
TEST(Registry, EveryEntryIsComplete) {
  for (const auto& m : mechanisms()) {
    SCOPED_TRACE(m.name);
    EXPECT_TRUE(m.sample && m.run && m.reference);
    EXPECT_FALSE(m.inputs.empty());
    // Edge-list mechanisms say so (bench's ns/edge, eval's edges per node).
    EXPECT_EQ(static_cast<bool>(m.edges), m.name.rfind("sparse-", 0) == 0 || m.name == "sac");
    for (const auto& o : m.options) {
      EXPECT_FALSE(o.type_name().empty()) << o.key;
      EXPECT_FALSE(o.help.empty()) << o.key;
      if (o.type == MechanismOption::Type::choice)
        EXPECT_NE(std::find(o.choices.begin(), o.choices.end(), o.default_value), o.choices.end()) << o.key;
    }
    // Defaults written in the table are what the entry uses: resolving them is a no-op.
    std::string spec = m.name;
    for (const auto& o : m.options) spec += (spec == m.name ? ":" : ",") + o.key + "=" + o.default_value;
    EXPECT_NO_THROW(resolve_mechanism(spec));
  }
}

// What the builder and the CLI ask the registry instead of comparing names
// (issue 47): one exact entry with a torch baseline, the layer kind, the
// model's structures, the nodes a pattern adds, the default lists.
TEST(Registry, EntriesSayWhatTheBuilderAndTheCliAsk) {
  const auto& exact = exact_mechanism();
  EXPECT_EQ(exact.name, "full");
  EXPECT_TRUE(exact.torch_baseline);
  EXPECT_EQ(mechanism_names_where([](const MechanismInfo& m) { return m.exact; }), "full");
  EXPECT_EQ(mechanism_names_where([](const MechanismInfo& m) { return m.layer == MechanismLayer::class_projections; }),
            "agglomerative");
  // A mechanism with its own layer has no per-head module, and the reverse.
  for (const auto& m : mechanisms())
    EXPECT_EQ(m.layer == MechanismLayer::class_projections, !m.make) << m.name;
  EXPECT_EQ(mechanism_names_where([](const MechanismInfo& m) { return m.model_structures; }), "sac");
  EXPECT_EQ(mechanism_names_where([](const MechanismInfo& m) { return static_cast<bool>(m.node_spans); }),
            "sparse-bp-tree, sparse-star");
  // Star's relay spans every token; bp-tree's t - 1 span nodes over t = 4
  // tokens are the root and its two halves.
  EXPECT_EQ(find_mechanism("sparse-star").node_spans(5), (NodeSpans{{0, 5}}));
  auto spans = find_mechanism("sparse-bp-tree").node_spans(4);
  std::sort(spans.begin(), spans.end());
  EXPECT_EQ(spans, (NodeSpans{{0, 2}, {0, 4}, {2, 4}}));
  EXPECT_TRUE(find_mechanism("sparse-bp-tree").node_spans(1).empty());
  for (auto which : {DefaultSpecs::bench, DefaultSpecs::model_train, DefaultSpecs::model_generate}) {
    EXPECT_FALSE(default_specs(which).empty());
    for (const auto& spec : default_specs(which)) EXPECT_NO_THROW(resolve_mechanism(spec)) << spec;
  }
}

// The one list of MechanismSupports' fields: distinct keys and letters, a
// default MechanismSupports reads false / none in each, and every field is
// set by some mechanism (a field no entry sets would be a dead column).
TEST(Registry, SupportFieldsAreOneListOfDistinctColumns) {
  std::vector<std::string> keys;
  std::string letters;
  for (const auto& f : support_fields()) {
    SCOPED_TRACE(f.key);
    keys.push_back(f.key);
    EXPECT_FALSE(f.help.empty());
    const auto off = f.value(MechanismSupports{});
    EXPECT_TRUE(off == "false" || off == "none") << off;
    for (const auto& l : f.letters) {
      EXPECT_EQ(letters.find(l.letter), std::string::npos) << l.letter;
      letters += l.letter;
    }
    EXPECT_FALSE(mechanism_names_where([&](const MechanismInfo& m) { return f.value(m.supports) != off; }).empty());
  }
  auto sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
  EXPECT_EQ(keys.size(), 9u);  // MechanismSupports' nine members: a new member needs a field here
}

/// The functional form in float64 equals the entry's definition, for every
/// mechanism, on the shapes each supports (L != S and M != E where allowed,
/// causal where allowed). Clustered forms use the same seed on both sides.
TEST(Registry, EveryMechanismMatchesItsFloat64Definition) {
  for (const auto& m : mechanisms()) {
    SCOPED_TRACE(m.name);
    torch::manual_seed(5);
    AttentionShape s{2, 2, 7, m.supports.cross ? 9 : 7, 4, m.supports.value_dim ? 3 : 4};
    if (m.name == "sparse-bp-tree") s.L = s.S = 7;   // 2t - 1 nodes
    const auto spec = resolve_mechanism(m.name).second;
    const auto x = m.sample(s, torch::kDouble);
    for (bool causal : {false, true}) {
      if (causal && !m.supports.causal) continue;
      const AttendArgs args{causal, {}};
      EXPECT_LT(testing::rel_err(m.run(x, args, spec), m.reference(x, args, spec)), 1e-10)
          << (causal ? "causal" : "non-causal");
    }
  }
}

TEST(Registry, NoneIsEachPositionsOwnValue) {
  // The control without attention: out_i = v_i, 0 for padded positions, no
  // gradient to queries or keys; its decoding state gives the same rows.
  torch::manual_seed(3);
  auto q = torch::randn({2, 2, 5, 4}, f64()).requires_grad_();
  auto k = torch::randn({2, 2, 5, 4}, f64()).requires_grad_();
  auto v = torch::randn({2, 2, 5, 3}, f64()).requires_grad_();
  const auto lengths = torch::tensor({5, 3}, torch::kLong);
  auto out = make_mechanism("none")->forward(q, k, v, {false, lengths});
  EXPECT_TRUE(torch::equal(out[0], v[0]));
  EXPECT_TRUE(torch::equal(out[1].slice(1, 0, 3), v[1].slice(1, 0, 3)));
  EXPECT_TRUE(torch::equal(out[1].slice(1, 3), torch::zeros({2, 2, 3}, f64())));
  const auto& info = find_mechanism("none");
  const auto spec = resolve_mechanism("none").second;
  for (bool causal : {false, true})
    EXPECT_LT(testing::rel_err(info.run({q, k, v}, {causal, lengths}, spec),
                               info.reference({q, k, v}, {causal, lengths}, spec)),
              1e-12);
  out.sum().backward();
  EXPECT_FALSE(q.grad().defined() && q.grad().abs().max().item<double>() != 0.0);
  EXPECT_FALSE(k.grad().defined() && k.grad().abs().max().item<double>() != 0.0);
  auto seen = torch::ones_like(v);
  seen[1].slice(1, 3).zero_();
  EXPECT_TRUE(torch::equal(v.grad(), seen));
  auto state = info.start_decoding(spec);
  for (int64_t t = 0; t < 5; ++t) {
    const auto row = [t](const torch::Tensor& x) { return x.select(2, t).detach(); };
    EXPECT_TRUE(torch::equal(state->step(row(q), row(k), row(v)), row(v)));
  }
  EXPECT_EQ(state->steps(), 5);
  expect_error([&] { make_mechanism("none")->forward(q, k.slice(2, 0, 4), v.slice(2, 0, 4)); }, {"none"});
}

TEST(Registry, ModulesHonourSupportsAndCarryClusteredState) {
  auto q = torch::randn({1, 2, 5, 4}), k = torch::randn({1, 2, 6, 4});
  expect_error([&] { make_mechanism("sparse-local")->forward(q, k, k); }, {"sparse-local", "L == S"});
  expect_error([&] { make_mechanism("clustered")->forward(q, k, k, {true, {}}); }, {"clustered", "causal"});
  expect_error([&] { make_mechanism("linear")->forward(q, k, k, {false, torch::tensor({3}, torch::kLong)}); },
               {"linear", "key_lengths"});
  // Clustered modules advance their seed per training-mode call (fresh LSH
  // planes per step) and keep the count in their state_dict.
  auto m = make_mechanism("clustered:clusters=2,bits=8");
  m->train();
  auto a = m->forward(q, q, q), b = m->forward(q, q, q);
  auto buffers = m->named_buffers();
  ASSERT_TRUE(buffers.contains("clustered.calls"));
  EXPECT_EQ(buffers["clustered.calls"].item<int64_t>(), 2);
  m->eval();
  auto c = m->forward(q, q, q), d = m->forward(q, q, q);
  EXPECT_TRUE(torch::equal(c, d)) << "eval calls use the fixed seed";
  EXPECT_EQ(buffers["clustered.calls"].item<int64_t>(), 2);
  // MultiheadAttention holds the mechanism as a submodule, so its state is saved.
  MultiheadAttention mha(MultiheadAttentionOptions(8, 2).attention("clustered:clusters=2"));
  EXPECT_TRUE(mha->named_buffers().contains("attention.clustered.calls"));
}

}  // namespace
}  // namespace attnkit::nn::registry_test

namespace attnkit::nn::registry_test {
namespace {

/// MultiheadAttention end to end on the float32 kernels (projections on
/// attnkit::linear, attention on each mechanism's kernel) against the same
/// module in float64 (composites): output and every parameter gradient.
/// Clustered mechanisms are left out here: float32 and float64 hashing may
/// put a query on different sides of a plane (tests/ops/clustered_attention_op_test.cpp and
/// tests/kernels/clustered_attention_kernel_test.cpp cover them).
TEST(MultiheadFloat32, KernelsEndToEndMatchFloat64) {
  for (const auto& info : mechanisms()) {
    if (!info.make || info.approximates_exact) continue;
    SCOPED_TRACE(info.name);
    torch::manual_seed(11);
    const int64_t N = 2, L = info.name == "sparse-bp-tree" ? 15 : 13, D = 16, H = 2;
    MultiheadAttention m32(MultiheadAttentionOptions(D, H).attention(info.name));
    auto m64 = std::dynamic_pointer_cast<MultiheadAttentionImpl>(m32->clone());
    m64->to(torch::kDouble);
    auto x32 = torch::randn({N, L, D});
    auto x64 = x32.to(torch::kDouble);
    auto y32 = m32->forward(x32, x32, x32), y64 = m64->forward(x64, x64, x64);
    EXPECT_LT(testing::rel_err(y32, y64), 1e-5);
    auto cot = torch::randn(y32.sizes());
    (y32 * cot).sum().backward();
    (y64 * cot.to(torch::kDouble)).sum().backward();
    // Errors relative to the largest gradient of the module: k_proj.bias has a
    // zero gradient under softmax mechanisms (a shift of every key's score in a
    // row), which float32 rounds to ~1e-8 and a per-tensor ratio would inflate.
    // A parameter outside the graph (`none`'s query and key projections) has
    // no gradient in either precision: zeros on both sides.
    const auto grad = [](const torch::Tensor& p) {
      return p.grad().defined() ? p.grad().to(torch::kDouble) : torch::zeros_like(p, torch::kDouble);
    };
    auto p32 = m32->named_parameters(), p64 = m64->named_parameters();
    double scale = 0;
    for (const auto& p : p64) scale = std::max(scale, testing::max_abs(grad(p.value())));
    for (const auto& p : p32) {
      SCOPED_TRACE(p.key());
      EXPECT_EQ(p.value().grad().defined(), p64[p.key()].grad().defined());
      const double err = testing::max_abs(grad(p.value()) - grad(p64[p.key()]));
      EXPECT_LT(err / scale, 1e-5);
    }
  }
}

}  // namespace
}  // namespace attnkit::nn::registry_test

namespace attnkit::nn::registry_test {
namespace {

TEST(MultiheadClone, KeepsTheSwappedMechanismAndItsState) {
  torch::manual_seed(12);
  MultiheadAttention m(MultiheadAttentionOptions(8, 2));
  m->set_attention("clustered:clusters=2,bits=8");
  EXPECT_EQ(m->options.attention(), "clustered:clusters=2,bits=8");
  m->train();
  auto x = torch::randn({1, 5, 8});
  m->forward(x, x, x);
  m->forward(x, x, x);
  auto c = std::dynamic_pointer_cast<MultiheadAttentionImpl>(m->clone());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->options.attention(), "clustered:clusters=2,bits=8");
  auto calls = c->named_buffers()["attention.clustered.calls"];
  EXPECT_EQ(calls.item<int64_t>(), 2) << "the copy continues the seed sequence";
  // Same parameters, same next seed: the same output; and the copy is independent.
  EXPECT_TRUE(torch::equal(c->forward(x, x, x), m->forward(x, x, x)));
  c->forward(x, x, x);
  EXPECT_EQ(m->named_buffers()["attention.clustered.calls"].item<int64_t>(), 3);
  EXPECT_EQ(calls.item<int64_t>(), 4);
}

/// The float32 functional form (kernels) against the float64 definition, with
/// L == S and L != S where supported; clustered forms are covered by their own
/// tests (float32 and float64 hashing may split a query differently).
TEST(Registry, Float32FormsMatchTheirFloat64Definitions) {
  for (const auto& m : mechanisms()) {
    if (m.approximates_exact) continue;
    for (const bool cross : {false, true}) {
      if (cross && !m.supports.cross) continue;
      SCOPED_TRACE(m.name + (cross ? " L != S" : " L == S"));
      torch::manual_seed(6);
      AttentionShape s{2, 2, 7, cross ? 9 : 7, 8, m.supports.value_dim ? 5 : 8};
      const auto spec = resolve_mechanism(m.name).second;
      const auto x64 = m.sample(s, torch::kDouble);
      MechanismInputs x32;
      for (const auto& t : x64) x32.push_back(t.to(torch::kFloat));
      for (const bool causal : {false, true}) {
        if (causal && !m.supports.causal) continue;
        const AttendArgs args{causal, {}};
        // float32 takes each op's kernel; `none` has none to take (its
        // output is a copy of the values).
        if (m.name != "none") EXPECT_EQ(m.dispatch(x32, args, spec).backend, Backend::kernel);
        EXPECT_LT(testing::rel_err(m.run(x32, args, spec), m.reference(x64, args, spec)), 1e-5)
            << (causal ? "causal" : "non-causal");
      }
    }
  }
}

}  // namespace
}  // namespace attnkit::nn::registry_test

namespace attnkit::nn::registry_test {
namespace {

TEST(Registry, ExactFlopsCountTheVisiblePairs) {
  // 2 (E + M) flops per visible (query, key) pair; E = 3, M = 2.
  const auto& full = find_mechanism("full");
  const MechanismSpec spec = MechanismSpec::parse("full");
  auto flops = [&](int64_t L, int64_t S, bool causal) {
    return *full.flops(AttentionShape{1, 1, L, S, 3, 2}, causal, spec) / (2.0 * 5);
  };
  EXPECT_EQ(flops(4, 6, false), 24);
  EXPECT_EQ(flops(4, 4, true), 10);  // 1 + 2 + 3 + 4
  EXPECT_EQ(flops(1, 5, true), 5);   // one query over a cache sees every key
  EXPECT_EQ(flops(2, 5, true), 9);   // 4 + 5
  EXPECT_EQ(flops(5, 3, true), 6);   // 0 + 0 + 1 + 2 + 3
}

}  // namespace
}  // namespace attnkit::nn::registry_test

namespace attnkit::nn::registry_test {
namespace {

TEST(Registry, SparseEntriesReuseTheRightCachedEdgeList) {
  // The entries keep their last few edge lists by (length, spec): cycling
  // through more lengths and specs than they keep, every call must still
  // attend over its own pattern, bitwise as a fresh list gives.
  const auto& local = find_mechanism("sparse-local");
  torch::manual_seed(12);
  for (int round = 0; round < 2; ++round)
    for (const int64_t n : {5, 9, 13, 17, 21, 5})
      for (const int64_t span : {1, 3}) {
        SCOPED_TRACE("n " + std::to_string(n) + " span " + std::to_string(span));
        const auto spec = MechanismSpec::parse("sparse-local:span=" + std::to_string(span));
        const auto x = local.sample(AttentionShape{1, 2, n, n, 4, 4}, torch::kFloat);
        const auto got = local.run(x, AttendArgs{}, spec);
        const auto want = sparse_attention(x[0], x[1], x[2], edges::local(n, span));
        EXPECT_TRUE(torch::equal(got, want));
        const auto fresh = local.edges(n, spec);
        EXPECT_TRUE(torch::equal(fresh.columns, edges::local(n, span).columns));
      }
}

}  // namespace
}  // namespace attnkit::nn::registry_test
