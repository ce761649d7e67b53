// MultiheadAttention and the mechanism registry (include/attnkit/nn/multihead.h):
// "full" against a hand-written composite in float64 (projections, per-head
// masked softmax, output projection), every registered mechanism end to end,
// the identities that tie mechanisms to exact attention, how attend() maps
// names and options onto the ops, its errors, and gradients.
#include <attnkit/nn/multihead.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

namespace attnkit::nn::multihead_test {
namespace {

using testing::all_finite;
using testing::expect_error;
using testing::expect_gradients_match;
using testing::f64;
using testing::i64;
using testing::max_abs;
using testing::rel_err;

/// Two float64 computations of the same softmax attention by different routes
/// (composite vs module, sparse mask vs dense, centroid of one query vs the
/// query): ~1e-15 apart; 1e-12 leaves room and still catches any real error.
constexpr double kSameMathTol = 1e-12;
/// Softmax is invariant to adding one constant to a row of scores, so the key
/// bias gets no gradient in softmax-normalised mechanisms; float64 rounding
/// leaves ~1e-16 of the other gradients' size.
constexpr double kShiftInvariantTol = 1e-10;

torch::Tensor project(Linear& lin, const torch::Tensor& x) {
  auto y = torch::matmul(x, lin->weight.t());
  return lin->bias.defined() ? y + lin->bias : y;
}

/// The attention weights written out: x W^T + b projections, for each head h
/// the features [h dh, (h+1) dh), a masked softmax of q k^T / sqrt(dh) built
/// with loops (causal: j <= i + S - L; keys j >= len[n] hidden; no visible key:
/// zero row). (N, H, L, S).
torch::Tensor composite_weights(MultiheadAttention& m, const torch::Tensor& query, const torch::Tensor& key,
                                const std::vector<int64_t>& lengths, bool causal) {
  torch::NoGradGuard no_grad;
  const int64_t N = query.size(0), L = query.size(1), S = key.size(1);
  const int64_t D = m->options.width(), H = m->options.heads(), dh = D / H;
  auto q = project(m->q_proj, query), k = project(m->k_proj, key);
  auto weights = torch::zeros({N, H, L, S}, f64());
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      auto qh = q[n].narrow(1, h * dh, dh), kh = k[n].narrow(1, h * dh, dh);
      auto scores = torch::matmul(qh, kh.t()) / std::sqrt(double(dh));  // (L, S)
      auto a = weights[n][h];
      for (int64_t i = 0; i < L; ++i) {
        std::vector<int64_t> seen;
        for (int64_t j = 0; j < S; ++j) {
          const bool visible = (lengths.empty() || j < lengths[n]) && (!causal || j <= i + (S - L));
          if (visible) seen.push_back(j);
        }
        if (seen.empty()) continue;
        double mx = -inf, sum = 0;
        for (int64_t j : seen) mx = std::max(mx, scores[i][j].item<double>());
        for (int64_t j : seen) sum += std::exp(scores[i][j].item<double>() - mx);
        for (int64_t j : seen) a[i][j] = std::exp(scores[i][j].item<double>() - mx) / sum;
      }
    }
  return weights;
}

/// The multi-head formula written out: the composite weights of each head
/// times its features [h dh, (h+1) dh) of the projected values, the heads
/// concatenated and projected by W^O.
torch::Tensor composite_mha(MultiheadAttention& m, const torch::Tensor& query, const torch::Tensor& key,
                            const torch::Tensor& value, const std::vector<int64_t>& lengths, bool causal) {
  const auto weights = composite_weights(m, query, key, lengths, causal);
  torch::NoGradGuard no_grad;
  const int64_t N = query.size(0), L = query.size(1);
  const int64_t D = m->options.width(), H = m->options.heads(), dh = D / H;
  auto v = project(m->v_proj, value);
  auto concat = torch::zeros({N, L, D}, f64());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      concat[n].narrow(1, h * dh, dh).copy_(torch::matmul(weights[n][h], v[n].narrow(1, h * dh, dh)));
  return project(m->out_proj, concat);
}

MultiheadAttention make_mha(int64_t D, int64_t H, const std::string& mechanism = "full", bool bias = true) {
  MultiheadAttention m(MultiheadAttentionOptions(D, H).bias(bias).attention(mechanism));
  m->to(torch::kDouble);
  return m;
}

TEST(MultiheadTest, FullEqualsComposite) {
  torch::manual_seed(31);
  const int64_t N = 2, D = 6;
  for (int64_t H : {1, 2, 3})
    for (auto [L, S] : {std::pair<int64_t, int64_t>{4, 4}, {3, 5}, {5, 3}}) {
      SCOPED_TRACE("H " + std::to_string(H) + " L " + std::to_string(L) + " S " + std::to_string(S));
      auto m = make_mha(D, H);
      auto query = torch::randn({N, L, D}, f64()), key = torch::randn({N, S, D}, f64());
      auto value = torch::randn({N, S, D}, f64());
      auto out = m->forward(query, key, value);
      EXPECT_EQ(out.sizes(), (std::vector<int64_t>{N, L, D}));
      EXPECT_LT(rel_err(out, composite_mha(m, query, key, value, {}, false)), kSameMathTol);
      // Causal, bottom-right aligned (L > S leaves the first L - S queries empty).
      EXPECT_LT(rel_err(m->forward(query, key, value, {}, true), composite_mha(m, query, key, value, {}, true)),
                kSameMathTol);
      // Padding, a zero length included, with and without causal.
      const std::vector<int64_t> lens{S - 1, 0};
      EXPECT_LT(rel_err(m->forward(query, key, value, i64(lens)),
                        composite_mha(m, query, key, value, lens, false)),
                kSameMathTol);
      EXPECT_LT(rel_err(m->forward(query, key, value, i64(lens), true),
                        composite_mha(m, query, key, value, lens, true)),
                kSameMathTol);
    }
}

// need_weights (attention_weights): the composite's softmax per head, or its
// head mean; masks as forward's (empty rows zero), the mechanism's own options
// (a window), the weights before dropout, differentiable; refused for a
// mechanism that forms no (L, S) matrix.
TEST(MultiheadTest, AttentionWeightsAreTheCompositesSoftmax) {
  torch::manual_seed(37);
  const int64_t N = 2, D = 6;
  for (int64_t H : {1, 2, 3})
    for (auto [L, S] : {std::pair<int64_t, int64_t>{1, 1}, {4, 4}, {3, 5}, {5, 3}})
      for (bool causal : {false, true}) {
        SCOPED_TRACE("H " + std::to_string(H) + " L " + std::to_string(L) + " S " + std::to_string(S) +
                     (causal ? " causal" : ""));
        auto m = make_mha(D, H);
        auto query = torch::randn({N, L, D}, f64()), key = torch::randn({N, S, D}, f64());
        const std::vector<int64_t> lens{S, S - 1};  // S - 1 = 0 at S = 1: a batch with no visible key
        const auto want = composite_weights(m, query, key, lens, causal);
        const auto per_head = m->attention_weights(query, key, i64(lens), causal, /*average=*/false);
        EXPECT_EQ(per_head.sizes(), (std::vector<int64_t>{N, H, L, S}));
        EXPECT_LT(max_abs(per_head - want), kSameMathTol);
        const auto averaged = m->attention_weights(query, key, i64(lens), causal);
        EXPECT_EQ(averaged.sizes(), (std::vector<int64_t>{N, L, S}));
        EXPECT_LT(max_abs(averaged - want.mean(1)), kSameMathTol);
      }
  // Differentiable: the weights' gradients towards query and key match central
  // differences (causal, L != S, per head), and reach the query projection.
  auto m = make_mha(D, 2);
  testing::expect_gradients_match(
      [&](const std::vector<torch::Tensor>& x) { return m->attention_weights(x[0], x[1], {}, true, false); },
      {torch::randn({2, 3, D}, f64()), torch::randn({2, 5, D}, f64())});
  // The float32 fast path (the exact kernel) against the float64 composite:
  // weights in [0, 1] from scores of six-term float32 products; 1e-5 leaves
  // room over float32's 6e-8 per operation and catches any wrong mask or scale.
  {
    MultiheadAttention m32(MultiheadAttentionOptions(D, 3));
    auto m64 = std::dynamic_pointer_cast<MultiheadAttentionImpl>(m32->clone());
    m64->to(torch::kDouble);
    MultiheadAttention h64(m64);
    auto q32 = torch::randn({2, 7, D}), k32 = torch::randn({2, 9, D});
    const std::vector<int64_t> lens{9, 4};
    const auto want = composite_weights(h64, q32.to(torch::kDouble), k32.to(torch::kDouble), lens, true);
    const auto got = m32->attention_weights(q32, k32, i64(lens), true, false);
    EXPECT_EQ(got.scalar_type(), torch::kFloat);
    EXPECT_LT(max_abs(got.to(torch::kDouble) - want), 1e-5);
  }
  auto x = torch::randn({1, 4, D}, f64());
  (m->attention_weights(x, x) * torch::randn({1, 4, 4}, f64())).sum().backward();
  ASSERT_TRUE(m->q_proj->weight.grad().defined());
  EXPECT_GT(m->q_proj->weight.grad().abs().max().item<double>(), 0);
  // The window the spec gives: keys more than window - 1 before a query get 0.
  auto windowed = make_mha(D, 2, "full:window=2");
  const auto w = windowed->attention_weights(x, x, {}, /*causal=*/true, /*average=*/false);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 4; ++j)
      if (j > i || j < i - 1) EXPECT_EQ(w[0][0][i][j].item<double>(), 0) << i << ", " << j;
  EXPECT_LT(max_abs(w.sum(-1) - 1), kSameMathTol);
  // Training mode with attention dropout: the weights before dropout.
  MultiheadAttention dropped(MultiheadAttentionOptions(D, 2).dropout(0.5));
  dropped->to(torch::kDouble);
  dropped->eval();
  const auto eval_weights = dropped->attention_weights(x, x);
  dropped->train();
  EXPECT_LT(max_abs(dropped->attention_weights(x, x) - eval_weights), kSameMathTol);
  // Refused where no (L, S) matrix exists, with the exact mechanism named.
  auto linear = make_mha(D, 2, "linear");
  expect_error([&] { linear->attention_weights(x, x); },
               {"MultiheadAttention.attention_weights", "need_weights", "'full'", "'linear'"});
}

