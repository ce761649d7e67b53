// Long on purpose: the custom class, its schema and every module kind's
// adapter make one contract with python/attnkit/_bridge.py (below), read as one.
//
// The C++ side of the Python package's modules: `torch.classes.attnkit.Module`
// holds one attnkit::nn or attnkit::models module and exposes it through a
// uniform interface that python/attnkit/_bridge.py turns into torch.nn.Modules.
//
// The contract with the Python side:
//   * parameter_names()/parameters() and buffer_names()/buffers() list the
//     module's tensors recursively, in libtorch's order, with their dotted
//     names. Python registers these very tensors (the same TensorImpls; a
//     parameter's Python object becomes an nn.Parameter) under the same names,
//     so autograd, optimizers, hooks and DistributedDataParallel act on the
//     tensors the C++ code computes with, and state_dicts match checkpoints.
//   * The op attnkit::module_forward(module, input0, input1?, input2?, input3?,
//     causal, offset, training, weights) runs the module's forward on its
//     positional inputs (None for absent ones); `weights` asks
//     MultiheadAttention for its attention weights as a second output. An
//     op of the dispatcher with a typed schema, it is what torch.jit.trace
//     records and torch.jit.script compiles: a model of attnkit.nn modules
//     exports, and the saved file runs wherever libattnkit is loaded
//     (torch::jit::load in C++, torch.jit.load in Python).
//   * call(method, inputs, args, training) runs any other method (generate,
//     set_attention, features) with keyword settings `args` (a JSON object).
//   * The class pickles (torch.jit.save) as its kind, settings and named
//     tensors; the tensors are those Python registered, so a saved file
//     stores each one once. (torch's copy.deepcopy of a ScriptModule calls
//     __setstate__(__getstate__()) without copying the state: the copy's C++
//     module shares the original's storage.)
// Keeping the modules in C++ means Python runs the very code the CLI, the
// trainer and the tests run: the same forward, checks, errors and checkpoints.
#include <attnkit/document_memory.h>
#include <attnkit/models/transformer.h>
#include <attnkit/nn/agglomerative_attention.h>
#include <attnkit/nn/dense.h>
#include <attnkit/nn/linear_attention.h>
#include <attnkit/nn/multihead.h>
#include <attnkit/nn/registry.h>
#include <attnkit/nn/zoo.h>
#include <attnkit/runtime.h>
#include <attnkit/train/trainer.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/custom_class.h>

#include <cmath>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace attnkit::bindings {
namespace {

using json = nlohmann::json;
using Inputs = std::vector<c10::optional<at::Tensor>>;
using Outputs = std::vector<at::Tensor>;

json parse_object(const std::string& text, const std::string& what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, what, ": not JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), what, ": expected a JSON object, got ", j.dump());
  return j;
}

/// Keyword settings of a constructor or a call: typed reads with defaults,
/// and a final check that every key given was read.
class Settings {
 public:
  Settings(json j, std::string what) : j_(std::move(j)), what_(std::move(what)) {}

  template <typename T>
  T get(const std::string& key, T fallback) {
    read_.insert(key);
    if (!j_.contains(key) || j_.at(key).is_null()) return fallback;
    try {
      return j_.at(key).get<T>();
    } catch (const json::exception&) {
      TORCH_CHECK(false, what_, ": '", key, "' has the wrong type (", j_.at(key).type_name(), ": ",
                  j_.at(key).dump(), ")");
    }
  }
  template <typename T>
  T require(const std::string& key) {
    TORCH_CHECK(j_.contains(key) && !j_.at(key).is_null(), what_, ": '", key, "' is required");
    return get<T>(key, T{});
  }
  void done() const {
    for (const auto& item : j_.items())
      TORCH_CHECK(read_.count(item.key()), what_, ": unknown setting '", item.key(), "'");
  }
  const json& raw() const { return j_; }

