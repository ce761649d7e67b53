// The mechanism registry (include/attnkit/nn/registry.h): spec strings, typed
// options, and the table that the files of src/nn/mechanisms fill, one file
// per mechanism.
#include <attnkit/nn/registry.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>

#include "ops/checks.h"
#include "nn/mechanisms/mechanism.h"

namespace attnkit::nn {

// --- Spec strings ----------------------------------------------------------------------

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

}  // namespace

MechanismSpec MechanismSpec::parse(const std::string& text) {
  MechanismSpec spec;
  const auto colon = text.find(':');
  spec.name = trim(text.substr(0, colon));
  TORCH_CHECK(!spec.name.empty(), "mechanism spec '", text,
              "': expected NAME[:key=value,...], e.g. 'improved-clustered:clusters=25,topk=32'");
  if (colon == std::string::npos) return spec;
  std::stringstream rest(text.substr(colon + 1));
  for (std::string item; std::getline(rest, item, ',');) {
    const auto eq = item.find('=');
    const std::string key = trim(item.substr(0, eq));
    TORCH_CHECK(eq != std::string::npos && !key.empty(), "mechanism spec '", text,
                "': option '", trim(item), "' is not of the form key=value");
    TORCH_CHECK(!spec.has(key), "mechanism spec '", text, "': option '", key, "' given twice");
    spec.options.emplace_back(key, trim(item.substr(eq + 1)));
  }
  return spec;
}

std::string MechanismSpec::str() const {
  std::string s = name;
  for (size_t i = 0; i < options.size(); ++i)
    s += (i ? "," : ":") + options[i].first + "=" + options[i].second;
  return s;
}

bool MechanismSpec::has(const std::string& key) const {
  return std::any_of(options.begin(), options.end(), [&](const auto& kv) { return kv.first == key; });
}

std::string MechanismSpec::get(const std::string& key, const std::string& fallback) const {
  for (const auto& [k, v] : options)
    if (k == key) return v;
  return fallback;
}

namespace {

/// Parses all of `text` with `convert` (std::stoll, std::stod); nullopt if
/// it does not parse or leaves characters over.
template <typename T, typename Convert>
c10::optional<T> parse_whole(const std::string& text, Convert convert) {
  size_t used = 0;
  try {
    const T x = convert(text, &used);
    if (used == text.size() && !text.empty()) return x;
  } catch (const std::exception&) {
  }
  return c10::nullopt;
}

}  // namespace

int64_t MechanismSpec::get_int(const std::string& key, int64_t fallback) const {
  if (!has(key)) return fallback;
  const std::string value = get(key, "");
  const auto x = parse_whole<int64_t>(value, [](const std::string& t, size_t* n) {
    return std::stoll(t, n);
  });
  TORCH_CHECK(x, "mechanism '", str(), "': option '", key, "' must be an integer, got '", value, "'");
  return *x;
}

double MechanismSpec::get_double(const std::string& key, double fallback) const {
  if (!has(key)) return fallback;
  const std::string value = get(key, "");
  const auto x = parse_whole<double>(value, [](const std::string& t, size_t* n) {
    return std::stod(t, n);
  });
  TORCH_CHECK(x && std::isfinite(*x), "mechanism '", str(), "': option '", key,
              "' must be a finite number, got '", value, "'");
  return *x;
}

bool MechanismSpec::get_bool(const std::string& key, bool fallback) const {
  if (!has(key)) return fallback;
  const std::string value = get(key, "");
  if (value == "true" || value == "1") return true;
  if (value == "false" || value == "0") return false;
  TORCH_CHECK(false, "mechanism '", str(), "': option '", key,
              "' must be true or false, got '", value, "'");
}

// --- Typed options ------------------------------------------------------------------

namespace {

/// The shortest text that reads back as `x` ("1e-6", "0.001", "1"), as a
/// spec would write the number.
std::string format_number(double x) {
  char buffer[32];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", digits, x);
    if (std::strtod(buffer, nullptr) == x) break;
  }
  std::string text = buffer;
  // "1e-06" -> "1e-6": C's exponent has at least two digits.
  const auto e = text.find('e');
  if (e != std::string::npos) {
    size_t digits = e + 1 + (text[e + 1] == '-' || text[e + 1] == '+');
    while (digits + 1 < text.size() && text[digits] == '0') text.erase(digits, 1);
    if (text[e + 1] == '+') text.erase(e + 1, 1);
  }
  return text;
}

std::string join(const std::vector<std::string>& words, const char* separator) {
  std::string s;
  for (const auto& w : words) s += (s.empty() ? "" : separator) + w;
  return s;
}

}  // namespace

