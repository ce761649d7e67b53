// Fuzz target: every public op of include/attnkit/ops.h through the C++ API.
//
// The input chooses the op, its shapes (0 included), each tensor's layout
// (contiguous, transposed, stepped, expanded, offset), dtype, values (with
// NaN, inf, huge and tiny entries), options (NaN, inf, huge, negative),
// key/query lengths, biases and edge lists (valid, per head, malformed), and
// whether to run backward; or it builds structures: edge patterns, block
// masks (built, expanded and combined, then each of their tensors broken), and
// score modifier programs (score_programs). Invariants (fuzz_util.h's violation() aborts):
//   - an op either returns or throws a c10::Error whose message names the op;
//     any other exception, a crash, a hang (-timeout) or a sanitizer report fails;
//   - backward after a successful forward does not throw;
//   - moderate input (finite, |x| <= 4.5, moderate options): finite output and
//     gradients, and a float32 output within a stated bound of the same op run
//     in float64 (the composite path), the "silently different result" check.
#include <attnkit/block_mask.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>

#include "fuzz_util.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <functional>
#include <sstream>

using namespace attnkit;
using namespace attnkit::fuzz;

namespace {

/// One call of an op: its name, the floating inputs that may require grad, and
/// the oracle, set by the op's case when the input is moderate.
struct Outcome {
  const char* op = "";
  std::vector<torch::Tensor> inputs;
  torch::Tensor out;
  bool expect_finite = false;
  torch::Tensor expected;  // float64 oracle of a float32 call (undefined: none)
  double tolerance = 0;    // max |out - expected| allowed
};

/// What the invariants were checked on; printed at exit with ATTNKIT_FUZZ_STATS=1.
struct Stats {
  long calls = 0, errors = 0, finite_checked = 0, compared = 0, backward = 0, programs = 0, programs_run = 0;
  ~Stats() {
    if (std::getenv("ATTNKIT_FUZZ_STATS") != nullptr)
      std::fprintf(stderr,
                   "ops_fuzz stats: %ld op calls, %ld refused with an error, %ld outputs checked finite, "
                   "%ld float32 outputs compared with float64, %ld backward passes; %ld score programs, "
                   "%ld of them run\n",
                   calls, errors, finite_checked, compared, backward, programs, programs_run);
  }
} stats;

torch::Tensor lengths(FuzzedDataProvider& in, int64_t n, int64_t max) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: {  // out of range
      std::vector<int64_t> v(n);
      for (auto& x : v) x = in.ConsumeIntegralInRange<int64_t>(-2, max + 2);
      return torch::tensor(v, torch::kLong);
    }
    case 1:  // wrong dtype
      return torch::full({n}, max, torch::kInt);
    case 2:  // wrong shape
      return torch::full({n + 1}, max, torch::kLong);
    case 3:
    case 4: {
      std::vector<int64_t> v(n);
      for (auto& x : v) x = in.ConsumeIntegralInRange<int64_t>(0, max);
      auto t = torch::tensor(v, torch::kLong);
      if (n > 0 && in.ConsumeBool()) t = t.repeat({2}).slice(0, 0, 2 * n, 2);  // strided
      return t;
    }
    default: return {};
  }
}

c10::optional<double> maybe_scale(FuzzedDataProvider& in) {
  if (in.ConsumeBool()) return c10::nullopt;
  return awkward_double(in, 0.3);
}

bool scale_moderate(const c10::optional<double>& s, int64_t E) {
  return !s.has_value() ? E > 0 : std::isfinite(*s) && std::abs(*s) <= 4.5;
}

/// An additive bias broadcastable to (N, H, L, S) (or perturbed into not).
torch::Tensor bias(FuzzedDataProvider& in, TensorMaker& tm, int64_t N, int64_t H, int64_t L,
                   int64_t S, torch::ScalarType dtype) {
  if (in.ConsumeIntegralInRange<int>(0, 2) != 0) return {};
  std::vector<int64_t> full = {N, H, L, S}, sizes;
  const int rank = in.ConsumeIntegralInRange<int>(1, 4);
  for (int d = 4 - rank; d < 4; ++d) sizes.push_back(in.ConsumeBool() ? full[d] : 1);
  auto b = tm.make(sizes, dtype);
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0 && b.numel() > 0 && b.is_floating_point()) {  // hide some keys
    auto mask = torch::rand(b.sizes(), tm.gen) < 0.5;
    b = b.detach().masked_fill(mask, -std::numeric_limits<double>::infinity());
    if (in.ConsumeBool()) b.requires_grad_(true);
  }
  return b;
}

/// A bias of moderate finite values and -inf (hidden keys) only.
bool bias_moderate(const torch::Tensor& b) {
  if (!b.defined() || b.numel() == 0) return true;
  auto d = f64(b);
  auto hidden = d == -std::numeric_limits<double>::infinity();
  return moderate(d.masked_fill(hidden, 0.0));
}