 private:
  json j_;
  std::string what_;
  std::set<std::string> read_;
};

at::Tensor input(const Inputs& inputs, size_t i) {
  return i < inputs.size() && inputs[i].has_value() ? *inputs[i] : at::Tensor();
}

at::Tensor required(const Inputs& inputs, size_t i, const std::string& what, const char* name) {
  auto t = input(inputs, i);
  TORCH_CHECK(t.defined(), what, ": argument '", name, "' is required");
  return t;
}

/// A forward's arguments besides its tensors (those of the op module_forward).
struct ForwardArgs {
  bool causal = false;
  int64_t offset = 0;
  /// MultiheadAttention's attention weights as a second output
  /// (need_weights): none, per head (N, H, L, S), or averaged over the heads.
  enum class Weights : int64_t { none = 0, per_head = 1, averaged = 2 } weights = Weights::none;
};

ForwardArgs::Weights weights_wanted(int64_t code) {
  TORCH_CHECK(code >= 0 && code <= 2, "module_forward: weights must be 0 (none), 1 (per head) or 2 (averaged over "
              "the heads), got ", code);
  return static_cast<ForwardArgs::Weights>(code);
}

/// Refuses the arguments `kind`'s forward has no use for, rather than
/// ignoring them.
void takes(const char* kind, const ForwardArgs& a, bool causal, bool offset, bool weights = false) {
  TORCH_CHECK(causal || !a.causal, kind, ".forward takes no causal flag");
  TORCH_CHECK(offset || a.offset == 0, kind, ".forward takes no offset");
  TORCH_CHECK(weights || a.weights == ForwardArgs::Weights::none, kind, ".forward returns no attention weights");
}

using Method = std::function<Outputs(const Inputs&, Settings&)>;

/// One module kind: how to build it from its settings, and its methods.
struct Bridged {
  std::shared_ptr<torch::nn::Module> module;
  /// (inputs, arguments) -> outputs
  std::function<Outputs(const Inputs&, const ForwardArgs&)> forward;
  /// The other methods by name: (inputs, settings) -> outputs.
  std::map<std::string, Method> methods;
  /// The settings that rebuild it (for the Transformer, the options as changed
  /// by set_attention).
  std::function<std::string()> settings;
};

Outputs pair(const nn::AttentionOutput& out) { return {out.context, out.weights}; }

models::GenerateOptions generate_options(Settings& s) {
  return models::GenerateOptions()
      .tokens(s.get<int64_t>("tokens", 100))
      .temperature(s.get<double>("temperature", 1.0))
      .top_k(s.get<int64_t>("top_k", 0))
      .seed(s.get<uint64_t>("seed", 0));
}

Bridged bridge_transformer(std::shared_ptr<models::TransformerImpl> model) {
  Bridged b;
  b.module = model;
  b.settings = [model] { return model->options().to_json(); };
  b.forward = [model](const Inputs& in, const ForwardArgs& a) -> Outputs {
    takes("Transformer", a, /*causal=*/false, /*offset=*/false);
    return {model->forward(required(in, 0, "Transformer", "tokens"), input(in, 1), input(in, 2))};
  };
  b.methods["generate"] = [model](const Inputs& in, Settings& s) -> Outputs {
    return {model->generate(required(in, 0, "Transformer.generate", "prompt"), generate_options(s), input(in, 1),
                            input(in, 2))};
  };
  b.methods["set_attention"] = [model](const Inputs&, Settings& s) -> Outputs {
    model->set_attention(s.require<std::vector<std::string>>("attention"));
    return {};
  };
  return b;
}

/// The zoo's score-based modules: (query, keys, values, key_lengths?) -> (context, weights).
template <class Holder>
Bridged score_attention(Holder m, const char* kind) {
  return Bridged{m.ptr(),
                 [m, kind](const Inputs& in, const ForwardArgs& a) mutable -> Outputs {
                   takes(kind, a, /*causal=*/false, /*offset=*/false);
                   return pair(m(required(in, 0, kind, "query"), required(in, 1, kind, "keys"),
                                 required(in, 2, kind, "values"), input(in, 3)));
                 },
                 {}, nullptr};
}

using Factory = std::function<Bridged(Settings&)>;

/// Module settings written before the naming pass (attnkit 0.1.0: pickled
/// modules, saved settings) name the width `embed_dim` or `d_model` and the
/// heads `num_heads`: the one place that reads those names, as the current ones.
json with_current_names(const std::string& kind, json settings) {
  static const std::map<std::string, std::vector<std::pair<const char*, const char*>>> renamed = {
      {"MultiheadAttention", {{"embed_dim", "width"}, {"num_heads", "heads"}}},
      {"RelativePositionAttention", {{"embed_dim", "width"}, {"num_heads", "heads"}}},
      {"SinusoidalPositionalEncoding", {{"d_model", "width"}}},
      {"AgglomerativeAttention", {{"embed_dim", "width"}}},
  };
  const auto it = renamed.find(kind);
  if (it == renamed.end()) return settings;
  for (const auto& [old_name, name] : it->second) {
    if (!settings.contains(old_name)) continue;
    TORCH_CHECK(!settings.contains(name), kind, ": give '", name, "' or its old name '", old_name, "', not both");
    settings[name] = settings[old_name];
    settings.erase(old_name);
  }
  return settings;
}

const std::map<std::string, Factory>& factories() {
  static const std::map<std::string, Factory> table = {
      {"Linear",
       [](Settings& s) {
         nn::Linear m(torch::nn::LinearOptions(s.require<int64_t>("in_features"), s.require<int64_t>("out_features"))
                          .bias(s.get<bool>("bias", true)));
         return Bridged{m.ptr(), [m](const Inputs& in, const ForwardArgs& a) mutable -> Outputs {
                          takes("Linear", a, /*causal=*/false, /*offset=*/false);
                          return {m(required(in, 0, "Linear", "input"))};
                        }, {}, nullptr};
       }},
      {"MultiheadAttention",
       [](Settings& s) {
         nn::MultiheadAttention m(
             nn::MultiheadAttentionOptions(s.require<int64_t>("width"), s.require<int64_t>("heads"))
                 .kv_heads(s.get<int64_t>("kv_heads", 0))
                 .alibi(s.get<bool>("alibi", false))
                 .rotary_dim(s.get<int64_t>("rotary_dim", 0))
                 .rotary_base(s.get<double>("rotary_base", 10000.0))
                 .bias(s.get<bool>("bias", true))
                 .dropout(s.get<double>("dropout", 0.0))
                 .attention(s.get<std::string>("attention", "full")));
         Bridged b{m.ptr(), [m](const Inputs& in, const ForwardArgs& a) mutable -> Outputs {
                     const char* what = "MultiheadAttention";
                     takes(what, a, /*causal=*/true, /*offset=*/false, /*weights=*/true);
                     const auto query = required(in, 0, what, "query"), key = required(in, 1, what, "key");
                     const auto lengths = input(in, 3);
                     using Weights = ForwardArgs::Weights;
                     torch::Tensor weights;  // first: a mechanism that forms none is refused before the forward
                     if (a.weights != Weights::none)
                       weights = m->attention_weights(query, key, lengths, a.causal, a.weights == Weights::averaged);
                     auto out = m(query, key, required(in, 2, what, "value"), lengths, a.causal);
                     return weights.defined() ? Outputs{out, weights} : Outputs{out};
                   }, {}, nullptr};
         b.methods["set_attention"] = [m](const Inputs&, Settings& a) mutable -> Outputs {
           m->set_attention(a.require<std::string>("attention"));
           return {};
         };
         b.settings = [m] {
           return json{{"width", m->options.width()},
                       {"heads", m->options.heads()},
                       {"kv_heads", m->options.kv_heads()},
                       {"alibi", m->options.alibi()},
                       {"rotary_dim", m->options.rotary_dim()},
                       {"rotary_base", m->options.rotary_base()},
                       {"bias", m->options.bias()},
                       {"dropout", m->options.dropout()},
                       {"attention", m->options.attention()}}
               .dump();
         };
         return b;
       }},
      {"Attention",
       [](Settings& s) {
         auto m = nn::make_mechanism(s.require<std::string>("spec"));
         return Bridged{m, [m](const Inputs& in, const ForwardArgs& a) -> Outputs {
                          const char* what = "Attention";
                          takes(what, a, /*causal=*/true, /*offset=*/false);
                          return {m->forward(required(in, 0, what, "q"), required(in, 1, what, "k"),
                                             required(in, 2, what, "v"), nn::AttendArgs{a.causal, input(in, 3)})};
                        }, {}, nullptr};
       }},
      {"AdditiveAttention",
       [](Settings& s) {
         nn::AdditiveAttention m(nn::AdditiveAttentionOptions(
             s.require<int64_t>("query_dim"), s.require<int64_t>("key_dim"), s.require<int64_t>("hidden_dim")));
         return score_attention(m, "AdditiveAttention");
       }},
      {"GeneralAttention",
       [](Settings& s) {
         nn::GeneralAttention m(
             nn::GeneralAttentionOptions(s.require<int64_t>("query_dim"), s.require<int64_t>("key_dim")));
         return score_attention(m, "GeneralAttention");
       }},
      {"DotAttention",
       [](Settings& s) {
         nn::DotAttention m(nn::DotAttentionOptions().scaled(s.get<bool>("scaled", true)));
         return score_attention(m, "DotAttention");
       }},
      {"LocationAttention",
       [](Settings& s) {
         nn::LocationAttention m(nn::LocationAttentionOptions(s.require<int64_t>("query_dim"),
                                                              s.require<int64_t>("max_source_length")));
         return Bridged{m.ptr(), [m](const Inputs& in, const ForwardArgs& a) mutable -> Outputs {
                          const char* what = "LocationAttention";
                          takes(what, a, /*causal=*/false, /*offset=*/false);
                          return pair(m(required(in, 0, what, "query"), required(in, 1, what, "values"), input(in, 2)));
                        }, {}, nullptr};
       }},
      {"RelativePositionAttention",
       [](Settings& s) {
         nn::RelativePositionAttention m(nn::RelativePositionAttentionOptions(
             s.require<int64_t>("width"), s.require<int64_t>("heads"), s.require<int64_t>("max_relative")));
         return Bridged{m.ptr(), [m](const Inputs& in, const ForwardArgs& a) mutable -> Outputs {
                          const char* what = "RelativePositionAttention";
                          takes(what, a, /*causal=*/true, /*offset=*/false);
                          return {m(required(in, 0, what, "x"), input(in, 1), a.causal)};
                        }, {}, nullptr};
       }},
      {"SinusoidalPositionalEncoding",
       [](Settings& s) {
         nn::SinusoidalPositionalEncoding m(nn::SinusoidalPositionalEncodingOptions(
             s.require<int64_t>("width"), s.get<int64_t>("max_length", 8192)));
         return Bridged{m.ptr(), [m](const Inputs& in, const ForwardArgs& a) mutable -> Outputs {
                          const char* what = "SinusoidalPositionalEncoding";
                          takes(what, a, /*causal=*/false, /*offset=*/true);
                          return {m(required(in, 0, what, "x"), a.offset)};
                        }, {}, nullptr};
       }},
      {"AgglomerativeAttention",
       [](Settings& s) {
         nn::AgglomerativeAttention m(
             nn::AgglomerativeAttentionOptions(s.require<int64_t>("width"), s.require<int64_t>("classes"))
                 .dropout(s.get<double>("dropout", 0.0)));
         return Bridged{m.ptr(), [m](const Inputs& in, const ForwardArgs& a) mutable -> Outputs {
                          const char* what = "AgglomerativeAttention";
                          takes(what, a, /*causal=*/true, /*offset=*/false);
                          return {m(required(in, 0, what, "query"), input(in, 1), a.causal)};
                        }, {}, nullptr};
       }},
      {"LinearAttention",
       [](Settings& s) {
         nn::LinearAttention m(nn::LinearAttentionOptions()
                                   .feature_map(feature_map_from_string(s.get<std::string>("feature_map", "identity")))
                                   .normalize(s.get<bool>("normalize", false))
                                   .causal(s.get<bool>("causal", false))
                                   .eps(s.get<double>("eps", 1e-6))
                                   .rotary_dim(s.get<int64_t>("rotary_dim", 0))
                                   .rotary_base(s.get<double>("rotary_base", 10000.0)));
         return Bridged{m.ptr(), [m](const Inputs& in, const ForwardArgs& a) mutable -> Outputs {
                          const char* what = "LinearAttention";
                          // causal is an option of this module, not an argument
                          takes(what, a, /*causal=*/false, /*offset=*/false);
                          return {m(required(in, 0, what, "q"), required(in, 1, what, "k"), required(in, 2, what, "v"))};
                        }, {}, nullptr};
       }},
      {"GatedLinearAttention",
       [](Settings& s) {
         nn::GatedLinearAttention m(nn::GatedLinearAttentionOptions(s.require<int64_t>("dim")));
         Bridged b{m.ptr(), [m](const Inputs& in, const ForwardArgs& a) mutable -> Outputs {
                     const char* what = "GatedLinearAttention";
                     takes(what, a, /*causal=*/true, /*offset=*/false);
                     return {m(required(in, 0, what, "hidden"), required(in, 1, what, "queries"), a.causal)};
                   }, {}, nullptr};
         b.methods["features"] = [m](const Inputs& in, Settings&) mutable -> Outputs {
           return {m->features(required(in, 0, "GatedLinearAttention.features", "hidden"))};
         };
         return b;
       }},
      {"Transformer",
       [](Settings& s) {
         // The builder's own JSON reader checks every key and type.
         for (const auto& item : s.raw().items()) s.get<json>(item.key(), json());
         return bridge_transformer(
             std::make_shared<models::TransformerImpl>(models::TransformerOptions::from_json(s.raw().dump())));
       }},
  };
  return table;
}

std::vector<std::string> kinds() {
  std::vector<std::string> out;
  for (const auto& item : factories()) out.push_back(item.first);
  return out;
}

/// Keeps torch's default CPU generator where it was: building a module to
/// take saved values (unpickling) must not move the user's random stream.
/// (It restores the whole state: draws another thread makes meanwhile are
/// drawn again after it.)
class GeneratorStateGuard {
 public:
  GeneratorStateGuard() : generator_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    state_ = generator_.get_state();
  }
  ~GeneratorStateGuard() {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_state(state_);
  }
  GeneratorStateGuard(const GeneratorStateGuard&) = delete;
  GeneratorStateGuard& operator=(const GeneratorStateGuard&) = delete;