TEST(MultiheadTest, ZeroLengthGivesOutputBiasOnly) {
  torch::manual_seed(32);
  auto m = make_mha(4, 2);
  auto x = torch::randn({2, 3, 4}, f64());
  auto out = m->forward(x, x, x, i64({3, 0}));
  EXPECT_TRUE(all_finite(out));
  EXPECT_LT(max_abs(out[1] - m->out_proj->bias.detach().expand({3, 4})), kSameMathTol);
}

TEST(MultiheadTest, NoBiasOption) {
  torch::manual_seed(33);
  auto m = make_mha(4, 2, "full", /*bias=*/false);
  EXPECT_FALSE(m->q_proj->bias.defined());
  EXPECT_FALSE(m->out_proj->bias.defined());
  EXPECT_EQ(m->parameters().size(), 4u);
  auto x = torch::randn({1, 3, 4}, f64());
  EXPECT_LT(rel_err(m->forward(x, x, x), composite_mha(m, x, x, x, {}, false)), kSameMathTol);
}

TEST(MultiheadTest, MechanismNamesAreTheDocumentedList) {
  EXPECT_EQ(mechanism_names(),
            (std::vector<std::string>{"full", "linear", "causal-linear", "gated-linear",
                                      "agglomerative", "clustered",
                                      "improved-clustered",
                                      "sparse-full", "sparse-causal", "sparse-local", "sparse-local-causal",
                                      "sparse-segments", "sparse-segments-causal", "sparse-bp-tree",
                                      "sparse-star", "sparse-strided", "sparse-random", "sac", "none"}));
}