torch::Tensor column_tensor(const std::vector<int64_t>& v) { return torch::tensor(v, torch::kLong); }

/// Rows of a random valid list: row i's columns are the set bits of a fuzzer word.
void random_rows(FuzzedDataProvider& in, int64_t L, int64_t S, std::vector<int64_t>& offsets,
                 std::vector<int64_t>& columns) {
  offsets.push_back(static_cast<int64_t>(columns.size()));
  for (int64_t i = 0; i < L; ++i) {
    const uint32_t bits = in.ConsumeIntegral<uint32_t>();
    for (int64_t j = 0; j < S; ++j)
      if (bits >> (j % 32) & 1u) columns.push_back(j);
    offsets.push_back(static_cast<int64_t>(columns.size()));
  }
}

/// An edge list for L queries, S keys, H heads: random valid (shared or per
/// head), mutated, or malformed.
EdgeList edge_list(FuzzedDataProvider& in, int64_t L, int64_t S, int64_t H) {
  const int mode = in.ConsumeIntegralInRange<int>(0, 5);
  std::vector<int64_t> offsets, columns;
  EdgeList e;
  if (mode <= 1) {
    random_rows(in, L, S, offsets, columns);
    e = {column_tensor(offsets), column_tensor(columns)};
  } else if (mode == 2) {
    for (int64_t h = 0; h < H; ++h) {
      std::vector<int64_t> head;
      random_rows(in, L, S, head, columns);
      offsets.insert(offsets.end(), head.begin(), head.end());
    }
    e = {column_tensor(offsets).view({H, L + 1}), column_tensor(columns)};
  } else if (mode == 3) {  // a valid list with one entry changed
    random_rows(in, L, S, offsets, columns);
    auto& target = in.ConsumeBool() || columns.empty() ? offsets : columns;
    target[in.ConsumeIntegralInRange<size_t>(0, target.size() - 1)] = awkward_int(in, -1, std::max(L, S) + 1);
    e = {column_tensor(offsets), column_tensor(columns)};
  } else {  // malformed: arbitrary offsets and columns
    const int64_t n_off = in.ConsumeIntegralInRange<int64_t>(0, 20), n_col = in.ConsumeIntegralInRange<int64_t>(0, 40);
    for (int64_t i = 0; i < n_off; ++i) offsets.push_back(awkward_int(in, 0, n_col));
    for (int64_t i = 0; i < n_col; ++i) columns.push_back(awkward_int(in, 0, S));
    auto off = column_tensor(offsets), col = column_tensor(columns);
    switch (in.ConsumeIntegralInRange<int>(0, 5)) {
      case 0: off = off.to(torch::kInt); break;
      case 1: col = col.to(torch::kFloat); break;
      case 2: col = torch::Tensor(); break;
      case 3: if (n_off % 2 == 0 && n_off > 0) off = off.view({2, n_off / 2}); break;
      case 4: off = off.view({1, 1, n_off}); break;
      default: break;
    }
    e = {off, col};
  }
  if (in.ConsumeIntegralInRange<int>(0, 5) == 0 && e.columns.defined() && e.columns.numel() > 0)
    e.columns = e.columns.repeat({2}).slice(0, 0, 2 * e.columns.numel(), 2);  // strided columns
  return e;
}

// ---------------------------------------------------------------------------
// One case per op. Each builds its arguments (outside the op's try), stores
// them in the outcome, then calls the op.
// ---------------------------------------------------------------------------

struct Shapes {
  int64_t N, H, L, S, E, M;
};

Shapes shapes(FuzzedDataProvider& in) {
  Shapes s;
  s.N = in.ConsumeIntegralInRange<int64_t>(0, 3);
  s.H = in.ConsumeIntegralInRange<int64_t>(0, 3);
  s.L = in.ConsumeIntegralInRange<int64_t>(0, 16);
  s.S = in.ConsumeBool() ? s.L : in.ConsumeIntegralInRange<int64_t>(0, 16);
  s.E = in.ConsumeIntegralInRange<int64_t>(0, 8);
  s.M = in.ConsumeIntegralInRange<int64_t>(0, 8);
  return s;
}

using Run = std::function<void(Outcome&)>;

