// Bad input to every public op raises one c10::Error at the op boundary whose
// message names the op and the offending argument. (Non-CPU tensors cannot be
// made on the CI machines, so the device checks are not exercised here.)
#include <attnkit/block_mask.h>
#include <attnkit/ops.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include "test_util.h"

#include <limits>

namespace attnkit::testing::bad_input_test {
namespace {

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

// Valid inputs: N = 2, H = 3, L = 4, S = 6, E = 5, M = 7.
constexpr int64_t N = 2, H = 3, L = 4, S = 6, E = 5, M = 7;
torch::Tensor Q() { return torch::randn({N, H, L, E}, f64()); }
torch::Tensor K() { return torch::randn({N, H, S, E}, f64()); }
torch::Tensor V() { return torch::randn({N, H, S, M}, f64()); }

using QkvOp = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;

/// The q/k/v checks shared by softmax, linear, clustered and sparse attention.
void expect_qkv_errors(const std::string& op, const QkvOp& call) {
  auto q = Q(), k = K(), v = V();
  ASSERT_NO_THROW(call(q, k, v)) << op << " rejects valid input";
  // Wrong rank.
  expect_error([&] { call(q[0], k, v); }, {op, "'q'", "dimensions"});
  expect_error([&] { call(q, k.unsqueeze(0), v); }, {op, "'k'", "dimensions"});
  expect_error([&] { call(q, k, v.flatten(0, 1)); }, {op, "'v'", "dimensions"});
  // Integer tensors.
  expect_error([&] { call(q.to(torch::kLong), k, v); }, {op, "'q'", "floating"});
  expect_error([&] { call(q, k.to(torch::kInt), v); }, {op, "'k'", "floating"});
  expect_error([&] { call(q, k, v.to(torch::kLong)); }, {op, "'v'", "floating"});
  // Mixed float32 / float64.
  expect_error([&] { call(q, k.to(torch::kFloat), v); }, {op, "'k'", "dtype"});
  expect_error([&] { call(q, k, v.to(torch::kFloat)); }, {op, "'v'", "dtype"});
  expect_error([&] { call(q.to(torch::kFloat), k, v); }, {op, "'k'", "dtype"});
  // Mismatched sizes.
  expect_error([&] { call(q, k.narrow(0, 0, 1), v); }, {op, "'k'", "batch size"});
  expect_error([&] { call(q, k.narrow(1, 0, 2), v); }, {op, "'k'", "head count"});
  expect_error([&] { call(q, k.narrow(3, 0, 4), v); }, {op, "'k'", "feature size"});
  expect_error([&] { call(q, k, v.narrow(0, 0, 1)); }, {op, "'v'", "batch size"});
  expect_error([&] { call(q, k, v.narrow(1, 0, 1)); }, {op, "'v'", "head count"});
  expect_error([&] { call(q, k, v.narrow(2, 0, 5)); }, {op, "'v'", "key count"});
  // Empty feature dimensions.
  expect_error([&] { call(q.narrow(3, 0, 0), k.narrow(3, 0, 0), v); }, {op, "E"});
  expect_error([&] { call(q, k, v.narrow(3, 0, 0)); }, {op, "M"});
  // Undefined tensor.
  expect_error([&] { call(torch::Tensor(), k, v); }, {op, "'q'", "undefined"});
  // Non-strided layouts: sparse COO, and mkldnn where libtorch has it.
  expect_error([&] { call(q.to_sparse(), k, v); }, {op, "'q'", "dense (strided)", "layout"});
  expect_error([&] { call(q, k.to_sparse(), v); }, {op, "'k'", "dense (strided)", "layout"});
  expect_error([&] { call(q, k, v.to_sparse()); }, {op, "'v'", "dense (strided)", "layout"});
  if (at::hasMKLDNN())
    expect_error([&] { call(q.to(torch::kFloat).to_mkldnn(), k, v); },
                 {op, "'q'", "dense (strided)", "layout"});
}

/// Checks of an int64 (N) lengths argument with upper bound `limit`.
void expect_lengths_errors(const std::string& op, const std::string& name, int64_t limit,
                           const std::function<void(const torch::Tensor&)>& call) {
  ASSERT_NO_THROW(call(i64({0, limit}))) << op << " rejects valid " << name;
  expect_error([&] { call(i64({-1, 2})); }, {op, name, "negative"});
  expect_error([&] { call(i64({limit + 1, 2})); }, {op, name, "larger"});
  expect_error([&] { call(i64({1, 2}).to(torch::kInt)); }, {op, name, "int64"});
  expect_error([&] { call(torch::ones({N}, f64())); }, {op, name, "int64"});
  expect_error([&] { call(i64({1, 2, 3})); }, {op, name, "shape"});
  expect_error([&] { call(i64({1, 2, 3, 4}).view({2, 2})); }, {op, name, "shape"});
  expect_error([&] { call(i64({1, 2}).to_sparse()); }, {op, name, "dense (strided)"});
}

// ---------------------------------------------------------------------------

TEST(BadInputSoftmax, TensorsAndSizes) {
  expect_qkv_errors("softmax_attention", [](const auto& q, const auto& k, const auto& v) {
    return softmax_attention(q, k, v);
  });
}

TEST(BadInputSoftmax, NonFiniteScale) {
  auto q = Q(), k = K(), v = V();
  for (double s : {kNaN, kInf, -kInf})
    expect_error([&] { softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().scale(s)); },
                 {"softmax_attention", "scale", "finite"});
}

TEST(BadInputSoftmax, KeyLengths) {
  auto q = Q(), k = K(), v = V();
  expect_lengths_errors("softmax_attention", "key_lengths", S, [&](const torch::Tensor& l) {
    softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().key_lengths(l));
  });
}

