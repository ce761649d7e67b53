// Loading an optimiser state that either supported torch wrote, in one place.
//
// torch's own Optimizer::load cannot read across the two: torch 1.13 keys each
// parameter's state by the address of its TensorImpl printed in hexadecimal
// ("0x55d0..."), torch 2 by the address in decimal, parsed back with
// std::stoull, which reads every hexadecimal key as 0, so a torch 1.13
// checkpoint resumed on torch 2 gives every parameter the same (wrong) state.
// (torch 1.13 reads torch 2's files: it compares the keys as strings.)
// load_optimizer matches the saved keys as strings, as torch 1.13 does, on
// both; the in-memory key type (a string in 1.13, the TensorImpl pointer in
// torch 2) is taken from Optimizer::state()'s type, not from a version number.
// The archive's layout (param_groups: param_groups/size, param_groups/<i>:
// params/size, params/<j>, options; state: <key>) is the same in both.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/serialize/input-archive.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace attnkit::train::optimizer_compat {

/// The key Optimizer::state() holds `param`'s state under, as a `Key`.
template <typename Key>
Key state_key_as(const torch::Tensor& param) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;  // what torch 1.13's c10::guts::to_string printed
    text << param.unsafeGetTensorImpl();
    return text.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

/// The key Optimizer::state() holds `param`'s state under.
inline auto state_key(const torch::Tensor& param) {
  using Key = typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
  return state_key_as<Key>(param);
}

/// Restores `optimizer` (its groups built as when the archive was written)
/// from an archive its save() wrote with either torch, for an optimiser whose
/// per-group options are `Options` and per-parameter state `ParamState`;
/// throws c10::Error when the archive does not fit (group or parameter counts).
template <typename Options, typename ParamState>
void load_state(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive saved_groups;
  archive.read("param_groups", saved_groups);
  torch::Tensor count;
  saved_groups.read("param_groups/size", count);
  auto& groups = optimizer.param_groups();
  TORCH_CHECK(count.item<int64_t>() == static_cast<int64_t>(groups.size()), "the archive has ",
              count.item<int64_t>(), " parameter groups, the optimiser ", groups.size());
  torch::serialize::InputArchive states;
  archive.read("state", states);
  const auto stored = states.keys();
  for (size_t i = 0; i < groups.size(); ++i) {
    torch::serialize::InputArchive group;
    saved_groups.read("param_groups/" + std::to_string(i), group);
    torch::Tensor params_size;
    group.read("params/size", params_size);
    const auto params = groups[i].params();
    TORCH_CHECK(params_size.item<int64_t>() == static_cast<int64_t>(params.size()), "group ", i,
                " of the archive has ", params_size.item<int64_t>(), " parameters, the optimiser's ",
                params.size());
    torch::serialize::InputArchive options_archive;
    group.read("options", options_archive);
    Options options;
    options.serialize(options_archive);
    static_cast<Options&>(groups[i].options()) = options;  // as torch's load does
    for (size_t j = 0; j < params.size(); ++j) {
      c10::IValue key;
      group.read("params/" + std::to_string(j), key);
      if (std::find(stored.begin(), stored.end(), key.toStringRef()) == stored.end()) continue;  // no step yet
      torch::serialize::InputArchive state_archive;
      states.read(key.toStringRef(), state_archive);
      auto state = std::make_unique<ParamState>();
      state->serialize(state_archive);
      optimizer.state()[state_key(params[j])] = std::move(state);
    }
  }
}

/// Optimizer::load for the optimisers attnkit uses (AdamW: the trainer and
/// the experiments; Adam: node-classify), through load_state; any other
/// through torch's own.
inline void load_optimizer(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer))
    load_state<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(archive, optimizer);
  else if (dynamic_cast<torch::optim::Adam*>(&optimizer))
    load_state<torch::optim::AdamOptions, torch::optim::AdamParamState>(archive, optimizer);
  else
    optimizer.load(archive);
}

}  // namespace attnkit::train::optimizer_compat