/// Builds one call; returns the function that makes it (and sets the oracle).
Run softmax_case(FuzzedDataProvider& in, TensorMaker& tm, torch::ScalarType dtype) {
  const Shapes s = shapes(in);
  auto q = tm.make({s.N, s.H, s.L, s.E}, dtype), k = tm.make({s.N, s.H, s.S, s.E}, dtype),
       v = tm.make({s.N, s.H, s.S, s.M}, dtype);
  SoftmaxAttentionFuncOptions o;
  o.scale(maybe_scale(in)).causal(in.ConsumeBool()).key_lengths(lengths(in, s.N, s.S));
  o.bias(bias(in, tm, s.N, s.H, s.L, s.S, dtype));
  return [=](Outcome& r) mutable {
    r.op = "softmax_attention";
    r.inputs = {q, k, v, o.bias()};
    r.out = softmax_attention(q, k, v, o);
    if (moderate(q) && moderate(k) && moderate(v) && bias_moderate(o.bias()) && scale_moderate(o.scale(), s.E)) {
      r.expect_finite = true;
      auto o64 = o;
      o64.bias(f64(o.bias()));
      r.expected = softmax_attention(f64(q), f64(k), f64(v), o64);
      r.tolerance = 4e-3 * std::max(max_abs(v), 1e-30);
    }
  };
}

Run linear_attention_case(FuzzedDataProvider& in, TensorMaker& tm, torch::ScalarType dtype) {
  const Shapes s = shapes(in);
  auto q = tm.make({s.N, s.H, s.L, s.E}, dtype), k = tm.make({s.N, s.H, s.S, s.E}, dtype),
       v = tm.make({s.N, s.H, s.S, s.M}, dtype);
  LinearAttentionFuncOptions o;
  o.feature_map(in.ConsumeBool() ? FeatureMap::elu : FeatureMap::identity)
      .normalize(in.ConsumeBool())
      .causal(in.ConsumeBool())
      .eps(awkward_double(in, 1e-6));
  return [=](Outcome& r) {
    r.op = "linear_attention";
    r.inputs = {q, k, v};
    r.out = linear_attention(q, k, v, o);
    // The identity map's normaliser phi(q) . z can be 0 or negative: no bound.
    const bool bounded = !(o.normalize() && o.feature_map() == FeatureMap::identity);
    if (bounded && moderate(q) && moderate(k) && moderate(v) && o.eps() >= 0 && o.eps() <= 4.5) {
      r.expect_finite = true;
      r.expected = linear_attention(f64(q), f64(k), f64(v), o);
      // Normalised elu: a weighted average of v. Otherwise the same sums of
      // products taken with absolute values bound the rounding.
      const double scale = o.normalize() ? max_abs(v)
                           : o.feature_map() == FeatureMap::elu
                               ? max_abs(linear_attention(f64(q), f64(k), abs64(v), o))
                               : max_abs(linear_attention(abs64(q), abs64(k), abs64(v), o));
      r.tolerance = (o.normalize() ? 4e-3 : 2e-4) * std::max(scale, 1e-30);
    }
  };
}

Run gated_case(FuzzedDataProvider& in, TensorMaker& tm, torch::ScalarType dtype) {
  const Shapes s = shapes(in);
  auto f = tm.make({s.N, s.H, s.L, s.E}, dtype), q = tm.make({s.N, s.H, s.L, s.E}, dtype),
       alpha = tm.make({s.N, s.H, s.L}, dtype), beta = tm.make({s.N, s.H, s.L}, dtype);
  GatedLinearAttentionFuncOptions o;
  o.causal(in.ConsumeBool());
  return [=](Outcome& r) {
    r.op = "gated_linear_attention";
    r.inputs = {f, q, alpha, beta};
    r.out = gated_linear_attention(f, q, alpha, beta, o);
    if (moderate(f) && moderate(q) && moderate(alpha) && moderate(beta)) {
      r.expect_finite = true;
      r.expected = gated_linear_attention(f64(f), f64(q), f64(alpha), f64(beta), o);
      r.tolerance = 2e-4 * std::max(max_abs(gated_linear_attention(abs64(f), abs64(q), abs64(alpha),
                                                                   abs64(beta), o)), 1e-30);
    }
  };
}

Run agglomerative_case(FuzzedDataProvider& in, TensorMaker& tm, torch::ScalarType dtype) {
  const Shapes s = shapes(in);
  auto cq = tm.make({s.N, s.H, s.L}, dtype), cr = tm.make({s.N, s.H, s.S}, dtype, in.ConsumeIntegralInRange<int>(0, 3) != 0),
       v = tm.make({s.N, s.H, s.S, s.M}, dtype);
  AgglomerativeAttentionFuncOptions o;
  o.causal(in.ConsumeBool()).clip(awkward_double(in, 1e-3));
  return [=](Outcome& r) {
    r.op = "agglomerative_attention";
    r.inputs = {cq, cr, v};
    r.out = agglomerative_attention(cq, cr, v, o);
    // With cr >= 0 every a_h is an average of rows of v (or smaller): bounded.
    const bool cr_nonnegative = cr.numel() == 0 || (f64(cr) >= 0).all().item<bool>();
    if (moderate(cq) && moderate(cr) && moderate(v) && cr_nonnegative && o.clip() >= 1e-3 && o.clip() <= 4.5) {
      r.expect_finite = true;
      r.expected = agglomerative_attention(f64(cq), f64(cr), f64(v), o);
      r.tolerance = 1e-3 * std::max(max_abs(cq) * max_abs(v), 1e-30);
    }
  };
}

