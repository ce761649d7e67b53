// TransformerOptions: names of the enums, JSON (what a checkpoint stores), and
// the builder's validation (include/attnkit/models/transformer.h).
#include <attnkit/models/transformer.h>
#include <attnkit/nn/registry.h>

#include <nlohmann/json.hpp>

#include <algorithm>

namespace attnkit::models {

namespace {

template <typename Enum>
Enum from_table(const char* what, const std::string& name,
                const std::vector<std::pair<const char*, Enum>>& table) {
  std::string known;
  for (const auto& [text, value] : table) {
    if (name == text) return value;
    known += (known.empty() ? "" : ", ") + std::string(text);
  }
  TORCH_CHECK(false, "unknown ", what, " '", name, "'; expected one of ", known);
}

template <typename Enum>
std::string to_text(Enum value, const std::vector<std::pair<const char*, Enum>>& table) {
  for (const auto& [text, v] : table)
    if (v == value) return text;
  TORCH_CHECK(false, "unnamed enum value ", static_cast<int>(value));
}

const std::vector<std::pair<const char*, Architecture>>& architectures() {
  static const std::vector<std::pair<const char*, Architecture>> t{
      {"decoder", Architecture::decoder},
      {"encoder", Architecture::encoder},
      {"encoder-decoder", Architecture::encoder_decoder}};
  return t;
}

/// The single schemes, in the order to_string writes a set.
const std::vector<std::pair<const char*, Positions>>& position_schemes() {
  static const std::vector<std::pair<const char*, Positions>> t{
      {"conv", Positions::conv}, {"sinusoidal", Positions::sinusoidal},
      {"learned", Positions::learned}, {"relative", Positions::relative}, {"alibi", Positions::alibi},
      {"rope", Positions::rope}};
  return t;
}

const std::vector<std::pair<const char*, Norm>>& norms() {
  static const std::vector<std::pair<const char*, Norm>> t{{"pre", Norm::pre}, {"post", Norm::post}};
  return t;
}

const std::vector<std::pair<const char*, Normalization>>& normalizations() {
  static const std::vector<std::pair<const char*, Normalization>> t{{"layer", Normalization::layer},
                                                                    {"rms", Normalization::rms}};
  return t;
}

const std::vector<std::pair<const char*, FeedForward>>& feed_forwards() {
  static const std::vector<std::pair<const char*, FeedForward>> t{{"relu", FeedForward::relu},
                                                                  {"swiglu", FeedForward::swiglu}};
  return t;
}

}  // namespace

Architecture architecture_from_string(const std::string& name) {
  return from_table("architecture", name, architectures());
}
Positions positions_from_string(const std::string& name) {
  if (name == "none") return Positions::none;
  Positions set = Positions::none;
  for (size_t begin = 0;;) {
    const size_t end = std::min(name.find('+', begin), name.size());
    const auto part = name.substr(begin, end - begin);
    TORCH_CHECK(part != "none", "position schemes '", name, "': 'none' stands alone");
    const auto scheme = from_table("position scheme", part, position_schemes());
    TORCH_CHECK(!has(set, scheme), "position schemes '", name, "' name ", to_string(scheme), " twice");
    set = set | scheme;
    if (end == name.size()) break;
    begin = end + 1;
  }
  TORCH_CHECK(!(has(set, Positions::sinusoidal) && has(set, Positions::learned)), "position schemes '", name,
              "' add two absolute tables; choose sinusoidal or learned");
  const int relative_schemes = has(set, Positions::relative) + has(set, Positions::alibi) + has(set, Positions::rope);
  TORCH_CHECK(relative_schemes <= 1, "position schemes '", name,
              "' give the scores two relative terms; choose one of relative, alibi and rope");
  return set;
}
Norm norm_from_string(const std::string& name) { return from_table("norm placement", name, norms()); }
Normalization normalization_from_string(const std::string& name) {
  return from_table("normalization", name, normalizations());
}
FeedForward feed_forward_from_string(const std::string& name) {
  return from_table("feed-forward network", name, feed_forwards());
}
std::string to_string(Architecture value) { return to_text(value, architectures()); }
std::string to_string(Positions value) {
  std::string text;
  for (const auto& [name, scheme] : position_schemes())
    if (has(value, scheme)) text += (text.empty() ? "" : "+") + std::string(name);
  return text.empty() ? "none" : text;
}
std::string to_string(Norm value) { return to_text(value, norms()); }
std::string to_string(Normalization value) { return to_text(value, normalizations()); }
std::string to_string(FeedForward value) { return to_text(value, feed_forwards()); }

// --- JSON -----------------------------------------------------------------------------------

std::string TransformerOptions::to_json() const {
  nlohmann::ordered_json j;
  j["architecture"] = models::to_string(architecture());
  j["vocab_size"] = vocab_size();
  j["source_vocab_size"] = source_vocab_size();
  j["layers"] = layers();
  j["width"] = width();
  j["heads"] = heads();
  // Written only when set: the options of a model without grouped heads stay
  // what they were before the option existed.
  if (kv_heads() != 0) j["kv_heads"] = kv_heads();
  j["ffn"] = ffn();
  j["dropout"] = dropout();
  // Written only when set, as kv_heads.
  if (attention_dropout() != 0.0) j["attention_dropout"] = attention_dropout();
  j["attention"] = attention();
  j["cross_attention"] = cross_attention();
  j["positions"] = models::to_string(positions());
  j["max_length"] = max_length();
  j["relative_clip"] = relative_clip();
  j["conv_width"] = conv_width();
  // Written only when changed, as kv_heads.
  if (rotary_fraction() != 1.0) j["rotary_fraction"] = rotary_fraction();
  j["norm"] = models::to_string(norm());
  // Written only when changed, as kv_heads: a classic block's options are
  // those of checkpoints from before the modern block existed.
  if (normalization() != Normalization::layer) j["normalization"] = models::to_string(normalization());
  if (feed_forward() != FeedForward::relu) j["feed_forward"] = models::to_string(feed_forward());
  if (!bias()) j["bias"] = bias();
  j["tie_embeddings"] = tie_embeddings();
  j["shared_weights"] = shared_weights();
  return j.dump();
}

TransformerOptions TransformerOptions::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "TransformerOptions::from_json: not JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "TransformerOptions::from_json: expected a JSON object, got ", j.type_name());
  TransformerOptions o;
  for (const auto& [key, value] : j.items()) {
    try {
      if (key == "architecture") o.architecture(architecture_from_string(value.get<std::string>()));
      else if (key == "vocab_size") o.vocab_size(value.get<int64_t>());
      else if (key == "source_vocab_size") o.source_vocab_size(value.get<int64_t>());
      else if (key == "layers") o.layers(value.get<int64_t>());
      else if (key == "width") o.width(value.get<int64_t>());
      else if (key == "heads") o.heads(value.get<int64_t>());
      else if (key == "kv_heads") o.kv_heads(value.get<int64_t>());
      else if (key == "ffn") o.ffn(value.get<int64_t>());
      else if (key == "dropout") o.dropout(value.get<double>());
      else if (key == "attention_dropout") o.attention_dropout(value.get<double>());
      else if (key == "attention") o.attention(value.get<std::vector<std::string>>());
      else if (key == "cross_attention") o.cross_attention(value.get<std::string>());
      else if (key == "positions") o.positions(positions_from_string(value.get<std::string>()));
      else if (key == "max_length") o.max_length(value.get<int64_t>());
      else if (key == "relative_clip") o.relative_clip(value.get<int64_t>());
      else if (key == "conv_width") o.conv_width(value.get<int64_t>());
      else if (key == "rotary_fraction") o.rotary_fraction(value.get<double>());
      else if (key == "norm") o.norm(norm_from_string(value.get<std::string>()));
      else if (key == "normalization") o.normalization(normalization_from_string(value.get<std::string>()));
      else if (key == "feed_forward") o.feed_forward(feed_forward_from_string(value.get<std::string>()));
      else if (key == "bias") o.bias(value.get<bool>());
      else if (key == "tie_embeddings") o.tie_embeddings(value.get<bool>());
      else if (key == "shared_weights") o.shared_weights(value.get<bool>());
      else TORCH_CHECK(false, "TransformerOptions::from_json: unknown key '", key, "'");
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "TransformerOptions::from_json: key '", key, "' has the wrong type (",
                  value.type_name(), "): ", e.what());
    }
  }
  return o;
}