TEST(BadInputSoftmax, BiasNotBroadcastable) {
  auto q = Q(), k = K(), v = V();
  auto call = [&](const torch::Tensor& b) { softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().bias(b)); };
  ASSERT_NO_THROW(call(torch::zeros({L, S}, f64())));
  ASSERT_NO_THROW(call(torch::zeros({N, 1, 1, S}, f64())));
  ASSERT_NO_THROW(call(torch::zeros({1, H, L, 1}, f64())));
  expect_error([&] { call(torch::zeros({N, H, L, S - 1}, f64())); }, {"softmax_attention", "bias", "broadcast"});
  expect_error([&] { call(torch::zeros({L + 1, S}, f64())); }, {"softmax_attention", "bias", "broadcast"});
  expect_error([&] { call(torch::zeros({N + 1, 1, 1, 1}, f64())); }, {"softmax_attention", "bias"});
  expect_error([&] { call(torch::zeros({1, N, H, L, S}, f64())); }, {"softmax_attention", "bias"});
  expect_error([&] { call(torch::zeros({L, S}, torch::kFloat)); }, {"softmax_attention", "bias", "dtype"});
  expect_error([&] { call(torch::zeros({L, S}, torch::kLong)); }, {"softmax_attention", "bias"});
}

// ---------------------------------------------------------------------------

TEST(BadInputLinear, TensorsAndSizes) {
  expect_qkv_errors("linear_attention", [](const auto& q, const auto& k, const auto& v) {
    return linear_attention(q, k, v);
  });
}

TEST(BadInputLinear, BadEps) {
  auto q = Q(), k = K(), v = V();
  for (double eps : {kNaN, kInf, -1e-6})
    expect_error([&] { linear_attention(q, k, v, LinearAttentionFuncOptions().normalize(true).eps(eps)); },
                 {"linear_attention", "eps"});
}

TEST(BadInputLinear, FeatureMapFromString) {
  EXPECT_EQ(feature_map_from_string("identity"), FeatureMap::identity);
  EXPECT_EQ(feature_map_from_string("elu"), FeatureMap::elu);
  for (const char* name : {"relu", "", "elu+1"})
    expect_error([&] { feature_map_from_string(name); }, {"feature_map", "identity", "elu", name});
}