Run clustered_case(FuzzedDataProvider& in, TensorMaker& tm, torch::ScalarType dtype) {
  const Shapes s = shapes(in);
  auto q = tm.make({s.N, s.H, s.L, s.E}, dtype), k = tm.make({s.N, s.H, s.S, s.E}, dtype),
       v = tm.make({s.N, s.H, s.S, s.M}, dtype);
  ClusteredAttentionFuncOptions o;
  o.clusters(awkward_int(in, 1, std::max<int64_t>(s.L, 1)))
      .bits(awkward_int(in, 1, 63))
      .iterations(awkward_int(in, 0, 12))
      .topk(in.ConsumeBool() ? 0 : awkward_int(in, 1, std::max<int64_t>(s.S, 1)))
      .hash_bias(in.ConsumeBool())
      .seed(in.ConsumeIntegral<int64_t>())
      .scale(maybe_scale(in))
      .key_lengths(lengths(in, s.N, s.S))
      .query_lengths(lengths(in, s.N, s.L));
  return [=](Outcome& r) {
    r.op = "clustered_attention";
    r.inputs = {q, k, v};
    r.out = clustered_attention(q, k, v, o);
    // Hashing in float32 and float64 may put a query on either side of a
    // plane: no float64 oracle, but the output stays finite.
    r.expect_finite = moderate(q) && moderate(k) && moderate(v) && scale_moderate(o.scale(), s.E);
  };
}

Run sparse_case(FuzzedDataProvider& in, TensorMaker& tm, torch::ScalarType dtype) {
  Shapes s = shapes(in);
  EdgeList e;
  if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {  // a builder's pattern; L = S = its nodes
    static const char* names[] = {"full", "causal", "local", "segments", "bp-tree", "star", "strided", "nope"};
    const char* name = names[in.ConsumeIntegralInRange<size_t>(0, std::size(names) - 1)];
    const int64_t n = in.ConsumeIntegralInRange<int64_t>(0, 12), param = in.ConsumeIntegralInRange<int64_t>(-1, 6);
    try {
      e = edges::by_name(name, n, param);
    } catch (const c10::Error&) {
      e = edges::full(n, n);
    }
    s.L = s.S = e.num_queries();
  } else {
    e = edge_list(in, s.L, s.S, s.H);
  }
  auto q = tm.make({s.N, s.H, s.L, s.E}, dtype), k = tm.make({s.N, s.H, s.S, s.E}, dtype),
       v = tm.make({s.N, s.H, s.S, s.M}, dtype);
  SparseAttentionFuncOptions o;
  o.scale(maybe_scale(in));
  return [=](Outcome& r) {
    r.op = "sparse_attention";
    r.inputs = {q, k, v};
    r.out = sparse_attention(q, k, v, e, o);
    if (moderate(q) && moderate(k) && moderate(v) && scale_moderate(o.scale(), s.E)) {
      r.expect_finite = true;
      r.expected = sparse_attention(f64(q), f64(k), f64(v), e, o);
      r.tolerance = 4e-3 * std::max(max_abs(v), 1e-30);
    }
  };
}

Run dense_case(FuzzedDataProvider& in, TensorMaker& tm, torch::ScalarType dtype) {
  const int64_t in_f = in.ConsumeIntegralInRange<int64_t>(0, 8), out_f = in.ConsumeIntegralInRange<int64_t>(0, 8);
  std::vector<int64_t> xs;
  for (int d = in.ConsumeIntegralInRange<int>(0, 2); d > 0; --d) xs.push_back(in.ConsumeIntegralInRange<int64_t>(0, 4));
  xs.push_back(in_f);
  auto x = tm.make(xs, dtype), w = tm.make({out_f, in_f}, dtype);
  torch::Tensor b = in.ConsumeBool() ? tm.make({out_f}, dtype) : torch::Tensor();
  return [=](Outcome& r) {
    r.op = "linear";
    r.inputs = {x, w, b};
    r.out = linear(x, w, b);
    if (moderate(x) && moderate(w) && moderate(b)) {
      r.expect_finite = true;
      r.expected = linear(f64(x), f64(w), f64(b));
      r.tolerance = 2e-4 * std::max(max_abs(linear(abs64(x), abs64(w), abs64(b))), 1e-30);
    }
  };
}

