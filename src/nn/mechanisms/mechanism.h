// What the mechanism files of src/nn/mechanisms share: the registrar that adds
// a file's entries to the registry (include/attnkit/nn/registry.h), random
// inputs, the functional module, and the plumbing of mechanisms that are
// sparse attention over an edge list.
//
// A mechanism file defines its entries and registers them at load time:
//
//   namespace { MechanismInfo full_entry() { ... } }
//   ATTNKIT_REGISTER_MECHANISMS(full, 10, { return {full_entry()}; })
//
// The position orders the table (`attnkit mechanisms` prints it in that
// order); files register in whatever order the loader runs them.
#pragma once

#include <attnkit/nn/registry.h>

#include <functional>
#include <memory>
#include <vector>

namespace attnkit::nn::registration {

using Inputs = MechanismInputs;

/// Adds the entries `make` returns to the table, at `position`. Registrars
/// are static objects of the mechanism files: all of them run before the
/// first read of the table (mechanisms() and friends are never called during
/// static initialisation); one that ran later would be refused loudly.
class Registrar {
 public:
  Registrar(const char* file, int position, std::function<std::vector<MechanismInfo>()> make);
};

#define ATTNKIT_REGISTER_MECHANISMS(tag, position, ...)                               \
  static const ::attnkit::nn::registration::Registrar attnkit_mechanisms_##tag{          \
      __FILE__, position, []() -> std::vector<::attnkit::nn::MechanismInfo> __VA_ARGS__}

/// Standard-normal q (N, H, L, E), k (N, H, S, E), v (N, H, S, M) from torch's
/// global generator.
MechanismInputs sample_qkv(const AttentionShape& s, torch::Dtype dtype);

/// The module of a stateless q, k, v mechanism: its functional form, with the
/// call checked against what the entry supports.
std::shared_ptr<MechanismImpl> make_functional(const MechanismSpec& spec);

/// The sparse_attention options of a call's settings (ALiBi's slopes).
SparseAttentionFuncOptions sparse_options(const AttendArgs& args);

/// Builds the edge list of a sparse mechanism over n nodes from its spec.
using EdgeBuilder = std::function<EdgeList(int64_t n, const MechanismSpec&)>;

/// Fills the functional forms of a mechanism that is sparse_attention over
/// the edge list `build(L, spec)` of L nodes: edges, run, reference, dispatch
/// (reusing recently built lists) and flops (per edge, q . k and p v:
/// 2 (E + M), over every edge of every head; a shared list serves H heads).
void attend_over_edges(MechanismInfo& m, EdgeBuilder build);

}  // namespace attnkit::nn::registration
