// The one table of attention mechanisms. Every front end (MultiheadAttention,
// `attnkit bench`, `attnkit approx`, the figure commands, later the transformer
// builder, the training commands and the Python package) names a mechanism by
// a spec string and reads everything else about it from here:
//
//   "NAME[:key=value,...]"   e.g. "improved-clustered:clusters=25,topk=32",
//                                 "linear:feature_map=elu", "sparse-local:span=64"
//
// An entry holds the mechanism's name, its typed options with their defaults,
// what it supports, how to run it on per-head tensors, its float64 definition
// (the composite in src/reference, which the tests and the bench's `err`
// column compare against), a factory for its module, and its FLOP count. Each
// mechanism is written down once, in its own file src/nn/mechanisms/<name>.cpp,
// which adds its entries to the table when the library loads.
#pragma once

#include <attnkit/dispatch.h>
#include <attnkit/nn/decoding.h>
#include <attnkit/ops.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace attnkit::nn {

/// A parsed spec string: NAME and its key=value pairs, in the order written.
struct MechanismSpec {
  std::string name;
  std::vector<std::pair<std::string, std::string>> options;

  /// Parses "NAME[:key=value,...]". Throws on empty names, pairs without '=',
  /// empty keys and repeated keys. Does not check NAME or the keys against the
  /// registry (find_mechanism and make_mechanism do).
  static MechanismSpec parse(const std::string& text);
  /// The canonical text, e.g. "clustered:clusters=25".
  std::string str() const;

  bool has(const std::string& key) const;
  /// The value of `key` or `fallback`; errors name the spec, the key and the value.
  std::string get(const std::string& key, const std::string& fallback) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_double(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
};

/// One option of a mechanism: its key, type, default, range and help. The
/// registry checks every value a spec gives against it (resolve_mechanism),
/// and `attnkit mechanisms` and attnkit.mechanisms() list it. Defaults are
/// taken from the ops' *FuncOptions (or the module's options) where those
/// have one, so each default exists once.
struct MechanismOption {
  enum class Type { integer, real, boolean, choice };

  std::string key;
  Type type = Type::integer;
  std::string default_value;  ///< as a spec writes it, e.g. "100", "1e-6", "true", "elu"
  std::string help;
  /// integer and real: the accepted range (infinite: unbounded), closed
  /// unless min_exclusive (a real that must be > min, e.g. a positive bound).
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_exclusive = false;
  /// choice: the accepted words.
  std::vector<std::string> choices;

  static MechanismOption integer(std::string key, int64_t fallback, int64_t min, std::string help,
                                 c10::optional<int64_t> max = c10::nullopt);
  static MechanismOption real(std::string key, double fallback, double min, std::string help,
                              bool min_exclusive = false);
  static MechanismOption boolean(std::string key, bool fallback, std::string help);
  static MechanismOption choice(std::string key, std::string fallback, std::vector<std::string> choices,
                                std::string help);