/// `name` with small settings for every option it has (clusters, topk,
/// iterations, and the pattern parameter of sparse patterns).
std::string small_spec(const std::string& name) {
  std::string spec = name;
  for (const auto& o : find_mechanism(name).options) {
    std::string value;
    if (o.key == "clusters" || o.key == "topk" || o.key == "iterations") value = "3";
    if (o.key == "span" || o.key == "segment" || o.key == "stride") value = "2";
    if (!value.empty()) spec += (spec == name ? ":" : ",") + o.key + "=" + value;
  }
  return spec;
}

/// Mechanisms whose rows are softmax-normalised (a key bias cannot change them).
bool softmax_normalised(const std::string& name) { return name.find("linear") == std::string::npos; }

TEST(MultiheadTest, EveryMechanismRunsAndTrains) {
  // L = 7: odd (bp-tree over 4 tokens) and >= 2 (star with 6 satellites).
  const int64_t N = 2, L = 7, D = 8, H = 2;
  for (const auto& name : mechanism_names()) {
    SCOPED_TRACE(name);
    torch::manual_seed(34);
    if (!find_mechanism(name).make) continue;  // agglomerative: a layer of its own
    MultiheadAttention m(MultiheadAttentionOptions(D, H).attention(small_spec(name)));
    m->to(torch::kDouble);
    auto x = torch::randn({N, L, D}, f64()).requires_grad_(true);
    auto out = m->forward(x, x, x);
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{N, L, D}));
    EXPECT_TRUE(all_finite(out));
    (out * torch::randn_like(out)).sum().backward();
    ASSERT_TRUE(x.grad().defined());
    EXPECT_TRUE(all_finite(x.grad()));
    EXPECT_GT(max_abs(x.grad()), 0.0);
    const double k_weight_grad = max_abs(m->k_proj->weight.grad());
    for (const auto& p : m->named_parameters()) {
      SCOPED_TRACE(p.key());
      // `none` (each position's own value) never reads queries or keys.
      const bool unused = name == "none" && (p.key().rfind("q_proj.", 0) == 0 || p.key().rfind("k_proj.", 0) == 0);
      if (unused) {
        EXPECT_FALSE(p.value().grad().defined());
        continue;
      }
      ASSERT_TRUE(p.value().grad().defined());
      EXPECT_TRUE(all_finite(p.value().grad()));
      if (p.key() == "k_proj.bias" && softmax_normalised(name))
        EXPECT_LE(max_abs(p.value().grad()), kShiftInvariantTol * k_weight_grad);
      else
        EXPECT_GT(max_abs(p.value().grad()), 0.0);
    }
  }
}

