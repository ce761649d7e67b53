// Data-parallel training on libtorch's c10d: rendezvous through a TCPStore,
// collectives through ProcessGroupGloo. The trainer (trainer.h) uses the two
// classes here; docs/TRAINING.md ("Data-parallel training") is the user's view.
//
//   Communicator    one process's membership of a job: rank, world size, and
//                   blocking all-reduce / broadcast / barrier on CPU tensors.
//   GradientReducer averages the gradients of a set of parameters over the
//                   job in buckets of about `bucket_bytes`, each all-reduced
//                   (asynchronously) as soon as the backward pass has produced
//                   every gradient of the bucket (a post-hook on each
//                   parameter's gradient accumulator), so communication
//                   overlaps the rest of the backward pass.
//
// c10d's own bucketing Reducer (torch/csrc/distributed/c10d/reducer.hpp)
// cannot be compiled against Debian's libtorch 1.13 headers (it includes
// torch/csrc/distributed/autograd/context/context.h, which the package does
// not ship); GradientReducer is the same scheme in ~150 lines: buckets in
// reverse parameter order (the order the backward pass produces gradients),
// the first one capped at 1 MiB so that communication starts early (as DDP's),
// launched strictly in bucket order so that every rank issues the same
// sequence of collectives, and a bucket whose parameters got no gradient this
// step (unused) is all-reduced with zeros when the backward pass ends.
//
// Errors of the job (a worker that died, one that did not answer within the
// timeout, a port in use, a rendezvous nobody joined) are thrown as
// DistributedError naming the rank, the operation and c10d's message.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace attnkit::train {

inline constexpr int64_t kDefaultBucketBytes = int64_t{25} << 20;  ///< 25 MiB, DistributedDataParallel's default
inline constexpr int kDefaultMasterPort = 29500;                 ///< torch.distributed's default

struct DistributedOptions {
  TORCH_ARG(int, world_size) = 1;                 ///< processes in the job; 1: no communication at all
  TORCH_ARG(int, rank) = 0;                       ///< this process, in [0, world_size)
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";  ///< where rank 0 serves the TCPStore
  TORCH_ARG(int, master_port) = kDefaultMasterPort;
  TORCH_ARG(double, timeout) = 60;                ///< seconds to wait for the others (rendezvous, every collective)
  TORCH_ARG(int64_t, bucket_bytes) = kDefaultBucketBytes;  ///< gradient bytes per all-reduce
  TORCH_ARG(bool, overlap) = true;                ///< all-reduce during the backward pass (false: after it and a barrier)
  /// The TCPStore at master_addr:master_port is served by the launcher that
  /// started the workers (LauncherStore), so rank 0 connects to it like the
  /// others instead of serving it.
  TORCH_ARG(bool, launcher_store) = false;
};

/// Throws std::invalid_argument naming the option and its value: world_size
/// in [1, 65536], rank in [0, world_size), master_port in [1, 65535], a
/// non-empty master_addr, a finite timeout > 0, bucket_bytes > 0.
void validate(const DistributedOptions& options);

/// Fills world_size, rank, master_addr and master_port from the environment
/// variables WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT (torch.distributed's
/// names) where they are set, and launcher_store from ATTNKIT_LAUNCHER_STORE=1;
/// a value that is not an integer is refused with an error naming the
/// variable. Returns whether WORLD_SIZE was set.
bool distributed_from_environment(DistributedOptions& options);