  /// What the option accepts, as `attnkit mechanisms` prints it, e.g.
  /// "integer >= 1", "number > 0", "true|false", "identity|elu".
  std::string type_name() const;
  /// Throws unless the spec's value for this key (if it gives one) is of this
  /// option's type and range; the error names the spec, the key and the value.
  void check(const MechanismSpec& spec) const;
};

/// How a mechanism takes rotary positions (RoPE; ops.h rotary_embedding).
enum class RotarySupport {
  none,    ///< not at all: its scores are no dot products of q and k
           ///< (agglomerative classes, gated linear attention's gates), so
           ///< rotated inputs would not give RoPE's relative form
  inputs,  ///< its scores are dot products of q and k: q and k rotated before
           ///< the call are RoPE exactly (nn::MultiheadAttention rotates them)
  kernel,  ///< inside its kernel as q and k blocks load (AttendArgs::rotary_dim);
           ///< linear attention's is RoFormer's form, phi(q) and phi(k) rotated
           ///< in the numerator only, which no rotation of its inputs gives
};

/// What a mechanism can honour. A front end asks before it calls; a call that
/// needs an unsupported feature is refused with an error naming it.
struct MechanismSupports {
  bool causal = false;          ///< the causal flag (query i sees keys j <= i + S - L)
  bool key_lengths = false;     ///< padding: int64 (N) key lengths
  bool cross = false;           ///< L != S (cross-attention)
  bool value_dim = false;       ///< M != E (values of another width than keys)
  bool decoding_state = false;  ///< incremental decoding with a state (nn/decoding.h)
  /// Grouped-query heads: k and v with fewer heads than q, a divisor Hk of H,
  /// query head h reading key/value head h / (H / Hk), without copies (and
  /// the decoding state keeping Hk heads). Modules repeat each key/value head
  /// over its group for a mechanism without it (nn::MultiheadAttention).
  bool grouped_heads = false;
  /// ALiBi: per-head linear distance penalties on the scores
  /// (AttendArgs::alibi_slopes), computed inside the kernel; the decoding
  /// state takes them too (CausalState::set_alibi_slopes).
  bool alibi = false;
  /// Rotary positions, and where they are applied.
  RotarySupport rotary = RotarySupport::none;
  /// Attention dropout on the weights inside the kernel (AttendArgs::dropout_p).
  bool dropout = false;
};

/// One field of MechanismSupports as every listing shows it: the key of the
/// bindings' JSON (attnkit.mechanisms()), the letters of `attnkit
/// mechanisms`, and the text of both. The one list of the fields
/// (support_fields()) makes all three, so a new field appears in each.
struct SupportField {
  std::string key;   ///< e.g. "key_lengths"
  std::string help;  ///< e.g. "key_lengths (padding)"
  /// The field's value: "true" / "false", or for rotary "kernel" / "inputs" / "none".
  std::function<std::string(const MechanismSupports&)> value;
  /// `attnkit mechanisms`' letter for each value other than "false" / "none",
  /// with what it means there, e.g. {{"true", 'p', "key_lengths (padding)"}}.
  struct Letter {
    std::string value;
    char letter;
    std::string meaning;
  };
  std::vector<Letter> letters;
};

/// MechanismSupports' fields, in the order every listing prints them.
const std::vector<SupportField>& support_fields();

/// The attention layer a transformer block builds around a mechanism.
enum class MechanismLayer {
  /// nn::MultiheadAttention: query, key and value projections around the
  /// entry's module (`make`).
  multihead,
  /// nn::AgglomerativeAttention: query and reference class projections
  /// (`classes` of them, the spec's option, 0: the model's head count) in
  /// place of query/key projections; no grouped heads, no relative positions.
  class_projections,
};

/// Token spans [first, last), one per node.
using NodeSpans = std::vector<std::pair<int64_t, int64_t>>;

/// Sizes of one per-head call: q (N, H, L, E), k (N, Hk, S, E), v (N, Hk, S, M)
/// with Hk = kv_heads, or H when kv_heads is 0.
struct AttentionShape {
  int64_t N = 1, H = 1, L = 1, S = 1, E = 1, M = 1;
  int64_t kv_heads = 0;
  int64_t Hk() const { return kv_heads > 0 ? kv_heads : H; }
};

/// Call-time settings of a per-head call.
struct AttendArgs {
  // A constructor rather than an aggregate: {causal, key_lengths} keeps
  // meaning what it did before alibi_slopes existed, without warnings.
  AttendArgs(bool causal_ = false, torch::Tensor key_lengths_ = {}, torch::Tensor alibi_slopes_ = {})
      : causal(causal_), key_lengths(std::move(key_lengths_)), alibi_slopes(std::move(alibi_slopes_)) {}
  bool causal = false;
  torch::Tensor key_lengths;   ///< undefined, or int64 (N)
  torch::Tensor alibi_slopes;  ///< undefined, or floating (H): SoftmaxAttentionFuncOptions::alibi_slopes
  /// Rotary positions inside the kernel (RotarySupport::kernel):
  /// SoftmaxAttentionFuncOptions' (LinearAttentionFuncOptions') rotary_dim
  /// and rotary_base. 0: none.
  int64_t rotary_dim = 0;
  double rotary_base = 10000.0;
  /// Attention dropout (MechanismSupports::dropout):
  /// SoftmaxAttentionFuncOptions' dropout_p and dropout_seed (unset: drawn
  /// from torch's default generator). Modules set it in training only.
  double dropout_p = 0.0;
  c10::optional<int64_t> dropout_seed;
};

/// A mechanism as a module over per-head tensors: (q, k, v) of the shapes in
/// AttentionShape -> (N, H, L, M). Stateful mechanisms (clustered attention's
/// seed sequence) keep their state in buffers, so state_dict covers it.
class MechanismImpl : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  virtual torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const AttendArgs& args = {}) = 0;
  /// A deep copy, state (buffers) included: what a module holding this
  /// mechanism uses in its own clone().
  virtual std::shared_ptr<MechanismImpl> copy(
      const c10::optional<torch::Device>& device = c10::nullopt) const = 0;
};

