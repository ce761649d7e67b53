// Incremental causal self-attention: the state a mechanism carries from one
// position to the next when a decoder emits tokens one at a time. The registry
// (nn/registry.h) makes one per mechanism that supports decoding
// (MechanismInfo::start_decoding); the transformer builder keeps one per block.
//
// Fed the q, k, v of positions 0, 1, 2, ... in turn, step() returns what the
// mechanism's causal forward over the whole sequence returns at each position.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace attnkit::nn {

class CausalState {
 public:
  virtual ~CausalState() = default;
  /// q (N, H, E), k (N, H, E), v (N, H, M) of the next position -> (N, H, M):
  /// its attention over every position stepped so far, itself included.
  virtual torch::Tensor step(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v) = 0;
  /// Positions stepped so far.
  virtual int64_t steps() const = 0;
  /// ALiBi: the (H) slopes of the steps to come (a state of a mechanism with
  /// MechanismSupports::alibi). The default refuses.
  virtual void set_alibi_slopes(const torch::Tensor& slopes);
  /// Rotary positions (rotate the first `dim` entries, angles from `base`)
  /// that the state applies itself at each step's position: a mechanism whose
  /// rotary form is no rotation of q and k before the call (causal linear
  /// attention turns phi(q), phi(k) in its numerator only). Returns whether
  /// it does; the default does not (false), and the caller then rotates each
  /// step's query and key at their position (exact attention's cache holds
  /// rotated keys).
  virtual bool rotate_inside(int64_t dim, double base);
};

/// The keys and values of the positions a decoder has seen, (N, H, T, E) and
/// (N, H, T, M), in buffers that grow geometrically, so an append is amortised
/// O(1) and the views handed to attention are strided windows of the buffers
/// (no copy). Positions a window has moved past can be forgotten; their rows
/// are reclaimed when the buffer next fills, so a window of w positions keeps
/// O(w) memory however long the sequence.
class KeyValueCache {
 public:
  /// Appends k (N, H, E) and v (N, H, M) as position size().
  void append(const torch::Tensor& k, const torch::Tensor& v);
  /// Positions appended so far.
  int64_t size() const { return first_ + rows_; }
  /// Keys and values of positions [begin, size()); begin must not be forgotten.
  torch::Tensor keys(int64_t begin = 0) const;
  torch::Tensor values(int64_t begin = 0) const;
  /// Positions before `position` will not be read again.
  void forget_before(int64_t position);
  /// Rows currently held (for tests of the memory bound).
  int64_t capacity() const { return k_.defined() ? k_.size(2) : 0; }

 private:
  int64_t row(int64_t position, const char* what) const;
  torch::Tensor k_, v_;     // (N, H, capacity, E), (N, H, capacity, M)
  int64_t first_ = 0;       // position held in buffer row 0
  int64_t rows_ = 0;        // rows in use
  int64_t forgotten_ = 0;   // positions < forgotten_ may be dropped
};

/// Exact softmax attention over a key/value cache. `visible(t)` gives the
/// positions query t sees, as a contiguous range [begin, t] (begin(t) must not
/// decrease) or, when `gather` is set, an explicit sorted list.
class CachedSoftmaxState : public CausalState {
 public:
  /// Query t sees [window_begin(t), t]; positions before it are forgotten.
  explicit CachedSoftmaxState(std::function<int64_t(int64_t)> window_begin);
  /// Query t sees the positions `positions(t)` (sorted, ending at t).
  static std::unique_ptr<CachedSoftmaxState> gathered(
      std::function<std::vector<int64_t>(int64_t)> positions);

  torch::Tensor step(const torch::Tensor& q, const torch::Tensor& k,
                     const torch::Tensor& v) override;
  int64_t steps() const override { return cache_.size(); }
  /// ALiBi's penalties -slope_h (t - position) for query t: a window state's
  /// query sits at the end of its consecutive keys (the kernel's bottom-right
  /// alignment gives the distances); a gathered state passes the penalties of
  /// the positions it keeps as a bias.
  void set_alibi_slopes(const torch::Tensor& slopes) override;
  const KeyValueCache& cache() const { return cache_; }

 private:
  CachedSoftmaxState() = default;
  std::function<int64_t(int64_t)> window_begin_;
  std::function<std::vector<int64_t>(int64_t)> positions_;
  KeyValueCache cache_;
  torch::Tensor alibi_slopes_;
};

}  // namespace attnkit::nn
