// One setting decides how many threads attnkit's kernels use (DESIGN: threads).
#pragma once

namespace attnkit::kernels {

/// Threads for our kernels and for oneDNN inside them. Default: omp_get_max_threads()
/// at first use. Values < 1 reset to that default.
int num_threads();
void set_num_threads(int threads);

/// Makes OpenMP's default team size (which oneDNN follows) equal num_threads()
/// for the lifetime of the scope, then restores it.
class ThreadScope {
 public:
  ThreadScope();
  ~ThreadScope();
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  int previous_;
};

}  // namespace attnkit::kernels
