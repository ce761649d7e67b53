// Gated linear attention's modules: GatedLinearAttention against the paper's
// recurrence (the general op) and a DocumentMemory, and the "gated-linear"
// mechanism of MultiheadAttention.
#include <attnkit/document_memory.h>
#include <attnkit/nn/gated_linear_attention.h>
#include <attnkit/nn/multihead.h>
#include <attnkit/ops.h>

#include "test_util.h"

namespace attnkit::nn::gated_linear_attention_module_test {
namespace {

using testing::expect_error;
using testing::f32;
using testing::f64;
using testing::rel_err;

// Two float64 evaluations of the same sums in different orders.
constexpr double kSameMathTol64 = 1e-12;

// --- GatedLinearAttention -------------------------------------------------------------

/// The module's parameters in float64 (for exact comparisons).
GatedLinearAttention gated_module(int64_t dim) {
  auto m = GatedLinearAttention(GatedLinearAttentionOptions(dim));
  m->to(torch::kDouble);
  return m;
}

TEST(LinearGatedModule, IsTheSeedsGatedRecurrence) {
  // f_t = sigmoid(W h_t + b) * h_t, C_t = C_{t-1} + f_t f_t^T, out = C q: the
  // general op with alpha = beta = 1.
  torch::manual_seed(4);
  const int64_t N = 2, n = 23, dim = 5;
  auto m = gated_module(dim);
  auto h = torch::randn({N, n, dim}, f64()), q = torch::randn({N, n, dim}, f64());
  auto f = torch::sigmoid(torch::matmul(h, m->gate->weight.t()) + m->gate->bias) * h;
  EXPECT_LT(rel_err(m->features(h), f), kSameMathTol64);
  auto ones = torch::ones({N, 1, n}, f64());
  for (bool causal : {false, true}) {
    auto want = gated_linear_attention(f.unsqueeze(1), q.unsqueeze(1), ones, ones,
                                       attnkit::GatedLinearAttentionFuncOptions().causal(causal));
    EXPECT_LT(rel_err(m->forward(h, q, causal), want.squeeze(1)), kSameMathTol64);
  }
}

TEST(LinearGatedModule, AnyNumberOfQueriesReadTheDocument) {
  // The cheap-linear-attention paper's question answering: m queries (here fewer and more than the
  // n states) against one document matrix C = F^T F.
  torch::manual_seed(5);
  const int64_t n = 30, dim = 6;
  auto m = gated_module(dim);
  auto h = torch::randn({1, n, dim}, f64());
  auto F = m->features(h)[0];
  for (int64_t queries : {1, 4, 45}) {
    auto q = torch::randn({1, queries, dim}, f64());
    EXPECT_LT(rel_err(m->forward(h, q)[0], torch::matmul(q[0], torch::matmul(F.t(), F))),
              kSameMathTol64);
  }
}

TEST(LinearGatedModule, GradientsMatchFiniteDifferences) {
  torch::manual_seed(6);
  const int64_t dim = 3;
  auto m = gated_module(dim);
  for (bool causal : {false, true})
    testing::expect_gradients_match(
        [&](const std::vector<torch::Tensor>& x) {
          m->gate->weight = x[2];
          m->gate->bias = x[3];
          return m->forward(x[0], x[1], causal);
        },
        {torch::randn({2, 6, dim}, f64()), torch::randn({2, 6, dim}, f64()),
         m->gate->weight.detach(), m->gate->bias.detach()});
}

TEST(LinearGatedModule, FeaturesFeedADocumentMemory) {
  // Float32: the module's non-causal output is a DocumentMemory lookup of its features.
  torch::manual_seed(7);
  const int64_t n = 200, dim = 16;
  auto m = GatedLinearAttention(GatedLinearAttentionOptions(dim));
  torch::NoGradGuard no_grad;
  auto h = torch::randn({1, n, dim}, f32()), q = torch::randn({1, 9, dim}, f32());
  DocumentMemory memory(dim);
  memory.append(m->features(h)[0]);
  // Both sum n = 200 float32 products per entry, in different orders.
  constexpr double kTwoFloat32Sums = 2 * 200 * 6e-8;
  EXPECT_LT(rel_err(memory.lookup(q[0]), m->forward(h, q)[0]), kTwoFloat32Sums);
}

TEST(LinearGatedModule, RejectsBadInput) {
  GatedLinearAttention m(GatedLinearAttentionOptions(4));
  expect_error(
      [&] {
        m->forward(torch::randn({1, 3, 5}), torch::randn({1, 3, 4}));
      },
      {"GatedLinearAttention", "hidden", "feature size dim"});
  expect_error(
      [&] {
        m->forward(torch::randn({1, 3, 4}), torch::randn({2, 3, 4}));
      },
      {"GatedLinearAttention", "queries", "batch size N"});
  expect_error([] { GatedLinearAttention(GatedLinearAttentionOptions(0)); },
               {"GatedLinearAttention", "dim", "positive"});
}

// --- MultiheadAttention's "gated-linear" ----------------------------------------------------

TEST(LinearMultihead, GatedLinearGatesTheValueProjectionWithTheKeyProjection) {
  torch::manual_seed(8);
  const int64_t N = 2, L = 11, D = 8, H = 2, dh = D / H;
  MultiheadAttention mha(
      MultiheadAttentionOptions(D, H).attention("gated-linear"));
  mha->to(torch::kDouble);
  auto x = torch::randn({N, L, D}, f64());
  auto heads = [&](const torch::Tensor& t) { return t.view({N, L, H, dh}).transpose(1, 2); };
  auto q = heads(mha->q_proj(x)), k = heads(mha->k_proj(x)), v = heads(mha->v_proj(x));
  auto f = torch::sigmoid(k) * v;
  auto ones = torch::ones({N, H, L}, f64());
  for (bool causal : {false, true}) {
    auto per_head = gated_linear_attention(f, q, ones, ones,
                                           attnkit::GatedLinearAttentionFuncOptions().causal(causal));
    auto want = mha->out_proj(per_head.transpose(1, 2).reshape({N, L, D}));
    EXPECT_LT(rel_err(mha->forward(x, x, x, {}, causal), want), kSameMathTol64);
  }
  expect_error([&] { mha->forward(x, x, x, torch::full({N}, L, torch::kLong)); },
               {"gated-linear", "key_lengths"});
}

}  // namespace
}  // namespace attnkit::nn::gated_linear_attention_module_test