// ---------------------------------------------------------------------------

TEST(BadInputGated, TensorsAndSizes) {
  const std::string op = "gated_linear_attention";
  auto f = Q(), q = Q();
  auto a = torch::rand({N, H, L}, f64()), b = torch::rand({N, H, L}, f64());
  auto call = [&](const torch::Tensor& f_, const torch::Tensor& q_, const torch::Tensor& a_, const torch::Tensor& b_) {
    gated_linear_attention(f_, q_, a_, b_);
  };
  ASSERT_NO_THROW(call(f, q, a, b));
  // Wrong rank.
  expect_error([&] { call(f[0], q, a, b); }, {op, "'f'", "dimensions"});
  expect_error([&] { call(f, q.unsqueeze(0), a, b); }, {op, "'q'", "dimensions"});
  expect_error([&] { call(f, q, a.unsqueeze(-1), b); }, {op, "'alpha'", "dimensions"});
  expect_error([&] { call(f, q, a, b[0]); }, {op, "'beta'", "dimensions"});
  // Integer and mixed dtypes.
  expect_error([&] { call(f.to(torch::kLong), q, a, b); }, {op, "'f'", "floating"});
  expect_error([&] { call(f, q, a.to(torch::kInt), b); }, {op, "'alpha'", "floating"});
  expect_error([&] { call(f, q.to(torch::kFloat), a, b); }, {op, "'q'", "dtype"});
  expect_error([&] { call(f, q, a.to(torch::kFloat), b); }, {op, "'alpha'", "dtype"});
  expect_error([&] { call(f, q, a, b.to(torch::kFloat)); }, {op, "'beta'", "dtype"});
  // Mismatched sizes.
  expect_error([&] { call(f, q.narrow(2, 0, L - 1), a, b); }, {op, "'q'", "shape"});
  expect_error([&] { call(f, q.narrow(3, 0, E - 1), a, b); }, {op, "'q'", "shape"});
  expect_error([&] { call(f, q, a.narrow(0, 0, 1), b); }, {op, "'alpha'", "shape"});
  expect_error([&] { call(f, q, a.narrow(2, 0, L - 1), b); }, {op, "'alpha'", "shape"});
  expect_error([&] { call(f, q, a, b.narrow(1, 0, 1)); }, {op, "'beta'", "shape"});
  // Non-strided layouts.
  expect_error([&] { call(f.to_sparse(), q, a, b); }, {op, "'f'", "dense (strided)"});
  expect_error([&] { call(f, q.to_sparse(), a, b); }, {op, "'q'", "dense (strided)"});
  expect_error([&] { call(f, q, a.to_sparse(), b); }, {op, "'alpha'", "dense (strided)"});
  expect_error([&] { call(f, q, a, b.to_sparse()); }, {op, "'beta'", "dense (strided)"});
}

// ---------------------------------------------------------------------------

