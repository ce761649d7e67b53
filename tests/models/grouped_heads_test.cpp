// Grouped-query heads in the modules and the builder (kv_heads): a
// MultiheadAttention with kv_heads key/value heads equals the same module
// whose k and v projections are repeated over each group, for exact, linear
// and clustered attention (which read the groups in place) and for
// mechanisms that do not (the module repeats them); the KV cache of exact
// attention and the state of causal linear attention keep kv_heads heads;
// decoding equals the forward; options round-trip and old ones still load;
// the refusals name what is wrong.
#include <attnkit/models/transformer.h>
#include <attnkit/nn/decoding.h>
#include <attnkit/nn/multihead.h>

#include <algorithm>

#include "models/decoding_util.h"
#include "test_util.h"

namespace attnkit::grouped_heads_test {
namespace {

using testing::decode_all;
using testing::expect_error;
using testing::f64;
using testing::rel_err;

/// Two float64 routes through the same sums in another order: ~1e-15 apart.
constexpr double kSameMathTol = 1e-12;

/// A module with full heads whose k and v projections are `grouped`'s, each
/// key/value head's rows repeated over its group: what grouped-query
/// attention means, written with full heads.
nn::MultiheadAttention with_repeated_projections(nn::MultiheadAttention& grouped) {
  const auto& o = grouped->options;
  nn::MultiheadAttention full(nn::MultiheadAttentionOptions(o.width(), o.heads()).attention(o.attention()));
  full->to(torch::kDouble);
  const int64_t group = o.heads() / grouped->kv_head_count(), dh = o.width() / o.heads();
  torch::NoGradGuard no_grad;
  auto repeat_rows = [&](const torch::Tensor& w) {  // (Hk dh, ...) -> (H dh, ...)
    auto per_head = w.view({grouped->kv_head_count(), dh, -1});
    return per_head.repeat_interleave(group, 0).reshape({o.width(), -1}).squeeze(-1);
  };
  full->q_proj->weight.copy_(grouped->q_proj->weight);
  full->q_proj->bias.copy_(grouped->q_proj->bias);
  full->out_proj->weight.copy_(grouped->out_proj->weight);
  full->out_proj->bias.copy_(grouped->out_proj->bias);
  full->k_proj->weight.copy_(repeat_rows(grouped->k_proj->weight));
  full->k_proj->bias.copy_(repeat_rows(grouped->k_proj->bias.unsqueeze(-1)));
  full->v_proj->weight.copy_(repeat_rows(grouped->v_proj->weight));
  full->v_proj->bias.copy_(repeat_rows(grouped->v_proj->bias.unsqueeze(-1)));
  return full;
}

TEST(GroupedHeads, MultiheadAttentionEqualsRepeatedProjections) {
  const int64_t N = 2, D = 12, H = 6;
  // full, the linear, sparse and clustered mechanisms read the groups in
  // place; `none` gets them repeated by the module.
  for (const std::string spec : {"full", "linear", "causal-linear", "gated-linear", "sparse-local:span=2", "none",
                                 "improved-clustered:clusters=2,topk=3", "clustered:clusters=3"})
    for (int64_t Hk : {1, 2, 3, 6}) {
      SCOPED_TRACE(spec + " kv_heads " + std::to_string(Hk));
      torch::manual_seed(41);
      nn::MultiheadAttention grouped(nn::MultiheadAttentionOptions(D, H).kv_heads(Hk).attention(spec));
      grouped->to(torch::kDouble);
      EXPECT_EQ(grouped->k_proj->weight.sizes(), torch::IntArrayRef({Hk * D / H, D}));
      EXPECT_EQ(grouped->v_proj->weight.sizes(), torch::IntArrayRef({Hk * D / H, D}));
      auto full = with_repeated_projections(grouped);
      const bool cross = spec == "full" || spec == "linear";
      const int64_t L = 5, S = cross ? 7 : 5;
      auto query = torch::randn({N, L, D}, f64()), key = torch::randn({N, S, D}, f64());
      auto value = torch::randn({N, S, D}, f64());
      const bool causal = spec == "full";
      auto lengths = spec == "full" ? torch::tensor({S, S - 2}, torch::kLong) : torch::Tensor();
      EXPECT_LT(rel_err(grouped->forward(query, key, value, lengths, causal),
                        full->forward(query, key, value, lengths, causal)),
                kSameMathTol);
    }
}

TEST(GroupedHeads, GradientsEqualThoseOfRepeatedProjectionsSummedOverGroups) {
  const int64_t N = 2, L = 6, D = 8, H = 4, Hk = 2, dh = D / H;
  torch::manual_seed(42);
  nn::MultiheadAttention grouped(nn::MultiheadAttentionOptions(D, H).kv_heads(Hk));
  grouped->to(torch::kDouble);
  auto full = with_repeated_projections(grouped);
  auto x = torch::randn({N, L, D}, f64());
  auto upstream = torch::randn({N, L, D}, f64());
  (grouped->forward(x, x, x, {}, true) * upstream).sum().backward();
  (full->forward(x, x, x, {}, true) * upstream).sum().backward();
  EXPECT_LT(rel_err(grouped->q_proj->weight.grad(), full->q_proj->weight.grad()), kSameMathTol);
  // A shared key/value head's gradient is the sum of its copies'.
  auto summed = [&](const torch::Tensor& g) { return g.view({Hk, H / Hk, dh, -1}).sum(1).reshape({Hk * dh, -1}); };
  EXPECT_LT(rel_err(grouped->k_proj->weight.grad(), summed(full->k_proj->weight.grad())), kSameMathTol);
  EXPECT_LT(rel_err(grouped->v_proj->weight.grad(), summed(full->v_proj->weight.grad())), kSameMathTol);
  EXPECT_LT(rel_err(grouped->v_proj->bias.grad(), summed(full->v_proj->bias.grad().unsqueeze(-1)).squeeze(-1)),
            kSameMathTol);
}

TEST(GroupedHeads, MechanismsSayWhetherTheyReadGroups) {
  const auto& full = nn::find_mechanism("full");
  EXPECT_TRUE(full.supports.grouped_heads);
  for (const char* name : {"linear", "causal-linear", "gated-linear"})
    EXPECT_TRUE(nn::find_mechanism(name).supports.grouped_heads);
  // The sparse patterns and SAC read groups in the sparse kernel.
  EXPECT_TRUE(nn::find_mechanism("sparse-local").supports.grouped_heads);
  EXPECT_TRUE(nn::find_mechanism("sac").supports.grouped_heads);
  EXPECT_TRUE(nn::find_mechanism("clustered").supports.grouped_heads);
  EXPECT_FALSE(nn::find_mechanism("none").supports.grouped_heads);
  torch::manual_seed(43);
  auto q = torch::randn({1, 4, 3, 2}), k = torch::randn({1, 2, 3, 2}), v = torch::randn({1, 2, 3, 2});
  // A grouped call of a mechanism that reads groups equals repeated heads.
  for (const std::string spec :
       {"full", "linear", "causal-linear", "gated-linear", "sparse-local:span=1", "sparse-random:edges=2", "sac"}) {
    SCOPED_TRACE(spec);
    EXPECT_LT(rel_err(nn::attend(spec, q, k, v), nn::attend(spec, q, k.repeat_interleave(2, 1),
                                                            v.repeat_interleave(2, 1))),
              1e-6);
    EXPECT_LT(rel_err(nn::make_mechanism(spec)->forward(q, k, v),
                      nn::make_mechanism(spec)->forward(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))),
              1e-6);
  }
  // The float64 definitions of the linear mechanisms read the groups too.
  for (const char* name : {"linear", "causal-linear", "gated-linear"}) {
    const auto& info = nn::find_mechanism(name);
    const auto spec = nn::resolve_mechanism(name).second;
    const std::vector<torch::Tensor> x{q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble)};
    const std::vector<torch::Tensor> repeated{x[0], x[1].repeat_interleave(2, 1), x[2].repeat_interleave(2, 1)};
    EXPECT_LT(rel_err(info.reference(x, {}, spec), info.reference(repeated, {}, spec)), kSameMathTol) << name;
  }
  expect_error([&] { nn::attend("none", q, k, v); },
               {"none", "reads no grouped-query heads", "head count 4", "got 2"});
  expect_error([&] { nn::attend("full", q, k.narrow(1, 0, 1).expand({1, 3, 3, 2}), v); },
               {"head count 3", "must divide q's head count 4"});
}