/// A TCPStore served by a launcher for the workers it starts, on a port the
/// operating system picks when the store binds it. The launcher holds the
/// port from then to the end of the job. (Finding a free port, closing it and
/// letting rank 0 bind it later left a window in which another process, such
/// as another job's Gloo connections, could take it; the job then failed at
/// its rendezvous.) Workers connect with launcher_store(true).
class LauncherStore {
 public:
  /// Serves on every interface and connects its own client through
  /// `master_addr` (the address the workers get), so an address that does
  /// not reach this host fails here, before any worker starts. `timeout` in
  /// seconds bounds the store's waits.
  LauncherStore(const std::string& master_addr, double timeout);
  ~LauncherStore();
  LauncherStore(const LauncherStore&) = delete;
  LauncherStore& operator=(const LauncherStore&) = delete;
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// A failure of the job's communication (see the file comment).
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Communicator {
 public:
  /// Joins the job: rank 0 serves a TCPStore on master_addr:master_port (or,
  /// with launcher_store, the launcher does), the others connect to it
  /// (retrying until `timeout`), then ProcessGroupGloo
  /// connects every pair. Blocks until all world_size processes have joined.
  /// Gloo's device: the interface in GLOO_SOCKET_IFNAME when set, 127.0.0.1
  /// for a loopback master address, else the address this host's name
  /// resolves to.
  static std::unique_ptr<Communicator> connect(const DistributedOptions& options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return options_.rank(); }
  int world_size() const { return options_.world_size(); }
  const DistributedOptions& options() const { return options_; }

  /// In place, blocking: the element-wise sum (or max) over the ranks.
  void allreduce_sum(torch::Tensor& tensor, const char* what);
  void allreduce_max(torch::Tensor& tensor, const char* what);
  /// In place, blocking: every rank gets rank `root`'s values.
  void broadcast(torch::Tensor& tensor, int root, const char* what);
  void barrier(const char* what);

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  Communicator(const DistributedOptions& options, std::unique_ptr<Impl> impl);
  DistributedOptions options_;
  std::unique_ptr<Impl> impl_;
};

class GradientReducer {
 public:
  /// `parameters`: leaf float32 tensors that require grad, each once; the
  /// same list in the same order on every rank. Registers the hooks; they are
  /// removed by the destructor. `sources` (mixed precision; empty: the
  /// parameters themselves): leaves of the same shapes, one per parameter,
  /// whose gradients the backward pass computes (in any floating dtype); the
  /// hooks watch them, their gradients are all-reduced in float32 and the mean
  /// is left in the float32 parameters' grads.
  GradientReducer(Communicator& communicator, std::vector<torch::Tensor> parameters, int64_t bucket_bytes,
                  bool overlap, std::vector<torch::Tensor> sources = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// Arms the hooks for one backward pass (call before backward()).
  void prepare();
  /// After backward(): all-reduces the buckets not launched yet, waits for
  /// every bucket and leaves in each parameter's grad the mean over the ranks.
  void finish();

  int64_t bytes() const { return bytes_; }  ///< gradient bytes all-reduced per step
  std::size_t buckets() const { return buckets_.size(); }
  /// Seconds finish() waited (the communication the backward pass did not hide,
  /// and the wait for slower ranks; with overlap off, the whole all-reduce,
  /// timed after a barrier so that it excludes the wait for slower ranks).
  double last_wait_seconds() const { return last_wait_; }
  /// Buckets the last step launched during the backward pass (the rest: in finish()).
  std::size_t last_launched_in_backward() const { return launched_in_backward_; }

 private:
  struct Bucket;
  void ready(std::size_t param);
  void launch(std::size_t bucket);

  Communicator& comm_;
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> sources_;  // whose grads are reduced: params_ or their working copies
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<std::size_t> bucket_of_;
  std::vector<int64_t> offset_of_;
  std::vector<bool> seen_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep the gradient accumulators (and their hooks) alive
  std::vector<uintptr_t> hook_keys_;
  std::size_t next_ = 0, launched_in_backward_ = 0;
  bool armed_ = false, overlap_;
  int64_t bytes_ = 0;
  double last_wait_ = 0;
};

/// The seed of torch's default generator for the dropout of rank `rank` at
/// (0-based) step `step` of a data-parallel run seeded `seed`:
/// splitmix64(splitmix64(splitmix64(seed) + step) + rank).
uint64_t dropout_seed(uint64_t seed, int64_t step, int rank);

}  // namespace attnkit::train
