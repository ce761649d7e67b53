// Process-wide accounting of the bytes attnkit holds: tensors allocated through
// torch (when the counting allocator is installed, see attnkit/runtime.h) and the
// kernels' own scratch buffers. Benchmarks read the peak to report measured memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "base/isa_namespace.h"

namespace attnkit::kernels::memory {

void note_alloc(std::size_t bytes);
void note_free(std::size_t bytes);
int64_t current_bytes();
int64_t peak_bytes();
/// Sets the peak to the current number of bytes held.
void reset_peak();

}  // namespace attnkit::kernels::memory

ATTNKIT_KERNELS_BEGIN

/// A 64-byte aligned, uninitialised, counted scratch array. Kernels allocate
/// scratch only through this type so that benchmarks see it.
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t count) : count_(count) {
    if (count == 0) return;
    const std::size_t bytes = (count * sizeof(T) + 63) / 64 * 64;
    data_ = static_cast<T*>(std::aligned_alloc(64, bytes));
    if (!data_) throw std::bad_alloc();
    memory::note_alloc(bytes);
  }
  ~Buffer() { release(); }
  Buffer(Buffer&& other) noexcept : data_(other.data_), count_(other.count_) {
    other.data_ = nullptr;
    other.count_ = 0;
  }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = other.data_;
      count_ = other.count_;
      other.data_ = nullptr;
      other.count_ = 0;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return count_; }
  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }

 private:
  void release() {
    if (!data_) return;
    std::free(data_);
    memory::note_free((count_ * sizeof(T) + 63) / 64 * 64);
    data_ = nullptr;
  }
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

ATTNKIT_KERNELS_END