/// The edge-pattern builders and helpers on their own: sizes from tiny to
/// absurd must give a list check_edge_list accepts or a clear error.
void builders(FuzzedDataProvider& in) {
  static const char* names[] = {"full", "causal", "local", "segments", "bp-tree", "star", "strided", ""};
  const char* name = names[in.ConsumeIntegralInRange<size_t>(0, std::size(names) - 1)];
  const int64_t n = awkward_int(in, 0, 40), param = awkward_int(in, 0, 8);
  EdgeList a;
  try {
    a = edges::by_name(name, n, param);
  } catch (const c10::Error& e) {
    if (std::string(e.what_without_backtrace()).empty()) violation("edges::by_name: an empty message");
    return;
  }
  const int64_t L = a.num_queries();
  const int64_t nodes = a.num_edges() == 0 ? 0 : a.columns.max().item<int64_t>() + 1;
  try {
    check_edge_list(a, L, nodes, 1);
  } catch (const c10::Error& e) {
    violation(std::string("edges::by_name('") + name + "', " + std::to_string(n) + ", " +
              std::to_string(param) + ") built a list check_edge_list refuses: " + e.what_without_backtrace());
  }
  if (L > 64) return;
  try {
    std::vector<int64_t> offsets, columns;
    random_rows(in, L, nodes, offsets, columns);
    auto merged = edges::merge(a, {column_tensor(offsets), column_tensor(columns)});
    check_edge_list(merged, L, nodes, 1);
    if (nodes == L) {
      auto d = edges::hop_distances(merged, awkward_int(in, 0, 6));
      if (d.dim() != 2 || d.size(0) != L) violation("hop_distances: wrong shape");
    }
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.empty()) violation("edges::merge / hop_distances: an empty message");
  }
}

