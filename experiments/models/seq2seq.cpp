// The recurrent encoder-decoder with a zoo score (experiments/models/seq2seq.h).
#include "models/seq2seq.h"

#include <torch/nn/utils/rnn.h>
#include <torch/torch.h>

#include "tasks/dictionary.h"

namespace attnkit::experiments {

Score score_from_string(const std::string& name) {
  for (auto score : {Score::none, Score::additive, Score::general, Score::dot, Score::scaled_dot, Score::location})
    if (name == to_string(score)) return score;
  TORCH_CHECK(false, "seq2seq: unknown score '", name,
              "'; expected none, additive, general, dot, scaled-dot or location");
}

std::string to_string(Score score) {
  switch (score) {
    case Score::none: return "none";
    case Score::additive: return "additive";
    case Score::general: return "general";
    case Score::dot: return "dot";
    case Score::scaled_dot: return "scaled-dot";
    case Score::location: return "location";
  }
  return "?";
}

Seq2SeqImpl::Seq2SeqImpl(const Seq2SeqOptions& options_) : options(options_) { reset(); }

void Seq2SeqImpl::reset() {
  const auto& o = options;
  TORCH_CHECK(o.vocab() >= 5, "Seq2Seq: option 'vocab' must be >= 5 (4 specials and a character), got ", o.vocab());
  TORCH_CHECK(o.max_source() >= 1, "Seq2Seq: option 'max_source' must be >= 1, got ", o.max_source());
  TORCH_CHECK(o.embedding() >= 1, "Seq2Seq: option 'embedding' must be >= 1, got ", o.embedding());
  TORCH_CHECK(o.hidden() >= 1, "Seq2Seq: option 'hidden' must be >= 1, got ", o.hidden());
  const int64_t k = state_size();
  embed_source = register_module("embed_source", torch::nn::Embedding(o.vocab(), o.embedding()));
  embed_target = register_module("embed_target", torch::nn::Embedding(o.vocab(), o.embedding()));
  encoder = register_module(
      "encoder", torch::nn::GRU(torch::nn::GRUOptions(o.embedding(), o.hidden()).batch_first(true).bidirectional(true)));
  decoder = register_module("decoder", torch::nn::GRU(torch::nn::GRUOptions(o.embedding(), k).batch_first(true)));
  bridge = register_module("bridge", nn::Linear(k, k));
  combine = register_module("combine", nn::Linear(2 * k, k));
  output = register_module("output", nn::Linear(k, o.vocab()));
  additive = nullptr;
  general = nullptr;
  dot = nullptr;
  location = nullptr;
  switch (o.score()) {
    case Score::none: break;
    case Score::additive:
      additive = register_module("attention", nn::AdditiveAttention(nn::AdditiveAttentionOptions(k, k, k)));
      break;
    case Score::general:
      general = register_module("attention", nn::GeneralAttention(nn::GeneralAttentionOptions(k, k)));
      break;
    case Score::dot:
    case Score::scaled_dot:
      dot = register_module("attention", nn::DotAttention(nn::DotAttentionOptions().scaled(o.score() == Score::scaled_dot)));
      break;
    case Score::location:
      location = register_module("attention", nn::LocationAttention(nn::LocationAttentionOptions(k, o.max_source())));
      break;
  }
}

Encoded Seq2SeqImpl::encode(const torch::Tensor& source, const torch::Tensor& lengths) {
  TORCH_CHECK(source.dim() == 2 && source.scalar_type() == torch::kInt64 && source.size(0) >= 1 && source.size(1) >= 1,
              "Seq2Seq: source must be int64 (N >= 1, S >= 1), got ", source.scalar_type(), " ", source.sizes());
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == torch::kInt64 && lengths.size(0) == source.size(0),
              "Seq2Seq: lengths must be int64 (N) = (", source.size(0), "), got ", lengths.scalar_type(), " ",
              lengths.sizes());
  const int64_t S = source.size(1);
  TORCH_CHECK(lengths.min().item<int64_t>() >= 1 && lengths.max().item<int64_t>() <= S,
              "Seq2Seq: lengths must be in [1, S = ", S, "], got ", lengths);
  TORCH_CHECK(options.score() != Score::location || S <= options.max_source(), "Seq2Seq: a source of length ", S,
              " is longer than max_source ", options.max_source(), " (location scores)");
  namespace rnn = torch::nn::utils::rnn;
  auto packed = rnn::pack_padded_sequence(embed_source(source), lengths, /*batch_first=*/true,
                                          /*enforce_sorted=*/false);
  auto [states, final] = encoder->forward_with_packed_input(packed);
  auto H = std::get<0>(rnn::pad_packed_sequence(states, /*batch_first=*/true, 0.0, S));
  // final (2, N, hidden): the forward direction's state after each row's last
  // character, the backward direction's after its first.
  auto s0 = torch::tanh(bridge(torch::cat({final[0], final[1]}, 1)));
  return {H, lengths, s0.unsqueeze(0)};
}

