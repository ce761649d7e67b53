// Incremental causal self-attention states (include/attnkit/nn/decoding.h).
#include <attnkit/nn/decoding.h>
#include <attnkit/ops.h>

#include <algorithm>

#include "ops/checks.h"

namespace attnkit::nn {

// --- KeyValueCache ------------------------------------------------------------------------

void KeyValueCache::append(const torch::Tensor& k, const torch::Tensor& v) {
  constexpr const char* where = "KeyValueCache::append";
  detail::check_float_tensor(where, "k", k, 3);
  detail::check_float_tensor(where, "v", v, 3);
  detail::check_dim(where, "v", v, 0, k.size(0), "batch size N");
  detail::check_dim(where, "v", v, 1, k.size(1), "head count H");
  if (k_.defined()) {
    TORCH_CHECK(k.size(0) == k_.size(0) && k.size(1) == k_.size(1) && k.size(2) == k_.size(3) &&
                    v.size(2) == v_.size(3) && k.scalar_type() == k_.scalar_type(),
                where, ": the cache holds keys ", detail::shape_str(k_), " and values ",
                detail::shape_str(v_), " (N, H, rows, E|M) in ", k_.scalar_type(), ", got k ",
                detail::shape_str(k), " and v ", detail::shape_str(v), " in ", k.scalar_type());
  }
  const int64_t capacity = this->capacity();
  if (rows_ == capacity) {
    // Full: drop the forgotten rows, and grow unless that freed at least half,
    // so every row is copied O(1) times on average.
    const int64_t drop = std::min(rows_, forgotten_ - first_);
    const int64_t keep = rows_ - drop;
    const int64_t new_capacity = keep <= capacity / 2 && capacity > 0 ? capacity
                                                                       : std::max<int64_t>(16, 2 * capacity);
    const auto N = k.size(0), H = k.size(1);
    auto k_new = torch::empty({N, H, new_capacity, k.size(2)}, k.options());
    auto v_new = torch::empty({N, H, new_capacity, v.size(2)}, v.options());
    if (keep > 0) {
      k_new.narrow(2, 0, keep).copy_(k_.narrow(2, drop, keep));
      v_new.narrow(2, 0, keep).copy_(v_.narrow(2, drop, keep));
    }
    k_ = std::move(k_new);
    v_ = std::move(v_new);
    first_ += drop;
    rows_ = keep;
  }
  k_.select(2, rows_).copy_(k);
  v_.select(2, rows_).copy_(v);
  ++rows_;
}

int64_t KeyValueCache::row(int64_t position, const char* what) const {
  TORCH_CHECK(position >= forgotten_ && position >= first_ && position <= size(), "KeyValueCache::",
              what, ": position ", position, " is not held (held: [", std::max(first_, forgotten_),
              ", ", size(), "))");
  return position - first_;
}

torch::Tensor KeyValueCache::keys(int64_t begin) const {
  TORCH_CHECK(k_.defined(), "KeyValueCache::keys: the cache is empty");
  const int64_t r = row(begin, "keys");
  return k_.narrow(2, r, rows_ - r);
}

torch::Tensor KeyValueCache::values(int64_t begin) const {
  TORCH_CHECK(v_.defined(), "KeyValueCache::values: the cache is empty");
  const int64_t r = row(begin, "values");
  return v_.narrow(2, r, rows_ - r);
}

void KeyValueCache::forget_before(int64_t position) {
  forgotten_ = std::max(forgotten_, std::min(position, size()));
}

void CausalState::set_alibi_slopes(const torch::Tensor&) {
  TORCH_CHECK(false, "this decoding state does not take ALiBi slopes");
}

bool CausalState::rotate_inside(int64_t, double) { return false; }

// --- CachedSoftmaxState -------------------------------------------------------------------

void CachedSoftmaxState::set_alibi_slopes(const torch::Tensor& slopes) { alibi_slopes_ = slopes; }

CachedSoftmaxState::CachedSoftmaxState(std::function<int64_t(int64_t)> window_begin)
    : window_begin_(std::move(window_begin)) {}

std::unique_ptr<CachedSoftmaxState> CachedSoftmaxState::gathered(
    std::function<std::vector<int64_t>(int64_t)> positions) {
  std::unique_ptr<CachedSoftmaxState> state(new CachedSoftmaxState());
  state->positions_ = std::move(positions);
  return state;
}

torch::Tensor CachedSoftmaxState::step(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v) {
  detail::check_float_tensor("CachedSoftmaxState::step", "q", q, 3);
  const int64_t t = cache_.size();
  cache_.append(k, v);
  torch::Tensor keys, values;
  auto options = SoftmaxAttentionFuncOptions();
  if (positions_) {
    const auto seen = positions_(t);
    auto index = torch::tensor(seen, torch::kLong);
    keys = cache_.keys().index_select(2, index);
    values = cache_.values().index_select(2, index);
    if (alibi_slopes_.defined()) {
      // The gathered keys are not consecutive: ALiBi's penalties
      // -slope_h (t - position) per kept position, as a (1, H, 1, kept) bias.
      const auto distance = (t - index).to(q.scalar_type());
      options.bias(-alibi_slopes_.to(q.scalar_type()).view({1, -1, 1, 1}) * distance.view({1, 1, 1, -1}));
    }
  } else {
    const int64_t begin = std::clamp<int64_t>(window_begin_(t), 0, t);
    cache_.forget_before(begin);
    keys = cache_.keys(begin);
    values = cache_.values(begin);
    // The query sits at the end of its consecutive keys: the kernel's
    // bottom-right alignment gives ALiBi's distances.
    options.alibi_slopes(alibi_slopes_);
  }
  // One query over every visible key: no mask; the kernel splits long key
  // ranges across threads.
  return softmax_attention(q.unsqueeze(2), keys, values, options).squeeze(2);
}

}  // namespace attnkit::nn