/// Block masks (include/attnkit/block_mask.h): a mask built from fuzzed
/// blocks of pairs on an awkward grid must check, expand to its pairs, and
/// combine by and / or as the dense masks do; a mask with one tensor broken
/// must be refused by check_block_mask with an error naming the op.
void block_masks(FuzzedDataProvider& in) {
  // Sizes in range (a mask's memory follows them: no extremes here), then
  // one of them made invalid, which create_block_mask must refuse.
  int64_t sizes[6] = {in.ConsumeIntegralInRange<int64_t>(1, 2), in.ConsumeIntegralInRange<int64_t>(1, 3),
                      in.ConsumeIntegralInRange<int64_t>(0, 40), in.ConsumeIntegralInRange<int64_t>(0, 40),
                      in.ConsumeIntegralInRange<int64_t>(1, 20), in.ConsumeIntegralInRange<int64_t>(1, 20)};
  {
    int64_t bad[6] = {sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5]};
    const size_t which = in.ConsumeIntegralInRange<size_t>(0, 5);
    bad[which] = which < 2 || which > 3 ? in.ConsumeIntegralInRange<int64_t>(-3, 0)
                                        : in.ConsumeIntegralInRange<int64_t>(-3, -1);
    try {
      create_block_mask(masks::causal(1, 1), bad[0], bad[1], bad[2], bad[3], bad[4], bad[5]);
      violation("create_block_mask: accepted a batch, head count or block size < 1, or a length < 0");
    } catch (const c10::Error& e) {
      if (std::string(e.what_without_backtrace()).find("create_block_mask") == std::string::npos)
        violation(std::string("create_block_mask: an error that does not name it: ") + e.what_without_backtrace());
    }
  }
  const int64_t B = sizes[0], H = sizes[1], L = sizes[2], S = sizes[3], qb = sizes[4], kvb = sizes[5];
  // Pairs from a few fuzzed words, repeated: runs of empty, full and mixed blocks.
  std::vector<uint8_t> words = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(1, 16));
  if (words.empty()) words.push_back(0);
  auto pattern = [&words](int64_t b, int64_t h, int64_t q, int64_t kv) {
    const uint8_t w = words[(b * 7 + h * 5 + q / 3 + kv / 5) % words.size()];
    return w < 64 ? false : w >= 192 ? true : ((w >> ((q + kv) % 8)) & 1) != 0;
  };
  BlockMask a, b;
  try {
    a = create_block_mask(pattern, B, H, L, S, qb, kvb);
    b = create_block_mask(masks::causal(L, S), 1, 1, L, S, qb, kvb);
  } catch (const c10::Error& e) {
    violation(std::string("create_block_mask refused a valid grid: ") + e.what_without_backtrace());
  }
  try {
    check_block_mask("fuzz", a, B, H, L, S);
    const auto dense = a.to_dense();
    for (int64_t q = 0; q < L; ++q)
      for (int64_t kv = 0; kv < S; ++kv)
        if (dense[B - 1][H - 1][q][kv].item<bool>() != pattern(B - 1, H - 1, q, kv))
          violation("create_block_mask: a pair differs from its mask function");
    if (!torch::equal(block_mask_and(a, b).to_dense(), dense & b.to_dense()) ||
        !torch::equal(block_mask_or(a, b).to_dense(), dense | b.to_dense()))
      violation("block_mask_and / block_mask_or: differ from the dense masks");
  } catch (const c10::Error& e) {
    violation(std::string("a built block mask was refused: ") + e.what_without_backtrace());
  }
  // One tensor broken: refused naming the op, never a crash.
  BlockMask broken{a.q_len, a.kv_len, a.q_block, a.kv_block, a.kinds.clone(), a.partial_index.clone(),
                   a.bits.clone()};
  const bool has_blocks = broken.kinds.numel() > 0;
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: broken.kinds = broken.kinds.to(torch::kInt); break;
    case 1: if (has_blocks) broken.kinds.view(-1)[0] = static_cast<uint8_t>(in.ConsumeIntegralInRange<int>(3, 255)); break;
    case 2: if (has_blocks) broken.partial_index.view(-1)[0] = in.ConsumeIntegral<int32_t>(); break;
    case 3: if (broken.bits.numel() > 0) broken.bits.view(-1)[broken.bits.numel() - 1] = 0xFF; break;
    case 4: broken.bits = broken.bits.narrow(1, 0, std::max<int64_t>(0, broken.bits.size(1) - 1)); break;
    default: broken.q_len += 1; break;
  }
  try {
    check_block_mask("fuzz", broken, B, H, L, S);
  } catch (const c10::Error& e) {
    if (std::string(e.what_without_backtrace()).find("fuzz") == std::string::npos)
      violation(std::string("check_block_mask: an error that does not name the op: ") + e.what_without_backtrace());
  }
  // The exact kernel over the mask against the float64 composite (which
  // expands it), values and that the gradients are finite; the broken mask,
  // or the mask given to a call with one head more, refused naming the op.
  const int64_t E = in.ConsumeIntegralInRange<int64_t>(1, 9), M = in.ConsumeIntegralInRange<int64_t>(1, 9);
  const auto q = torch::randn({B, H, L, E}), k = torch::randn({B, H, S, E}), v = torch::randn({B, H, S, M});
  const auto options = SoftmaxAttentionFuncOptions().block_mask(a).causal(in.ConsumeBool());
  try {
    const auto leaf = q.clone().requires_grad_();
    const auto out = softmax_attention(leaf, k, v, options);
    const auto want = softmax_attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble), options);
    if (out.numel() > 0 && !((out.to(torch::kDouble) - want).abs().max().item<double>() <= 1e-4))
      violation("softmax_attention over a block mask: float32 differs from the float64 composite");
    out.sum().backward();
    if (!torch::isfinite(leaf.grad()).all().item<bool>())
      violation("softmax_attention over a block mask: a gradient that is not finite");
  } catch (const c10::Error& e) {
    violation(std::string("softmax_attention refused a fitting block mask: ") + e.what_without_backtrace());
  }
  for (const auto& [mask, heads] : {std::pair<const BlockMask*, int64_t>{&broken, H}, {&a, H + 1}}) {
    if (mask == &a && a.heads() == 1) continue;  // a mask of one head fits any head count
    try {
      softmax_attention(torch::randn({B, heads, L, E}), torch::randn({B, heads, S, E}), torch::randn({B, heads, S, M}),
                        SoftmaxAttentionFuncOptions().block_mask(*mask));
      if (mask == &a) violation("softmax_attention: accepted a block mask of another head count");
    } catch (const c10::Error& e) {
      if (std::string(e.what_without_backtrace()).find("softmax_attention") == std::string::npos)
        violation(std::string("softmax_attention: a block mask error that does not name it: ") +
                  e.what_without_backtrace());
    }
  }
}

