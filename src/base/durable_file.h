// Replacing files so that a crash or a power cut leaves either the old content
// or the new, never an empty or half-written file: the one way attnkit writes
// a file that a later run reads (checkpoints, saved document memories,
// prepared corpora, benchmark JSON).
//
// The steps, each of which must reach the disk before the next: write the new
// bytes to a temporary file in the target's directory, fsync it, close it,
// rename it over the target (atomic within a file system), fsync the
// directory (which makes the rename itself durable). Without the first fsync
// a power cut after the rename can leave the new name on an empty file;
// without the second the rename can be lost.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace attnkit::base {

/// Replaces the file `path` with `bytes` by the steps above. On failure the
/// temporary file is removed, `path` keeps its old content (or stays absent)
/// unless the rename had happened, and a std::system_error names the step,
/// the file and the system's reason.
void write_file_durably(const std::string& path, std::string_view bytes);

/// fsyncs the directory `dir`, which makes the renames and removals of its
/// entries so far durable; a std::system_error on failure.
void fsync_directory(const std::string& dir);

/// Several files replaced as one step: each written under a temporary name
/// (open, then write), and on commit() every one fsynced and closed, then
/// renamed into place in the order opened, then their directories fsynced.
/// A failure before the renames leaves every target as it was (one during
/// them, the files before it renamed); the temporary files of a set that
/// was never committed are removed when it is destroyed. Not thread-safe.
class DurableFiles {
 public:
  DurableFiles();
  ~DurableFiles();
  DurableFiles(const DurableFiles&) = delete;
  DurableFiles& operator=(const DurableFiles&) = delete;

  /// Starts the new content of `path`; appends with write(). Returns its index.
  std::size_t open(const std::string& path);
  /// Appends bytes to file `index`.
  void write(std::size_t index, std::string_view bytes);
  /// Makes every file durable and renames them into place (see above).
  void commit();

 private:
  struct File;
  std::vector<std::unique_ptr<File>> files_;
};

namespace detail {

/// The system calls the helpers make, replaceable by tests that fail them one
/// at a time (tests/base/durable_file_test.cpp). Each has the POSIX call's
/// meaning: -1 with errno set on failure.
struct FileCalls {
  int (*open)(const char* path, int flags, mode_t mode);
  ssize_t (*write)(int fd, const void* data, std::size_t size);
  int (*fsync)(int fd);
  int (*close)(int fd);
  int (*rename)(const char* from, const char* to);
};

/// The POSIX calls.
const FileCalls& posix_file_calls();

/// Makes the helpers use `calls` instead of the POSIX calls until destroyed,
/// then the calls in use before. For tests; not thread-safe.
class ScopedFileCalls {
 public:
  explicit ScopedFileCalls(const FileCalls& calls);
  ~ScopedFileCalls();
  ScopedFileCalls(const ScopedFileCalls&) = delete;
  ScopedFileCalls& operator=(const ScopedFileCalls&) = delete;

 private:
  const FileCalls* previous_;
};

}  // namespace detail
}  // namespace attnkit::base