TEST(MultiheadTest, FullGradientsMatchFiniteDifferences) {
  torch::manual_seed(35);
  auto m = make_mha(4, 2);
  std::vector<Linear*> lins{&m->q_proj, &m->k_proj, &m->v_proj, &m->out_proj};
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    std::vector<torch::Tensor> inputs{torch::randn({2, 2, 4}, f64()), torch::randn({2, 3, 4}, f64()),
                                      torch::randn({2, 3, 4}, f64())};
    for (auto* lin : lins) {
      inputs.push_back((*lin)->weight.detach());
      inputs.push_back((*lin)->bias.detach());
    }
    auto len = i64({3, 2});
    expect_gradients_match(
        [&](const std::vector<torch::Tensor>& in) {
          for (size_t l = 0; l < lins.size(); ++l) {
            (*lins[l])->weight = in[3 + 2 * l];
            (*lins[l])->bias = in[4 + 2 * l];
          }
          return m->forward(in[0], in[1], in[2], len, causal);
        },
        inputs);
  }
}

// --- Identities with exact attention ---------------------------------------------------------

/// The same module (same parameters) under another mechanism.
torch::Tensor run_as(MultiheadAttention& m, const std::string& spec, const torch::Tensor& x,
                     const torch::Tensor& lengths = {}, bool causal = false) {
  const std::string saved = m->options.attention();
  m->set_attention(spec);
  auto out = m->forward(x, x, x, lengths, causal);
  m->set_attention(saved);
  return out;
}

TEST(MultiheadTest, SparseFullAndCausalEqualFull) {
  torch::manual_seed(36);
  auto m = make_mha(6, 3);
  auto x = torch::randn({2, 5, 6}, f64());
  auto full = run_as(m, "full", x);
  EXPECT_LT(rel_err(run_as(m, "sparse-full", x), full), kSameMathTol);
  auto causal = run_as(m, "full", x, {}, true);
  EXPECT_LT(rel_err(run_as(m, "sparse-causal", x), causal), kSameMathTol);
  // A local window at least as wide as the sequence is full attention too.
  EXPECT_LT(rel_err(run_as(m, "sparse-local:span=4", x), full), kSameMathTol);
  EXPECT_GT(rel_err(causal, full), 1e-3) << "the test inputs must tell causal from full";
}