 private:
  at::Generator generator_;
  at::Tensor state_;
};

class Module : public torch::CustomClassHolder {
 public:
  /// What the class pickles to: kind, settings, and the tensors by name.
  using State = std::tuple<std::string, std::string, std::vector<std::string>, std::vector<at::Tensor>>;

  Module(const std::string& kind, const std::string& settings) : kind_(kind) {
    if (kind == "run") {
      load_run(settings);
      return;
    }
    const auto it = factories().find(kind);
    if (it == factories().end()) {
      std::string list;
      for (const auto& k : kinds()) list += (list.empty() ? "" : ", ") + k;
      TORCH_CHECK(false, "attnkit.Module: unknown kind '", kind, "' (known: ", list, ")");
    }
    Settings s(with_current_names(kind, parse_object(settings, kind + " settings")), kind);
    bridged_ = it->second(s);
    s.done();
    if (!bridged_.settings) {
      const auto text = s.raw().dump();
      bridged_.settings = [text] { return text; };
    }
  }

  std::string kind() const { return kind_; }
  /// For a module loaded from a run: {"checkpoint", "step", "task", "trainer"}; else "{}".
  std::string run_info() const { return run_info_; }
  std::string settings() const { return bridged_.settings(); }

  std::vector<std::string> parameter_names() const { return names(bridged_.module->named_parameters()); }
  std::vector<at::Tensor> parameters() const { return bridged_.module->parameters(); }
  std::vector<std::string> buffer_names() const { return names(bridged_.module->named_buffers()); }
  std::vector<at::Tensor> buffers() const { return bridged_.module->buffers(); }

