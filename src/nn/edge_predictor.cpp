// The SAC edge predictor: see include/attnkit/nn/edge_predictor.h.
#include <attnkit/nn/edge_predictor.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

namespace attnkit::nn {

namespace {
constexpr const char* kEdgePredictorModule = "EdgePredictor";
}  // namespace

EdgePredictorVariant edge_predictor_variant_from_string(const std::string& name) {
  if (name == "shared") return EdgePredictorVariant::shared_structure;
  if (name == "all-connected") return EdgePredictorVariant::all_connected;
  if (name == "head-adaptive") return EdgePredictorVariant::head_adaptive;
  TORCH_CHECK(false, kEdgePredictorModule, ": variant must be one of shared, all-connected, head-adaptive, got '",
              name, "'");
  return EdgePredictorVariant::shared_structure;  // unreachable
}

std::string to_string(EdgePredictorVariant variant) {
  switch (variant) {
    case EdgePredictorVariant::shared_structure: return "shared";
    case EdgePredictorVariant::all_connected: return "all-connected";
    case EdgePredictorVariant::head_adaptive: return "head-adaptive";
  }
  return "?";
}

// Everything a decoding pass needs about one set of nodes.
// Everything a decoding pass needs about G graphs of n nodes (G = 1 except in
// sample_batch).
struct EdgePredictorImpl::Context {
  torch::Tensor nodes;            // (G n, width): graph g's nodes are rows g n .. g n + n - 1
  torch::Tensor w;                // (G, n, hidden): pointer vectors W x_i
  std::vector<int64_t> distance;  // n x n clipped distances (empty: no encoding)
  int64_t n = 0, graphs = 1;
};

EdgePredictorImpl::EdgePredictorImpl(const EdgePredictorOptions& options_) : options(options_) {
  reset();
}

int64_t EdgePredictorImpl::sequences() const {
  return options.variant() == EdgePredictorVariant::head_adaptive ? options.heads() : 1;
}

void EdgePredictorImpl::reset() {
  const auto& o = options;
  TORCH_CHECK(o.width() > 0, kEdgePredictorModule, ": width must be positive, got ", o.width());
  TORCH_CHECK(o.hidden_size() > 0, kEdgePredictorModule, ": hidden_size must be positive, got ", o.hidden_size());
  TORCH_CHECK(o.alpha() >= 1, kEdgePredictorModule, ": alpha (edges per node) must be >= 1, got ", o.alpha());
  TORCH_CHECK(o.max_distance() >= 0, kEdgePredictorModule, ": max_distance must be >= 0 (0 disables it), got ",
              o.max_distance());
  const bool adaptive = o.variant() == EdgePredictorVariant::head_adaptive;
  if (adaptive) {
    TORCH_CHECK(o.heads() >= 1, kEdgePredictorModule, ": heads must be >= 1 for head-adaptive, got ", o.heads());
    TORCH_CHECK(o.head_embedding_dim() >= 1, kEdgePredictorModule,
                ": head_embedding_dim must be >= 1 for head-adaptive, got ", o.head_embedding_dim());
  }
  const int64_t input = o.width() + (adaptive ? o.head_embedding_dim() : 0);
  lstm = register_module("lstm", torch::nn::LSTMCell(input, o.hidden_size()));
  start = register_parameter("start",
                             torch::randn({o.width()}) / std::sqrt(double(o.width())));
  const double bound = 1.0 / std::sqrt(double(o.width()));
  pointer = register_parameter(
      "pointer", torch::empty({o.hidden_size(), o.width()}).uniform_(-bound, bound));
  if (adaptive) {
    head_embedding = register_parameter(
        "head_embedding",
        torch::randn({o.heads(), o.head_embedding_dim()}) / std::sqrt(double(o.head_embedding_dim())));
  }
  reward_baseline = register_buffer("reward_baseline", torch::zeros({2}, torch::kFloat64));
  if (o.max_distance() > 0) {
    distance = register_parameter(
        "distance",
        torch::randn({o.max_distance() + 1, o.hidden_size()}) / std::sqrt(double(o.hidden_size())));
  }
}

EdgePredictorImpl::Context EdgePredictorImpl::context(const torch::Tensor& nodes,
                                                      const torch::Tensor& distances,
                                                      const char* op, bool batched) const {
  const int64_t dims = batched ? 3 : 2;
  const char* layout = batched ? "(B, n, width)" : "(n, width)";
  TORCH_CHECK(nodes.defined() && nodes.dim() == dims, kEdgePredictorModule, ".", op, ": argument 'nodes' must be ",
              dims, "-D ", layout, ", got ",
              nodes.defined() ? std::to_string(nodes.dim()) + "-D" : std::string("undefined"));
  const auto x = batched ? nodes : nodes.unsqueeze(0);
  TORCH_CHECK(x.size(0) >= 1, kEdgePredictorModule, ".", op, ": argument 'nodes' must hold at least one graph");
  TORCH_CHECK(x.size(1) >= 1, kEdgePredictorModule, ".", op, ": argument 'nodes' must have at least one node");
  TORCH_CHECK(x.size(2) == options.width(), kEdgePredictorModule, ".", op,
              ": argument 'nodes' must have width = ", options.width(), " columns, got ",
              x.size(2));
  TORCH_CHECK(nodes.scalar_type() == pointer.scalar_type(), kEdgePredictorModule, ".", op,
              ": argument 'nodes' has dtype ", nodes.scalar_type(), ", the parameters ",
              pointer.scalar_type());
  Context ctx;
  ctx.graphs = x.size(0);
  ctx.n = x.size(1);
  ctx.nodes = x.reshape({ctx.graphs * ctx.n, options.width()});
  ctx.w = attnkit::linear(x, pointer);
  if (options.max_distance() > 0) {
    const int64_t n = ctx.n;
    torch::Tensor d;
    if (distances.defined()) {
      TORCH_CHECK(distances.scalar_type() == torch::kInt64, kEdgePredictorModule, ".", op,
                  ": argument 'distances' must be int64, got ", distances.scalar_type());
      TORCH_CHECK(distances.sizes() == torch::IntArrayRef({n, n}), kEdgePredictorModule, ".", op,
                  ": argument 'distances' must be (n, n) = (", n, ", ", n, "), got ",
                  distances.sizes());
      TORCH_CHECK(distances.numel() == 0 || distances.min().item<int64_t>() >= 0, kEdgePredictorModule, ".", op,
                  ": argument 'distances' must be non-negative, got minimum ",
                  distances.min().item<int64_t>());
      d = distances.contiguous();
    } else {
      const auto i = torch::arange(n, torch::kInt64);
      d = (i.unsqueeze(1) - i.unsqueeze(0)).abs();
    }
    d = d.clamp_max(options.max_distance()).contiguous();
    ctx.distance.assign(d.data_ptr<int64_t>(), d.data_ptr<int64_t>() + n * n);
  } else {
    TORCH_CHECK(!distances.defined(), kEdgePredictorModule, ".", op,
                ": argument 'distances' given but the distance encoding is off (max_distance = 0)");
  }
  return ctx;
}

torch::Tensor EdgePredictorImpl::step_input(const Context& ctx, int64_t head, int64_t t,
                                            const std::vector<int64_t>& previous) const {
  const int64_t B = static_cast<int64_t>(previous.size());
  torch::Tensor x;
  if (t == 0) {
    x = start.unsqueeze(0).expand({B, options.width()});
  } else {
    // Row b reads graph b's chosen node, or the one graph's (beam search).
    std::vector<int64_t> rows(previous);
    if (ctx.graphs > 1)
      for (int64_t b = 0; b < B; ++b) rows[b] += b * ctx.n;
    x = ctx.nodes.index_select(0, torch::tensor(rows, torch::kInt64));
  }
  if (options.variant() == EdgePredictorVariant::head_adaptive) {
    x = torch::cat({x, head_embedding[head].unsqueeze(0).expand({B, options.head_embedding_dim()})}, 1);
  }
  return x;
}

torch::Tensor EdgePredictorImpl::step_log_probs(const Context& ctx, const torch::Tensor& g,
                                                const std::vector<int64_t>& origins) const {
  // (B, n): g_b . w_j, over graph b's nodes or the one graph's.
  auto logits = ctx.graphs == 1 ? attnkit::linear(g, ctx.w[0]) : (ctx.w * g.unsqueeze(1)).sum(2);
  if (!origins.empty() && !ctx.distance.empty()) {
    const int64_t B = g.size(0), n = ctx.n;
    auto dh = attnkit::linear(g, distance);  // (B, max + 1): g . v_d
    std::vector<int64_t> idx(B * n);
    for (int64_t b = 0; b < B; ++b) {
      std::copy_n(ctx.distance.begin() + origins[b] * n, n, idx.begin() + b * n);
    }
    logits = logits + dh.gather(1, torch::tensor(idx, torch::kInt64).view({B, n}));
  }
  return torch::log_softmax(logits, 1);
}

namespace {

// The decoding loop shared by sample() and log_prob(): one LSTM step per token,
// `choose(s, t, log_probs (1, n))` picks the token of a predicted step.
struct Step {
  bool forced;           // all_connected origin: fed, not predicted
  int64_t forced_token;  // its node
  bool destination;      // odd step
};

Step step_kind(const EdgePredictorOptions& o, int64_t t) {
  Step s{false, -1, t % 2 == 1};
  if (o.variant() == EdgePredictorVariant::all_connected && !s.destination) {
    s.forced = true;
    s.forced_token = (t / 2) / o.alpha();
  }
  return s;
}

}  // namespace

EdgeSample EdgePredictorImpl::sample(const torch::Tensor& nodes,
                                     c10::optional<at::Generator> generator,
                                     const torch::Tensor& distances) {
  auto batch = sample_from(context(nodes, distances, "sample"), std::move(generator), 1);
  EdgeSample out;
  out.edges = std::move(batch.edges[0]);
  out.log_prob = batch.log_prob[0];
  out.tokens = batch.tokens[0];
  return out;
}

EdgeSampleBatch EdgePredictorImpl::sample_batch(const torch::Tensor& nodes,
                                                c10::optional<at::Generator> generator,
                                                const torch::Tensor& distances) {
  const auto ctx = context(nodes, distances, "sample_batch", /*batched=*/true);
  return sample_from(ctx, std::move(generator), ctx.graphs);
}

EdgeSampleBatch EdgePredictorImpl::sample_many(const torch::Tensor& nodes, int64_t samples,
                                               c10::optional<at::Generator> generator,
                                               const torch::Tensor& distances) {
  TORCH_CHECK(samples >= 1, kEdgePredictorModule, ".sample_many: argument 'samples' must be >= 1, got ", samples);
  return sample_from(context(nodes, distances, "sample_many"), std::move(generator), samples);
}

EdgeSampleBatch EdgePredictorImpl::sample_from(const Context& ctx, c10::optional<at::Generator> generator,
                                               int64_t rows) {
  TORCH_INTERNAL_ASSERT(ctx.graphs == 1 || ctx.graphs == rows);
  const int64_t B = rows, S = sequences(), T = steps(ctx.n);
  auto tokens = torch::empty({B, S, T}, torch::kInt64);
  auto tok = tokens.accessor<int64_t, 3>();
  auto h = torch::zeros({B, options.hidden_size()}, pointer.options());
  auto c = h;
  std::vector<torch::Tensor> picks;  // (B) log-probabilities of each step, 0 where fed
  std::vector<torch::Tensor> entropies;  // (B) entropy of each predicted step
  std::vector<int64_t> previous(B, 0), origins;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t b = 0; b < B; ++b) previous[b] = t == 0 ? 0 : tok[b][s][t - 1];
      std::tie(h, c) = lstm->forward(step_input(ctx, s, t, previous), std::make_tuple(h, c));
      const Step kind = step_kind(options, t);
      if (kind.forced) {
        for (int64_t b = 0; b < B; ++b) tok[b][s][t] = kind.forced_token;
        picks.push_back(torch::zeros({B}, pointer.options()));
        continue;
      }
      origins.clear();
      if (kind.destination) origins = previous;
      const auto logp = step_log_probs(ctx, h, origins);  // (B, n)
      const auto choice =
          torch::multinomial(logp.detach().exp(), 1, /*replacement=*/false, generator);  // (B, 1)
      const auto chosen = choice.contiguous();
      const int64_t* j = chosen.data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) tok[b][s][t] = j[b];
      picks.push_back(logp.gather(1, choice).squeeze(1));
      entropies.push_back(-(logp.exp() * logp).sum(1));
    }
  }
  EdgeSampleBatch out;
  out.tokens = tokens;
  out.step_log_prob = torch::stack(picks, 1).view({B, S, T});
  out.log_prob = out.step_log_prob.sum({1, 2});
  out.entropy = torch::stack(entropies, 1).sum(1);
  for (int64_t b = 0; b < B; ++b) out.edges.push_back(edges_from_tokens(tokens[b], ctx.n));
  return out;
}

