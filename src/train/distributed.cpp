// Data parallel on c10d: TCPStore rendezvous, ProcessGroupGloo collectives,
// bucketed gradient all-reduce from autograd hooks (distributed.h).
//
// ProcessGroupGloo.hpp declares its class only under USE_C10D_GLOO (libtorch
// was built with it: libtorch_cpu.so exports c10d::ProcessGroupGloo); the
// define comes after the precompiled header, which does not mention it.
#define USE_C10D_GLOO 1
#include <attnkit/train/distributed.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <string>

#include "train/c10d_compat.h"

namespace attnkit::train {

namespace {

std::string error_text(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

int64_t parse_env_int(const char* name, const char* value) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value, &end, 10);
  if (end == value || *end != '\0' || errno != 0)
    throw std::invalid_argument(std::string("environment variable ") + name + "='" + value +
                                "' is not an integer");
  return v;
}

/// "60 s", "2.5 s".
std::string seconds_text(double s) {
  std::ostringstream out;
  out << s << " s";
  return out.str();
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

void validate(const DistributedOptions& o) {
  auto refuse = [](const std::string& what) { throw std::invalid_argument("data parallel: " + what); };
  if (o.world_size() < 1 || o.world_size() > 65536)
    refuse("world size " + std::to_string(o.world_size()) + " is outside [1, 65536]");
  if (o.rank() < 0 || o.rank() >= o.world_size())
    refuse("rank " + std::to_string(o.rank()) + " is outside [0, " + std::to_string(o.world_size() - 1) +
           "] (world size " + std::to_string(o.world_size()) + ")");
  if (o.master_port() < 1 || o.master_port() > 65535)
    refuse("master port " + std::to_string(o.master_port()) + " is outside [1, 65535]");
  if (o.master_addr().empty()) refuse("the master address is empty");
  if (!std::isfinite(o.timeout()) || o.timeout() <= 0)
    refuse("timeout " + std::to_string(o.timeout()) + " s must be a finite number > 0");
  if (o.bucket_bytes() <= 0) refuse("bucket size " + std::to_string(o.bucket_bytes()) + " bytes must be > 0");
}

bool distributed_from_environment(DistributedOptions& o) {
  bool world = false;
  if (const char* v = std::getenv("WORLD_SIZE")) {
    o.world_size(static_cast<int>(parse_env_int("WORLD_SIZE", v)));
    world = true;
  }
  if (const char* v = std::getenv("RANK")) o.rank(static_cast<int>(parse_env_int("RANK", v)));
  if (const char* v = std::getenv("MASTER_ADDR")) o.master_addr(v);
  if (const char* v = std::getenv("MASTER_PORT")) o.master_port(static_cast<int>(parse_env_int("MASTER_PORT", v)));
  if (const char* v = std::getenv("ATTNKIT_LAUNCHER_STORE")) {
    const std::string value = v;
    if (value != "0" && value != "1")
      throw std::invalid_argument("data parallel: ATTNKIT_LAUNCHER_STORE must be 0 or 1, got '" + value + "'");
    o.launcher_store(value == "1");
  }
  return world;
}

struct LauncherStore::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

LauncherStore::LauncherStore(const std::string& master_addr, double timeout) : impl_(std::make_unique<Impl>()) {
  c10d::TCPStoreOptions so = c10d_compat::tcp_store_options();
  so.port = 0;  // the operating system's choice, held from here on
  so.isServer = true;
  so.waitWorkers = false;  // the workers do not exist yet
  so.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(timeout * 1000)));
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(master_addr, so);
  } catch (const std::exception& e) {
    throw DistributedError("the launcher could not serve the TCPStore and reach it at " + master_addr + ": " +
                           error_text(e));
  }
}

LauncherStore::~LauncherStore() = default;

int LauncherStore::port() const { return impl_->store->getPort(); }

uint64_t dropout_seed(uint64_t seed, int64_t step, int rank) {
  return splitmix64(splitmix64(splitmix64(seed) + static_cast<uint64_t>(step)) + static_cast<uint64_t>(rank));
}

// ---------------------------------------------------------------------------
// Communicator
// ---------------------------------------------------------------------------

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
};

Communicator::Communicator(const DistributedOptions& options, std::unique_ptr<Impl> impl)
    : options_(options), impl_(std::move(impl)) {}

Communicator::~Communicator() = default;