  /// The op attnkit::module_forward.
  Outputs forward(const Inputs& inputs, const ForwardArgs& args, bool training) {
    TORCH_CHECK(!(loaded_ && training && at::GradMode::is_enabled()), kind_,
                ": this module was loaded from a saved file (torch.jit.load, torch::jit::load), which runs "
                "inference only: its computation reads the file's tensors, not the loaded module's parameters, "
                "so training it would update nothing. Fine-tune the eager model instead (load_state_dict from "
                "the loaded module's state_dict), or run under no_grad");
    bridged_.module->train(training);
    return bridged_.forward(inputs, args);
  }

  /// A method other than forward (the op module_forward runs that).
  Outputs call(const std::string& method, const Inputs& inputs, const std::string& args, bool training) {
    const auto it = bridged_.methods.find(method);
    if (it == bridged_.methods.end()) {
      std::string list;
      for (const auto& item : bridged_.methods) list += (list.empty() ? "" : ", ") + item.first;
      TORCH_CHECK(false, kind_, ": no method '", method, "' (it has: ", list.empty() ? "none" : list,
                  method == "forward" ? "; forward is the op attnkit::module_forward)" : ")");
    }
    Settings s(parse_object(args, kind_ + "." + method + " settings"), kind_ + "." + method);
    bridged_.module->train(training);
    auto out = it->second(inputs, s);
    s.done();
    return out;
  }