Seq2SeqOutput Seq2SeqImpl::read_out(const torch::Tensor& s, const Encoded& encoded) {
  const auto& H = encoded.states;
  nn::AttentionOutput attended;
  switch (options.score()) {
    case Score::none: attended.context = torch::zeros({s.size(0), s.size(1), H.size(2)}, s.options()); break;
    case Score::additive: attended = additive(s, H, H, encoded.lengths); break;
    case Score::general: attended = general(s, H, H, encoded.lengths); break;
    case Score::dot:
    case Score::scaled_dot: attended = dot(s, H, H, encoded.lengths); break;
    case Score::location: attended = location(s, H, encoded.lengths); break;
  }
  const auto o = torch::tanh(combine(torch::cat({attended.context, s}, 2)));
  return {output(o), attended.weights};
}

Seq2SeqOutput Seq2SeqImpl::forward(const torch::Tensor& source, const torch::Tensor& lengths,
                                   const torch::Tensor& decoder_input) {
  TORCH_CHECK(decoder_input.dim() == 2 && decoder_input.scalar_type() == torch::kInt64 &&
                  decoder_input.size(0) == source.size(0) && decoder_input.size(1) >= 1,
              "Seq2Seq: decoder_input must be int64 (N = ", source.size(0), ", T >= 1), got ",
              decoder_input.scalar_type(), " ", decoder_input.sizes());
  const auto encoded = encode(source, lengths);
  auto states = std::get<0>(decoder(embed_target(decoder_input), encoded.decoder_initial));
  return read_out(states, encoded);
}

Decoded Seq2SeqImpl::greedy(const torch::Tensor& source, const torch::Tensor& lengths, int64_t max_steps) {
  TORCH_CHECK(max_steps >= 1, "Seq2Seq: greedy needs max_steps >= 1, got ", max_steps);
  const auto encoded = encode(source, lengths);
  const int64_t N = source.size(0);
  auto state = encoded.decoder_initial;
  auto input = torch::full({N, 1}, CharVocabulary::kBos, torch::kInt64);
  auto finished = torch::zeros({N, 1}, torch::kBool);
  std::vector<torch::Tensor> ids, logits, weights;
  for (int64_t t = 0; t < max_steps; ++t) {
    auto [s, next_state] = decoder(embed_target(input), state);
    state = next_state;
    const auto out = read_out(s, encoded);
    // A row that has finished emits padding from then on.
    const auto best = out.logits.argmax(2).masked_fill(finished, CharVocabulary::kPad);
    ids.push_back(best);
    logits.push_back(out.logits);
    if (out.weights.defined()) weights.push_back(out.weights);
    finished = finished.logical_or(best.eq(CharVocabulary::kEos));
    if (finished.all().item<bool>()) break;
    input = best;
  }
  return {torch::cat(ids, 1), torch::cat(logits, 1), weights.empty() ? torch::Tensor() : torch::cat(weights, 1)};
}

}  // namespace attnkit::experiments