TEST(MultiheadTest, ImprovedClusteredWithAllKeysEqualsFull) {
  torch::manual_seed(37);
  auto m = make_mha(6, 2);
  auto x = torch::randn({2, 6, 6}, f64());
  for (int64_t topk : {6, 100}) {  // 100 is clamped to S = 6
    SCOPED_TRACE("topk " + std::to_string(topk));
    for (int64_t clusters : {1, 2}) {
      auto mech = std::string("improved-clustered:clusters=" + std::to_string(clusters) + ",topk=" + std::to_string(topk));
      EXPECT_LT(rel_err(run_as(m, mech, x), run_as(m, "full", x)), kSameMathTol);
      auto lens = i64({4, 6});
      EXPECT_LT(rel_err(run_as(m, mech, x, lens), run_as(m, "full", x, lens)), kSameMathTol);
    }
  }
}

TEST(MultiheadTest, ClusteredWithOneQueryPerClusterEqualsFull) {
  torch::manual_seed(38);
  auto m = make_mha(6, 2);
  auto x = torch::randn({2, 5, 6}, f64());  // distinct queries: distinct 63-bit hashes
  for (int64_t clusters : {5, 100}) {       // 100 is clamped to L = 5
    SCOPED_TRACE("clusters " + std::to_string(clusters));
    auto mech = std::string("clustered:clusters=" + std::to_string(clusters));
    EXPECT_LT(rel_err(run_as(m, mech, x), run_as(m, "full", x)), kSameMathTol);
    auto lens = i64({2, 5});
    EXPECT_LT(rel_err(run_as(m, mech, x, lens), run_as(m, "full", x, lens)), kSameMathTol);
  }
  // Fewer clusters than queries is an approximation: it must differ.
  EXPECT_GT(rel_err(run_as(m, "clustered:clusters=1", x), run_as(m, "full", x)),
            1e-3);
}

// --- attend(): names onto ops, options read -------------------------------------------------

