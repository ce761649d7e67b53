// Reference clustered and improved-clustered attention (docs/MATH.md,
// "Clustered attention" and "Improved clustered attention"), step by step:
// planes, hash bits, Hamming K-means, attention given the labels.
#include "base/random.h"
#include "reference/reference.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace attnkit::reference {

namespace rnd = kernels::random;

torch::Tensor hash_planes(int64_t bits, int64_t E, int64_t seed, bool hash_bias) {
  auto planes = torch::empty({bits, E + 1}, torch::kDouble);
  auto p = planes.accessor<double, 2>();
  for (int64_t b = 0; b < bits; ++b)
    for (int64_t e = 0; e <= E; ++e)
      p[b][e] = rnd::normal(static_cast<uint64_t>(seed), rnd::kPlanesStream, b * (E + 1) + e);
  if (!hash_bias) planes.select(1, E).zero_();
  return planes;
}

torch::Tensor hash_bits(const torch::Tensor& q, const torch::Tensor& planes) {
  const int64_t E = q.size(3);
  auto p = planes.to(q.scalar_type());
  auto projections = torch::matmul(q, p.narrow(1, 0, E).t());  // (N,H,L,B)
  return projections > p.select(1, E);
}

torch::Tensor pack_bits(const torch::Tensor& bits) {
  const int64_t B = bits.size(-1);
  auto weights = torch::pow(2, torch::arange(B, torch::kLong));  // exact for B <= 63
  return (bits.to(torch::kLong) * weights).sum(-1);
}

namespace {

int hamming(int64_t a, int64_t b) { return __builtin_popcountll(static_cast<uint64_t>(a ^ b)); }

/// Nearest centroid, ties to the lowest index.
int64_t nearest(int64_t h, const std::vector<int64_t>& centroids) {
  int64_t best = 0;
  int best_d = hamming(h, centroids[0]);
  for (size_t c = 1; c < centroids.size(); ++c) {
    const int d = hamming(h, centroids[c]);
    if (d < best_d) best_d = d, best = static_cast<int64_t>(c);
  }
  return best;
}

/// K-means of one sequence of `n` valid hashes; writes labels[0..n).
void kmeans_one(const int64_t* hashes, int64_t n, int64_t clusters, int64_t bits,
                int64_t iterations, uint64_t seed, uint64_t stream, int64_t* labels) {
  const int64_t C = std::min(clusters, n);  // a shorter sequence uses fewer clusters
  if (C == 0) return;
  // Initial centroids: the hashes of C distinct positions (partial Fisher-Yates).
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  for (int64_t c = 0; c < C; ++c)
    std::swap(order[c], order[c + rnd::below(seed, stream, c, n - c)]);
  std::vector<int64_t> centroids(C);
  for (int64_t c = 0; c < C; ++c) centroids[c] = hashes[order[c]];

  auto assign = [&] {
    for (int64_t i = 0; i < n; ++i) labels[i] = nearest(hashes[i], centroids);
  };
  std::vector<int64_t> previous(n);
  for (int64_t it = 0; it < iterations; ++it) {
    assign();
    // Labels as the previous assignment left them: a fixed point (the update
    // below depends on the labels only), so later iterations would change nothing.
    if (it > 0 && std::equal(labels, labels + n, previous.begin())) return;
    std::copy(labels, labels + n, previous.begin());
    // Majority vote per bit (ties to 0).
    std::vector<int64_t> count(C, 0), ones(C * bits, 0);
    for (int64_t i = 0; i < n; ++i) {
      ++count[labels[i]];
      for (int64_t b = 0; b < bits; ++b) ones[labels[i] * bits + b] += (hashes[i] >> b) & 1;
    }
    for (int64_t c = 0; c < C; ++c) {
      if (count[c] == 0) continue;
      int64_t h = 0;
      for (int64_t b = 0; b < bits; ++b)
        if (2 * ones[c * bits + b] > count[c]) h |= int64_t{1} << b;
      centroids[c] = h;
    }
    // Empty clusters, in increasing index, take the hashes of the queries
    // farthest from the just-updated centroid of their cluster (ties to the
    // lower position), each query used once.
    std::vector<int64_t> empty;
    for (int64_t c = 0; c < C; ++c)
      if (count[c] == 0) empty.push_back(c);
    if (!empty.empty()) {
      std::vector<int64_t> by_distance(n);
      std::iota(by_distance.begin(), by_distance.end(), 0);
      std::vector<int> dist(n);
      for (int64_t i = 0; i < n; ++i) dist[i] = hamming(hashes[i], centroids[labels[i]]);
      std::stable_sort(by_distance.begin(), by_distance.end(),
                       [&](int64_t a, int64_t b) { return dist[a] > dist[b]; });
      for (size_t e = 0; e < empty.size(); ++e) centroids[empty[e]] = hashes[by_distance[e]];
    }
  }
  assign();
}

}  // namespace

