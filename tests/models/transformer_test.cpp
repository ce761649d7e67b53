// The transformer builder: token-by-token decoding equals the causal forward
// for every mechanism that decodes, the builder's refusals, options as JSON,
// swapping mechanisms into a built model, generation.
#include <attnkit/models/transformer.h>
#include <attnkit/nn/registry.h>

#include "models/decoding_util.h"
#include "test_util.h"

namespace attnkit::models::transformer_test {
namespace {

using attnkit::testing::expect_error;
using attnkit::testing::decode_all;
using attnkit::testing::rel_err;

TransformerOptions small(int64_t vocab = 11) {
  return TransformerOptions(vocab).layers(2).width(16).heads(2).ffn(24).dropout(0).max_length(64);
}

/// Every registry mechanism that can decode, with options small enough that a
/// 13-token sequence exercises its window.
std::vector<std::string> decodable_specs() {
  std::vector<std::string> specs;
  for (const auto& m : nn::mechanisms()) {
    if (!nn::usable_in_decoder(m) || !m.supports.decoding_state) continue;
    if (m.name == "sparse-local-causal") specs.push_back("sparse-local-causal:span=3");
    else if (m.name == "sparse-segments-causal") specs.push_back("sparse-segments-causal:segment=4");
    else if (m.name == "sparse-strided") specs.push_back("sparse-strided:stride=3");
    else if (m.name == "agglomerative") specs.push_back("agglomerative:classes=4");
    else specs.push_back(m.name);
  }
  return specs;
}

class DecodingEqualsForward : public ::testing::TestWithParam<std::string> {};

// Tolerances: float64 1e-10 and float32 1e-5 relative to the largest logit;
// the two paths compute the same sums in different orders (and the float32
// forward runs the blocked kernels, the steps one query at a time).
TEST_P(DecodingEqualsForward, EveryPositionMatches) {
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    for (auto positions : {Positions::sinusoidal, Positions::conv, Positions::learned,
                           Positions::conv | Positions::learned}) {
      for (auto norm : {Norm::pre, Norm::post}) {
        torch::manual_seed(3);
        Transformer model(small().attention({GetParam()}).positions(positions).norm(norm).conv_width(3));
        model->to(dtype);
        model->eval();
        auto tokens = torch::randint(0, 11, {2, 13}, torch::kLong);
        auto full = model->forward(tokens);
        auto stepped = decode_all(model, tokens);
        const double tol = dtype == torch::kFloat64 ? 1e-10 : 1e-5;
        EXPECT_LE(rel_err(stepped, full), tol)
            << GetParam() << " " << c10::toString(dtype) << " positions " << to_string(positions)
            << " norm " << to_string(norm);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Mechanisms, DecodingEqualsForward, ::testing::ValuesIn(decodable_specs()),
                         [](const auto& info) {
                           std::string name = info.param.substr(0, info.param.find(':'));
                           for (auto& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

TEST(Transformer, EveryDecoderCapableMechanismDecodes) {
  // The registry promises a decoding state for every mechanism a decoder accepts.
  for (const auto& m : nn::mechanisms())
    if (nn::usable_in_decoder(m)) EXPECT_TRUE(m.supports.decoding_state) << m.name;
}

TEST(Transformer, DecodingMatchesForRelativePositionsMixedBlocksAndSharedWeights) {
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const double tol = dtype == torch::kFloat64 ? 1e-10 : 1e-5;
    std::vector<TransformerOptions> variants{
        small().positions(Positions::relative).relative_clip(3),
        small().positions(Positions::conv | Positions::sinusoidal | Positions::relative).relative_clip(3).conv_width(2),
        small().layers(3).attention({"full", "causal-linear", "agglomerative:classes=2"}),
        small().layers(3).shared_weights(true).attention({"agglomerative"}).positions(Positions::conv),
        small().positions(Positions::none).tie_embeddings(false),
    };
    for (const auto& options : variants) {
      torch::manual_seed(5);
      Transformer model(options);
      model->to(dtype);
      model->eval();
      auto tokens = torch::randint(0, 11, {2, 9}, torch::kLong);
      EXPECT_LE(rel_err(decode_all(model, tokens), model->forward(tokens)), tol) << options.to_json();
    }
  }
}

TEST(Transformer, EncoderDecoderDecodingMatchesForward) {
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    torch::manual_seed(7);
    Transformer model(small(9).architecture(Architecture::encoder_decoder).source_vocab_size(13));
    model->to(dtype);
    model->eval();
    auto source = torch::randint(0, 13, {2, 6}, torch::kLong);
    auto tokens = torch::randint(0, 9, {2, 5}, torch::kLong);
    auto full = model->forward(tokens, source);
    EXPECT_EQ(full.sizes(), torch::IntArrayRef({2, 5, 9}));
    EXPECT_LE(rel_err(decode_all(model, tokens, source), full), dtype == torch::kFloat64 ? 1e-10 : 1e-5);
  }
}

TEST(Transformer, CausalModelsDoNotSeeTheFuture) {
  for (const auto& spec : decodable_specs()) {
    torch::manual_seed(1);
    Transformer model(small().attention({spec}));
    model->to(torch::kFloat64);
    model->eval();
    auto a = torch::randint(0, 11, {1, 10}, torch::kLong);
    auto b = a.clone();
    b.index_put_({0, 7}, (a.index({0, 7}) + 1) % 11);
    auto la = model->forward(a), lb = model->forward(b);
    EXPECT_LE(rel_err(lb.narrow(1, 0, 7), la.narrow(1, 0, 7)), 1e-12) << spec;
    EXPECT_GT(rel_err(lb.narrow(1, 7, 3), la.narrow(1, 7, 3)), 1e-6) << spec;
  }
}

TEST(Transformer, DecodesPastTheFirstCacheBuffers) {
  torch::manual_seed(2);
  Transformer model(small().layers(1).attention({"sparse-local-causal:span=8"}).positions(Positions::none));
  model->eval();
  torch::NoGradGuard no_grad;
  auto state = model->start_decoding(1);
  for (int64_t t = 0; t < 1000; ++t) model->step(torch::tensor({t % 11}, torch::kLong), state);
  EXPECT_EQ(state.position(), 1000);
  // (The window's memory bound is tested on the state itself: tests/nn/decoding_test.cpp.)
  auto generated = model->generate(torch::zeros({1, 1}, torch::kLong),
                                   GenerateOptions().tokens(500).temperature(0));
  EXPECT_EQ(generated.size(1), 501);
}

TEST(Transformer, BuilderRefusesImpossibleCombinations) {
  expect_error([] { Transformer(small().attention({"clustered"})); },
               {"clustered", "cannot serve a decoder", "full"});
  expect_error([] { Transformer(small().width(18).heads(4)); }, {"width (18)", "heads (4)"});
  expect_error([] { Transformer(small().attention({"agglomerative:classes=3"})); },
               {"3 classes", "width 16"});
  expect_error([] { Transformer(small().layers(3).attention({"full", "full"})); },
               {"one per block (3)", "got 2"});
  expect_error([] { Transformer(small().positions(Positions::relative).attention({"causal-linear"})); },
               {"relative positions", "'full'"});
  expect_error([] { Transformer(small().architecture(Architecture::encoder).attention({"sparse-bp-tree", "full"})); },
               {"adds nodes of its own", "every block"});
  expect_error([] { Transformer(small().attention({"sparse-star"})); }, {"sparse-star", "cannot serve a decoder"});
  expect_error([] { Transformer(small().shared_weights(true).attention({"full", "full"})); },
               {"shared weights", "one attention spec"});
  expect_error([] { Transformer(small().attention({"fast"})); }, {"unknown attention mechanism 'fast'"});
  expect_error([] { Transformer(small().dropout(1)); }, {"dropout"});
  expect_error([] { Transformer(small().architecture(Architecture::encoder_decoder).cross_attention("agglomerative")); },
               {"cross-attention 'agglomerative'"});
  // The encoder takes non-causal mechanisms.
  Transformer encoder(small().architecture(Architecture::encoder).attention({"improved-clustered:clusters=3"}));
  EXPECT_EQ(encoder->forward(torch::randint(0, 11, {2, 7}, torch::kLong)).sizes(),
            torch::IntArrayRef({2, 7, 11}));
  expect_error([&] { encoder->start_decoding(1); }, {"encoder", "does not decode"});
}

TEST(Transformer, BadTokensAndLengthsAreRefused) {
  Transformer model(small().max_length(8));
  expect_error([&] { model->forward(torch::full({1, 3}, 11, torch::kLong)); },
               {"'tokens'", "outside the vocabulary [0, 11)"});
  expect_error([&] { model->forward(torch::zeros({1, 3}, torch::kInt)); }, {"int64 token ids"});
  expect_error([&] { model->forward(torch::zeros({1, 9}, torch::kLong)); }, {"max_length 8"});
  expect_error([&] { model->generate(torch::zeros({1, 4}, torch::kLong), GenerateOptions().tokens(5)); },
               {"exceed max_length 8"});
  auto state = model->start_decoding(2);
  expect_error([&] { model->step(torch::zeros({3}, torch::kLong), state); }, {"decodes 2 streams"});
}

TEST(Transformer, PositionSchemesComposeByName) {
  EXPECT_EQ(positions_from_string("none"), Positions::none);
  EXPECT_EQ(positions_from_string("learned+conv"), Positions::conv | Positions::learned);
  EXPECT_EQ(to_string(positions_from_string("relative+learned+conv")), "conv+learned+relative");
  for (const char* name : {"none", "sinusoidal", "learned", "relative", "conv", "conv+sinusoidal"})
    EXPECT_EQ(to_string(positions_from_string(name)), name);
  expect_error([] { positions_from_string("sinusoidal+learned"); }, {"two absolute tables"});
  expect_error([] { positions_from_string("conv+conv"); }, {"conv twice"});
  expect_error([] { positions_from_string("none+conv"); }, {"'none' stands alone"});
  expect_error([] { positions_from_string("conv+"); }, {"unknown position scheme ''"});
  expect_error([] { positions_from_string("rotary"); }, {"unknown position scheme 'rotary'", "conv, sinusoidal"});
  const auto o = small().positions(Positions::conv | Positions::learned);
  EXPECT_EQ(TransformerOptions::from_json(o.to_json()).positions(), o.positions());
  // Relative positions stay exact attention's, whatever they are combined with.
  expect_error([] {
    Transformer(small().architecture(Architecture::encoder).positions(Positions::conv | Positions::relative)
                    .attention({"sparse-local:span=2"}));
  }, {"need attention 'full'"});
}

TEST(Transformer, ConvolutionThenTableIsTheirComposition) {
  // conv+learned with a zero table computes what conv alone computes with the
  // same weights; a table that is not zero changes the logits of every position.
  for (auto architecture : {Architecture::decoder, Architecture::encoder}) {
    torch::manual_seed(6);
    Transformer conv(small().architecture(architecture).positions(Positions::conv).conv_width(3));
    Transformer both(small().architecture(architecture).positions(Positions::conv | Positions::learned).conv_width(3));
    conv->eval();
    both->eval();
    {
      torch::NoGradGuard no_grad;
      const auto source = conv->named_parameters();
      for (auto& p : both->named_parameters()) {
        if (p.key() == "positions") p.value().zero_();
        else p.value().copy_(source[p.key()]);
      }
    }
    const auto tokens = torch::randint(0, 11, {2, 9}, torch::kLong);
    EXPECT_LE(rel_err(both->forward(tokens), conv->forward(tokens)), 1e-6) << to_string(architecture);
    {
      torch::NoGradGuard no_grad;
      both->named_parameters()["positions"].normal_(0, 0.5);
    }
    const auto moved = (both->forward(tokens) - conv->forward(tokens)).abs().amax({0, 2});
    EXPECT_GT(moved.min().item<double>(), 1e-4) << to_string(architecture);
  }
}

TEST(Transformer, OptionsRoundTripThroughJson) {
  auto o = small().architecture(Architecture::encoder_decoder).source_vocab_size(5).layers(3)
               .attention({"full", "linear:feature_map=elu", "improved-clustered:clusters=4,topk=2"})
               .positions(Positions::learned).norm(Norm::post).tie_embeddings(false).dropout(0.25);
  const auto back = TransformerOptions::from_json(o.to_json());
  EXPECT_EQ(back.to_json(), o.to_json());
  EXPECT_EQ(back.attention(), o.attention());
  expect_error([] { TransformerOptions::from_json(R"({"layers": 2, "depth": 3})"); }, {"unknown key 'depth'"});
  expect_error([] { TransformerOptions::from_json(R"({"layers": "two"})"); }, {"key 'layers'", "wrong type"});
  expect_error([] { TransformerOptions::from_json("{"); }, {"not JSON"});
}

TEST(Transformer, SwappingKeepsWeightsAndRefusesWhatCannotCarryOver) {
  torch::manual_seed(4);
  Transformer model(small());
  model->eval();
  auto tokens = torch::randint(0, 11, {2, 12}, torch::kLong);
  const auto before = model->forward(tokens);
  const auto params = model->parameter_count();
  for (const auto& spec : decodable_specs()) {
    if (spec.rfind("agglomerative", 0) == 0) continue;
    model->set_attention({spec});
    EXPECT_EQ(model->parameter_count(), params) << spec;
    EXPECT_TRUE(torch::isfinite(model->forward(tokens)).all().item<bool>()) << spec;
  }
  model->set_attention({"full"});
  EXPECT_LE(rel_err(model->forward(tokens), before), 1e-6);
  expect_error([&] { model->set_attention({"agglomerative"}); }, {"class projections"});
  expect_error([&] { model->set_attention({"clustered"}); }, {"cannot serve a decoder"});
  EXPECT_EQ(model->options().attention(), std::vector<std::string>{"full"});
}

TEST(Transformer, GenerateIsSeededAndGreedyFollowsTheArgmax) {
  torch::manual_seed(6);
  Transformer model(small());
  auto prompt = torch::randint(0, 11, {2, 3}, torch::kLong);
  auto a = model->generate(prompt, GenerateOptions().tokens(6).seed(1).top_k(4));
  auto b = model->generate(prompt, GenerateOptions().tokens(6).seed(1).top_k(4));
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_TRUE(torch::equal(a.narrow(1, 0, 3), prompt));
  EXPECT_TRUE(model->is_training());  // generate restores the mode
  auto greedy = model->generate(prompt, GenerateOptions().tokens(4).temperature(0));
  model->eval();
  auto logits = model->forward(greedy.narrow(1, 0, 6));
  EXPECT_TRUE(torch::equal(logits.argmax(-1).narrow(1, 2, 4), greedy.narrow(1, 3, 4)));
}

TEST(Transformer, TiedEmbeddingsAreCountedOnce) {
  Transformer tied(small()), untied(small().tie_embeddings(false));
  EXPECT_EQ(untied->parameter_count() - tied->parameter_count(), 16 * 11 + 11);
}

// The attention probe sees each multi-head self-attention's real inputs: one
// call per layer application in order (encoder first), with per-head shapes;
// a cleared probe is not called and never changed the outputs.
TEST(Transformer, AttentionProbeReportsEveryLayersInputs) {
  torch::manual_seed(6);
  auto tokens = torch::randint(0, 11, {2, 9}, torch::kLong);
  auto layers_seen = [&](Transformer& model, const torch::Tensor& source = {}) {
    std::vector<int64_t> layers;
    model->set_attention_probe([&](int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v) {
      layers.push_back(layer);
      EXPECT_EQ(q.sizes(), (std::vector<int64_t>{2, 2, 9, 8}));
      EXPECT_EQ(k.sizes(), q.sizes());
      EXPECT_EQ(v.sizes(), q.sizes());
    });
    model->forward(tokens, source);
    return layers;
  };
  Transformer encoder(small().architecture(Architecture::encoder).layers(3));
  EXPECT_EQ(layers_seen(encoder), (std::vector<int64_t>{0, 1, 2}));
  Transformer shared(small().layers(4).shared_weights(true));
  EXPECT_EQ(layers_seen(shared), (std::vector<int64_t>{0, 1, 2, 3}));
  Transformer seq2seq(small().architecture(Architecture::encoder_decoder).source_vocab_size(11));
  EXPECT_EQ(layers_seen(seq2seq, tokens), (std::vector<int64_t>{0, 1, 2, 3}));
  // Relative-position blocks are not multi-head blocks and are not reported.
  Transformer relative(small().positions(Positions::relative));
  EXPECT_TRUE(layers_seen(relative).empty());

  // Cleared: no more calls, and the outputs never depended on the probe.
  int calls = 0;
  encoder->set_attention_probe([&](int64_t, const torch::Tensor&, const torch::Tensor&,
                                   const torch::Tensor&) { ++calls; });
  const auto probed = encoder->forward(tokens);
  EXPECT_EQ(calls, 3);
  encoder->set_attention_probe({});
  EXPECT_TRUE(torch::equal(encoder->forward(tokens), probed));
  EXPECT_EQ(calls, 3);
}

TEST(Transformer, ExtraNodeSpansAreTheTreesSpans) {
  EXPECT_EQ(extra_node_spans("sparse-star", 6), (std::vector<std::pair<int64_t, int64_t>>{{0, 6}}));
  for (int64_t t : {1, 2, 5, 8}) {
    SCOPED_TRACE(t);
    const auto spans = extra_node_spans("sparse-bp-tree", t);
    ASSERT_EQ(static_cast<int64_t>(spans.size()), t - 1);
    if (t > 1) EXPECT_EQ(spans[0], (std::pair<int64_t, int64_t>{0, t}));  // the root
    // Pre-order binary partition: each span splits into two spans (or tokens).
    const auto edges = nn::pattern_edges("bp-tree", 2 * t - 1, 0);
    const auto off = edges.offsets.accessor<int64_t, 1>();
    const auto col = edges.columns.accessor<int64_t, 1>();
    auto span_of = [&](int64_t node) {
      return node < t ? std::pair<int64_t, int64_t>{node, node + 1} : spans[node - t];
    };
    for (int64_t s = 0; s + 1 < t; ++s) {
      // (A row's columns are sorted by node id, not by position.)
      auto left = span_of(col[off[t + s]]), right = span_of(col[off[t + s] + 1]);
      if (right.first < left.first) std::swap(left, right);
      EXPECT_EQ(left.second, right.first);
      EXPECT_EQ(spans[s], (std::pair<int64_t, int64_t>{left.first, right.second}));
    }
  }
}

TEST(Transformer, ExtraNodesAreTheMeansOfTheirSpans) {
  const auto x = torch::randn({2, 5, 3}, torch::kDouble);
  for (const std::string mechanism : {"sparse-bp-tree", "sparse-star"}) {
    SCOPED_TRACE(mechanism);
    const auto y = append_extra_nodes(x, mechanism);
    const auto spans = extra_node_spans(mechanism, 5);
    ASSERT_EQ(y.size(1), 5 + static_cast<int64_t>(spans.size()));
    EXPECT_EQ(attention_nodes(mechanism, 5), y.size(1));
    EXPECT_TRUE(torch::equal(y.narrow(1, 0, 5), x));
    for (size_t s = 0; s < spans.size(); ++s) {
      const auto [lo, hi] = spans[s];
      const auto mean = x.narrow(1, lo, hi - lo).mean(1);
      EXPECT_LT(rel_err(y.select(1, 5 + static_cast<int64_t>(s)), mean), 1e-14) << "extra node " << s;
    }
  }
  EXPECT_EQ(attention_nodes("full", 5), 5);
  // One token: a tree without spans, nothing appended.
  EXPECT_TRUE(torch::equal(append_extra_nodes(x.narrow(1, 0, 1), "sparse-bp-tree"), x.narrow(1, 0, 1)));
  Transformer tree(small().architecture(Architecture::encoder).attention({"sparse-bp-tree"}));
  EXPECT_EQ(tree->forward(torch::zeros({1, 1}, torch::kLong)).sizes(), (std::vector<int64_t>{1, 1, 11}));
}

// Encoders with BP-Transformer's span nodes or Star-Transformer's relay:
// the blocks attend over tokens and extra nodes, the extra nodes start as the
// means of their spans, the output keeps the tokens, and everything trains.
TEST(Transformer, PatternsThatAddNodesTrainInAnEncoder) {
  for (const std::string spec : {"sparse-bp-tree", "sparse-star"}) {
    SCOPED_TRACE(spec);
    torch::manual_seed(8);
    Transformer model(small().architecture(Architecture::encoder).attention({spec}).dropout(0));
    const int64_t t = 9, extra = spec == "sparse-star" ? 1 : t - 1;
    auto tokens = torch::randint(0, 11, {2, t}, torch::kLong);
    std::vector<int64_t> nodes;
    torch::Tensor first_v;
    model->set_attention_probe([&](int64_t layer, const torch::Tensor&, const torch::Tensor& k,
                                   const torch::Tensor& v) {
      nodes.push_back(k.size(2));
      if (layer == 0) first_v = v.detach();
    });
    const auto logits = model->forward(tokens);
    EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, t, 11}));
    EXPECT_EQ(nodes, (std::vector<int64_t>{t + extra, t + extra}));
    // Values are linear in the (pre-norm: normalised) node inputs, so no
    // closed form here; the spans' means are checked through append_extra_nodes'
    // effect: a token outside a span does not change that span node's value.
    auto changed = tokens.clone();
    changed[0][t - 1] = (changed[0][t - 1].item<int64_t>() + 1) % 11;
    torch::Tensor changed_v;
    model->set_attention_probe([&](int64_t layer, const torch::Tensor&, const torch::Tensor&,
                                   const torch::Tensor& v) {
      if (layer == 0) changed_v = v.detach();
    });
    model->forward(changed);
    const auto spans = extra_node_spans(spec, t);
    for (int64_t s = 0; s < extra; ++s) {
      const bool covers = spans[s].second == t;
      const bool same = torch::allclose(first_v[0].select(1, t + s), changed_v[0].select(1, t + s));
      EXPECT_EQ(same, !covers) << "extra node " << s;
    }
    model->set_attention_probe({});
    (logits * torch::randn_like(logits)).sum().backward();
    for (const auto& p : model->named_parameters())
      EXPECT_TRUE(p.value().grad().defined() && testing::max_abs(p.value().grad()) > 0) << p.key();
    expect_error([&] { model->set_attention({"full"}); }, {"adds nodes", "out"});
  }
  Transformer plain(small().architecture(Architecture::encoder));
  expect_error([&] { plain->set_attention({"sparse-star"}); }, {"adds nodes", "in"});
}

}  // namespace
}  // namespace attnkit::models::transformer_test