  /// Transformer only: writes the run directory checkpoint (see save_model_run).
  std::string save_run(const std::string& run_dir, const std::string& task_json, const std::string& trainer_json,
                       int64_t step) {
    auto* model = dynamic_cast<models::TransformerImpl*>(bridged_.module.get());
    TORCH_CHECK(model != nullptr, kind_, ": only a Transformer saves a run");
    // The settings given override the trainer's defaults.
    auto trainer = json::parse(train::TrainerOptions().to_json());
    trainer.update(parse_object(trainer_json, "trainer settings"));
    return train::save_model_run(run_dir, *model, train::task_options_from_json(task_json),
                                 train::TrainerOptions::from_json(trainer.dump()), step);
  }

  /// Pickling: parameters and buffers by name, as the module holds them (a
  /// module loaded from a run pickles as the Transformer it is; its run_info
  /// is not kept).
  State state() const {
    std::vector<std::string> tensor_names;
    std::vector<at::Tensor> tensors;
    for (const auto& item : bridged_.module->named_parameters()) {
      tensor_names.push_back(item.key());
      tensors.push_back(item.value());
    }
    for (const auto& item : bridged_.module->named_buffers()) {
      tensor_names.push_back(item.key());
      tensors.push_back(item.value());
    }
    return State(kind_, settings(), std::move(tensor_names), std::move(tensors));
  }