/// Score modifier programs (kernels/common/score_program.h) through the
/// kernel ops: fuzzed instructions, mostly well formed (opcodes of the set,
/// earlier operands, index sizes that are whole numbers), sometimes not, over
/// fuzzed tables. Each call is refused with an error naming the op, or runs
/// forward and backward; then it must give the same bits on 1 and 2 threads
/// (its values may be anything a program computes, NaN included).
void score_programs(FuzzedDataProvider& in) {
  static const int32_t opcodes[] = {0,  1,  2,  3,  4,  5,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                    21, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45,
                                    46, 47, 48, 60, 70, 71, 70, 71};  // index and gather twice as often
  static const int arity[] = {0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                              2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 1, 1, 1, 1};
  const int32_t n = in.ConsumeIntegralInRange<int32_t>(1, 24);
  std::vector<int32_t> code;
  std::vector<float> values;
  for (int32_t t = 0; t < n; ++t) {
    const bool malformed = in.ConsumeIntegralInRange<int>(0, 31) == 0;
    const size_t pick = in.ConsumeIntegralInRange<size_t>(0, std::size(opcodes) - 1);
    const int a = t == 0 ? 0 : arity[pick];  // the first instruction can read nothing
    int32_t op = t == 0 ? in.ConsumeIntegralInRange<int32_t>(0, 5) : opcodes[pick];
    int32_t regs[3] = {-1, -1, -1};
    for (int r = 0; r < a; ++r) regs[r] = in.ConsumeIntegralInRange<int32_t>(0, t - 1);
    float value = in.ConsumeFloatingPointInRange<float>(-4.f, 4.f);
    if (op == 70) value = static_cast<float>(in.ConsumeIntegralInRange<int>(1, 40));
    if (malformed) {
      switch (in.ConsumeIntegralInRange<int>(0, 3)) {
        case 0: op = in.ConsumeIntegral<int32_t>(); break;
        case 1: regs[in.ConsumeIntegralInRange<int>(0, 2)] = in.ConsumeIntegralInRange<int32_t>(-3, t + 3); break;
        case 2: value = in.ConsumeFloatingPointInRange<float>(-2.f, 2.f); break;
        default: break;
      }
    }
    code.insert(code.end(), {op, regs[0], regs[1], regs[2]});
    values.push_back(value);
  }
  const int64_t table_numel = in.ConsumeIntegralInRange<int64_t>(0, 48);
  const int64_t N = in.ConsumeIntegralInRange<int64_t>(1, 2), H = in.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t L = in.ConsumeIntegralInRange<int64_t>(1, 40), S = in.ConsumeIntegralInRange<int64_t>(1, 300);
  const int64_t E = in.ConsumeIntegralInRange<int64_t>(1, 9), M = in.ConsumeIntegralInRange<int64_t>(1, 9);
  const bool causal = in.ConsumeBool();
  const auto q = torch::randn({N, H, L, E}), k = torch::randn({N, H, S, E}), v = torch::randn({N, H, S, M});
  const auto grad = torch::randn({N, H, L, M});
  const auto code_tensor = torch::tensor(code, torch::kInt).view({n, 4});
  const auto value_tensor = torch::tensor(values, torch::kFloat);
  const c10::IValue none, tables = table_numel > 0 ? c10::IValue(torch::randn({table_numel})) : none;
  auto& dispatcher = c10::Dispatcher::singleton();
  static const auto forward = dispatcher.findSchemaOrThrow("attnkit::_softmax_attention_forward", "");
  static const auto backward = dispatcher.findSchemaOrThrow("attnkit::_softmax_attention_backward", "");
  const std::vector<int64_t> blocks{128, 128};
  auto run = [&](int threads) {
    set_num_threads(threads);
    torch::jit::Stack stack{q, k, v, none, none, none, 0.5, causal, int64_t{0}, 10000.0, int64_t{0}, 0.0,
                            int64_t{0}, none, none, none, blocks, none, 0.0, code_tensor, value_tensor, tables};
    forward.callBoxed(&stack);
    const auto out = stack[0].toTensor(), lse = stack[1].toTensor();
    stack = {grad, q, k, v, out, lse, none, none, none, 0.5, causal, int64_t{0}, 10000.0, int64_t{0}, 0.0,
             int64_t{0}, false, none, none, none, blocks, none, none, 0.0, code_tensor, value_tensor, tables};
    backward.callBoxed(&stack);
    return std::vector<torch::Tensor>{out, lse, stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor(),
                                      stack[5].toTensor()};
  };
  std::vector<torch::Tensor> one;
  ++stats.programs;
  try {
    one = run(1);
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find("_softmax_attention_forward") == std::string::npos &&
        msg.find("_softmax_attention_backward") == std::string::npos)
      violation("a score program's error that does not name the op: " + msg);
    return;
  }
  ++stats.programs_run;
  const auto two = run(2);
  for (size_t i = 0; i < one.size(); ++i)
    if (!torch::equal(one[i].nan_to_num(0, 1, -1), two[i].nan_to_num(0, 1, -1)) ||
        !torch::equal(torch::isnan(one[i]), torch::isnan(two[i])))
      violation("a score program gives other bits on 2 threads than on 1");
}

void check_close(const Outcome& r) {
  // The bounds are float32's; bfloat16 runs the composite in its own precision.
  if (!r.expected.defined() || r.out.scalar_type() != torch::kFloat) return;
  auto got = r.out.detach().to(torch::kDouble);
  if (got.sizes() != r.expected.sizes())
    violation(std::string(r.op) + ": float32 and float64 outputs differ in shape");
  if (got.numel() == 0) return;
  ++stats.compared;
  const double err = (got - r.expected).abs().max().item<double>();
  if (!(err <= r.tolerance)) {
    std::ostringstream s;
    s << r.op << ": float32 output differs from the float64 op by " << err << " (allowed "
      << r.tolerance << ")";
    violation(s.str());
  }
}