TEST(BadInputAgglomerative, TensorsAndSizes) {
  const std::string op = "agglomerative_attention";
  auto cq = torch::rand({N, H, L}, f64()), cr = torch::rand({N, H, S}, f64());
  auto v = V();
  auto call = [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c) {
    agglomerative_attention(a, b, c);
  };
  ASSERT_NO_THROW(call(cq, cr, v));
  expect_error([&] { call(cq.unsqueeze(-1), cr, v); }, {op, "'cq'", "dimensions"});
  expect_error([&] { call(cq, cr[0], v); }, {op, "'cr'", "dimensions"});
  expect_error([&] { call(cq, cr, v[0]); }, {op, "'v'", "dimensions"});
  expect_error([&] { call(cq.to(torch::kLong), cr, v); }, {op, "'cq'", "floating"});
  expect_error([&] { call(cq, cr.to(torch::kInt), v); }, {op, "'cr'", "floating"});
  expect_error([&] { call(cq, cr.to(torch::kFloat), v); }, {op, "'cr'", "dtype"});
  expect_error([&] { call(cq, cr, v.to(torch::kFloat)); }, {op, "'v'", "dtype"});
  expect_error([&] { call(cq, cr.narrow(0, 0, 1), v); }, {op, "'cr'", "batch size"});
  expect_error([&] { call(cq, cr.narrow(1, 0, 1), v); }, {op, "'cr'", "class count"});
  expect_error([&] { call(cq, cr, v.narrow(0, 0, 1)); }, {op, "'v'", "batch size"});
  expect_error([&] { call(cq, cr, v.narrow(1, 0, 2)); }, {op, "'v'", "class count"});
  expect_error([&] { call(cq, cr, v.narrow(2, 0, S - 1)); }, {op, "'v'", "reference length"});
  expect_error([&] { call(cq.to_sparse(), cr, v); }, {op, "'cq'", "dense (strided)"});
  expect_error([&] { call(cq, cr.to_sparse(), v); }, {op, "'cr'", "dense (strided)"});
  expect_error([&] { call(cq, cr, v.to_sparse()); }, {op, "'v'", "dense (strided)"});
}

TEST(BadInputAgglomerative, BadClip) {
  auto cq = torch::rand({N, H, L}, f64()), cr = torch::rand({N, H, S}, f64());
  auto v = V();
  for (double clip : {0.0, -1e-3, kNaN, kInf})
    expect_error([&] { agglomerative_attention(cq, cr, v, AgglomerativeAttentionFuncOptions().clip(clip)); },
                 {"agglomerative_attention", "clip"});
}

// ---------------------------------------------------------------------------

TEST(BadInputClustered, TensorsAndSizes) {
  expect_qkv_errors("clustered_attention", [](const auto& q, const auto& k, const auto& v) {
    return clustered_attention(q, k, v, ClusteredAttentionFuncOptions().clusters(2).bits(8));
  });
}

TEST(BadInputClustered, OptionsOutOfRange) {
  const std::string op = "clustered_attention";
  auto q = Q(), k = K(), v = V();
  auto base = ClusteredAttentionFuncOptions().clusters(2).bits(8).iterations(2);
  auto call = [&](const ClusteredAttentionFuncOptions& o) { clustered_attention(q, k, v, o); };
  // Boundary values are accepted.
  ASSERT_NO_THROW(call(ClusteredAttentionFuncOptions(base).clusters(L)));
  ASSERT_NO_THROW(call(ClusteredAttentionFuncOptions(base).clusters(1)));
  ASSERT_NO_THROW(call(ClusteredAttentionFuncOptions(base).bits(1)));
  ASSERT_NO_THROW(call(ClusteredAttentionFuncOptions(base).bits(63)));
  ASSERT_NO_THROW(call(ClusteredAttentionFuncOptions(base).iterations(0)));
  ASSERT_NO_THROW(call(ClusteredAttentionFuncOptions(base).topk(S)));
  // And everything beyond them rejected.
  expect_error([&] { call(ClusteredAttentionFuncOptions(base).clusters(L + 1)); }, {op, "clusters"});
  expect_error([&] { call(ClusteredAttentionFuncOptions(base).clusters(0)); }, {op, "clusters"});
  expect_error([&] { call(ClusteredAttentionFuncOptions(base).clusters(-3)); }, {op, "clusters"});
  expect_error([&] { call(ClusteredAttentionFuncOptions(base).bits(0)); }, {op, "bits"});
  expect_error([&] { call(ClusteredAttentionFuncOptions(base).bits(64)); }, {op, "bits"});
  expect_error([&] { call(ClusteredAttentionFuncOptions(base).bits(-1)); }, {op, "bits"});
  expect_error([&] { call(ClusteredAttentionFuncOptions(base).iterations(-1)); }, {op, "iterations"});
  expect_error([&] { call(ClusteredAttentionFuncOptions(base).topk(S + 1)); }, {op, "topk"});
  expect_error([&] { call(ClusteredAttentionFuncOptions(base).topk(-1)); }, {op, "topk"});
  for (double s : {kNaN, kInf})
    expect_error([&] { call(ClusteredAttentionFuncOptions(base).scale(s)); }, {op, "scale", "finite"});
}