MechanismOption MechanismOption::integer(std::string key, int64_t fallback, int64_t min,
                                         std::string help, c10::optional<int64_t> max) {
  MechanismOption o;
  o.key = std::move(key);
  o.type = Type::integer;
  o.default_value = std::to_string(fallback);
  o.help = std::move(help);
  o.min = double(min);
  if (max) o.max = double(*max);
  return o;
}

MechanismOption MechanismOption::real(std::string key, double fallback, double min, std::string help,
                                      bool min_exclusive) {
  MechanismOption o;
  o.key = std::move(key);
  o.type = Type::real;
  o.default_value = format_number(fallback);
  o.help = std::move(help);
  o.min = min;
  o.min_exclusive = min_exclusive;
  return o;
}

MechanismOption MechanismOption::boolean(std::string key, bool fallback, std::string help) {
  MechanismOption o;
  o.key = std::move(key);
  o.type = Type::boolean;
  o.default_value = fallback ? "true" : "false";
  o.help = std::move(help);
  return o;
}

MechanismOption MechanismOption::choice(std::string key, std::string fallback,
                                        std::vector<std::string> choices, std::string help) {
  MechanismOption o;
  o.key = std::move(key);
  o.type = Type::choice;
  o.default_value = std::move(fallback);
  o.help = std::move(help);
  o.choices = std::move(choices);
  return o;
}

namespace {

/// "in [a, b]", ">= a", "<= b" or "" for a numeric option's range.
std::string range_text(const MechanismOption& o) {
  const auto show = [&o](double x) {
    return o.type == MechanismOption::Type::integer ? std::to_string(int64_t(x)) : format_number(x);
  };
  const bool low = std::isfinite(o.min), high = std::isfinite(o.max);
  if (low && high) return (o.min_exclusive ? "in (" : "in [") + show(o.min) + ", " + show(o.max) + "]";
  if (low) return (o.min_exclusive ? "> " : ">= ") + show(o.min);
  if (high) return "<= " + show(o.max);
  return "";
}

}  // namespace

std::string MechanismOption::type_name() const {
  switch (type) {
    case Type::integer:
    case Type::real: {
      const std::string range = range_text(*this);
      return std::string(type == Type::integer ? "integer" : "number") + (range.empty() ? "" : " " + range);
    }
    case Type::boolean:
      return "true|false";
    case Type::choice:
      return join(choices, "|");
  }
  return "";
}

void MechanismOption::check(const MechanismSpec& spec) const {
  if (!spec.has(key)) return;
  const std::string value = spec.get(key, "");
  // get_int and get_double refuse what is not an integer or a finite number.
  auto in_range = [&](double x) {
    TORCH_CHECK((min_exclusive ? x > min : x >= min) && x <= max, "mechanism '", spec.str(), "': option '", key, "' must be ",
                range_text(*this), ", got ", value);
  };
  switch (type) {
    case Type::integer:
      in_range(double(spec.get_int(key, 0)));
      return;
    case Type::real:
      in_range(spec.get_double(key, 0));
      return;
    case Type::boolean:
      spec.get_bool(key, false);
      return;
    case Type::choice:
      TORCH_CHECK(std::find(choices.begin(), choices.end(), value) != choices.end(), "mechanism '",
                  spec.str(), "': option '", key, "' must be ",
                  choices.size() == 2 ? choices[0] + " or " + choices[1] : "one of " + join(choices, ", "),
                  "; got '", value, "'");
      return;
  }
}

// --- The table ---------------------------------------------------------------------