double EdgePredictorImpl::update_baseline(const torch::Tensor& rewards, double decay) {
  TORCH_CHECK(rewards.defined() && rewards.numel() >= 1, kEdgePredictorModule,
              ".update_baseline: argument 'rewards' must hold at least one reward");
  TORCH_CHECK(decay >= 0 && decay < 1, kEdgePredictorModule, ".update_baseline: decay must be in [0, 1), got ",
              decay);
  const double mean = rewards.detach().to(torch::kFloat64).mean().item<double>();
  TORCH_CHECK(std::isfinite(mean), kEdgePredictorModule, ".update_baseline: the rewards' mean is ", mean);
  torch::NoGradGuard no_grad;
  auto state = reward_baseline.to(torch::kFloat64);
  const double b = state[0].item<double>(), updates = state[1].item<double>();
  const double used = updates == 0 ? mean : b;
  const double next = updates == 0 ? mean : decay * b + (1 - decay) * mean;
  reward_baseline.copy_(torch::tensor({next, updates + 1}, torch::kFloat64));
  return used;
}

double EdgePredictorImpl::baseline() const { return reward_baseline[0].item<double>(); }

torch::Tensor EdgePredictorImpl::log_prob(const torch::Tensor& nodes, const torch::Tensor& tokens,
                                          const torch::Tensor& distances) {
  const auto ctx = context(nodes, distances, "log_prob");
  const int64_t S = sequences(), T = steps(ctx.n);
  TORCH_CHECK(tokens.defined() && tokens.scalar_type() == torch::kInt64 &&
                  tokens.sizes() == torch::IntArrayRef({S, T}),
              kEdgePredictorModule, ".log_prob: argument 'tokens' must be int64 (", S, ", ", T, "), got ",
              tokens.defined() ? c10::toString(tokens.scalar_type()) : "undefined", " ",
              tokens.defined() ? tokens.sizes() : torch::IntArrayRef{});
  const auto tk = tokens.contiguous();
  auto tok = tk.accessor<int64_t, 2>();
  auto h = torch::zeros({1, options.hidden_size()}, pointer.options());
  auto c = h;
  std::vector<torch::Tensor> picks;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t j = tok[s][t];
      TORCH_CHECK(j >= 0 && j < ctx.n, kEdgePredictorModule, ".log_prob: tokens[", s, "][", t,
                  "] must be a node in [0, ", ctx.n, "), got ", j);
      std::tie(h, c) = lstm->forward(step_input(ctx, s, t, {t == 0 ? 0 : tok[s][t - 1]}),
                                     std::make_tuple(h, c));
      const Step kind = step_kind(options, t);
      if (kind.forced) {
        TORCH_CHECK(j == kind.forced_token, kEdgePredictorModule, ".log_prob: tokens[", s, "][", t,
                    "] is an all-connected origin and must be ", kind.forced_token, ", got ", j);
        continue;
      }
      std::vector<int64_t> origin;
      if (kind.destination) origin.push_back(tok[s][t - 1]);
      picks.push_back(step_log_probs(ctx, h, origin)[0][j]);
    }
  }
  return torch::stack(picks).sum();
}

