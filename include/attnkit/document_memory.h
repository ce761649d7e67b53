// A fixed-size representation of a document (the cheap-linear-attention paper,
// its sections 3.1-3.2; docs/MATH.md, "Linear attention"): the
// k x k matrix C = H^T H = sum_t h_t h_t^T of its hidden states h_t. It is built
// from a stream without holding the states, answers a query in O(k^2) whatever
// the document's length (R = C q), merges by addition, and is saved to a
// versioned, checksummed file.
//
// Inference only: tensors pass in and out without autograd history. To train
// through C use linear_attention (identity map, no normaliser, k = v = H) or
// nn::GatedLinearAttention. Like a standard container, const members (lookup,
// save) may run concurrently; append and merge need exclusive access.
//
//   attnkit::DocumentMemory memory(100);
//   for (const auto& chunk : document_chunks) memory.append(chunk);  // (n_i, 100)
//   auto answers = memory.lookup(queries);                           // (m, 100)
//   memory.save("doc.attnkit-mem");
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>

namespace attnkit {

class DocumentMemory {
 public:
  /// An empty memory (C = 0) for hidden states of size `dim` (the paper's k).
  explicit DocumentMemory(int64_t dim);

  /// Encodes the next hidden states of the stream, float32 (n, k): C += H^T H.
  /// Any split of a document into appends gives the same C up to float rounding.
  void append(const torch::Tensor& hidden);

  /// R = C q for every row q of `queries`, float32 (m, k) -> (m, k): one GEMM,
  /// O(m k^2) whatever the number of states encoded.
  torch::Tensor lookup(const torch::Tensor& queries) const;

  /// C += other's C: the memory of this document followed by the other one.
  void merge(const DocumentMemory& other);

  /// k.
  int64_t dim() const { return dim_; }
  /// Hidden states encoded so far, merges included.
  int64_t num_states() const { return num_states_; }
  /// A copy of C, float32 (k, k).
  torch::Tensor matrix() const { return C_.clone(); }

  /// Writes the memory to `path` atomically: a temporary file next to it,
  /// fsync, rename over `path`, fsync of the directory. Readers see the old
  /// file or the new one, never a partial one. Layout, integers little-endian:
  ///   bytes 0-7   magic "ATNKDMEM"
  ///   8-11        u32 format version (kFormatVersion)
  ///   12-15       u32 element type (1 = float32)
  ///   16-23       u64 k
  ///   24-31       u64 number of hidden states encoded
  ///   32-         C, k * k float32 (IEEE-754 bits, little-endian), row-major
  ///   last 8      u64 FNV-1a 64 hash of every byte before it
  /// FNV-1a changes its state bijectively with every byte, so any change to a
  /// single byte (every single bit flip) is always detected.
  void save(const std::string& path) const;

  /// Reads a memory written by save(). Throws a c10::Error naming the file and
  /// the problem if it is missing, truncated, corrupt (checksum mismatch), of
  /// another format version or not a DocumentMemory file at all.
  static DocumentMemory load(const std::string& path);

  /// Bumped whenever the file layout changes; load() refuses other versions.
  static constexpr uint32_t kFormatVersion = 1;

 private:
  DocumentMemory(int64_t dim, torch::Tensor C, int64_t num_states);

  int64_t dim_;
  torch::Tensor C_;  // float32 (k, k), contiguous
  int64_t num_states_ = 0;
};

}  // namespace attnkit
