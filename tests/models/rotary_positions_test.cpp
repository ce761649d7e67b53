// Rotary positions in the modules and the builder (Positions::rope): a
// MultiheadAttention with rotary_dim equals the same projections with q and k
// rotated by the op (inside the kernel for "full", before the call for the
// other dot-product mechanisms), and for linear attention the op with its
// rotary_dim (RoFormer's form: phi(q), phi(k) turned in the numerator only);
// token-by-token decoding, where each step's query and key are rotated once
// at their position (by causal linear attention's state itself), equals the
// causal forward; a model with rope alone runs past max_length and sees
// order; the options round-trip and the refusals name the problem.
#include <attnkit/models/transformer.h>
#include <attnkit/nn/multihead.h>

#include "models/decoding_util.h"
#include "test_util.h"

namespace attnkit::rotary_positions_test {
namespace {

using testing::expect_error;
using testing::f64;
using testing::rel_err;

/// The module's output computed by hand: projections, q and k rotated by the
/// op (query i at i + S - L, key j at j), the mechanism, the output projection.
torch::Tensor by_hand(nn::MultiheadAttention& m, const torch::Tensor& query, const torch::Tensor& kv, bool causal,
                      int64_t rotary_dim) {
  const int64_t N = query.size(0), L = query.size(1), S = kv.size(1), D = m->options.width();
  const int64_t H = m->options.heads(), dh = D / H;
  auto heads = [&](const torch::Tensor& x, int64_t T) { return x.view({N, T, H, dh}).transpose(1, 2); };
  auto rotate = [&](const torch::Tensor& x, int64_t offset) {
    return rotary_embedding(x, RotaryEmbeddingFuncOptions(rotary_dim).offset(offset));
  };
  const auto attended = nn::attend(m->options.attention(), rotate(heads(m->q_proj(query), L), S - L),
                                   rotate(heads(m->k_proj(kv), S), 0), heads(m->v_proj(kv), S), {causal});
  return m->out_proj(attended.transpose(1, 2).reshape({N, L, D}));
}

TEST(RotaryPositions, MultiheadAttentionRotatesQueriesAndKeys) {
  torch::manual_seed(61);
  const int64_t N = 2, D = 16, H = 2;
  struct Variant {
    std::string spec;
    int64_t L, S, rotary_dim;
    bool causal;
  };
  // full rotates inside its kernel; sparse-local is given rotated q and k.
  for (const Variant& c : {Variant{"full", 6, 9, 8, false}, Variant{"full", 7, 7, 4, true},
                           Variant{"sparse-local:span=2", 7, 7, 6, false}}) {
    SCOPED_TRACE(c.spec + " rotary_dim " + std::to_string(c.rotary_dim));
    nn::MultiheadAttention m(nn::MultiheadAttentionOptions(D, H).rotary_dim(c.rotary_dim).attention(c.spec));
    m->to(torch::kDouble);
    const auto query = torch::randn({N, c.L, D}, f64()), kv = torch::randn({N, c.S, D}, f64());
    EXPECT_LT(rel_err(m->forward(query, kv, kv, {}, c.causal), by_hand(m, query, kv, c.causal, c.rotary_dim)), 1e-12);
    // float32: the kernel's own rotation against the op's, to rounding.
    nn::MultiheadAttention m32(std::dynamic_pointer_cast<nn::MultiheadAttentionImpl>(m->clone()));
    m32->to(torch::kFloat);
    const auto q32 = query.to(torch::kFloat), kv32 = kv.to(torch::kFloat);
    EXPECT_LT(rel_err(m32->forward(q32, kv32, kv32, {}, c.causal), by_hand(m32, q32, kv32, c.causal, c.rotary_dim)),
              1e-5);
  }
}

TEST(RotaryPositions, MultiheadLinearAttentionPassesRotaryDimToTheKernel) {
  // No rotation of q and k gives RoFormer's linear form: the module hands
  // rotary_dim to the op, with grouped heads read in place.
  torch::manual_seed(65);
  const int64_t N = 2, D = 16, H = 4, Hk = 2, dh = D / H;
  for (const std::string spec : {"linear", "causal-linear"})
    for (auto dtype : {torch::kDouble, torch::kFloat}) {
      SCOPED_TRACE(spec + " " + c10::toString(dtype));
      nn::MultiheadAttention m(nn::MultiheadAttentionOptions(D, H).kv_heads(Hk).rotary_dim(2).rotary_base(50.0).attention(spec));
      m->to(dtype);
      const int64_t L = 6, S = spec == "linear" ? 9 : 6;
      const auto query = torch::randn({N, L, D}, dtype), kv = torch::randn({N, S, D}, dtype);
      auto heads = [&](const torch::Tensor& x, int64_t T, int64_t h) { return x.view({N, T, h, dh}).transpose(1, 2); };
      const auto o = LinearAttentionFuncOptions()
                         .feature_map(FeatureMap::elu)
                         .normalize(true)
                         .causal(spec == "causal-linear")
                         .rotary_dim(2)
                         .rotary_base(50.0);
      const auto attended = linear_attention(heads(m->q_proj(query), L, H), heads(m->k_proj(kv), S, Hk),
                                             heads(m->v_proj(kv), S, Hk), o);
      const auto want = m->out_proj(attended.transpose(1, 2).reshape({N, L, D}));
      EXPECT_LT(rel_err(m->forward(query, kv, kv), want), 1e-12);
    }
}

models::TransformerOptions small_rope() {
  return models::TransformerOptions(11).layers(2).width(16).heads(2).ffn(24).dropout(0).max_length(16).positions(
      models::Positions::rope);
}

TEST(RotaryPositions, DecodingEqualsTheForward) {
  std::vector<models::TransformerOptions> variants{
      small_rope(),
      small_rope().rotary_fraction(0.5),
      small_rope().positions(models::Positions::conv | models::Positions::rope).conv_width(3),
      small_rope().heads(4).kv_heads(2),
      small_rope().attention({"sparse-local-causal:span=3"}),
      // Causal linear attention's state rotates phi(q), phi(k) itself.
      small_rope().attention({"causal-linear"}),
      small_rope().attention({"causal-linear:feature_map=identity,normalize=false"}).rotary_fraction(0.5),
      small_rope().heads(4).kv_heads(1).attention({"causal-linear"}),
      small_rope().norm(models::Norm::post),
  };
  testing::expect_decoding_equals_forward(variants, 62);
}

TEST(RotaryPositions, RunsPastMaxLengthAndSeesOrder) {
  torch::manual_seed(63);
  models::Transformer model(small_rope());  // max_length 16: no table to run out of
  model->eval();
  EXPECT_TRUE(testing::all_finite(model->forward(torch::randint(0, 11, {1, 40}, torch::kLong))));
  // An encoder without positions is permutation-equivariant; with rope it
  // sees the order, reversal included (rotations tell i - j from j - i).
  const auto x = torch::randint(0, 11, {1, 9}, torch::kLong), reversed = x.flip(1);
  for (auto positions : {models::Positions::none, models::Positions::rope}) {
    torch::manual_seed(64);
    models::Transformer encoder(small_rope().architecture(models::Architecture::encoder).positions(positions));
    encoder->to(torch::kDouble);
    encoder->eval();
    const double gap = rel_err(encoder->forward(reversed), encoder->forward(x).flip(1));
    if (positions == models::Positions::none) EXPECT_LT(gap, 1e-12);
    else EXPECT_GT(gap, 1e-3);
  }
}

TEST(RotaryPositions, OptionsAndRefusals) {
  EXPECT_EQ(models::to_string(models::positions_from_string("rope+conv")), "conv+rope");
  EXPECT_EQ(small_rope().rotary_dim(), 8);
  EXPECT_EQ(small_rope().rotary_fraction(0.3).rotary_dim(), 2);  // 0.3 x 8 = 2.4 features: one pair
  EXPECT_EQ(small_rope().positions(models::Positions::sinusoidal).rotary_dim(), 0);
  // rotary_fraction is written only when changed: the options of earlier models read back unchanged.
  EXPECT_EQ(small_rope().to_json().find("rotary_fraction"), std::string::npos);
  const auto o = small_rope().rotary_fraction(0.5);
  const auto back = models::TransformerOptions::from_json(o.to_json());
  EXPECT_EQ(back.positions(), models::Positions::rope);
  EXPECT_EQ(back.rotary_fraction(), 0.5);
  expect_error([] { models::positions_from_string("alibi+rope"); }, {"choose one of relative, alibi and rope"});
  expect_error([] { models::Transformer m(small_rope().rotary_fraction(0.2)); },
               {"rotary_fraction 0.2 of 8 features per head rotates 0", "at least one pair"});
  expect_error([] { models::Transformer m(small_rope().rotary_fraction(1.5)); }, {"rotary_fraction must be in (0, 1]"});
  expect_error([] { models::Transformer m(small_rope().attention({"gated-linear"})); },
               {"rotary positions", "'gated-linear' has none", "full", "causal-linear"});
  expect_error([] { models::Transformer m(small_rope().attention({"agglomerative"})); },
               {"rotary positions", "'agglomerative' has none"});
  expect_error([] { nn::MultiheadAttention(nn::MultiheadAttentionOptions(8, 2).rotary_dim(6)); },
               {"MultiheadAttention", "option 'rotary_dim'", "[2, E] = [2, 4], got 6"});
  nn::MultiheadAttention m(nn::MultiheadAttentionOptions(8, 2).rotary_dim(4));
  expect_error([&] { m->set_attention("gated-linear"); }, {"rotary positions", "'gated-linear' has none"});
  // A mechanism that does not rotate in its kernel refuses rotary_dim in a direct call.
  auto q = torch::randn({1, 2, 3, 4});
  nn::AttendArgs args;
  args.rotary_dim = 4;
  expect_error([&] { nn::attend("sparse-local", q, q, q, args); },
               {"sparse-local", "does not rotate q and k inside its kernel", "rotary_embedding"});
}

}  // namespace
}  // namespace attnkit::rotary_positions_test
