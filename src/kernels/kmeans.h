// K-means of packed LSH hashes in Hamming space (see docs/MATH.md, Clustered
// attention). Torch-free. Labels equal those of
// reference::hamming_kmeans exactly, rule for rule:
//
//   - A sequence of n valid queries uses C = min(clusters, n) clusters.
//   - Initial centroids: the hashes of C distinct positions, a partial
//     Fisher-Yates shuffle driven by random::below(seed, kInitStream + n*H + h, c, n - c).
//   - At most `iterations` times: assign, then update; then one final assign.
//     An assignment that leaves every label as the previous one did is a
//     fixed point (the update depends on the labels only, so every later
//     iteration would repeat it): the loop stops there, which changes no label.
//   - Assign: argmin_c popcount(hash ^ centroid_c), ties to the lowest c.
//   - Update: per centroid and bit, the majority of its members (ties to 0).
//     Then the empty clusters, in increasing index, take the hashes of the
//     queries farthest from their (updated) centroid, farthest first, ties to
//     the lower position, each query used once.
//   - Padded queries (i >= query_lengths[n]) get label -1.
//
// Cost per iteration and sequence: O(n C) bit counts (8 queries per vector at
// avx512, 4 at avx2: a byte-table count, no VPOPCNTDQ) for the assignment and
// O(n) for the update and the convergence test.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

struct KMeansParams {
  const int64_t* hashes = nullptr;         // (N, H, L) contiguous, bits [0, B) used
  int64_t* labels = nullptr;               // (N, H, L) contiguous, written
  const int64_t* query_lengths = nullptr;  // (N), each in [0, L]; nullptr: all valid
  int64_t N = 0, H = 0, L = 0;
  int64_t clusters = 1;                    // >= 1
  int64_t bits = 63;                       // in [1, 63]
  int64_t iterations = 10;                 // >= 0, an upper bound (see above)
  int64_t seed = 0;
  int64_t* rounds = nullptr;               // (N, H) optional, written: the iterations run
                                           // (< iterations when the labels converged first)
};

/// Writes labels. Threads: num_threads() over (batch, head); each sequence is
/// clustered by one thread with integer arithmetic only, so the labels are the
/// same for any thread count.
void hamming_kmeans(const KMeansParams& p);

}  // namespace attnkit::kernels