TEST(GroupedHeads, KeyValueCacheHoldsTheKeyValueHeadsOnly) {
  torch::manual_seed(44);
  const int64_t N = 2, H = 4, Hk = 2, E = 3, T = 9;
  nn::CachedSoftmaxState grouped([](int64_t) { return int64_t{0}; });
  nn::CachedSoftmaxState repeated([](int64_t) { return int64_t{0}; });
  auto q = torch::randn({T, N, H, E}, f64()), k = torch::randn({T, N, Hk, E}, f64());
  auto v = torch::randn({T, N, Hk, E}, f64());
  for (int64_t t = 0; t < T; ++t) {
    auto a = grouped.step(q[t], k[t], v[t]);
    auto b = repeated.step(q[t], k[t].repeat_interleave(2, 1), v[t].repeat_interleave(2, 1));
    EXPECT_LT(rel_err(a, b), kSameMathTol) << "step " << t;
  }
  EXPECT_EQ(grouped.cache().keys().size(1), Hk);
  EXPECT_EQ(repeated.cache().keys().size(1), H);
  // The sparse patterns' states, window (local) and gathered (strided), get
  // the kv heads as they are: their caches hold Hk heads.
  for (const std::string spec : {"sparse-local-causal:span=2", "sparse-strided:stride=2"}) {
    SCOPED_TRACE(spec);
    const auto [info, parsed] = nn::resolve_mechanism(spec);
    auto state = info->start_decoding(parsed);
    auto again = info->start_decoding(parsed);
    for (int64_t t = 0; t < T; ++t) {
      auto a = state->step(q[t], k[t], v[t]);
      auto b = again->step(q[t], k[t].repeat_interleave(2, 1), v[t].repeat_interleave(2, 1));
      EXPECT_LT(rel_err(a, b), kSameMathTol) << "step " << t;
    }
    EXPECT_EQ(dynamic_cast<nn::CachedSoftmaxState&>(*state).cache().keys(T - 1).size(1), Hk);  // the last position
  }
}