  /// Unpickling: the module rebuilt from its kind and settings, every tensor
  /// then made to share the saved tensor's storage (set_data), as Python's
  /// ``tensor.data = saved`` does: a loaded file holds each tensor once. The
  /// module stays a separate set of tensors from the loaded ScriptModule's
  /// parameters (libtorch has no way to swap a module's tensors for others),
  /// so it is for inference: its tensors take no gradients, and forward
  /// refuses training mode with autograd on.
  static c10::intrusive_ptr<Module> from_state(State state) {
    auto& [kind, settings, tensor_names, tensors] = state;
    TORCH_CHECK(tensor_names.size() == tensors.size(), "attnkit.Module: a saved ", kind, " has ",
                tensor_names.size(), " tensor names for ", tensors.size(), " tensors");
    c10::intrusive_ptr<Module> module;
    {
      GeneratorStateGuard keep_random_stream;
      module = c10::make_intrusive<Module>(kind, settings);
    }
    module->loaded_ = true;
    auto own = module->bridged_.module->named_parameters();
    auto buffers = module->bridged_.module->named_buffers();
    TORCH_CHECK(own.size() + buffers.size() == tensors.size(), "attnkit.Module: a saved ", kind, " has ",
                tensors.size(), " tensors; one built from its settings has ", own.size() + buffers.size());
    torch::NoGradGuard no_grad;
    std::set<std::string> seen;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& name = tensor_names[i];
      TORCH_CHECK(seen.insert(name).second, "attnkit.Module: a saved ", kind, " names tensor '", name, "' twice");
      at::Tensor* target = own.find(name);
      if (target == nullptr) target = buffers.find(name);
      TORCH_CHECK(target != nullptr, "attnkit.Module: a saved ", kind, " has a tensor '", name,
                  "' that one built from its settings lacks");
      TORCH_CHECK(target->sizes() == tensors[i].sizes(), "attnkit.Module: saved tensor '", name, "' of a ", kind,
                  " has shape ", tensors[i].sizes(), "; the module's is ", target->sizes());
      target->set_data(tensors[i]);
      target->requires_grad_(false);
    }
    return module;
  }

 private:
  /// kind "run", settings {"run_dir": DIR}: the Transformer of the newest
  /// checkpoint of DIR (train::load_run), in eval mode.
  void load_run(const std::string& settings) {
    Settings s(parse_object(settings, "run settings"), "run");
    auto run = train::load_run(s.require<std::string>("run_dir"));
    s.done();
    kind_ = "Transformer";
    bridged_ = bridge_transformer(run.model.ptr());
    run_info_ = json{{"checkpoint", run.checkpoint},
                     {"step", run.step},
                     {"task", json::parse(train::task_options_to_json(run.task_options))},
                     {"trainer", json::parse(run.trainer.to_json())}}
                    .dump();
  }

  template <typename Dict>
  static std::vector<std::string> names(const Dict& dict) {
    std::vector<std::string> out;
    for (const auto& item : dict) out.push_back(item.key());
    return out;
  }

  std::string kind_;
  Bridged bridged_;
  std::string run_info_ = "{}";
  bool loaded_ = false;  // unpickled (from_state): inference only
};

