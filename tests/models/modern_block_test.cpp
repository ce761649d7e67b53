// The modern decoder block (TransformerOptions::normalization, feed_forward,
// bias, llama_block): RMSNorm is its formula (float64, and bfloat16 inputs
// normalised in float32); a one-block model computes, parameter by parameter,
// x + W_o W_v rms(x) (the "none" mechanism: each position attends to itself)
// then h + W_2 (silu(W_1 rms(h)) * W_3 rms(h)), and the final RMSNorm; such a
// model has no bias anywhere; decoding token by token equals the forward for
// the block with every mechanism family and with grouped-query heads; the
// classic block keeps its parameters' names and its options' JSON (so older
// checkpoints load); refusals name the problem.
#include <attnkit/models/transformer.h>

#include <cmath>
#include <set>
#include <string>

#include "models/block.h"
#include "models/decoding_util.h"
#include "test_util.h"

namespace attnkit::modern_block_test {
namespace {

using models::FeedForward;
using models::Normalization;
using models::Positions;
using testing::expect_error;
using testing::f64;
using testing::rel_err;

/// RMSNorm by its definition in double: x / sqrt(mean(x^2) + eps) * w.
torch::Tensor rms_by_hand(const torch::Tensor& x, const torch::Tensor& w) {
  const auto x64 = x.to(torch::kDouble);
  const double eps = models::FeatureNormImpl::kRmsEps;
  return x64 / (x64.square().mean(-1, true) + eps).sqrt() * w.to(torch::kDouble);
}

TEST(ModernBlock, RmsNormIsItsFormula) {
  torch::manual_seed(3);
  models::FeatureNorm norm(7, Normalization::rms, /*bias=*/true);  // RMSNorm has no bias whatever the model's
  EXPECT_EQ(norm->named_parameters().size(), 1u);
  norm->to(torch::kDouble);
  {
    torch::NoGradGuard no_grad;
    norm->weight.uniform_(0.5, 1.5);
  }
  // Rows of very different scales, and a row of zeros (eps keeps it finite: 0).
  auto x = torch::randn({2, 5, 7}, f64()) * torch::tensor({1e-3, 1.0, 30.0, 1.0, 0.0}, f64()).view({1, 5, 1});
  EXPECT_LT(rel_err(norm->forward(x), rms_by_hand(x, norm->weight)), 1e-14);
  EXPECT_EQ(norm->forward(x).select(1, 4).abs().max().item<double>(), 0.0);

  // bfloat16 inputs are normalised in float32, then rounded once and scaled.
  models::FeatureNorm norm16(7, Normalization::rms, false);
  norm16->to(torch::kBFloat16);
  const auto x16 = torch::randn({3, 7}).to(torch::kBFloat16);
  const auto out = norm16->forward(x16);
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_LT(rel_err(out, rms_by_hand(x16, norm16->weight)), 1e-2);  // bfloat16's 8 bits

  // Layer norm keeps torch::nn::LayerNorm's parameters and values.
  models::FeatureNorm layer(7, Normalization::layer, true);
  torch::nn::LayerNorm torch_layer(torch::nn::LayerNormOptions({7}));
  EXPECT_EQ(layer->named_parameters().keys(), torch_layer->named_parameters().keys());
  const auto y = torch::randn({4, 7});
  EXPECT_TRUE(torch::equal(layer->forward(y), torch_layer->forward(y)));
  models::FeatureNorm unbiased(7, Normalization::layer, false);
  EXPECT_EQ(unbiased->named_parameters().keys(), std::vector<std::string>{"weight"});
}

/// One block with the "none" mechanism, computed from the named parameters.
torch::Tensor llama_by_hand(models::Transformer& model, const torch::Tensor& tokens, int64_t d) {
  const auto p = model->named_parameters();
  const auto w = [&](const std::string& name) { return p[name].to(torch::kDouble); };
  auto x = w("embedding.weight").index_select(0, tokens.flatten()).view({tokens.size(0), tokens.size(1), d}) *
           std::sqrt(double(d));
  const auto mm = [](const torch::Tensor& a, const torch::Tensor& weight) { return torch::matmul(a, weight.t()); };
  // Attention to itself only: the output is the position's own value (rotations
  // of q and k do not matter).
  x = x + mm(mm(rms_by_hand(x, w("decoder_0.norm_self.weight")), w("decoder_0.self_attention.v_proj.weight")),
             w("decoder_0.self_attention.out_proj.weight"));
  const auto h = rms_by_hand(x, w("decoder_0.norm_ff.weight"));
  x = x + mm(torch::silu(mm(h, w("decoder_0.ff1.weight"))) * mm(h, w("decoder_0.ff3.weight")),
             w("decoder_0.ff2.weight"));
  return mm(rms_by_hand(x, w("decoder_norm.weight")), w("embedding.weight"));
}

TEST(ModernBlock, OneBlockIsItsFormulaWithoutAnyBias) {
  torch::manual_seed(5);
  const int64_t d = 16;
  auto options = models::TransformerOptions(13).layers(1).width(d).heads(4).ffn(24).dropout(0);
  options.llama_block().attention({"none"});
  EXPECT_EQ(options.positions(), Positions::rope);
  models::Transformer model(options);
  model->to(torch::kDouble);
  for (const auto& item : model->named_parameters())
    EXPECT_EQ(item.key().find("bias"), std::string::npos) << item.key();
  EXPECT_TRUE(model->named_parameters().contains("decoder_0.ff3.weight"));
  const auto tokens = torch::randint(0, 13, {2, 9}, torch::kLong);
  EXPECT_LT(rel_err(model->forward(tokens), llama_by_hand(model, tokens, d)), 1e-12);
  // An untied output layer has no bias either.
  options.tie_embeddings(false);
  models::Transformer untied(options);
  EXPECT_FALSE(untied->named_parameters().contains("output.bias"));
  EXPECT_TRUE(untied->named_parameters().contains("output.weight"));
}

TEST(ModernBlock, DecodingEqualsTheForward) {
  auto llama = [](const std::string& attention) {
    auto o = models::TransformerOptions(11).layers(2).width(16).heads(4).ffn(20).dropout(0);
    o.llama_block().attention({attention});
    return o;
  };
  std::vector<models::TransformerOptions> variants{
      llama("full"), llama("full").kv_heads(2), llama("full").kv_heads(1).rotary_fraction(0.5),
      llama("causal-linear").kv_heads(2), llama("sparse-local-causal:span=3"), llama("full:window=4"),
      llama("full").positions(Positions::conv | Positions::rope), llama("full").norm(models::Norm::post),
      // Each change alone.
      models::TransformerOptions(11).layers(2).width(16).heads(4).ffn(20).dropout(0).normalization(Normalization::rms),
      models::TransformerOptions(11).layers(2).width(16).heads(4).ffn(20).dropout(0).feed_forward(FeedForward::swiglu),
      models::TransformerOptions(11).layers(2).width(16).heads(4).ffn(20).dropout(0).bias(false).tie_embeddings(false),
  };
  testing::expect_decoding_equals_forward(variants, 17);

  // An encoder-decoder with the block: cross-attention without biases too.
  torch::manual_seed(19);
  auto o = llama("full").architecture(models::Architecture::encoder_decoder).kv_heads(2);
  models::Transformer model(o);
  model->to(torch::kDouble);
  model->eval();
  for (const auto& item : model->named_parameters())
    EXPECT_EQ(item.key().find("bias"), std::string::npos) << item.key();
  const auto source = torch::randint(0, 11, {2, 7}, torch::kLong), tokens = torch::randint(0, 11, {2, 6}, torch::kLong);
  EXPECT_LT(rel_err(testing::decode_all(model, tokens, source), model->forward(tokens, source)), 1e-10);
}

TEST(ModernBlock, ClassicBlockKeepsItsNamesAndOptions) {
  // The names of a classic block's parameters, as checkpoints before the
  // modern block stored them (torch::nn::LayerNorm's weight and bias).
  torch::manual_seed(7);
  models::Transformer model(models::TransformerOptions(11).layers(1).width(8).heads(2).ffn(12));
  std::set<std::string> names;
  for (const auto& item : model->named_parameters()) names.insert(item.key());
  const std::set<std::string> expected{
      "embedding.weight",
      "decoder_0.self_attention.q_proj.weight", "decoder_0.self_attention.q_proj.bias",
      "decoder_0.self_attention.k_proj.weight", "decoder_0.self_attention.k_proj.bias",
      "decoder_0.self_attention.v_proj.weight", "decoder_0.self_attention.v_proj.bias",
      "decoder_0.self_attention.out_proj.weight", "decoder_0.self_attention.out_proj.bias",
      "decoder_0.norm_self.weight", "decoder_0.norm_self.bias", "decoder_0.ff1.weight", "decoder_0.ff1.bias",
      "decoder_0.ff2.weight", "decoder_0.ff2.bias", "decoder_0.norm_ff.weight", "decoder_0.norm_ff.bias",
      "decoder_norm.weight", "decoder_norm.bias"};
  EXPECT_EQ(names, expected);

  // The classic options write no key of the modern block; JSON without them
  // (an older checkpoint's) reads as the classic block.
  const auto classic = models::TransformerOptions(11).to_json();
  for (const char* key : {"normalization", "feed_forward", "\"bias\""})
    EXPECT_EQ(classic.find(key), std::string::npos) << key;
  const auto read = models::TransformerOptions::from_json(classic);
  EXPECT_EQ(read.normalization(), Normalization::layer);
  EXPECT_EQ(read.feed_forward(), FeedForward::relu);
  EXPECT_TRUE(read.bias());

  auto llama = models::TransformerOptions(11).kv_heads(2);
  llama.llama_block();
  const auto back = models::TransformerOptions::from_json(llama.to_json());
  EXPECT_EQ(back.to_json(), llama.to_json());
  EXPECT_EQ(back.normalization(), Normalization::rms);
  EXPECT_EQ(back.feed_forward(), FeedForward::swiglu);
  EXPECT_FALSE(back.bias());
  EXPECT_EQ(back.positions(), Positions::rope);
  EXPECT_EQ(back.kv_heads(), 2);
}

TEST(ModernBlock, RefusalsNameTheProblem) {
  expect_error([] { models::normalization_from_string("batch"); }, {"batch"});
  expect_error([] { models::feed_forward_from_string("gelu"); }, {"gelu"});
  expect_error([] { models::TransformerOptions::from_json(R"({"normalization": "group"})"); }, {"group"});
  expect_error([] { models::TransformerOptions::from_json(R"({"bias": "no"})"); }, {"bias"});
  expect_error([] { models::Transformer(models::TransformerOptions(5).bias(false).attention({"agglomerative"})); },
               {"agglomerative blocks"});
  expect_error([] {
    models::Transformer(models::TransformerOptions(5).bias(false).positions(Positions::relative));
  }, {"relative-position blocks"});
}

}  // namespace
}  // namespace attnkit::modern_block_test