EdgeSample EdgePredictorImpl::beam_search(const torch::Tensor& nodes, int64_t beam,
                                          const torch::Tensor& distances) {
  TORCH_CHECK(beam >= 1, kEdgePredictorModule, ".beam_search: argument 'beam' (the beam width) must be >= 1, got ", beam);
  torch::NoGradGuard no_grad;
  const auto ctx = context(nodes, distances, "beam_search");
  const int64_t S = sequences(), T = steps(ctx.n), n = ctx.n;
  struct Beam {
    double score;
    std::vector<int64_t> tokens;  // all steps so far, sequences concatenated
  };
  std::vector<Beam> beams{{0.0, {}}};
  auto h = torch::zeros({1, options.hidden_size()}, pointer.options());
  auto c = h;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t B = static_cast<int64_t>(beams.size());
      std::vector<int64_t> previous(B, 0), origins;
      if (t > 0) {
        for (int64_t b = 0; b < B; ++b) previous[b] = beams[b].tokens.back();
      }
      std::tie(h, c) = lstm->forward(step_input(ctx, s, t, previous), std::make_tuple(h, c));
      const Step kind = step_kind(options, t);
      if (kind.forced) {
        for (auto& beam : beams) beam.tokens.push_back(kind.forced_token);
        continue;
      }
      if (kind.destination) origins = previous;
      const auto logp = step_log_probs(ctx, h, origins).to(torch::kFloat64).contiguous();
      const double* lp = logp.data_ptr<double>();
      // Candidates (parent, node) ordered by score, then parent, then node.
      std::vector<int64_t> order(B * n);
      for (int64_t i = 0; i < B * n; ++i) order[i] = i;
      auto score = [&](int64_t i) { return beams[i / n].score + lp[i]; };
      const int64_t keep = std::min<int64_t>(beam, B * n);
      std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                        [&](int64_t a, int64_t b) {
                          const double sa = score(a), sb = score(b);
                          return sa != sb ? sa > sb : a < b;
                        });
      std::vector<Beam> next;
      std::vector<int64_t> parents;
      for (int64_t k = 0; k < keep; ++k) {
        const int64_t i = order[k];
        Beam beam{score(i), beams[i / n].tokens};
        beam.tokens.push_back(i % n);
        next.push_back(std::move(beam));
        parents.push_back(i / n);
      }
      const auto index = torch::tensor(parents, torch::kInt64);
      h = h.index_select(0, index);
      c = c.index_select(0, index);
      beams = std::move(next);
    }
  }
  // beams are sorted by score (the last step was a predicted one, or every step
  // was forced and all beams are one).
  const Beam& best = beams.front();
  EdgeSample out;
  out.tokens = torch::tensor(best.tokens, torch::kInt64).view({S, T});
  out.log_prob = torch::tensor(best.score, pointer.options());
  out.edges = edges_from_tokens(out.tokens, n);
  return out;
}