torch::Tensor hamming_kmeans(const torch::Tensor& hashes, int64_t clusters, int64_t bits,
                             int64_t iterations, int64_t seed,
                             const torch::Tensor& query_lengths) {
  const int64_t N = hashes.size(0), H = hashes.size(1), L = hashes.size(2);
  auto h = hashes.contiguous();
  auto labels = torch::full({N, H, L}, -1, torch::kLong);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t valid = query_lengths.defined() ? query_lengths[n].item<int64_t>() : L;
    for (int64_t hd = 0; hd < H; ++hd) {
      const uint64_t stream = rnd::kInitStream + static_cast<uint64_t>(n * H + hd);
      kmeans_one(h[n][hd].data_ptr<int64_t>(), valid, clusters, bits, iterations,
                 static_cast<uint64_t>(seed), stream, labels[n][hd].data_ptr<int64_t>());
    }
  }
  return labels;
}

torch::Tensor clustered_attention_given_labels(const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v,
                                               const torch::Tensor& labels,
                                               int64_t clusters, int64_t topk, double scale,
                                               const torch::Tensor& key_lengths,
                                               torch::Tensor* weights) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), E = q.size(3);
  const int64_t C = clusters;
  const double inf = std::numeric_limits<double>::infinity();
  auto member = labels >= 0;                            // (N,H,L), padded queries: false
  auto safe_labels = labels.clamp_min(0);
  auto one_hot = torch::one_hot(safe_labels, C).to(q.scalar_type()) *
                 member.unsqueeze(-1).to(q.scalar_type());                // (N,H,L,C)
  auto count = one_hot.sum(2);                                       // (N,H,C)
  // Centroids: means of the member queries in E-space (empty clusters: 0).
  auto qc = torch::matmul(one_hot.transpose(-2, -1), q) / count.clamp_min(1).unsqueeze(-1);
  auto key_visible = visibility(N, C, S, /*causal=*/false, key_lengths);  // (N,1,C,S)
  auto centroid_scores = torch::matmul(qc, k.transpose(-2, -1)) * scale;  // (N,H,C,S)
  auto ac = masked_softmax(centroid_scores, key_visible);                 // (N,H,C,S)
  auto member_f = member.unsqueeze(-1).to(q.scalar_type());            // (N,H,L,1)
  // Row c of a per-cluster tensor (N,H,C,X) for every query: (N,H,L,X).
  auto rows_of = [&](const torch::Tensor& per_cluster) {
    const int64_t X = per_cluster.size(-1);
    return per_cluster.gather(2, safe_labels.unsqueeze(-1).expand({N, H, L, X}));
  };

  if (topk == 0) {
    if (weights) *weights = rows_of(ac) * member_f;
    return rows_of(torch::matmul(ac, v)) * member_f;
  }

  // Improved clustered: top-k' keys per centroid (higher score, then lower index).
  const int64_t kk = std::min(topk, S);
  auto ranked = centroid_scores.masked_fill(key_visible.logical_not(), -inf);
  auto order = std::get<1>(ranked.sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true));
  auto top = order.narrow(-1, 0, kk);                                     // (N,H,C,k')
  auto mass = ac.gather(-1, top).sum(-1);                                 // (N,H,C)
  auto in_top = torch::zeros({N, H, C, S}, torch::kBool).scatter(-1, top, true);
  auto vb = torch::matmul(ac.masked_fill(in_top, 0), v);                  // (N,H,C,M)

  // Per query: exact softmax over its cluster's top keys, scaled by the mass.
  auto query_top = rows_of(top);                                          // (N,H,L,k')
  auto query_top_visible = rows_of(key_visible.expand({N, H, C, S}).gather(-1, top));
  auto k_top = k.unsqueeze(2).expand({N, H, L, S, E})
                   .gather(3, query_top.unsqueeze(-1).expand({N, H, L, kk, E}));
  auto top_scores = (q.unsqueeze(3) * k_top).sum(-1) * scale;             // (N,H,L,k')
  auto top_weights = masked_softmax(top_scores, query_top_visible) *
                     rows_of(mass.unsqueeze(-1)) * member_f;              // (N,H,L,k')
  auto v_top = v.unsqueeze(2).expand({N, H, L, S, v.size(3)})
                   .gather(3, query_top.unsqueeze(-1).expand({N, H, L, kk, v.size(3)}));
  auto out = (top_weights.unsqueeze(-1) * v_top).sum(3) + rows_of(vb) * member_f;
  if (weights) {
    auto dense = rows_of(ac.masked_fill(in_top, 0)) * member_f;
    *weights = dense.scatter_add(-1, query_top, top_weights);
  }
  return out;
}

torch::Tensor clustered_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const ClusteredAttentionFuncOptions& o,
                                  torch::Tensor* weights) {
  const int64_t E = q.size(3);
  const double scale = o.scale() ? *o.scale() : 1.0 / std::sqrt(static_cast<double>(E));
  torch::Tensor labels;
  {
    torch::NoGradGuard no_grad;  // clustering has no gradient
    auto planes = hash_planes(o.bits(), E, o.seed(), o.hash_bias());
    auto hashes = pack_bits(hash_bits(q.detach(), planes));
    labels = hamming_kmeans(hashes, o.clusters(), o.bits(), o.iterations(), o.seed(),
                            o.query_lengths());
  }
  // Grouped-query heads: query head h reads key and value head h / (H / Hkv).
  return clustered_attention_given_labels(q, detail::repeat_kv_heads(k, q.size(1)),
                                          detail::repeat_kv_heads(v, q.size(1)), labels, o.clusters(),
                                          o.topk(), scale, o.key_lengths(), weights);
}

}  // namespace attnkit::reference
