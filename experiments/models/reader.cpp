// The recurrent cloze reader and its four read-outs (experiments/models/reader.h).
#include "models/reader.h"
#include <attnkit/ops.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace attnkit::experiments {

Readout readout_from_string(const std::string& name) {
  if (name == "none") return Readout::none;
  if (name == "linear") return Readout::linear;
  if (name == "gated") return Readout::gated;
  if (name == "softmax") return Readout::softmax;
  TORCH_CHECK(false, "reader: unknown read-out '", name, "'; expected none, linear, gated or softmax");
}

std::string to_string(Readout readout) {
  switch (readout) {
    case Readout::none: return "none";
    case Readout::linear: return "linear";
    case Readout::gated: return "gated";
    case Readout::softmax: return "softmax";
  }
  return "?";
}

namespace {

void check_states(const char* what, const torch::Tensor& H, const torch::Tensor& q) {
  TORCH_CHECK(H.dim() == 3, what, ": H must be (N, n, k), got ", H.sizes());
  TORCH_CHECK(q.dim() == 2, what, ": q must be (N, k), got ", q.sizes());
  TORCH_CHECK(q.size(0) == H.size(0) && q.size(1) == H.size(2), what, ": q ", q.sizes(),
              " must be (N, k) = (", H.size(0), ", ", H.size(2), ") for H ", H.sizes());
}

// (N, n, k) -> (N, 1, n, k); (N, k) -> (N, 1, 1, k): one head, one query.
torch::Tensor as_keys(const torch::Tensor& H) { return H.unsqueeze(1); }
torch::Tensor as_query(const torch::Tensor& q) { return q.unsqueeze(1).unsqueeze(1); }

}  // namespace

torch::Tensor linear_readout(const torch::Tensor& H, const torch::Tensor& q) {
  check_states("linear_readout", H, q);
  return attnkit::linear_attention(as_query(q), as_keys(H), as_keys(H)).squeeze(2).squeeze(1);
}

torch::Tensor softmax_readout(const torch::Tensor& H, const torch::Tensor& q) {
  check_states("softmax_readout", H, q);
  return attnkit::softmax_attention(as_query(q), as_keys(H), as_keys(H),
                                    SoftmaxAttentionFuncOptions().scale(1.0))
      .squeeze(2)
      .squeeze(1);
}

ReaderImpl::ReaderImpl(const ReaderOptions& options_) : options(options_) { reset(); }

void ReaderImpl::reset() {
  const auto& o = options;
  TORCH_CHECK(o.vocab() >= 2, "Reader: option 'vocab' must be >= 2, got ", o.vocab());
  TORCH_CHECK(o.embedding() >= 1, "Reader: option 'embedding' must be >= 1, got ", o.embedding());
  TORCH_CHECK(o.hidden() >= 1, "Reader: option 'hidden' must be >= 1, got ", o.hidden());
  const int64_t k = state_size();
  embed = register_module("embed", torch::nn::Embedding(o.vocab(), o.embedding()));
  auto rnn = [&](const char* name) {
    return register_module(name, torch::nn::GRU(torch::nn::GRUOptions(o.embedding(), o.hidden())
                                                    .batch_first(true)
                                                    .bidirectional(o.bidirectional())));
  };
  document_rnn = rnn("document_rnn");
  query_rnn = o.shared_encoder() ? document_rnn : rnn("query_rnn");
  gate = nullptr;
  TORCH_CHECK(!o.gate_bias() || o.readout() == Readout::gated, "Reader: option 'gate_bias' is for the gated "
              "read-out, got read-out ", to_string(o.readout()));
  if (o.readout() == Readout::gated) {
    gate = register_module("gate", nn::GatedLinearAttention(nn::GatedLinearAttentionOptions(k)));
    if (o.gate_bias()) {
      torch::NoGradGuard no_grad;
      gate->gate->bias.fill_(*o.gate_bias());
    }
  }
  from_readout = register_module("from_readout", nn::Linear(k, k));
  from_query = register_module("from_query", nn::Linear(k, k));
  output = register_module("output", torch::nn::Embedding(o.vocab(), k));
  // Scores o_w . g with g in (-1, 1)^k start near zero (uniform candidates)
  // when |o_w| is about 1, not sqrt(k) as with Embedding's N(0, 1).
  {
    torch::NoGradGuard no_grad;
    const double bound = 1.0 / std::sqrt(static_cast<double>(k));
    output->weight.uniform_(-bound, bound);
  }
  output_bias = register_parameter("output_bias", torch::zeros({o.vocab()}));
}