namespace {

/// The entries the mechanism files registered, by position; frozen (sorted
/// into `entries`, which never changes again) at the first read, after which
/// reads take no lock.
struct Table {
  std::mutex mutex;  // registration, and the freeze
  std::vector<std::pair<int, std::vector<MechanismInfo>>> registered;
  std::vector<MechanismInfo> entries;
  std::atomic<bool> frozen{false};
  std::once_flag freeze_once;
};

Table& table() {
  static Table t;  // constructed by the first registrar, whatever the file order
  return t;
}

void freeze(Table& t) {
  std::lock_guard<std::mutex> lock(t.mutex);
  std::sort(t.registered.begin(), t.registered.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<MechanismInfo> entries;
  for (auto& group : t.registered)
    for (auto& entry : group.second) {
      for (const auto& earlier : entries)
        TORCH_CHECK(earlier.name != entry.name, "attnkit: two mechanisms are named '", entry.name, "'");
      entries.push_back(std::move(entry));
    }
  t.registered.clear();
  t.entries = std::move(entries);
  t.frozen.store(true, std::memory_order_release);
}

}  // namespace

namespace registration {

Registrar::Registrar(const char* file, int position, std::function<std::vector<MechanismInfo>()> make) {
  // A registrar runs during static initialisation, where an exception would
  // end the process in std::terminate, often without its message: print it.
  try {
    auto entries = make();  // outside the lock: an entry's construction may take a while
    TORCH_CHECK(!entries.empty(), "attnkit: ", file, " registers no mechanism");
    Table& t = table();
    std::lock_guard<std::mutex> lock(t.mutex);
    TORCH_CHECK(!t.frozen.load(), "attnkit: the mechanisms of ", file,
                " were registered after the registry was first read; registrars must be static "
                "objects of the library, and nothing may read the registry during static "
                "initialisation");
    for (const auto& [other, theirs] : t.registered)
      TORCH_CHECK(other != position, "attnkit: two mechanism files register at position ", position,
                  " (", file, " and the file of '", theirs.front().name, "')");
    t.registered.emplace_back(position, std::move(entries));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attnkit: registering the mechanisms of %s failed: %s\n", file, e.what());
    std::abort();
  }
}

}  // namespace registration

const std::vector<MechanismInfo>& mechanisms() {
  Table& t = table();
  std::call_once(t.freeze_once, freeze, std::ref(t));
  return t.entries;
}

std::string mechanism_names_where(const std::function<bool(const MechanismInfo&)>& holds) {
  std::string names;
  for (const auto& m : mechanisms())
    if (holds(m)) names += (names.empty() ? "" : ", ") + m.name;
  return names;
}

const MechanismInfo& find_mechanism(const std::string& name) {
  for (const auto& m : mechanisms())
    if (m.name == name) return m;
  TORCH_CHECK(false, "unknown attention mechanism '", name, "'; known: ",
              mechanism_names_where([](const MechanismInfo&) { return true; }));
}

std::pair<const MechanismInfo*, MechanismSpec> resolve_mechanism(const std::string& spec_text) {
  auto spec = MechanismSpec::parse(spec_text);
  const MechanismInfo& info = find_mechanism(spec.name);
  for (const auto& option : spec.options) {
    // Not a structured binding: clang before 16 cannot capture one in a lambda.
    const std::string& key = option.first;
    const bool known = std::any_of(info.options.begin(), info.options.end(),
                                   [&](const MechanismOption& o) { return o.key == key; });
    if (known) continue;
    std::string accepted;
    for (const auto& o : info.options) accepted += (accepted.empty() ? "" : ", ") + o.key;
    TORCH_CHECK(false, "mechanism '", spec.name, "' has no option '", key, "'; ",
                accepted.empty() ? std::string("it takes none") : "accepted: " + accepted);
  }
  // Check every value now, so a typo fails here and not at the first call.
  for (const auto& o : info.options) o.check(spec);
  if (info.validate) info.validate(spec);
  return {&info, spec};
}

std::shared_ptr<MechanismImpl> make_mechanism(const std::string& spec_text) {
  auto [info, spec] = resolve_mechanism(spec_text);
  TORCH_CHECK(info->make, "mechanism '", info->name,
              "' replaces the whole attention layer (it holds its own class projections); "
              "build nn::AgglomerativeAttention instead of a per-head mechanism");
  return info->make(spec);
}

bool usable_in_decoder(const MechanismInfo& info) {
  return info.supports.causal || info.always_causal;
}

std::vector<std::string> mechanism_names() {
  std::vector<std::string> names;
  for (const auto& m : mechanisms()) names.push_back(m.name);
  return names;
}

const MechanismInfo& exact_mechanism() {
  const MechanismInfo* found = nullptr;
  for (const auto& m : mechanisms()) {
    if (!m.exact) continue;
    TORCH_CHECK(found == nullptr, "attnkit: two mechanisms are marked exact: '", found->name, "' and '", m.name, "'");
    found = &m;
  }
  TORCH_CHECK(found != nullptr, "attnkit: no mechanism is marked exact");
  return *found;
}

const std::vector<std::string>& default_specs(DefaultSpecs which) {
  // Every name here must be an entry (tests/nn/registry_test.cpp checks).
  static const std::vector<std::string> bench{"full",          "linear",    "causal-linear",
                                              "agglomerative", "clustered", "improved-clustered",
                                              "sparse-local"};
  static const std::vector<std::string> model_train{"full", "causal-linear", "agglomerative",
                                                    "sparse-local-causal:span=64", "linear"};
  static const std::vector<std::string> model_generate{"full", "causal-linear", "agglomerative"};
  switch (which) {
    case DefaultSpecs::bench: return bench;
    case DefaultSpecs::model_train: return model_train;
    case DefaultSpecs::model_generate: return model_generate;
  }
  TORCH_CHECK(false, "default_specs: unknown list");
}

const std::vector<SupportField>& support_fields() {
  using S = MechanismSupports;
  const auto flag = [](std::string key, char letter, std::string help, bool S::*field) {
    return SupportField{key, help, [field](const S& s) { return std::string(s.*field ? "true" : "false"); },
                        {{"true", letter, help}}};
  };
  static const std::vector<SupportField> fields{
      flag("causal", 'c', "causal flag", &S::causal),
      flag("key_lengths", 'p', "key_lengths (padding)", &S::key_lengths),
      flag("cross", 'x', "L != S", &S::cross),
      flag("value_dim", 'm', "M != E", &S::value_dim),
      flag("decoding_state", 'd', "incremental decoding state", &S::decoding_state),
      flag("grouped_heads", 'g', "grouped-query heads (k, v with fewer heads)", &S::grouped_heads),
      flag("alibi", 'a', "ALiBi slopes", &S::alibi),
      SupportField{"rotary",
                   "rotary positions: inside the kernel, on q and k before the call, or none",
                   [](const S& s) {
                     return std::string(s.rotary == RotarySupport::kernel   ? "kernel"
                                        : s.rotary == RotarySupport::inputs ? "inputs"
                                                                            : "none");
                   },
                   {{"kernel", 'R', "rotary positions inside the kernel"},
                    {"inputs", 'r', "rotary positions on q and k before the call"}}},
      flag("dropout", 'D', "attention dropout inside the kernel", &S::dropout),
  };
  return fields;
}

torch::Tensor attend(const std::string& spec_text, const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v, const AttendArgs& args) {
  auto [info, spec] = resolve_mechanism(spec_text);
  TORCH_CHECK(info->inputs == std::vector<std::string>({"q", "k", "v"}), "attend: mechanism '",
              info->name, "' does not take q, k, v (its inputs are class weights; see "
              "agglomerative_attention and nn::AgglomerativeAttention)");
  detail::check_qkv("attend", q, k, v, /*grouped_heads=*/true);
  check_supports(*info, q, k, v, args);
  return info->run({q, k, v}, args, spec);
}

void check_supports(const MechanismInfo& info, const torch::Tensor& q, const torch::Tensor& k,
                    const torch::Tensor& v, const AttendArgs& args) {
  const auto& s = info.supports;
  const char* n = info.name.c_str();
  TORCH_CHECK(s.causal || !args.causal, n, ": this mechanism does not support the causal flag",
              info.name.rfind("sparse-", 0) == 0 ? " (choose a causal pattern instead)" : "");
  TORCH_CHECK(s.key_lengths || !args.key_lengths.defined(), n,
              ": this mechanism does not support key_lengths (padding)");
  TORCH_CHECK(s.cross || q.size(2) == k.size(2), n,
              ": this mechanism is self-attention only and needs L == S, got L = ", q.size(2),
              ", S = ", k.size(2));
  TORCH_CHECK(s.value_dim || k.size(3) == v.size(3), n,
              ": this mechanism needs values as wide as keys (M == E), got E = ", k.size(3),
              ", M = ", v.size(3));
  TORCH_CHECK(s.alibi || !args.alibi_slopes.defined(), n,
              ": this mechanism does not take ALiBi slopes (mechanisms that do: ",
              mechanism_names_where([](const MechanismInfo& m) { return m.supports.alibi; }), ")");
  TORCH_CHECK(s.rotary == RotarySupport::kernel || args.rotary_dim == 0, n,
              ": this mechanism does not rotate q and k inside its kernel (rotary_dim); rotate them "
              "before the call (attnkit::rotary_embedding, as nn::MultiheadAttention does)",
              s.rotary == RotarySupport::none ? ", which its scores would not turn into rotary positions either"
                                              : "");
  TORCH_CHECK(s.dropout || args.dropout_p == 0, n,
              ": this mechanism has no attention dropout (dropout_p = ", args.dropout_p, "; mechanisms with it: ",
              mechanism_names_where([](const MechanismInfo& m) { return m.supports.dropout; }), ")");
  TORCH_CHECK(s.grouped_heads || k.size(1) == q.size(1), n,
              ": this mechanism reads no grouped-query heads: k and v need q's head count ", q.size(1),
              ", got ", k.size(1), " (repeat each over its group, as nn::MultiheadAttention does)");
}

}  // namespace attnkit::nn