int64_t TransformerOptions::rotary_dim() const {
  if (!has(positions(), Positions::rope)) return 0;
  const int64_t head = heads() > 0 ? width() / heads() : 0;
  return 2 * static_cast<int64_t>(rotary_fraction() * static_cast<double>(head) / 2);
}

TransformerOptions& TransformerOptions::llama_block() {
  norm(Norm::pre);
  normalization(Normalization::rms);
  feed_forward(FeedForward::swiglu);
  bias(false);
  // Rotary positions take the place of the absolute tables; a convolution stays.
  auto schemes = has(positions(), Positions::conv) ? Positions::conv : Positions::none;
  positions(schemes | Positions::rope);
  return *this;
}

// --- Validation -------------------------------------------------------------------------------

namespace {

void check_block_spec(const TransformerOptions& o, const std::string& text, bool in_decoder) {
  const auto [info, spec] = nn::resolve_mechanism(text);
  const char* where = "Transformer";
  TORCH_CHECK(!in_decoder || nn::usable_in_decoder(*info), where, ": attention '", text,
              "' cannot serve a decoder: it supports neither the causal flag nor a causal "
              "pattern, and a decoder must not see later positions; usable in a decoder: ",
              nn::mechanism_names_where(nn::usable_in_decoder));
  const bool class_projections = info->layer == nn::MechanismLayer::class_projections;
  if (class_projections) {
    const int64_t classes = spec.get_int("classes", 0) > 0 ? spec.get_int("classes", 0) : o.heads();
    TORCH_CHECK(o.width() % classes == 0, where, ": agglomerative attention with ", classes,
                " classes needs a width divisible by them, got width ", o.width());
    TORCH_CHECK(!has(o.positions(), Positions::relative), where,
                ": relative positions need exact attention's scores; agglomerative attention "
                "has none (use positions conv, the agglomerative paper's front end, or another)");
  }
  const bool grouped = o.kv_heads() != 0 && o.kv_heads() != o.heads();
  TORCH_CHECK(!grouped || !class_projections, where, ": kv_heads = ", o.kv_heads(),
              " needs key and value projections; agglomerative blocks have class projections instead");
  TORCH_CHECK(!grouped || !has(o.positions(), Positions::relative), where, ": kv_heads = ",
              o.kv_heads(), " is not supported with relative positions (their blocks keep full heads)");
  TORCH_CHECK(o.attention_dropout() == 0 || !has(o.positions(), Positions::relative), where,
              ": attention_dropout is not taken by relative-position blocks (their attention is not the kernel's)");
  TORCH_CHECK(o.attention_dropout() == 0 || info->supports.dropout, where, ": attention_dropout = ",
              o.attention_dropout(), " drops attention weights inside the kernel; '", text,
              "' does not (mechanisms that do: ",
              nn::mechanism_names_where([](const nn::MechanismInfo& m) { return m.supports.dropout; }), ")");
  TORCH_CHECK(!has(o.positions(), Positions::alibi) || info->supports.alibi, where,
              ": ALiBi positions penalise the scores inside the attention kernel; '", text,
              "' takes no slopes (mechanisms that do: ",
              nn::mechanism_names_where([](const nn::MechanismInfo& m) { return m.supports.alibi; }), ")");
  TORCH_CHECK(!has(o.positions(), Positions::rope) || info->supports.rotary != nn::RotarySupport::none, where,
              ": rotary positions rotate q and k (or linear attention's features of them), which needs scores that "
              "are their dot products; '", text,
              "' has none (mechanisms that take them: ",
              nn::mechanism_names_where(
                  [](const nn::MechanismInfo& m) { return m.supports.rotary != nn::RotarySupport::none; }),
              ")");
  TORCH_CHECK(o.bias() || (!class_projections && !has(o.positions(), Positions::relative)), where,
              ": bias = false leaves the biases out of multi-head blocks; ",
              class_projections ? "agglomerative blocks" : "relative-position blocks",
              " have projections of their own, which keep theirs");
  TORCH_CHECK(!has(o.positions(), Positions::relative) || info->exact, where,
              ": relative positions (Shaw et al.) add terms to exact attention's scores; they "
              "need attention '", nn::exact_mechanism().name, "', got '", text, "'");
}

}  // namespace

