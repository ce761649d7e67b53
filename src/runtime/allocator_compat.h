// What differs in c10::Allocator between torch 1.13 and torch 2, in one place:
// torch 2 made allocate() non-const and added copy_data(), pure virtual.
// A wrapper derives from AllocatorBase and implements allocate_block().
#pragma once

#include <c10/core/Allocator.h>
#include <torch/version.h>

namespace attnkit::memory {

class AllocatorBase : public c10::Allocator {
 public:
#if TORCH_VERSION_MAJOR >= 2
  c10::DataPtr allocate(size_t bytes) final { return allocate_block(bytes); }
  void copy_data(void* dest, const void* src, std::size_t count) const final {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t bytes) const final { return allocate_block(bytes); }
#endif

 protected:
  virtual c10::DataPtr allocate_block(size_t bytes) const = 0;
};

}  // namespace attnkit::memory
