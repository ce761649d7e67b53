// ALiBi positions in the modules and the builder (Positions::alibi): a
// MultiheadAttention with alibi(true) equals the same module given the
// penalty as an explicit bias; token-by-token decoding equals the causal
// forward (the cache's query sits at its end); a model with ALiBi alone runs
// past max_length; the refusals name the problem.
#include <attnkit/models/transformer.h>
#include <attnkit/nn/multihead.h>

#include "models/decoding_util.h"
#include "test_util.h"

namespace attnkit::alibi_positions_test {
namespace {

using testing::expect_error;
using testing::f64;
using testing::rel_err;

TEST(AlibiPositions, MultiheadAttentionAddsThePenalty) {
  torch::manual_seed(51);
  const int64_t N = 2, L = 6, S = 9, D = 12, H = 4, dh = D / H;
  nn::MultiheadAttention m(nn::MultiheadAttentionOptions(D, H).alibi(true));
  m->to(torch::kDouble);
  auto query = torch::randn({N, L, D}, f64()), kv = torch::randn({N, S, D}, f64());
  for (bool causal : {false, true}) {
    // The same projections and the penalty as a bias, through the reference op.
    auto heads = [&](const torch::Tensor& x, int64_t T) { return x.view({N, T, H, dh}).transpose(1, 2); };
    const auto query_at = torch::arange(L, f64()).add(double(S - L)).view({L, 1});
    const auto penalty = -alibi_slopes(H).to(torch::kDouble).view({H, 1, 1}) *
                         (query_at - torch::arange(S, f64()).view({1, S})).abs();
    const auto attended = softmax_attention(heads(m->q_proj(query), L), heads(m->k_proj(kv), S),
                                            heads(m->v_proj(kv), S),
                                            SoftmaxAttentionFuncOptions().causal(causal).bias(penalty));
    const auto want = m->out_proj(attended.transpose(1, 2).reshape({N, L, D}));
    EXPECT_LT(rel_err(m->forward(query, kv, kv, {}, causal), want), 1e-12) << "causal " << causal;
  }
  EXPECT_EQ(m->alibi_slopes().sizes(), torch::IntArrayRef({H}));
}

models::TransformerOptions small_alibi() {
  return models::TransformerOptions(11).layers(2).width(16).heads(4).ffn(24).dropout(0).max_length(16).positions(
      models::Positions::alibi);
}

TEST(AlibiPositions, DecodingEqualsTheForward) {
  std::vector<models::TransformerOptions> variants{
      small_alibi(),
      small_alibi().positions(models::Positions::conv | models::Positions::alibi).conv_width(3),
      small_alibi().kv_heads(2),
      small_alibi().norm(models::Norm::post),
      // Sparse patterns: a window state (local, segments) and a gathered one
      // (strided, whose kept positions are not consecutive), with grouped heads.
      small_alibi().attention({"sparse-local-causal:span=3"}),
      small_alibi().attention({"sparse-local-causal:span=3"}).kv_heads(2),
      small_alibi().attention({"sparse-segments-causal:segment=4"}).kv_heads(1),
      small_alibi().attention({"sparse-strided:stride=3"}),
      small_alibi().attention({"sparse-strided:stride=3"}).kv_heads(2),
  };
  testing::expect_decoding_equals_forward(variants, 52);
}

TEST(AlibiPositions, SparseMechanismsPassTheSlopesToTheKernel) {
  // Through the registry (and SAC's module) the slopes reach sparse_attention
  // over the mechanism's edges: the same call, bitwise.
  torch::manual_seed(55);
  const int64_t H = 4, L = 40;
  const auto q = torch::randn({2, H, L, 8}), k = torch::randn({2, H, L, 8}), v = torch::randn({2, H, L, 8});
  const auto slopes = alibi_slopes(H);
  for (const std::string spec : {"sparse-local:span=3", "sparse-random:edges=4", "sparse-bp-tree", "sac:alpha=3"}) {
    SCOPED_TRACE(spec);
    const int64_t n = spec == "sparse-bp-tree" ? L - 1 : L;  // 2t - 1 nodes
    const auto qn = q.narrow(2, 0, n), kn = k.narrow(2, 0, n), vn = v.narrow(2, 0, n);
    const auto [info, parsed] = nn::resolve_mechanism(spec);
    const auto want = sparse_attention(qn, kn, vn, info->edges(n, parsed), SparseAttentionFuncOptions().alibi_slopes(slopes));
    EXPECT_TRUE(torch::equal(nn::attend(spec, qn, kn, vn, {false, {}, slopes}), want));
    EXPECT_TRUE(torch::equal(nn::make_mechanism(spec)->forward(qn, kn, vn, {false, {}, slopes}), want));
  }
}

TEST(AlibiPositions, RunsPastMaxLengthAndSeesPositions) {
  torch::manual_seed(53);
  models::Transformer model(small_alibi());  // max_length 16: no table to run out of
  model->eval();
  auto tokens = torch::randint(0, 11, {1, 40}, torch::kLong);
  EXPECT_TRUE(testing::all_finite(model->forward(tokens)));
  // An encoder without positions is permutation-equivariant (rotating the
  // input rotates the output); with ALiBi it sees the order. (Not reversal:
  // the symmetric penalty |i - j| is the same read backwards.)
  const auto x = torch::randint(0, 11, {1, 9}, torch::kLong), rotated = x.roll(1, 1);
  for (auto positions : {models::Positions::none, models::Positions::alibi}) {
    torch::manual_seed(54);
    models::Transformer encoder(small_alibi().architecture(models::Architecture::encoder).positions(positions));
    encoder->to(torch::kDouble);
    encoder->eval();
    const double gap = rel_err(encoder->forward(rotated), encoder->forward(x).roll(1, 1));
    if (positions == models::Positions::none) EXPECT_LT(gap, 1e-12);
    else EXPECT_GT(gap, 1e-3);
  }
  models::Transformer tabled(small_alibi().positions(models::Positions::sinusoidal));
  expect_error([&] { tabled->forward(tokens); }, {"beyond max_length 16"});
}

TEST(AlibiPositions, OptionsAndRefusals) {
  EXPECT_EQ(models::to_string(models::positions_from_string("alibi+conv")), "conv+alibi");
  const auto o = small_alibi();
  EXPECT_EQ(models::TransformerOptions::from_json(o.to_json()).positions(), models::Positions::alibi);
  expect_error([] { models::positions_from_string("relative+alibi"); }, {"choose one of relative, alibi and rope"});
  expect_error([] { models::Transformer m(small_alibi().attention({"causal-linear"})); },
               {"ALiBi", "'causal-linear' takes no slopes", "full"});
  expect_error([] { models::Transformer m(small_alibi().attention({"agglomerative"})); }, {"ALiBi", "agglomerative"});
  nn::MultiheadAttention m(nn::MultiheadAttentionOptions(8, 2).alibi(true));
  expect_error([&] { m->set_attention("linear"); }, {"ALiBi", "'linear' does not"});
  expect_error([] { nn::MultiheadAttention(nn::MultiheadAttentionOptions(8, 2).alibi(true).attention("none")); },
               {"ALiBi", "'none' does not"});
  // A mechanism without ALiBi refuses slopes in a direct call too.
  auto q = torch::randn({1, 2, 3, 4});
  expect_error([&] { nn::attend("linear", q, q, q, {false, {}, alibi_slopes(2)}); },
               {"linear", "does not take ALiBi slopes", "full"});
}

}  // namespace
}  // namespace attnkit::alibi_positions_test