TEST(MultiheadTest, AttendMapsNamesOntoOps) {
  torch::manual_seed(39);
  const int64_t N = 2, H = 2, L = 7, E = 3;
  auto q = torch::randn({N, H, L, E}, f64()), k = torch::randn({N, H, L, E}, f64());
  auto v = torch::randn({N, H, L, 4}, f64());
  auto lens = i64({5, 7});
  auto same = [](const torch::Tensor& a, const torch::Tensor& b) { return rel_err(a, b) < kSameMathTol; };

  EXPECT_TRUE(same(attend("full", q, k, v, {true, lens}),
                   softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true).key_lengths(lens))));
  // linear: elu feature map, normalised by default; causal-linear is causal regardless of the flag.
  auto lin = LinearAttentionFuncOptions().feature_map(FeatureMap::elu).normalize(true);
  EXPECT_TRUE(same(attend("linear", q, k, v), linear_attention(q, k, v, lin)));
  EXPECT_TRUE(same(attend("linear", q, k, v, {true}),
                   linear_attention(q, k, v, LinearAttentionFuncOptions(lin).causal(true))));
  EXPECT_TRUE(same(attend("causal-linear", q, k, v),
                   linear_attention(q, k, v, LinearAttentionFuncOptions(lin).causal(true))));
  EXPECT_TRUE(same(attend("linear:feature_map=identity,normalize=false", q, k, v),
                   linear_attention(q, k, v)));
  // gated-linear: the cheap-linear-attention paper's gate f = sigmoid(k) * v,
  // alpha = beta = 1, i.e. identity-map linear attention with keys = values = f
  // (E == M needed).
  auto v3 = torch::randn({N, H, L, E}, f64());
  auto f = torch::sigmoid(k) * v3;
  EXPECT_TRUE(same(attend("gated-linear", q, k, v3), linear_attention(q, f, f)));
  EXPECT_TRUE(same(attend("gated-linear", q, k, v3, {true}),
                   linear_attention(q, f, f, LinearAttentionFuncOptions().causal(true))));
  // clustered: clusters clamped to L, the other options passed through.
  auto clus = ClusteredAttentionFuncOptions().clusters(3).bits(16).iterations(2).seed(9).key_lengths(lens);
  EXPECT_TRUE(same(attend("clustered:clusters=3,bits=16,iterations=2,seed=9", q, k, v,
                          {false, lens}),
                   clustered_attention(q, k, v, clus)));
  EXPECT_TRUE(same(attend("improved-clustered:clusters=3,bits=16,iterations=2,seed=9,topk=2", q,
                          k, v, {false, lens}),
                   clustered_attention(q, k, v, ClusteredAttentionFuncOptions(clus).topk(2))));
  EXPECT_TRUE(same(attend("clustered:clusters=50", q, k, v),
                   clustered_attention(q, k, v, ClusteredAttentionFuncOptions().clusters(L))));
  EXPECT_TRUE(same(attend("improved-clustered:clusters=50,topk=50", q, k, v),
                   clustered_attention(q, k, v, ClusteredAttentionFuncOptions().clusters(L).topk(L))));
  // sparse-<pattern>: the pattern over L nodes with its parameter (span, segment, stride); bp-tree over (L+1)/2
  // tokens and star over L-1 satellites, so that the node count is L.
  for (const std::string p : {"full", "causal", "local", "local-causal", "segments", "segments-causal", "strided"}) {
    SCOPED_TRACE(p);
    const auto& param = find_mechanism("sparse-" + p).options;
    const std::string spec = "sparse-" + p + (param.empty() ? "" : ":" + param[0].key + "=3");
    EXPECT_TRUE(same(attend(spec, q, k, v),
                     sparse_attention(q, k, v, edges::by_name(p, L, 3))));
  }
  EXPECT_TRUE(same(attend("sparse-bp-tree", q, k, v),
                   sparse_attention(q, k, v, edges::bp_tree(4))));
  EXPECT_TRUE(same(attend("sparse-star", q, k, v),
                   sparse_attention(q, k, v, edges::star(6))));
}

// --- Errors -----------------------------------------------------------------------------------

TEST(MultiheadTest, UnknownMechanismListsKnownNames) {
  auto q = torch::zeros({1, 1, 3, 2});
  std::vector<std::string> fragments{"unknown attention mechanism 'softmax'", "known:"};
  for (const auto& n : mechanism_names()) fragments.push_back(n);
  expect_error([&] { attend("softmax", q, q, q); }, fragments);
  expect_error([&] { MultiheadAttention(MultiheadAttentionOptions(4, 2).attention("sparse-dilated")); },
               {"unknown attention mechanism 'sparse-dilated'", "sparse-local"});
  expect_error([&] { MultiheadAttention(MultiheadAttentionOptions(4, 2).attention("sparse-causal:span=3")); },
               {"mechanism 'sparse-causal' has no option 'span'", "it takes none"});
  expect_error([&] { MultiheadAttention(MultiheadAttentionOptions(4, 2).attention("full:span=3")); },
               {"mechanism 'full' has no option 'span'", "accepted: window"});
  expect_error([&] { MultiheadAttention(MultiheadAttentionOptions(4, 2).attention("clustered:topk=3")); },
               {"'clustered' has no option 'topk'", "accepted: clusters, bits"});
  expect_error([&] { MultiheadAttention(MultiheadAttentionOptions(4, 2).attention("clustered:clusters=x")); },
               {"clusters", "must be an integer", "'x'"});
  expect_error([&] { MultiheadAttention(MultiheadAttentionOptions(4, 2).attention("agglomerative")); },
               {"agglomerative", "whole attention layer", "nn::AgglomerativeAttention"});
}