EdgeList EdgePredictorImpl::edges_from_tokens(const torch::Tensor& tokens, int64_t n) const {
  TORCH_CHECK(tokens.defined() && tokens.scalar_type() == torch::kInt64 && tokens.dim() == 2 &&
                  tokens.size(1) % 2 == 0,
              kEdgePredictorModule, ".edges_from_tokens: argument 'tokens' must be int64 (sequences, even)");
  const auto tk = tokens.contiguous();
  auto tok = tk.accessor<int64_t, 2>();
  const int64_t S = tk.size(0), T = tk.size(1);
  std::vector<int64_t> offsets, columns;
  offsets.reserve(S * (n + 1));
  for (int64_t s = 0; s < S; ++s) {
    std::vector<std::vector<int64_t>> rows(n);
    for (int64_t t = 0; t < T; t += 2) {
      const int64_t o = tok[s][t], d = tok[s][t + 1];
      TORCH_CHECK(o >= 0 && o < n && d >= 0 && d < n, kEdgePredictorModule,
                  ".edges_from_tokens: tokens must be nodes in [0, ", n, "), got the pair (", o, ", ",
                  d, ")");
      rows[o].push_back(d);
      if (options.symmetric()) rows[d].push_back(o);
    }
    for (int64_t i = 0; i < n; ++i) {
      auto& row = rows[i];
      if (options.self_edges()) row.push_back(i);
      std::sort(row.begin(), row.end());
      row.erase(std::unique(row.begin(), row.end()), row.end());
      offsets.push_back(static_cast<int64_t>(columns.size()));
      columns.insert(columns.end(), row.begin(), row.end());
    }
    offsets.push_back(static_cast<int64_t>(columns.size()));
  }
  EdgeList edges;
  edges.columns = torch::tensor(columns, torch::kInt64);
  auto off = torch::tensor(offsets, torch::kInt64).view({S, n + 1});
  edges.offsets = options.variant() == EdgePredictorVariant::head_adaptive ? off : off[0].clone();
  return edges;
}

torch::Tensor reinforce_loss(const torch::Tensor& log_prob, double reward, double baseline) {
  TORCH_CHECK(log_prob.defined() && log_prob.numel() == 1, kEdgePredictorModule,
              ": reinforce_loss: argument 'log_prob' must be a scalar");
  TORCH_CHECK(std::isfinite(reward) && std::isfinite(baseline), kEdgePredictorModule,
              ": reinforce_loss: reward and baseline must be finite, got ", reward, " and ", baseline);
  return -(reward - baseline) * log_prob.reshape({});
}

}  // namespace attnkit::nn