bool adds_nodes(const std::string& mechanism) {
  return static_cast<bool>(nn::find_mechanism(mechanism).node_spans);
}

std::vector<std::pair<int64_t, int64_t>> extra_node_spans(const std::string& mechanism, int64_t tokens) {
  const auto& info = nn::find_mechanism(mechanism);
  TORCH_CHECK(info.node_spans, "extra_node_spans: '", mechanism, "' adds no nodes");
  return info.node_spans(tokens);
}

int64_t attention_nodes(const std::string& mechanism, int64_t tokens) {
  return tokens + (adds_nodes(mechanism) ? static_cast<int64_t>(extra_node_spans(mechanism, tokens).size()) : 0);
}

torch::Tensor append_extra_nodes(const torch::Tensor& x, const std::string& mechanism) {
  const int64_t N = x.size(0), t = x.size(1), d = x.size(2);
  const auto spans = extra_node_spans(mechanism, t);
  if (spans.empty()) return x;  // one token: a tree without spans
  std::vector<int64_t> lo, hi;
  std::vector<double> inverse;
  for (const auto& [a, b] : spans) {
    lo.push_back(a);
    hi.push_back(b);
    inverse.push_back(1.0 / static_cast<double>(b - a));
  }
  // Span sums from prefix sums: O(t d) whatever the spans.
  const auto prefix = torch::cat({torch::zeros({N, 1, d}, x.options()), x.cumsum(1)}, 1);
  const auto sums = prefix.index_select(1, torch::tensor(hi, torch::kInt64)) -
                    prefix.index_select(1, torch::tensor(lo, torch::kInt64));
  const auto scale = torch::tensor(inverse, torch::kFloat64).to(x.scalar_type()).view({1, -1, 1});
  return torch::cat({x, sums * scale}, 1);
}