TEST(GroupedHeads, EveryMechanismThatReadsGroupsDecodesThemInPlace) {
  // What `attnkit mechanisms` flags 'g' (grouped_heads) and the decoding state
  // agree on: a state of such a mechanism takes k and v with kv_heads heads
  // and steps to what repeating them gives.
  torch::manual_seed(48);
  const int64_t N = 2, H = 4, Hk = 2, E = 3, T = 6;
  std::vector<std::string> decoders;
  for (const auto& info : nn::mechanisms()) {
    if (!info.supports.grouped_heads || !info.start_decoding) continue;
    SCOPED_TRACE(info.name);
    decoders.push_back(info.name);
    const auto spec = nn::resolve_mechanism(info.name).second;
    auto grouped = info.start_decoding(spec), repeated = info.start_decoding(spec);
    auto q = torch::randn({T, N, H, E}, f64()), k = torch::randn({T, N, Hk, E}, f64());
    auto v = torch::randn({T, N, Hk, E}, f64());
    for (int64_t t = 0; t < T; ++t)
      EXPECT_LT(rel_err(grouped->step(q[t], k[t], v[t]),
                        repeated->step(q[t], k[t].repeat_interleave(2, 1), v[t].repeat_interleave(2, 1))),
                kSameMathTol)
          << "step " << t;
  }
  for (const char* name : {"full", "linear", "causal-linear", "gated-linear"})
    EXPECT_NE(std::find(decoders.begin(), decoders.end(), name), decoders.end()) << name;
}