int64_t ReaderImpl::state_size() const {
  return options.bidirectional() ? 2 * options.hidden() : options.hidden();
}

namespace {

// GRU final states (layers * directions, N, hidden) -> (N, directions * hidden).
torch::Tensor final_state(const torch::Tensor& h_n, bool bidirectional) {
  if (!bidirectional) return h_n[-1];
  return torch::cat({h_n[-2], h_n[-1]}, 1);
}

void check_ids(const char* what, const torch::Tensor& ids, int64_t vocab) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == torch::kInt64 && ids.size(1) >= 1,
              "Reader: ", what, " must be int64 (N, length >= 1), got ", ids.scalar_type(), " ",
              ids.sizes());
  if (ids.numel() == 0) return;
  const auto lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < vocab, "Reader: ", what, " ids must be in [0, ", vocab,
              "), got values in [", lo, ", ", hi, "]");
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> ReaderImpl::encode_document(const torch::Tensor& document) {
  check_ids("document", document, options.vocab());
  auto [H, h_n] = document_rnn(embed(document));
  return {H, final_state(h_n, options.bidirectional())};
}

torch::Tensor ReaderImpl::encode_query(const torch::Tensor& query) {
  check_ids("query", query, options.vocab());
  auto [states, h_n] = query_rnn(embed(query));
  if (options.placeholder() < 0) return final_state(h_n, options.bidirectional());
  const auto is_blank = query.eq(options.placeholder());
  TORCH_CHECK(is_blank.any(1).all().item<bool>(), "Reader: every query must hold the placeholder id ",
              options.placeholder(), "; some row of query ", query.sizes(), " has none");
  const auto position = is_blank.to(torch::kInt64).argmax(1);  // the first occurrence
  return states.index({torch::arange(query.size(0)), position});
}

torch::Tensor ReaderImpl::read(const torch::Tensor& H, const torch::Tensor& final,
                               const torch::Tensor& q) {
  check_states("Reader::read", H, q);
  const double n = static_cast<double>(H.size(1));
  switch (options.readout()) {
    case Readout::none: return final;
    case Readout::linear: return linear_readout(H, q) / n;
    case Readout::gated: return gate(H, q.unsqueeze(1)).squeeze(1) / n;
    case Readout::softmax: return softmax_readout(H, q);
  }
  TORCH_CHECK(false, "Reader: unknown read-out");
}

torch::Tensor ReaderImpl::forward(const torch::Tensor& document, const torch::Tensor& query,
                                  const torch::Tensor& candidate) {
  TORCH_CHECK(document.dim() == 2 && query.dim() == 2 && query.size(0) == document.size(0),
              "Reader: document (N, n) and query (N, m) must have the same N, got ",
              document.sizes(), " and ", query.sizes());
  TORCH_CHECK(candidate.dim() == 2 && candidate.scalar_type() == torch::kBool &&
                  candidate.size(0) == document.size(0) && candidate.size(1) == options.vocab(),
              "Reader: candidate must be bool (N, V) = (", document.size(0), ", ", options.vocab(),
              "), got ", candidate.scalar_type(), " ", candidate.sizes());
  auto [H, final] = encode_document(document);
  const auto q = encode_query(query);
  const auto r = read(H, final, q);
  const auto g = torch::tanh(from_readout(r) + from_query(q));
  const auto scores = attnkit::linear(g, output->weight, output_bias);
  return scores.masked_fill(candidate.logical_not(), -std::numeric_limits<float>::infinity());
}

}  // namespace attnkit::experiments