/// The tensors a mechanism consumes in its functional form: q, k, v for every
/// mechanism but agglomerative attention, whose per-head inputs are class
/// weights cq (N, H, L), cr (N, H, S) and values v (N, H, S, M).
using MechanismInputs = std::vector<torch::Tensor>;

struct MechanismInfo {
  std::string name;
  std::string summary;
  std::vector<MechanismOption> options;
  MechanismSupports supports;
  /// True for mechanisms that approximate exact softmax attention (clustered,
  /// improved-clustered); the bench reports their distance to it.
  bool approximates_exact = false;
  /// True for exact softmax attention ("full"): the torch baseline computes
  /// it, relative-position blocks hold it, approximations are measured against
  /// it, and only it forms the (L, S) weight matrix that
  /// MultiheadAttention::attention_weights (need_weights) returns.
  bool exact = false;
  /// True when torch computes the same mechanism (torch's own SDPA or its
  /// composite): `attnkit bench --impl torch` and `attnkit bench-model
  /// --baseline` have a row to compare with.
  bool torch_baseline = false;
  /// The layer a transformer block builds around the mechanism.
  MechanismLayer layer = MechanismLayer::multihead;
  /// True for mechanisms that attend over structures the model predicts for
  /// each sequence (SAC: one nn::EdgePredictor, trained with the model by
  /// REINFORCE, whose options the spec gives: nn::SacOptions::from_spec). A
  /// model holding such blocks builds the predictor; no block swaps into or
  /// out of it, since the predictor is trained with the model.
  bool model_structures = false;
  /// Patterns that add nodes of their own after the t tokens
  /// (BP-Transformer's span nodes, Star-Transformer's relay): the token span
  /// of each added node, in node order (node t + i spans the i-th); null for
  /// the others. A model over such a pattern appends the nodes (means of
  /// their spans; models::append_extra_nodes) and uses one spec for every block.
  std::function<NodeSpans(int64_t tokens)> node_spans;
  /// True for mechanisms that are causal by construction (causal-linear, the
  /// causal sparse patterns): usable in a decoder without the causal flag.
  bool always_causal = false;
  /// Checks that involve more than one option (each option's own type and
  /// range are checked from `options`); null when there are none.
  std::function<void(const MechanismSpec&)> validate;
  /// Names of the tensors of the functional form, e.g. {"q", "k", "v"}.
  std::vector<std::string> inputs;