models::TransformerOptions small_grouped(int64_t kv_heads) {
  return models::TransformerOptions(11).layers(2).width(16).heads(4).kv_heads(kv_heads).ffn(24).dropout(0).max_length(64);
}

// Tolerances as tests/models/transformer_test.cpp's: the same sums in another
// order (blocked kernels against one query at a time).
TEST(GroupedHeads, DecodingEqualsTheForward) {
  for (auto dtype : {torch::kFloat64, torch::kFloat32})
    for (const std::string spec : {"full", "causal-linear", "sparse-local-causal:span=3"})
      for (int64_t Hk : {1, 2}) {
        SCOPED_TRACE(spec + " kv_heads " + std::to_string(Hk) + " " + c10::toString(dtype));
        torch::manual_seed(45);
        models::Transformer model(small_grouped(Hk).attention({spec}));
        model->to(dtype);
        model->eval();
        auto tokens = torch::randint(0, 11, {2, 13}, torch::kLong);
        EXPECT_LE(rel_err(decode_all(model, tokens), model->forward(tokens)),
                  dtype == torch::kFloat64 ? 1e-10 : 1e-5);
      }
  // An encoder-decoder: the cross-attention's projected encoder output has kv_heads heads too.
  torch::manual_seed(46);
  models::Transformer model(small_grouped(2).architecture(models::Architecture::encoder_decoder).source_vocab_size(13));
  model->to(torch::kDouble);
  model->eval();
  auto source = torch::randint(0, 13, {2, 6}, torch::kLong);
  auto tokens = torch::randint(0, 11, {2, 5}, torch::kLong);
  EXPECT_LE(rel_err(decode_all(model, tokens, source), model->forward(tokens, source)), 1e-10);
}

TEST(GroupedHeads, FewerParametersAndTheSameAsFullHeadsWhenEqual) {
  torch::manual_seed(47);
  models::Transformer full(small_grouped(0)), grouped(small_grouped(1));
  // Two layers, each k and v projection 16 x 16 + 16 -> 16 x 4 + 4.
  EXPECT_EQ(full->parameter_count() - grouped->parameter_count(), 2 * 2 * (16 * 12 + 12));
  torch::manual_seed(47);
  models::Transformer same(small_grouped(4));
  EXPECT_EQ(same->parameter_count(), full->parameter_count());
}

TEST(GroupedHeads, OptionsRoundTripAndOldOptionsLoad) {
  const auto o = small_grouped(2);
  EXPECT_NE(o.to_json().find("\"kv_heads\":2"), std::string::npos);
  EXPECT_EQ(models::TransformerOptions::from_json(o.to_json()).kv_heads(), 2);
  // Without grouped heads the JSON is what it was before the option existed,
  // and such JSON (every checkpoint written before) loads with full heads.
  const auto plain = small_grouped(0).to_json();
  EXPECT_EQ(plain.find("kv_heads"), std::string::npos);
  EXPECT_EQ(models::TransformerOptions::from_json(plain).kv_heads(), 0);
}

TEST(GroupedHeads, RefusalsNameTheProblem) {
  expect_error([] { models::Transformer m(small_grouped(3)); }, {"kv_heads (3) must divide heads (4)"});
  expect_error([] { models::Transformer m(small_grouped(2).positions(models::Positions::relative)); },
               {"kv_heads = 2", "relative positions"});
  expect_error([] { models::Transformer m(small_grouped(2).attention({"agglomerative"})); },
               {"kv_heads = 2", "agglomerative"});
  expect_error([] { nn::MultiheadAttention m(nn::MultiheadAttentionOptions(8, 4).kv_heads(3)); },
               {"kv_heads (3) must divide heads (4)"});
  // kv_heads equal to heads is plain multi-head attention: allowed everywhere.
  EXPECT_NO_THROW(models::Transformer(small_grouped(4).positions(models::Positions::relative)));
}

}  // namespace
}  // namespace attnkit::grouped_heads_test