TEST(BadInputClustered, KeyAndQueryLengths) {
  const std::string op = "clustered_attention";
  auto q = Q(), k = K(), v = V();
  auto base = ClusteredAttentionFuncOptions().clusters(2).bits(8).iterations(2);
  expect_lengths_errors(op, "key_lengths", S, [&](const torch::Tensor& l) {
    clustered_attention(q, k, v, ClusteredAttentionFuncOptions(base).key_lengths(l));
  });
  expect_lengths_errors(op, "query_lengths", L, [&](const torch::Tensor& l) {
    clustered_attention(q, k, v, ClusteredAttentionFuncOptions(base).query_lengths(l));
  });
}

// ---------------------------------------------------------------------------

TEST(BadInputSparse, TensorsAndSizes) {
  expect_qkv_errors("sparse_attention", [](const auto& q, const auto& k, const auto& v) {
    return sparse_attention(q, k, v, edges::full(L, S));
  });
}

TEST(BadInputSparse, NonFiniteScale) {
  auto q = Q(), k = K(), v = V();
  for (double s : {kNaN, -kInf})
    expect_error([&] { sparse_attention(q, k, v, edges::full(L, S), SparseAttentionFuncOptions().scale(s)); },
                 {"sparse_attention", "scale", "finite"});
}

TEST(BadInputSparse, MalformedEdgeLists) {
  const std::string op = "sparse_attention";
  auto q = Q(), k = K(), v = V();
  auto call = [&](const torch::Tensor& offsets, const torch::Tensor& columns) {
    sparse_attention(q, k, v, EdgeList{offsets, columns});
  };
  // Valid reference point: L = 4 rows {0, 5}, {}, {1, 2, 3}, {5}.
  ASSERT_NO_THROW(call(i64({0, 2, 2, 5, 6}), i64({0, 5, 1, 2, 3, 5})));
  // Sparse-layout offsets or columns.
  expect_error([&] { call(i64({0, 2, 2, 5, 6}).to_sparse(), i64({0, 5, 1, 2, 3, 5})); },
               {op, "edges.offsets", "dense (strided)"});
  expect_error([&] { call(i64({0, 2, 2, 5, 6}), i64({0, 5, 1, 2, 3, 5}).to_sparse()); },
               {op, "edges.columns", "dense (strided)"});
  // Offsets of the wrong length (L instead of L + 1, and L + 2).
  expect_error([&] { call(i64({0, 2, 2, 5}), i64({0, 5, 1, 2, 3})); }, {op, "offsets", "L + 1"});
  expect_error([&] { call(i64({0, 2, 2, 5, 6, 6}), i64({0, 5, 1, 2, 3, 5})); }, {op, "offsets", "L + 1"});
  // Decreasing offsets.
  expect_error([&] { call(i64({0, 3, 2, 5, 6}), i64({0, 1, 5, 2, 3, 5})); }, {op, "offsets", "non-decreasing"});
  // Not starting at 0 / not ending at nnz.
  expect_error([&] { call(i64({1, 2, 2, 5, 6}), i64({0, 5, 1, 2, 3, 5})); }, {op, "offsets", "start at 0"});
  expect_error([&] { call(i64({0, 2, 2, 5, 5}), i64({0, 5, 1, 2, 3, 5})); }, {op, "offsets", "end"});
  expect_error([&] { call(i64({0, 2, 2, 5, 7}), i64({0, 5, 1, 2, 3, 5})); }, {op, "offsets"});
  // Columns out of range.
  expect_error([&] { call(i64({0, 2, 2, 5, 6}), i64({0, 6, 1, 2, 3, 5})); }, {op, "columns", "outside"});
  expect_error([&] { call(i64({0, 2, 2, 5, 6}), i64({-1, 5, 1, 2, 3, 5})); }, {op, "columns", "outside"});
  // Unsorted and duplicate columns within a row.
  expect_error([&] { call(i64({0, 2, 2, 5, 6}), i64({0, 5, 2, 1, 3, 5})); }, {op, "columns", "increasing"});
  expect_error([&] { call(i64({0, 2, 2, 5, 6}), i64({0, 5, 1, 1, 3, 5})); }, {op, "columns", "increasing"});
  // Wrong dtypes and ranks.
  expect_error([&] { call(i64({0, 2, 2, 5, 6}).to(torch::kInt), i64({0, 5, 1, 2, 3, 5})); }, {op, "offsets", "int64"});
  expect_error([&] { call(i64({0, 2, 2, 5, 6}), i64({0, 5, 1, 2, 3, 5}).to(torch::kDouble)); }, {op, "columns", "int64"});
  expect_error([&] { call(i64({0, 2, 2, 5, 6}), i64({0, 5, 1, 2, 3, 5}).view({2, 3})); }, {op, "columns", "1-D"});
  expect_error([&] { call(i64({0, 2, 2, 5, 6}).view({1, 1, 5}), i64({0, 5, 1, 2, 3, 5})); }, {op, "offsets"});
  expect_error([&] { call(torch::Tensor(), i64({0})); }, {op, "offsets"});
  expect_error([&] { call(i64({0, 0, 0, 0, 0}), torch::Tensor()); }, {op, "columns"});
}