void backward(FuzzedDataProvider& in, Outcome& r, torch::Generator& gen) {
  if (!r.out.requires_grad()) return;
  std::vector<torch::Tensor> wrt;
  for (const auto& t : r.inputs)
    if (t.defined() && t.requires_grad()) wrt.push_back(t);
  auto g = torch::randn(r.out.sizes(), gen, torch::TensorOptions().dtype(torch::kDouble)).to(r.out.scalar_type());
  if (in.ConsumeBool() && g.dim() >= 2) g = g.transpose(0, 1).contiguous().transpose(0, 1);  // strided gradient
  const bool create_graph = in.ConsumeIntegralInRange<int>(0, 7) == 0;
  std::vector<torch::Tensor> grads;
  ++stats.backward;
  try {
    grads = torch::autograd::grad({r.out}, wrt, {g}, /*retain_graph=*/c10::nullopt, create_graph,
                                  /*allow_unused=*/true);
  } catch (const c10::Error& e) {
    violation(std::string(r.op) + ": backward failed after a successful forward: " + e.what_without_backtrace());
  }
  if (r.expect_finite)
    for (const auto& gr : grads)
      if (!all_finite(gr)) violation(std::string(r.op) + ": non-finite gradient for moderate input");
  // Second order: supported (the composite) or refused naming the op (float32
  // kernels: libtorch's autograd::Error node, which throws std::runtime_error).
  if (create_graph) {
    torch::Tensor sum;
    for (const auto& gr : grads)
      if (gr.defined() && gr.requires_grad()) sum = sum.defined() ? sum + gr.sum() : gr.sum();
    if (!sum.defined()) return;
    try {
      torch::autograd::grad({sum}, wrt, {}, c10::nullopt, false, /*allow_unused=*/true);
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      if (msg.find(std::string(r.op) + ": double backward") == std::string::npos)
        violation(std::string(r.op) + ": second-order gradient failed: " + msg);
    }
  }
}

}  // namespace


/// ATTNKIT_FUZZ_VERBOSE=1: print each call's tensors (to triage a crash-* input).
void describe(const Outcome& r) {
  std::ostringstream s;
  s << "call " << r.op << "\n";
  for (const auto& t : r.inputs) {
    if (!t.defined()) {
      s << "  (undefined)\n";
      continue;
    }
    s << "  " << t.scalar_type() << " sizes " << t.sizes() << " strides " << t.strides() << " offset "
      << t.storage_offset() << (t.requires_grad() ? " requires_grad" : "") << "\n";
    if (t.numel() <= 64) s << t << "\n";
  }
  std::fputs(s.str().c_str(), stderr);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  set_num_threads(in.ConsumeBool() ? 1 : 2);
  TensorMaker tm{in, at::detail::createCPUGenerator(in.ConsumeIntegral<uint32_t>())};
  // The ops' cases first, then the structures' builders (edge patterns, block masks).
  static const std::function<Run(FuzzedDataProvider&, TensorMaker&, torch::ScalarType)> cases[] = {
      softmax_case, linear_attention_case, gated_case, agglomerative_case, clustered_case, sparse_case, dense_case};
  static const std::function<void(FuzzedDataProvider&)> structures[] = {builders, block_masks, score_programs};
  const auto which = in.ConsumeIntegralInRange<size_t>(0, std::size(cases) + std::size(structures) - 1);
  if (which >= std::size(cases)) {
    structures[which - std::size(cases)](in);
    return 0;
  }
  const auto dtype = choose_dtype(in);
  Run run = cases[which](in, tm, dtype);
  Outcome r;
  ++stats.calls;
  static const bool verbose = std::getenv("ATTNKIT_FUZZ_VERBOSE") != nullptr;
  try {
    run(r);
    if (verbose) describe(r);
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (r.out.defined())  // the op's own call returned; the float64 oracle's threw
      violation(std::string(r.op) + ": accepted in float32 but refused in float64: " + msg);
    ++stats.errors;
    if (msg.find(r.op) == std::string::npos)
      violation(std::string(r.op) + ": an error that does not name the op: " + msg);
    return 0;
  } catch (const std::exception& e) {
    violation(std::string(r.op) + ": an exception other than c10::Error: " + e.what());
  }
  stats.finite_checked += r.expect_finite;
  if (r.expect_finite && !all_finite(r.out)) violation(std::string(r.op) + ": non-finite output for moderate input");
  check_close(r);
  backward(in, r, tm.gen);
  return 0;
}