void validate(const TransformerOptions& o) {
  const char* where = "Transformer";
  TORCH_CHECK(o.vocab_size() >= 1, where, ": vocab_size must be >= 1, got ", o.vocab_size());
  TORCH_CHECK(o.source_vocab_size() >= 0, where, ": source_vocab_size must be >= 0, got ",
              o.source_vocab_size());
  TORCH_CHECK(o.layers() >= 1, where, ": layers must be >= 1, got ", o.layers());
  TORCH_CHECK(o.width() >= 1 && o.heads() >= 1 && o.width() % o.heads() == 0, where, ": width (",
              o.width(), ") must be a positive multiple of heads (", o.heads(), ")");
  TORCH_CHECK(o.kv_heads() >= 0 && (o.kv_heads() == 0 || o.heads() % o.kv_heads() == 0), where,
              ": kv_heads (", o.kv_heads(), ") must divide heads (", o.heads(),
              "), or be 0 for as many as heads");
  TORCH_CHECK(o.ffn() >= 1, where, ": ffn must be >= 1, got ", o.ffn());
  TORCH_CHECK(o.dropout() >= 0 && o.dropout() < 1, where, ": dropout must be in [0, 1), got ",
              o.dropout());
  TORCH_CHECK(o.attention_dropout() >= 0 && o.attention_dropout() < 1, where,
              ": attention_dropout must be in [0, 1), got ", o.attention_dropout());
  TORCH_CHECK(o.max_length() >= 1, where, ": max_length must be >= 1, got ", o.max_length());
  TORCH_CHECK(o.relative_clip() >= 0, where, ": relative_clip must be >= 0, got ", o.relative_clip());
  TORCH_CHECK(o.conv_width() >= 1, where, ": conv_width must be >= 1, got ", o.conv_width());
  TORCH_CHECK(o.rotary_fraction() > 0 && o.rotary_fraction() <= 1, where,
              ": rotary_fraction must be in (0, 1], got ", o.rotary_fraction());
  TORCH_CHECK(!has(o.positions(), Positions::rope) || o.rotary_dim() >= 2, where, ": rotary_fraction ",
              o.rotary_fraction(), " of ", o.width() / o.heads(), " features per head rotates ", o.rotary_dim(),
              "; rope positions need at least one pair (2)");
  const auto& specs = o.attention();
  TORCH_CHECK(specs.size() == 1 || static_cast<int64_t>(specs.size()) == o.layers(), where,
              ": give one attention spec for every block or one per block (", o.layers(),
              "), got ", specs.size());
  TORCH_CHECK(!o.shared_weights() || specs.size() == 1, where,
              ": shared weights (a universal transformer) apply one block's weights at every "
              "layer, so they take one attention spec, got ", specs.size());
  const bool decoder = o.architecture() != Architecture::encoder;
  const bool encoder = o.architecture() != Architecture::decoder;
  for (const auto& spec : specs) {
    if (encoder) check_block_spec(o, spec, false);
    if (decoder) check_block_spec(o, spec, true);
  }
  // Patterns that add nodes (BP-Transformer's spans, Star-Transformer's relay)
  // change the node set every block attends over: one spec for all blocks.
  for (const auto& text : specs) {
    const auto name = nn::resolve_mechanism(text).second.name;
    if (!adds_nodes(name)) continue;
    for (const auto& other : specs)
      TORCH_CHECK(other == text, where, ": attention '", text, "' adds nodes of its own, so every "
                  "block must use it (the blocks attend over one node set), got '", other, "' too");
  }
  // SAC blocks read one structure per sequence from the model's one edge
  // predictor, so they must agree on its options.
  std::string sac;
  for (const auto& text : specs) {
    const auto [info, spec] = nn::resolve_mechanism(text);
    if (!info->model_structures) continue;
    TORCH_CHECK(sac.empty() || sac == spec.str(), where, ": the SAC blocks share one edge predictor, "
                "so their specs must be the same, got '", sac, "' and '", spec.str(), "'");
    sac = spec.str();
  }
  if (o.architecture() == Architecture::encoder_decoder) {
    const auto [info, spec] = nn::resolve_mechanism(o.cross_attention());
    TORCH_CHECK(info->make && info->supports.cross, where, ": cross-attention '",
                o.cross_attention(), "' must attend from L queries to S != L keys through the "
                "projections; '", info->name, "' cannot");
    TORCH_CHECK(o.attention_dropout() == 0 || info->supports.dropout, where, ": attention_dropout = ",
                o.attention_dropout(), " drops attention weights inside the kernel; cross-attention '",
                o.cross_attention(), "' does not (mechanisms that do: ",
                nn::mechanism_names_where([](const nn::MechanismInfo& m) { return m.supports.dropout; }), ")");
  }
}

}  // namespace attnkit::models