/// The op's inputs are four positional tensors rather than a list: the
/// tracer records no list of optional tensors (torch 1.13).
Outputs module_forward(const c10::intrusive_ptr<Module>& module, const at::Tensor& input0,
                       const c10::optional<at::Tensor>& input1, const c10::optional<at::Tensor>& input2,
                       const c10::optional<at::Tensor>& input3, bool causal, int64_t offset, bool training,
                       int64_t weights) {
  return module->forward({input0, input1, input2, input3}, ForwardArgs{causal, offset, weights_wanted(weights)},
                         training);
}

/// DocumentMemory for Python: the C++ class as it is (nothing to adapt).
class Memory : public torch::CustomClassHolder {
 public:
  explicit Memory(int64_t dim) : memory_(dim) {}
  explicit Memory(DocumentMemory memory) : memory_(std::move(memory)) {}
  void append(const at::Tensor& hidden) { memory_.append(hidden); }
  at::Tensor lookup(const at::Tensor& queries) const { return memory_.lookup(queries); }
  void merge(const c10::intrusive_ptr<Memory>& other) { memory_.merge(other->memory_); }
  int64_t dim() const { return memory_.dim(); }
  int64_t num_states() const { return memory_.num_states(); }
  at::Tensor matrix() const { return memory_.matrix(); }
  void save(const std::string& path) const { memory_.save(path); }

 private:
  DocumentMemory memory_;
};

