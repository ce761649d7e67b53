// TrainerOptions: JSON, validation, the learning-rate schedule; TaskOptions' JSON.
#include <attnkit/train/trainer.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

namespace attnkit::train {

namespace {

std::string display_name(Display d) {
  switch (d) {
    case Display::automatic: return "auto";
    case Display::live: return "live";
    case Display::plain: return "plain";
    case Display::quiet: return "quiet";
  }
  return "auto";
}

Display display_from_name(const std::string& name) {
  if (name == "auto") return Display::automatic;
  if (name == "live") return Display::live;
  if (name == "plain") return Display::plain;
  if (name == "quiet") return Display::quiet;
  throw std::invalid_argument("TrainerOptions: display '" + name + "' is not auto|live|plain|quiet");
}

}  // namespace

std::string to_string(DType dtype) { return dtype == DType::bf16 ? "bf16" : "float32"; }

DType dtype_from_string(const std::string& name) {
  if (name == "float32") return DType::float32;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  throw std::invalid_argument("TrainerOptions: dtype must be float32, bf16 or bfloat16, got '" + name + "'");
}

namespace {

/// Reads `key` of `j` as T; the error names the key, what was expected and what came.
template <typename T>
T field(const nlohmann::json& j, const std::string& what, const std::string& key, const char* type) {
  const auto& v = j.at(key);
  bool ok = false;
  if constexpr (std::is_same_v<T, bool>) ok = v.is_boolean();
  else if constexpr (std::is_same_v<T, std::string>) ok = v.is_string();
  else if constexpr (std::is_integral_v<T>) ok = v.is_number_integer();
  else ok = v.is_number();
  if (!ok)
    throw std::invalid_argument(what + ": key '" + key + "' must be " + type + ", got " + v.dump());
  return v.get<T>();
}

/// Refuses keys outside `known` and `optional`, and missing keys of `known`.
void check_keys(const nlohmann::json& j, const std::string& what, const std::set<std::string>& known,
                const std::set<std::string>& optional = {}) {
  if (!j.is_object()) throw std::invalid_argument(what + ": expected a JSON object, got " + j.dump());
  for (const auto& item : j.items())
    if (!known.count(item.key()) && !optional.count(item.key()))
      throw std::invalid_argument(what + ": unknown key '" + item.key() + "'");
  for (const auto& key : known)
    if (!j.contains(key)) throw std::invalid_argument(what + ": missing key '" + key + "'");
}

nlohmann::json parse(const std::string& json, const std::string& what) {
  try {
    return nlohmann::json::parse(json);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(what + ": not JSON: " + e.what());
  }
}

}  // namespace

std::string TrainerOptions::to_json() const {
  nlohmann::json j = {{"steps", steps_},
                      {"batch", batch_},
                      {"context", context_},
                      {"lr", lr_},
                      {"warmup", warmup_},
                      {"min_lr", min_lr_},
                      {"weight_decay", weight_decay_},
                      {"betas", {std::get<0>(betas_), std::get<1>(betas_)}},
                      {"eps", eps_},
                      {"clip", clip_},
                      {"seed", seed_},
                      {"threads", threads_},
                      {"log_every", log_every_},
                      {"eval_every", eval_every_},
                      {"eval_batches", eval_batches_},
                      {"checkpoint_every", checkpoint_every_},
                      {"out", out_},
                      {"resume", resume_},
                      {"display", display_name(display_)},
                      {"dtype", to_string(dtype_)}};
  return j.dump();
}

TrainerOptions TrainerOptions::from_json(const std::string& json) {
  const std::string what = "TrainerOptions::from_json";
  const auto j = parse(json, what);
  check_keys(j, what,
             {"steps", "batch", "context", "lr", "warmup", "min_lr", "weight_decay", "betas", "eps",
              "clip", "seed", "threads", "log_every", "eval_every", "eval_batches",
              "checkpoint_every", "out", "resume", "display"},
             // Checkpoints written before mixed precision have no dtype: float32.
             {"dtype"});
  const auto& betas = j.at("betas");
  if (!betas.is_array() || betas.size() != 2 || !betas[0].is_number() || !betas[1].is_number())
    throw std::invalid_argument(what + ": key 'betas' must be [beta1, beta2], got " + betas.dump());
  TrainerOptions o;
  o.steps(field<int64_t>(j, what, "steps", "an integer"))
      .batch(field<int64_t>(j, what, "batch", "an integer"))
      .context(field<int64_t>(j, what, "context", "an integer"))
      .lr(field<double>(j, what, "lr", "a number"))
      .warmup(field<int64_t>(j, what, "warmup", "an integer"))
      .min_lr(field<double>(j, what, "min_lr", "a number"))
      .weight_decay(field<double>(j, what, "weight_decay", "a number"))
      .betas(std::make_tuple(betas[0].get<double>(), betas[1].get<double>()))
      .eps(field<double>(j, what, "eps", "a number"))
      .clip(field<double>(j, what, "clip", "a number"))
      .seed(field<uint64_t>(j, what, "seed", "an integer"))
      .threads(field<int>(j, what, "threads", "an integer"))
      .log_every(field<int64_t>(j, what, "log_every", "an integer"))
      .eval_every(field<int64_t>(j, what, "eval_every", "an integer"))
      .eval_batches(field<int64_t>(j, what, "eval_batches", "an integer"))
      .checkpoint_every(field<int64_t>(j, what, "checkpoint_every", "an integer"))
      .out(field<std::string>(j, what, "out", "a string"))
      .resume(field<bool>(j, what, "resume", "a boolean"))
      .display(display_from_name(field<std::string>(j, what, "display", "a string")));
  if (j.contains("dtype")) o.dtype(dtype_from_string(field<std::string>(j, what, "dtype", "a string")));
  return o;
}

void validate(const TrainerOptions& o) {
  auto fail = [](const std::string& name, const std::string& expected, const std::string& value) {
    throw std::invalid_argument("TrainerOptions: " + name + " must be " + expected + ", got " + value);
  };
  auto positive = [&](const char* name, int64_t v) {
    if (v < 1) fail(name, ">= 1", std::to_string(v));
  };
  auto non_negative = [&](const char* name, int64_t v) {
    if (v < 0) fail(name, ">= 0", std::to_string(v));
  };
  auto finite_non_negative = [&](const char* name, double v) {
    if (!std::isfinite(v) || v < 0) fail(name, "finite and >= 0", std::to_string(v));
  };
  positive("steps", o.steps());
  positive("batch", o.batch());
  positive("context", o.context());
  if (!std::isfinite(o.lr()) || o.lr() <= 0) fail("lr", "finite and > 0", std::to_string(o.lr()));
  non_negative("warmup", o.warmup());
  finite_non_negative("min_lr", o.min_lr());
  if (o.min_lr() > o.lr())
    fail("min_lr", "<= lr (" + std::to_string(o.lr()) + ")", std::to_string(o.min_lr()));
  finite_non_negative("weight_decay", o.weight_decay());
  for (double b : {std::get<0>(o.betas()), std::get<1>(o.betas())})
    if (!(b >= 0 && b < 1)) fail("betas", "in [0, 1)", std::to_string(b));
  if (!std::isfinite(o.eps()) || o.eps() <= 0) fail("eps", "finite and > 0", std::to_string(o.eps()));
  finite_non_negative("clip", o.clip());
  if (o.threads() < 0) fail("threads", ">= 0", std::to_string(o.threads()));
  positive("log_every", o.log_every());
  non_negative("eval_every", o.eval_every());
  non_negative("eval_batches", o.eval_batches());
  positive("checkpoint_every", o.checkpoint_every());
  if (o.out().empty()) fail("out", "a run directory", "\"\"");
}

double learning_rate(const TrainerOptions& o, int64_t step) {
  if (step < o.warmup())
    return o.lr() * static_cast<double>(step + 1) / static_cast<double>(o.warmup());
  const int64_t decay_steps = std::max<int64_t>(1, o.steps() - o.warmup());
  const double t = std::min(1.0, static_cast<double>(step - o.warmup()) / static_cast<double>(decay_steps));
  return o.min_lr() + 0.5 * (o.lr() - o.min_lr()) * (1.0 + std::cos(M_PI * t));
}

std::string task_options_to_json(const tasks::TaskOptions& options) {
  return nlohmann::json{{"name", options.name}, {"data_dir", options.data_dir}, {"copy_length", options.copy_length}}
      .dump();
}

tasks::TaskOptions task_options_from_json(const std::string& json) {
  const std::string what = "task options (JSON)";
  const auto j = parse(json, what);
  // Runs written before the naming pass (attnkit 0.1.0) store the copy task's
  // length under "length": read it as "copy_length" (the one old-name reader
  // of the task options).
  check_keys(j, what, {"name", "data_dir"}, {"copy_length", "length"});
  if (j.contains("copy_length") == j.contains("length"))
    throw std::invalid_argument(what + ": expected one of 'copy_length' and its old name 'length'");
  tasks::TaskOptions o;
  o.name = field<std::string>(j, what, "name", "a string");
  o.data_dir = field<std::string>(j, what, "data_dir", "a string");
  o.copy_length = field<int64_t>(j, what, j.contains("length") ? "length" : "copy_length", "an integer");
  return o;
}

}  // namespace attnkit::train