TEST(BadInputSparse, MalformedPerHeadEdgeLists) {
  const std::string op = "sparse_attention";
  auto q = Q(), k = K(), v = V();
  auto call = [&](const torch::Tensor& offsets, const torch::Tensor& columns) {
    sparse_attention(q, k, v, EdgeList{offsets, columns});
  };
  // H = 3 heads, each row {j} for j = row index (4 columns per head, 12 in all).
  auto cols = i64({0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3});
  auto offs = i64({0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 11, 12}).view({3, 5});
  ASSERT_NO_THROW(call(offs, cols));
  // Wrong number of heads.
  expect_error([&] { call(offs.narrow(0, 0, 2), cols); }, {op, "offsets", "H = 3"});
  expect_error([&] { call(torch::cat({offs, offs.narrow(0, 0, 1)}), cols); }, {op, "offsets", "H = 3"});
  // Wrong row length, decreasing, beyond nnz.
  expect_error([&] { call(offs.narrow(1, 0, 4), cols); }, {op, "offsets", "L + 1"});
  auto dec = offs.clone();
  dec[1][2] = 4;
  expect_error([&] { call(dec, cols); }, {op, "offsets", "non-decreasing"});
  auto beyond = offs.clone();
  beyond[2][4] = 13;
  expect_error([&] { call(beyond, cols); }, {op, "offsets"});
  // A bad column in the second head.
  auto bad = cols.clone();
  bad[5] = S;
  expect_error([&] { call(offs, bad); }, {op, "columns", "outside"});
  // Head 1 rows {0}, {2, 1} (unsorted), {3}, {}.
  auto unsorted_offs = i64({0, 1, 2, 3, 4, 4, 5, 7, 8, 8, 8, 9, 10, 11, 12}).view({3, 5});
  auto unsorted_cols = i64({0, 1, 2, 3, 0, 2, 1, 3, 0, 1, 2, 3});
  expect_error([&] { call(unsorted_offs, unsorted_cols); }, {op, "columns", "increasing"});
}

TEST(BadInputSparse, CheckEdgeListNamesTheCaller) {
  EdgeList bad{i64({0, 1}), i64({7})};
  expect_error([&] { check_edge_list(bad, 1, 3, 1, "my_module"); }, {"my_module", "columns"});
  EXPECT_NO_THROW(check_edge_list(edges::causal(5, 7), 5, 7, 2));
}