std::unique_ptr<Communicator> Communicator::connect(const DistributedOptions& o) {
  validate(o);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(o.timeout() * 1000)));
  const std::string where = o.master_addr() + ":" + std::to_string(o.master_port());
  auto impl = std::make_unique<Impl>();
  try {
    c10d::TCPStoreOptions so = c10d_compat::tcp_store_options();
    so.port = static_cast<uint16_t>(o.master_port());
    so.isServer = o.rank() == 0 && !o.launcher_store();
    so.numWorkers = static_cast<std::size_t>(o.world_size());
    so.waitWorkers = true;
    so.timeout = timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>(o.master_addr(), so);
  } catch (const std::exception& e) {
    throw DistributedError("rank " + std::to_string(o.rank()) + ": the rendezvous at " + where + " failed (" +
                           (o.rank() == 0 && !o.launcher_store() ? "serving the TCPStore; is the port in use?"
                            : o.launcher_store() ? "connecting to the launcher's TCPStore"
                                                 : "connecting to rank 0's TCPStore") +
                           ", world size " + std::to_string(o.world_size()) + ", timeout " +
                           seconds_text(o.timeout()) + "): " + error_text(e));
  }
  try {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"))
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    else if (is_loopback(o.master_addr()))
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    else
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    impl->group = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, o.rank(), o.world_size(), options);
  } catch (const std::exception& e) {
    throw DistributedError("rank " + std::to_string(o.rank()) + ": connecting the Gloo process group (master " +
                           where + ", world size " + std::to_string(o.world_size()) + ") failed: " +
                           error_text(e));
  }
  return std::unique_ptr<Communicator>(new Communicator(o, std::move(impl)));
}

namespace {

void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const Communicator& comm, const char* what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw DistributedError("rank " + std::to_string(comm.rank()) + ": the " + what + " failed (a worker died, or " +
                           "did not answer within the timeout of " + seconds_text(comm.options().timeout()) +
                           "): " + error_text(e));
  }
}

}  // namespace

void Communicator::allreduce_sum(torch::Tensor& tensor, const char* what) {
  std::vector<at::Tensor> v{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait_for(impl_->group->allreduce(v, opts), *this, what);
}

void Communicator::allreduce_max(torch::Tensor& tensor, const char* what) {
  std::vector<at::Tensor> v{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  wait_for(impl_->group->allreduce(v, opts), *this, what);
}

void Communicator::broadcast(torch::Tensor& tensor, int root, const char* what) {
  std::vector<at::Tensor> v{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  wait_for(impl_->group->broadcast(v, opts), *this, what);
}

void Communicator::barrier(const char* what) { wait_for(impl_->group->barrier(), *this, what); }

// ---------------------------------------------------------------------------
// GradientReducer
// ---------------------------------------------------------------------------

struct GradientReducer::Bucket {
  std::vector<std::size_t> params;  // indices into params_
  torch::Tensor buffer;             // float32, the bucket's gradients back to back
  std::size_t pending = 0;          // parameters whose gradient has not arrived this step
  c10::intrusive_ptr<c10d::Work> work;
};

GradientReducer::GradientReducer(Communicator& communicator, std::vector<torch::Tensor> parameters,
                                 int64_t bucket_bytes, bool overlap, std::vector<torch::Tensor> sources)
    : comm_(communicator), params_(std::move(parameters)), sources_(std::move(sources)), overlap_(overlap) {
  TORCH_CHECK(bucket_bytes > 0, "GradientReducer: bucket_bytes must be > 0, got ", bucket_bytes);
  const std::size_t n = params_.size();
  if (sources_.empty()) sources_ = params_;
  TORCH_CHECK(sources_.size() == n, "GradientReducer: ", sources_.size(), " gradient sources for ", n,
              " parameters; expected one per parameter");
  for (std::size_t k = 0; k < n; ++k)
    TORCH_CHECK(sources_[k].is_leaf() && sources_[k].requires_grad() && sources_[k].sizes() == params_[k].sizes() &&
                    sources_[k].is_floating_point(),
                "GradientReducer: gradient source ", k, " must be a floating-point leaf that requires grad, of "
                "its parameter's shape ", params_[k].sizes(), "; got ", sources_[k].scalar_type(), " ",
                sources_[k].sizes());
  bucket_of_.resize(n);
  offset_of_.resize(n);
  seen_.assign(n, false);
  // Reverse order: the backward pass produces the last layers' gradients first.
  // The first bucket is capped at 1 MiB (DistributedDataParallel's first
  // bucket), so that communication starts early in the backward pass.
  const int64_t first_cap = std::min<int64_t>(bucket_bytes, int64_t{1} << 20);
  int64_t in_bucket = 0;
  for (std::size_t k = n; k-- > 0;) {
    const auto& p = params_[k];
    TORCH_CHECK(p.is_leaf() && p.requires_grad(), "GradientReducer: parameter ", k,
                " is not a leaf that requires grad");
    TORCH_CHECK(p.scalar_type() == torch::kFloat32 && p.device().is_cpu(), "GradientReducer: parameter ", k,
                " is ", p.scalar_type(), " on ", p.device(), "; only float32 CPU parameters are supported");
    if (buckets_.empty() || in_bucket >= (buckets_.size() == 1 ? first_cap : bucket_bytes)) {
      buckets_.push_back(std::make_unique<Bucket>());
      in_bucket = 0;
    }
    auto& bucket = *buckets_.back();
    bucket_of_[k] = buckets_.size() - 1;
    offset_of_[k] = in_bucket / static_cast<int64_t>(sizeof(float));
    bucket.params.push_back(k);
    in_bucket += p.numel() * static_cast<int64_t>(sizeof(float));
    bytes_ += p.numel() * static_cast<int64_t>(sizeof(float));
  }
  for (auto& b : buckets_) {
    int64_t numel = 0;
    for (auto k : b->params) numel += params_[k].numel();
    b->buffer = torch::zeros({numel}, torch::kFloat32);
  }
  // A post-hook on each parameter's gradient accumulator runs after the
  // gradient was accumulated into .grad: then the parameter is ready. A
  // parameter used several times (tied embeddings, shared blocks) has one
  // accumulator, which runs once per backward pass with the summed gradient.
  for (std::size_t k = 0; k < n; ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(sources_[k]);
    TORCH_CHECK(acc, "GradientReducer: parameter ", k, " has no gradient accumulator");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          ready(k);
          return outputs;
        })));
    accumulators_.push_back(std::move(acc));
  }
}

