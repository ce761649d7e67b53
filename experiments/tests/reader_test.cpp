// The cloze reader's read-outs: linear = H^T H q on a hand-computed case (and
// DocumentMemory's lookup, and the paper's gradients), softmax = a convex
// combination of the states with weights softmax(H q), gated = C q / n with
// C = sum f f^T built by hand, none = the final state; the reader's scores and
// its refusals.
#include <attnkit/document_memory.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "models/reader.h"
#include "test_util.h"

namespace reader_test {

using attnkit::experiments::linear_readout;
using attnkit::experiments::Reader;
using attnkit::experiments::ReaderOptions;
using attnkit::experiments::Readout;
using attnkit::experiments::softmax_readout;
using attnkit::testing::expect_error;

namespace {

torch::Tensor f32(std::initializer_list<float> values, torch::IntArrayRef shape) {
  return torch::tensor(std::vector<float>(values)).reshape(shape);
}

}  // namespace

TEST(ReaderReadout, LinearIsHTransposeHTimesQByHand) {
  // Document 0: h = (1, 2), (3, -1), (0, 1); q = (1, 1).
  //   C = [[1+9+0, 2-3+0], [2-3+0, 4+1+1]] = [[10, -1], [-1, 6]],  C q = (9, 5).
  // Document 1: h = (2, 0), (0, 0), (1, 1); q = (0.5, -1).
  //   C = [[4+0+1, 0+0+1], [1, 0+0+1]] = [[5, 1], [1, 1]],  C q = (1.5, -0.5).
  const auto H = f32({1, 2, 3, -1, 0, 1, 2, 0, 0, 0, 1, 1}, {2, 3, 2});
  const auto q = f32({1, 1, 0.5f, -1}, {2, 2});
  const auto r = linear_readout(H, q);
  ASSERT_EQ(r.sizes(), torch::IntArrayRef({2, 2}));
  EXPECT_TRUE(torch::allclose(r, f32({9, 5, 1.5f, -0.5f}, {2, 2}), 1e-6, 1e-6)) << r;
  // DocumentMemory, the inference-only form of the same C, answers alike.
  for (int64_t n = 0; n < 2; ++n) {
    attnkit::DocumentMemory memory(2);
    memory.append(H[n].slice(0, 0, 1));
    memory.append(H[n].slice(0, 1, 3));
    EXPECT_TRUE(torch::allclose(memory.lookup(q[n].unsqueeze(0)).squeeze(0), r[n], 1e-6, 1e-6));
  }
}

TEST(ReaderReadout, LinearGradientsAreThePapers) {
  // dq = C g, dh_t = q (h_t . g) + g (h_t . q) (the paper, section 3.3), in float64.
  torch::manual_seed(3);
  const auto H = torch::randn({3, 7, 5}).requires_grad_();
  const auto q = torch::randn({3, 5}).requires_grad_();
  const auto g = torch::randn({3, 5});
  linear_readout(H, q).backward(g);
  const auto Hd = H.detach().to(torch::kFloat64), qd = q.detach().to(torch::kFloat64),
             gd = g.to(torch::kFloat64);
  const auto C = torch::matmul(Hd.transpose(1, 2), Hd);
  const auto dq = torch::matmul(C, gd.unsqueeze(2)).squeeze(2);
  const auto hg = torch::matmul(Hd, gd.unsqueeze(2)), hq = torch::matmul(Hd, qd.unsqueeze(2));
  const auto dH = hg * qd.unsqueeze(1) + hq * gd.unsqueeze(1);
  // float32 kernels against float64: about 1e-5 relative.
  EXPECT_TRUE(torch::allclose(q.grad().to(torch::kFloat64), dq, 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(H.grad().to(torch::kFloat64), dH, 1e-5, 1e-5));
}

TEST(ReaderReadout, SoftmaxIsAConvexCombinationOfTheStates) {
  // By hand: h = (1, 0), (0, 1), (1, 1), q = (ln 2, 0): H q = (ln 2, 0, ln 2),
  // weights (2, 1, 2) / 5, r = (4/5, 3/5).
  const auto H = f32({1, 0, 0, 1, 1, 1}, {1, 3, 2});
  const auto q = f32({std::log(2.0f), 0}, {1, 2});
  EXPECT_TRUE(torch::allclose(softmax_readout(H, q), f32({0.8f, 0.6f}, {1, 2}), 1e-6, 1e-6));
  // Random cases: r = H^T w with w = softmax(H q) (unscaled, the paper's form),
  // w >= 0 summing to one, so every coordinate of r lies between the states'.
  torch::manual_seed(4);
  const auto Hr = torch::randn({4, 9, 6}), qr = torch::randn({4, 6});
  const auto r = softmax_readout(Hr, qr);
  const auto w = torch::softmax(torch::matmul(Hr.to(torch::kFloat64), qr.to(torch::kFloat64).unsqueeze(2)), 1);
  EXPECT_TRUE(torch::allclose(w.sum(1), torch::ones({4, 1}, torch::kFloat64)));
  const auto expected = (w * Hr.to(torch::kFloat64)).sum(1);
  EXPECT_TRUE(torch::allclose(r.to(torch::kFloat64), expected, 1e-5, 1e-6));
  EXPECT_TRUE(r.ge(std::get<0>(Hr.min(1)) - 1e-6).all().item<bool>());
  EXPECT_TRUE(r.le(std::get<0>(Hr.max(1)) + 1e-6).all().item<bool>());
  // Equal states: the combination is that state, whatever q.
  const auto same = torch::randn({1, 1, 6}).expand({1, 5, 6}).contiguous();
  EXPECT_TRUE(torch::allclose(softmax_readout(same, torch::randn({1, 6})), same[0][0].unsqueeze(0), 1e-6, 1e-6));
}

TEST(Reader, EachReadoutReadsWhatItShould) {
  torch::manual_seed(5);
  const int64_t V = 20, N = 3, n = 11, m = 4;
  const auto doc = torch::randint(0, V, {N, n}, torch::kInt64);
  const auto query = torch::randint(0, V, {N, m}, torch::kInt64);
  for (const auto readout : {Readout::none, Readout::linear, Readout::gated, Readout::softmax}) {
    SCOPED_TRACE(attnkit::experiments::to_string(readout));
    Reader reader(ReaderOptions(V).embedding(6).hidden(5).readout(readout));
    EXPECT_EQ(reader->state_size(), 10);
    torch::NoGradGuard no_grad;
    auto [H, final] = reader->encode_document(doc);
    ASSERT_EQ(H.sizes(), torch::IntArrayRef({N, n, 10}));
    // The final state: the forward direction's last state, the backward one's first.
    EXPECT_TRUE(torch::equal(final.slice(1, 0, 5), H.select(1, n - 1).slice(1, 0, 5)));
    EXPECT_TRUE(torch::equal(final.slice(1, 5), H.select(1, 0).slice(1, 5)));
    const auto q = reader->encode_query(query);
    const auto r = reader->read(H, final, q);
    const auto Hd = H.to(torch::kFloat64), qd = q.to(torch::kFloat64);
    torch::Tensor expected;
    switch (readout) {
      case Readout::none: expected = final.to(torch::kFloat64); break;
      case Readout::linear:
        expected = torch::matmul(torch::matmul(Hd.transpose(1, 2), Hd), qd.unsqueeze(2)).squeeze(2) / n;
        break;
      case Readout::gated: {
        const auto W = reader->gate->gate->weight.to(torch::kFloat64);
        const auto b = reader->gate->gate->bias.to(torch::kFloat64);
        const auto f = torch::sigmoid(torch::matmul(Hd, W.t()) + b) * Hd;
        expected = torch::matmul(torch::matmul(f.transpose(1, 2), f), qd.unsqueeze(2)).squeeze(2) / n;
        break;
      }
      case Readout::softmax:
        expected = (torch::softmax(torch::matmul(Hd, qd.unsqueeze(2)), 1) * Hd).sum(1);
        break;
    }
    EXPECT_TRUE(torch::allclose(r.to(torch::kFloat64), expected, 1e-5, 1e-6));
    // Scores: -inf exactly off the candidates, finite on them.
    auto candidate = torch::zeros({N, V}, torch::kBool);
    candidate.index_put_({0, torch::tensor({1, 4})}, true);
    candidate.index_put_({1, torch::tensor({7})}, true);
    candidate.index_put_({2, torch::tensor({0, 2, 19})}, true);
    const auto scores = reader->forward(doc, query, candidate);
    ASSERT_EQ(scores.sizes(), torch::IntArrayRef({N, V}));
    EXPECT_TRUE(torch::equal(torch::isfinite(scores), candidate));
    EXPECT_TRUE(scores.masked_select(candidate.logical_not()).eq(-INFINITY).all().item<bool>());
  }
}

TEST(Reader, TheQueryIsReadAtThePlaceholder) {
  torch::manual_seed(7);
  Reader reader(ReaderOptions(12).embedding(4).hidden(3).placeholder(1));
  // Placeholder at positions 2, 0 and 4 (the first of two in row 2).
  const auto query = torch::tensor({5, 6, 1, 7, 8, 1, 9, 3, 2, 4, 5, 5, 5, 5, 1}, torch::kInt64).reshape({3, 5});
  auto q_row2 = query.clone();
  q_row2[2][1] = 1;  // row 2 now holds it at 1 and 4
  torch::NoGradGuard no_grad;
  const auto states = std::get<0>(reader->query_rnn(reader->embed(query)));
  const auto q = reader->encode_query(query);
  EXPECT_TRUE(torch::equal(q[0], states[0][2]));
  EXPECT_TRUE(torch::equal(q[1], states[1][0]));
  EXPECT_TRUE(torch::equal(q[2], states[2][4]));
  const auto states2 = std::get<0>(reader->query_rnn(reader->embed(q_row2)));
  EXPECT_TRUE(torch::equal(reader->encode_query(q_row2)[2], states2[2][1]));
  expect_error([&] { reader->encode_query(torch::full({2, 3}, 4, torch::kInt64)); },
               {"every query must hold the placeholder id 1"});
}

TEST(Reader, GradientsReachEveryParameter) {
  torch::manual_seed(6);
  const int64_t V = 15;
  for (const auto readout : {Readout::none, Readout::linear, Readout::gated, Readout::softmax}) {
    SCOPED_TRACE(attnkit::experiments::to_string(readout));
    Reader reader(ReaderOptions(V).embedding(4).hidden(3).readout(readout));
    const auto doc = torch::randint(0, V, {2, 6}, torch::kInt64);
    const auto query = torch::randint(0, V, {2, 3}, torch::kInt64);
    const auto candidate = torch::ones({2, V}, torch::kBool);
    torch::nn::functional::cross_entropy(reader->forward(doc, query, candidate),
                                         torch::tensor({3, 9}, torch::kInt64))
        .backward();
    for (const auto& p : reader->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      // "none" never reads the document's states except the final one, but every
      // GRU weight still shapes that state.
      EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0) << p.key();
    }
  }
}

TEST(Reader, AnOpenedGateStartsNearTheLinearReadout) {
  // gate_bias b with the gate's weights at zero: f = sigmoid(b) h, so the
  // gated read-out is sigmoid(b)^2 times the linear one.
  torch::manual_seed(9);
  const int64_t V = 20, N = 2, n = 7;
  Reader gated(ReaderOptions(V).embedding(6).hidden(5).readout(Readout::gated).gate_bias(4.0));
  EXPECT_TRUE(gated->gate->gate->bias.eq(4.0).all().item<bool>());
  torch::NoGradGuard no_grad;
  gated->gate->gate->weight.zero_();
  const auto [H, final] = gated->encode_document(torch::randint(0, V, {N, n}, torch::kInt64));
  const auto q = torch::randn({N, 10});
  const double s = 1 / (1 + std::exp(-4.0));
  EXPECT_TRUE(torch::allclose(gated->read(H, final, q), s * s * linear_readout(H, q) / n, 1e-5, 1e-6));
  // Without it, the layer's own initialisation (|b| <= 1 / sqrt(k)).
  Reader plain(ReaderOptions(V).embedding(6).hidden(5).readout(Readout::gated));
  EXPECT_LE(plain->gate->gate->bias.abs().max().item<double>(), 1 / std::sqrt(10.0));
  expect_error([] { Reader(ReaderOptions(V).readout(Readout::linear).gate_bias(4.0)); },
               {"'gate_bias' is for the gated read-out", "linear"});
}

TEST(Reader, RefusesBadInput) {
  expect_error([] { attnkit::experiments::readout_from_string("attention"); },
               {"unknown read-out 'attention'", "none, linear, gated or softmax"});
  Reader reader(ReaderOptions(10).embedding(4).hidden(3));
  const auto doc = torch::zeros({2, 5}, torch::kInt64), query = torch::zeros({2, 3}, torch::kInt64);
  expect_error([&] { reader->forward(doc, query, torch::ones({2, 9}, torch::kBool)); },
               {"candidate must be bool (N, V) = (2, 10)", "[2, 9]"});
  expect_error([&] { reader->forward(doc + 10, query, torch::ones({2, 10}, torch::kBool)); },
               {"document ids must be in [0, 10)", "[10, 10]"});
  expect_error([&] { reader->forward(doc, query.slice(0, 0, 1), torch::ones({2, 10}, torch::kBool)); },
               {"same N"});
  expect_error([&] { linear_readout(torch::zeros({2, 5, 4}), torch::zeros({2, 3})); },
               {"linear_readout", "must be (N, k) = (2, 4)"});
  expect_error([] { Reader(ReaderOptions(1)); }, {"option 'vocab' must be >= 2, got 1"});
}

}  // namespace reader_test
