#include "kernels/common/threading.h"

#include <omp.h>

#include <atomic>

namespace attnkit::kernels {

namespace {
std::atomic<int> g_threads{0};  // 0: not yet decided
int default_threads() { return omp_get_max_threads() > 0 ? omp_get_max_threads() : 1; }
}  // namespace

int num_threads() {
  int t = g_threads.load(std::memory_order_relaxed);
  if (t == 0) {
    t = default_threads();
    g_threads.store(t, std::memory_order_relaxed);
  }
  return t;
}

void set_num_threads(int threads) {
  g_threads.store(threads >= 1 ? threads : default_threads(), std::memory_order_relaxed);
}

ThreadScope::ThreadScope() : previous_(omp_get_max_threads()) { omp_set_num_threads(num_threads()); }
ThreadScope::~ThreadScope() { omp_set_num_threads(previous_); }

}  // namespace attnkit::kernels