GradientReducer::~GradientReducer() {
  for (std::size_t k = 0; k < accumulators_.size(); ++k) accumulators_[k]->del_post_hook(hook_keys_[k]);
}

void GradientReducer::prepare() {
  for (auto& b : buckets_) {
    b->pending = b->params.size();
    b->work.reset();
  }
  std::fill(seen_.begin(), seen_.end(), false);
  next_ = 0;
  armed_ = true;
}

void GradientReducer::ready(std::size_t k) {
  if (!armed_) return;  // a backward pass outside prepare()/finish(): not ours to reduce
  TORCH_CHECK(!seen_[k], "GradientReducer: parameter ", k, " got its gradient twice in one backward pass");
  seen_[k] = true;
  --buckets_[bucket_of_[k]]->pending;
  // Strictly in bucket order, so that every rank issues the same collectives
  // in the same order.
  while (overlap_ && next_ < buckets_.size() && buckets_[next_]->pending == 0) launch(next_++);
}

void GradientReducer::launch(std::size_t b) {
  auto& bucket = *buckets_[b];
  for (auto k : bucket.params) {
    auto slice = bucket.buffer.narrow(0, offset_of_[k], params_[k].numel());
    const auto& grad = sources_[k].grad();
    // A parameter unused this step contributes what its grad holds (zeros
    // after the optimiser's zero_grad), or zeros when it has none yet.
    if (grad.defined())
      slice.copy_(grad.reshape({-1}));  // converts a bfloat16 gradient to float32
    else
      slice.zero_();
  }
  std::vector<at::Tensor> tensors{bucket.buffer};
  bucket.work = comm_.impl().group->allreduce(tensors);
}

void GradientReducer::finish() {
  TORCH_CHECK(armed_, "GradientReducer::finish without prepare");
  armed_ = false;
  // Without overlap (a measurement mode), first wait for every rank to finish
  // its backward pass, so that the time below is the all-reduce alone, not
  // also the wait for a slower rank.
  if (!overlap_) comm_.barrier("barrier before the gradient all-reduce");
  const auto start = std::chrono::steady_clock::now();
  launched_in_backward_ = next_;
  // Buckets not launched during the backward pass: with overlap off, all of
  // them; else those holding a parameter that got no gradient this step.
  while (next_ < buckets_.size()) launch(next_++);
  for (auto& b : buckets_) {
    wait_for(b->work, comm_, "gradient all-reduce");
    b->work.reset();
  }
  last_wait_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (auto& b : buckets_) {
    b->buffer.div_(static_cast<double>(comm_.world_size()));  // the mean over the ranks
    for (auto k : b->params) {
      auto& p = params_[k];
      auto slice = b->buffer.narrow(0, offset_of_[k], p.numel()).view(p.sizes());
      if (p.grad().defined())
        p.mutable_grad().copy_(slice);
      else
        p.mutable_grad() = slice.clone();
    }
  }
}

}  // namespace attnkit::train