  /// Random inputs of the functional form (standard normal, or the form the
  /// mechanism expects) from torch's global generator.
  std::function<MechanismInputs(const AttentionShape&, torch::Dtype)> sample;
  /// The functional form: the attnkit op(s) with the spec's options.
  std::function<torch::Tensor(const MechanismInputs&, const AttendArgs&, const MechanismSpec&)> run;
  /// The same mechanism's float64-capable composite definition (src/reference).
  std::function<torch::Tensor(const MechanismInputs&, const AttendArgs&, const MechanismSpec&)>
      reference;
  /// Which backend `run` takes on these inputs, and why.
  std::function<Dispatch(const MechanismInputs&, const AttendArgs&, const MechanismSpec&)> dispatch;
  /// Mechanisms that are sparse_attention over an edge list (sparse-*, and
  /// sac alone): the list over n nodes for a spec; null for the others.
  std::function<EdgeList(int64_t n, const MechanismSpec&)> edges;
  /// Floating-point operations of one forward pass, when there is a closed form.
  std::function<c10::optional<double>(const AttentionShape&, bool causal, const MechanismSpec&)>
      flops;
  /// The module over q, k, v; null for mechanisms that replace the whole layer
  /// (agglomerative attention holds its own class projections:
  /// nn::AgglomerativeAttention).
  std::function<std::shared_ptr<MechanismImpl>(const MechanismSpec&)> make;
  /// A fresh state for decoding causal self-attention token by token (the
  /// same mechanism, causal, one position at a time); null when the mechanism
  /// has none. Agglomerative attention decodes through its layer
  /// (nn::AgglomerativeAttention::step) and has none here.
  std::function<std::unique_ptr<CausalState>(const MechanismSpec&)> start_decoding;
};

/// True when `info` can serve as a decoder's self-attention: it honours the
/// causal flag or is causal by construction.
bool usable_in_decoder(const MechanismInfo& info);

/// Every mechanism, in the order `attnkit mechanisms` prints them.
const std::vector<MechanismInfo>& mechanisms();

/// The names of the mechanisms for which `holds` is true, in registry order,
/// joined by ", ": what an error lists as the alternatives.
std::string mechanism_names_where(const std::function<bool(const MechanismInfo&)>& holds);

/// The entry named `name`; the error lists every known name.
const MechanismInfo& find_mechanism(const std::string& name);

/// Parses `spec_text`, finds its entry and checks every key against the
/// entry's options (the error lists the accepted keys), every value against
/// its option's type and range, and the entry's `validate`.
std::pair<const MechanismInfo*, MechanismSpec> resolve_mechanism(const std::string& spec_text);

/// resolve_mechanism, then the entry's module; refuses layer-only mechanisms
/// with an error that names the layer to use instead.
std::shared_ptr<MechanismImpl> make_mechanism(const std::string& spec_text);

/// Checks that `info` supports the call (causal, key_lengths, L != S, E != M,
/// grouped heads, ALiBi);
/// the error names the mechanism and the missing feature.
void check_supports(const MechanismInfo& info, const torch::Tensor& q, const torch::Tensor& k,
                    const torch::Tensor& v, const AttendArgs& args);

/// The names of every entry, in registry order.
std::vector<std::string> mechanism_names();

/// The one exact-attention entry (MechanismInfo::exact): the baseline the
/// front ends compare the others with.
const MechanismInfo& exact_mechanism();

/// The specs a front end runs when its user names none.
enum class DefaultSpecs {
  bench,          ///< `attnkit bench --attention`
  model_train,    ///< `attnkit bench-model`'s training rows
  model_generate, ///< `attnkit bench-model`'s generation rows
};
const std::vector<std::string>& default_specs(DefaultSpecs which);

/// One call of a per-head mechanism by spec, without a module: resolves the
/// spec, validates q, k, v and the call against what the mechanism supports,
/// and runs its functional form (clustered mechanisms with the spec's seed).
torch::Tensor attend(const std::string& spec, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v, const AttendArgs& args = {});

/// The edges a "sparse-<pattern>" mechanism uses over a self-attention
/// sequence of n nodes. bp-tree and star add nodes of their own: bp-tree over
/// t tokens has n = 2t - 1 nodes and star over t satellites n = t + 1.
EdgeList pattern_edges(const std::string& pattern, int64_t n, int64_t param);

}  // namespace attnkit::nn