/// The registry as JSON: [{"name", "summary", "options": [{"key", "type"
/// (integer | real | boolean | choice), "accepts" (e.g. "integer >= 1"),
/// "default", "help", and "min", "min_exclusive", "max" (bounded numbers),
/// "choices" (choice options)}], "supports": {...}, "inputs",
/// "approximates_exact", "always_causal", "layer_only", "exact",
/// "torch_baseline", "layer" (multihead | class_projections),
/// "model_structures", "adds_nodes"}]; "supports" holds one key per
/// nn::support_fields() entry.
std::string mechanisms_json() {
  json out = json::array();
  for (const auto& m : nn::mechanisms()) {
    json options = json::array();
    for (const auto& o : m.options) {
      using Type = nn::MechanismOption::Type;
      const bool integer = o.type == Type::integer;
      const char* type = integer ? "integer" : o.type == Type::real ? "real"
                                             : o.type == Type::boolean ? "boolean" : "choice";
      json option{{"key", o.key}, {"type", type}, {"accepts", o.type_name()}, {"default", o.default_value},
                  {"help", o.help}};
      auto number = [integer](double x) { return integer ? json(static_cast<int64_t>(x)) : json(x); };
      if (std::isfinite(o.min)) option["min"] = number(o.min);
      if (std::isfinite(o.min) && o.min_exclusive) option["min_exclusive"] = true;
      if (std::isfinite(o.max)) option["max"] = number(o.max);
      if (!o.choices.empty()) option["choices"] = o.choices;
      options.push_back(option);
    }
    json supports = json::object();
    for (const auto& field : nn::support_fields()) {
      const auto value = field.value(m.supports);
      supports[field.key] = value == "true" ? json(true) : value == "false" ? json(false) : json(value);
    }
    out.push_back({{"name", m.name},
                   {"summary", m.summary},
                   {"options", options},
                   {"supports", supports},
                   {"inputs", m.inputs},
                   {"approximates_exact", m.approximates_exact},
                   {"always_causal", m.always_causal},
                   {"layer_only", !static_cast<bool>(m.make)},
                   {"exact", m.exact},
                   {"torch_baseline", m.torch_baseline},
                   {"layer", m.layer == nn::MechanismLayer::multihead ? "multihead" : "class_projections"},
                   {"model_structures", m.model_structures},
                   {"adds_nodes", static_cast<bool>(m.node_spans)}});
  }
  return out.dump();
}

/// The support fields (nn::support_fields()) as JSON: [{"key", "help"}], in
/// the order every listing prints them; attnkit.mechanisms()' docstring is
/// made from it.
std::string support_fields_json() {
  json out = json::array();
  for (const auto& field : nn::support_fields()) out.push_back({{"key", field.key}, {"help", field.help}});
  return out.dump();
}

c10::intrusive_ptr<Memory> load_memory(const std::string& path) {
  return c10::make_intrusive<Memory>(DocumentMemory::load(path));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.class_<Module>("Module")
      .def(torch::init<std::string, std::string>())
      .def("kind", &Module::kind)
      .def("settings", &Module::settings)
      .def("run_info", &Module::run_info)
      .def("parameter_names", &Module::parameter_names)
      .def("parameters", &Module::parameters)
      .def("buffer_names", &Module::buffer_names)
      .def("buffers", &Module::buffers)
      .def("call", &Module::call)
      .def("save_run", &Module::save_run)
      .def_pickle([](const c10::intrusive_ptr<Module>& self) { return self->state(); },
                  [](Module::State state) { return Module::from_state(std::move(state)); });
  m.class_<Memory>("DocumentMemory")
      .def(torch::init<int64_t>())
      .def("append", &Memory::append)
      .def("lookup", &Memory::lookup)
      .def("merge", &Memory::merge)
      .def("dim", &Memory::dim)
      .def("num_states", &Memory::num_states)
      .def("matrix", &Memory::matrix)
      .def("save", &Memory::save);
  // Every module's forward (see the contract at the top of this file).
  m.def("module_forward(__torch__.torch.classes.attnkit.Module module, Tensor input0, Tensor? input1=None, "
        "Tensor? input2=None, Tensor? input3=None, bool causal=False, int offset=0, bool training=False, "
        "int weights=0) -> Tensor[]",
        &module_forward);
  m.def("mechanisms_json() -> str", &mechanisms_json);
  m.def("support_fields_json() -> str", &support_fields_json);
  m.def("version() -> str", &attnkit::version);
  m.def("isa() -> str", &attnkit::isa);
  m.def("isa_description() -> str", &attnkit::isa_description);
  m.def("machine_isa() -> str", &attnkit::machine_isa);
  m.def("set_max_isa(str level) -> bool", [](c10::string_view level) {
    return attnkit::set_max_isa(std::string(level));
  });
  m.def("load_document_memory(str path) -> __torch__.torch.classes.attnkit.DocumentMemory", &load_memory);
}

}  // namespace attnkit::bindings
