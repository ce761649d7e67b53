// The visibility rule every attention kernel shares (see docs/MATH.md, Masks
// and visibility): query i of batch n sees key j iff
//   j < key_lengths[n]            (padding; no key_lengths: every key), and
//   j <= i + S - L                (when causal: bottom-right aligned).
// Both cut a prefix of the keys, so a query sees exactly [0, visible(i)).
// Exact attention adds an optional window W (its `window`): then also
//   j > i + S - L - W             (and, when not causal, j < i + S - L + W),
// a band of keys [first(i), visible(i)) around the query's position.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/common/isa.h"

ATTNKIT_KERNELS_BEGIN

/// The causal offset S - L: when causal, query i sees the keys j <= i + offset
/// (for kernels that walk keys and queries together, as a scan does).
inline int64_t causal_offset(int64_t L, int64_t S) { return S - L; }

/// The keys [0, key_limit) of batch n that padding leaves visible: key_lengths[n]
/// clamped to [0, S], or S without key_lengths.
inline int64_t key_limit(const int64_t* key_lengths, int64_t n, int64_t S) {
  return key_lengths ? std::clamp<int64_t>(key_lengths[n], 0, S) : S;
}

/// Query i sees exactly the keys [first(i), visible(i)); first(i) is 0
/// without a window. Both are nondecreasing in i, and by at most 1 per query
/// when causal or windowed.
class Visibility {
 public:
  /// L queries against S keys, of which [0, limit) survive padding; window
  /// W > 0 keeps the keys within W - 1 of the query's position i + S - L
  /// (before it only when causal), 0 none.
  Visibility(int64_t L, int64_t S, bool causal, int64_t limit, int64_t window = 0)
      : limit_(limit), offset_(causal_offset(L, S)), window_(window), causal_(causal) {}
  Visibility(int64_t L, int64_t S, bool causal) : Visibility(L, S, causal, S) {}

  int64_t operator()(int64_t i) const {
    if (causal_) return std::clamp<int64_t>(i + 1 + offset_, 0, limit_);
    return window_ ? std::clamp<int64_t>(i + offset_ + window_, 0, limit_) : limit_;
  }
  /// The first key query i sees (when it sees any: first(i) < visible(i)).
  int64_t first(int64_t i) const {
    return window_ ? std::clamp<int64_t>(i + offset_ - window_ + 1, 0, limit_) : 0;
  }
  /// The first query that sees key j (L when none does).
  int64_t first_query(int64_t j, int64_t L) const {
    if (j >= limit_) return L;
    if (causal_) return std::clamp<int64_t>(j - offset_, 0, L);
    return window_ ? std::clamp<int64_t>(j - offset_ - window_ + 1, 0, L) : 0;
  }
  /// One past the last query that sees key j: the queries [first_query(j),
  /// end_query(j)) see it (L without a window; an empty range when none does).
  int64_t end_query(int64_t j, int64_t L) const {
    if (j >= limit_) return L;
    return window_ ? std::clamp<int64_t>(j - offset_ + window_, 0, L) : L;
  }

 private:
  int64_t limit_, offset_, window_;
  bool causal_;
};

ATTNKIT_KERNELS_END