TEST(MultiheadTest, UnsupportedMasksRaiseClearErrors) {
  const int64_t D = 4, H = 2;
  auto x = torch::zeros({2, 5, D});
  auto lens = i64({5, 3});
  auto with = [&](const std::string& name) {
    return MultiheadAttention(MultiheadAttentionOptions(D, H).attention(name));
  };
  for (const std::string name : {"linear", "causal-linear", "gated-linear"})
    expect_error([&] { with(name)->forward(x, x, x, lens); },
                 {name + ": this mechanism does not support key_lengths"});
  for (const std::string name : {"clustered", "improved-clustered"})
    expect_error([&] { with(name)->forward(x, x, x, {}, true); }, {name + ":", "causal"});
  for (const std::string name : {"sparse-local", "sparse-full", "sparse-strided"}) {
    expect_error([&] { with(name)->forward(x, x, x, lens); }, {name + ":", "key_lengths"});
    expect_error([&] { with(name)->forward(x, x, x, {}, true); },
                 {name + ":", "causal", "causal pattern"});
    expect_error([&] { with(name)->forward(x, torch::zeros({2, 6, D}), torch::zeros({2, 6, D})); },
                 {name + ":", "L == S", "L = 5, S = 6"});
  }
  expect_error([&] { attend("gated-linear", torch::zeros({1, 2, 3, 4}),
                            torch::zeros({1, 2, 3, 4}), torch::zeros({1, 2, 3, 5})); },
               {"gated-linear", "M == E", "E = 4, M = 5"});
  expect_error([&] { with("sparse-bp-tree")->forward(torch::zeros({1, 4, D}), torch::zeros({1, 4, D}),
                                                     torch::zeros({1, 4, D})); },
               {"sparse-bp-tree", "odd", "4"});
  expect_error([&] { with("sparse-star")->forward(torch::zeros({1, 1, D}), torch::zeros({1, 1, D}),
                                                  torch::zeros({1, 1, D})); },
               {"sparse-star", "at least 2"});
}

TEST(MultiheadTest, AttendRejectsWrongRankForEveryMechanism) {
  // attend() is public: a wrong-rank q must give the op's (or attend's) clear
  // error naming 'q', whatever the mechanism, not a bare index error.
  auto q3 = torch::zeros({2, 5, 4}), q2 = torch::zeros({5, 4}), k = torch::zeros({1, 2, 5, 4});
  for (const auto& name : mechanism_names()) {
    SCOPED_TRACE(name);
    if (!find_mechanism(name).make) continue;  // agglomerative takes class weights
    expect_error([&] { attend(name, q2, k, k); }, {"'q'", "4 dimensions"});
    expect_error([&] { attend(name, q3, k, k); }, {"'q'", "4 dimensions"});
  }
}

TEST(MultiheadTest, RejectsBadInput) {
  expect_error([] { MultiheadAttention(MultiheadAttentionOptions(6, 4)); },
               {"MultiheadAttention", "width (6)", "heads (4)"});
  expect_error([] { MultiheadAttention(MultiheadAttentionOptions(4, 0)); }, {"MultiheadAttention", "heads (0)"});
  MultiheadAttention m(MultiheadAttentionOptions(4, 2));
  auto x = torch::zeros({2, 3, 4});
  expect_error([&] { m->forward(x[0], x, x); }, {"MultiheadAttention", "'query'", "3 dimensions"});
  expect_error([&] { m->forward(torch::zeros({2, 3, 5}), x, x); }, {"MultiheadAttention", "'query'", "feature size"});
  expect_error([&] { m->forward(x, torch::zeros({2, 3, 3}), x); }, {"MultiheadAttention", "'key'", "feature size"});
  expect_error([&] { m->forward(x, x, torch::zeros({2, 3, 2})); }, {"MultiheadAttention", "'value'", "feature size"});
  expect_error([&] { m->forward(x, torch::zeros({1, 3, 4}), x); }, {"MultiheadAttention", "'key'", "batch size N"});
  expect_error([&] { m->forward(x, x, torch::zeros({2, 4, 4})); }, {"MultiheadAttention", "'value'", "length S"});
  expect_error([&] { m->forward(x, x, x, i64({3, 4})); }, {"softmax_attention", "'key_lengths'"});
  expect_error([&] { m->forward(x, x, x.to(torch::kInt)); }, {"MultiheadAttention", "'value'", "floating"});
}

}  // namespace
}  // namespace attnkit::nn::multihead_test