// ---------------------------------------------------------------------------

TEST(BadInputEdges, BuildersRejectBadSizes) {
  expect_error([] { edges::full(-1, 3); }, {"edges::full", "'L'"});
  expect_error([] { edges::causal(3, -2); }, {"edges::causal", "'S'"});
  expect_error([] { edges::local(4, -1); }, {"edges::local", "'span'"});
  expect_error([] { edges::segments(4, 0); }, {"edges::segments", "'segment'"});
  expect_error([] { edges::bp_tree(0); }, {"edges::bp_tree", "'n'"});
  expect_error([] { edges::star(0); }, {"edges::star", "'n'"});
  expect_error([] { edges::strided(4, 0); }, {"edges::strided", "'stride'"});
  expect_error([] { edges::by_name("diagonal", 4, 1); }, {"edges::by_name", "diagonal"});
}

// ---------------------------------------------------------------------------
// The torch.ops registration calls the same checks.

TEST(BadInputDispatcher, SoftmaxThroughTorchOps) {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("attnkit::softmax_attention", "")
                .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                     c10::optional<double>, bool, const c10::optional<torch::Tensor>&,
                                     const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&,
                                     int64_t, double, int64_t, double, c10::optional<int64_t>,
                                     const c10::optional<torch::Tensor>&, const c10::optional<torch::Tensor>&,
                                     const c10::optional<torch::Tensor>&, c10::IntArrayRef,
                                     const c10::optional<torch::Tensor>&, double)>();
  const std::vector<int64_t> blocks{128, 128};  // the schema's default block_size
  auto q = Q(), k = K(), v = V();
  auto good = op.call(q, k, v, c10::nullopt, true, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, 0, 0.0, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, blocks, c10::nullopt, 0.0);
  EXPECT_TRUE(torch::equal(good, softmax_attention(q, k, v, SoftmaxAttentionFuncOptions().causal(true))));
  expect_error([&] { op.call(q, k.narrow(3, 0, 4), v, c10::nullopt, false, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, 0, 0.0, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, blocks, c10::nullopt, 0.0); },
               {"softmax_attention", "'k'", "feature size"});
  expect_error([&] { op.call(q, k, v, kNaN, false, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, 0, 0.0, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, blocks, c10::nullopt, 0.0); },
               {"softmax_attention", "scale"});
  expect_error([&] { op.call(q, k, v, c10::nullopt, false, i64({1, S + 1}), c10::nullopt, c10::nullopt, 0, 10000.0, 0, 0.0, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, blocks, c10::nullopt, 0.0); },
               {"softmax_attention", "key_lengths"});
  expect_error([&] { op.call(q, k, v, c10::nullopt, false, c10::nullopt, c10::nullopt, torch::ones({q.size(1) + 1}), 0, 10000.0, 0, 0.0, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, blocks, c10::nullopt, 0.0); },
               {"softmax_attention", "'alibi_slopes'", "shape (H)"});
  expect_error([&] { op.call(q, k, v, c10::nullopt, false, c10::nullopt, c10::nullopt, c10::nullopt, 3, 10000.0, 0, 0.0, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, blocks, c10::nullopt, 0.0); },
               {"softmax_attention", "'rotary_dim'", "even number"});
  expect_error([&] { op.call(q, k, v, c10::nullopt, false, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, -1, 0.0, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, blocks, c10::nullopt, 0.0); },
               {"softmax_attention", "'window' must be >= 0"});
  expect_error([&] { op.call(q, k, v, c10::nullopt, false, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, 0, 1.0, 3, c10::nullopt, c10::nullopt, c10::nullopt, blocks, c10::nullopt, 0.0); },
               {"softmax_attention", "'dropout_p' must be in [0, 1)"});
  const auto mask = attnkit::create_block_mask(attnkit::masks::causal(q.size(2), k.size(2)), 1, 1, q.size(2), k.size(2));
  expect_error([&] { op.call(q, k, v, c10::nullopt, false, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, 0, 0.0, c10::nullopt, mask.kinds, c10::nullopt, mask.bits, blocks, c10::nullopt, 0.0); },
               {"softmax_attention", "needs all of block_kinds, block_partial_index and block_bits, got 2"});
  expect_error([&] { op.call(q, k, v, c10::nullopt, false, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, 0, 0.0, c10::nullopt, mask.kinds, mask.partial_index, mask.bits, {128}, c10::nullopt, 0.0); },
               {"softmax_attention", "'block_size' must be (q_block, kv_block), got 1 values"});
  const auto masked = op.call(q, k, v, c10::nullopt, false, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, 0, 0.0, c10::nullopt, mask.kinds, mask.partial_index, mask.bits, blocks, c10::nullopt, 0.0);
  EXPECT_TRUE(torch::allclose(masked, good, 1e-5, 1e-6));
  expect_error([&] { op.call(q, k, v, c10::nullopt, false, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, 0, 0.0, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, blocks, torch::zeros({q.size(1) + 1}), 0.0); },
               {"softmax_attention", "argument 'sinks' must be a floating CPU tensor of shape (H)"});
  expect_error([&] { op.call(q, k, v, c10::nullopt, false, c10::nullopt, c10::nullopt, c10::nullopt, 0, 10000.0, 0, 0.0, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt, blocks, c10::nullopt, -2.0); },
               {"softmax_attention", "option 'softcap' must be finite and >= 0"});
}

