#include "base/memory.h"

#include <atomic>

namespace attnkit::kernels::memory {

namespace {
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
}  // namespace

void note_alloc(std::size_t bytes) {
  const int64_t now = g_current.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

void note_free(std::size_t bytes) { g_current.fetch_sub(static_cast<int64_t>(bytes)); }
int64_t current_bytes() { return g_current.load(); }
int64_t peak_bytes() { return g_peak.load(); }
void reset_peak() { g_peak.store(g_current.load()); }

}  // namespace attnkit::kernels::memory
