// What the mechanism files share (mechanism.h).
#include "nn/mechanisms/mechanism.h"

#include <list>
#include <mutex>
#include <string>
#include <utility>

#include "ops/checks.h"
#include "reference/reference.h"

namespace attnkit::nn::registration {

MechanismInputs sample_qkv(const AttentionShape& s, torch::Dtype dtype) {
  auto o = torch::TensorOptions().dtype(dtype);
  return {torch::randn({s.N, s.H, s.L, s.E}, o), torch::randn({s.N, s.Hk(), s.S, s.E}, o),
          torch::randn({s.N, s.Hk(), s.S, s.M}, o)};
}

namespace {

/// A per-head mechanism as a module: the entry's functional form.
class FunctionalMechanism : public MechanismImpl {
 public:
  FunctionalMechanism(const MechanismInfo* info, MechanismSpec spec)
      : info_(info), spec_(std::move(spec)) {}
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttendArgs& args) override {
    detail::check_qkv(info_->name.c_str(), q, k, v, /*grouped_heads=*/true);
    check_supports(*info_, q, k, v, args);
    return info_->run({q, k, v}, args, spec_);
  }
  std::shared_ptr<MechanismImpl> copy(const c10::optional<torch::Device>&) const override {
    return std::make_shared<FunctionalMechanism>(info_, spec_);  // stateless
  }
  void pretty_print(std::ostream& stream) const override {
    stream << "attnkit::nn::Mechanism(" << spec_.str() << ")";
  }

 private:
  const MechanismInfo* info_;
  MechanismSpec spec_;
};

/// The edge lists a builder made last, by (n, spec). A model calls its
/// mechanism with the same length in every layer and step, and rebuilding the
/// pattern each call (a vector per row, sorted, then copied into tensors) took
/// a large share of a sparse call (docs/PERFORMANCE.md, "Why the kernels'
/// constants"). The
/// kernels only read the lists, so the cached tensors are shared;
/// `MechanismInfo::edges` still returns fresh lists, which a caller may
/// modify. Holds at most kEntries lists (17 MiB each for a span-64 band at
/// L = 16384).
class EdgeListCache {
 public:
  explicit EdgeListCache(EdgeBuilder build) : build_(std::move(build)) {}

  EdgeList operator()(int64_t n, const MechanismSpec& spec) {
    const std::string key = std::to_string(n) + " " + spec.str();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = entries_.begin(); it != entries_.end(); ++it)
        if (it->first == key) {
          entries_.splice(entries_.begin(), entries_, it);  // most recently used first
          return it->second;
        }
    }
    EdgeList built = build_(n, spec);  // outside the lock: building can take a while
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.emplace_front(key, built);
    if (entries_.size() > kEntries) entries_.pop_back();
    return built;
  }

 private:
  static constexpr std::size_t kEntries = 4;
  EdgeBuilder build_;
  std::mutex mutex_;
  std::list<std::pair<std::string, EdgeList>> entries_;
};

}  // namespace

SparseAttentionFuncOptions sparse_options(const AttendArgs& args) {
  return SparseAttentionFuncOptions().alibi_slopes(args.alibi_slopes);
}

/// The entry is looked up when the factory runs, after the table is built.
std::shared_ptr<MechanismImpl> make_functional(const MechanismSpec& spec) {
  return std::make_shared<FunctionalMechanism>(&find_mechanism(spec.name), spec);
}

void attend_over_edges(MechanismInfo& m, EdgeBuilder build) {
  m.edges = build;
  const auto cache = std::make_shared<EdgeListCache>(build);
  const auto edges = [cache](int64_t n, const MechanismSpec& spec) { return (*cache)(n, spec); };
  m.run = [edges](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return sparse_attention(x[0], x[1], x[2], edges(x[0].size(2), spec), sparse_options(a));
  };
  m.reference = [edges](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return reference::sparse_attention(x[0], x[1], x[2], edges(x[0].size(2), spec), sparse_options(a));
  };
  m.dispatch = [edges](const Inputs& x, const AttendArgs& a, const MechanismSpec& spec) {
    return sparse_attention_dispatch(x[0], x[1], x[2], edges(x[0].size(2), spec), sparse_options(a));
  };
  m.flops = [edges](const AttentionShape& s, bool, const MechanismSpec& spec) -> c10::optional<double> {
    const auto e = edges(s.L, spec);
    const double per_head = e.per_head() ? 1.0 : double(s.H);
    return 2.0 * double(s.E + s.M) * double(s.N) * per_head * double(e.num_edges());
  };
}

}  // namespace attnkit::nn::registration