TEST(BadInputDispatcher, ClusteredAndSparseAndLinearThroughTorchOps) {
  auto q = Q(), k = K(), v = V();
  auto clustered = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnkit::clustered_attention", "")
                       .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                            int64_t, int64_t, int64_t, int64_t, bool, int64_t,
                                            c10::optional<double>, const c10::optional<torch::Tensor>&,
                                            const c10::optional<torch::Tensor>&)>();
  expect_error([&] { clustered.call(q, k, v, L + 1, 8, 2, 0, true, 0, c10::nullopt, c10::nullopt, c10::nullopt); },
               {"clustered_attention", "clusters"});
  expect_error([&] { clustered.call(q, k, v, 2, 8, 2, S + 1, true, 0, c10::nullopt, c10::nullopt, c10::nullopt); },
               {"clustered_attention", "topk"});

  auto sparse = c10::Dispatcher::singleton()
                    .findSchemaOrThrow("attnkit::sparse_attention", "")
                    .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                         const torch::Tensor&, const torch::Tensor&, c10::optional<double>,
                                         const c10::optional<torch::Tensor>&)>();
  expect_error([&] { sparse.call(q, k, v, i64({0, 1, 1, 1, 1}), i64({S}), c10::nullopt, c10::nullopt); },
               {"sparse_attention", "columns"});
  const auto full = edges::full(L, S);
  expect_error([&] { sparse.call(q, k, v, full.offsets, full.columns, c10::nullopt, torch::ones({q.size(1) + 1})); },
               {"sparse_attention", "'alibi_slopes'", "shape (H)"});

  auto linear = c10::Dispatcher::singleton()
                    .findSchemaOrThrow("attnkit::linear_attention", "")
                    .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                         c10::string_view, bool, bool, double, int64_t, double)>();
  expect_error([&] { linear.call(q, k, v, "softplus", false, false, 1e-6, 0, 1e4); }, {"feature_map", "softplus"});
  expect_error([&] { linear.call(q, k, v, "elu", true, false, -1.0, 0, 1e4); }, {"linear_attention", "eps"});
  expect_error([&] { linear.call(q, k, v, "elu", true, false, 1e-6, 3, 1e4); }, {"linear_attention", "rotary_dim"});
}

}  // namespace
}  // namespace attnkit::testing::bad_input_test
