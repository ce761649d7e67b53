#include "base/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <set>
#include <stdexcept>
#include <system_error>

namespace attnkit::base {
namespace detail {

const FileCalls& posix_file_calls() {
  static const FileCalls calls{
      [](const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); },
      [](int fd, const void* data, std::size_t size) { return ::write(fd, data, size); },
      [](int fd) { return ::fsync(fd); },
      [](int fd) { return ::close(fd); },
      [](const char* from, const char* to) { return ::rename(from, to); },
  };
  return calls;
}

namespace {
const FileCalls* current_calls = nullptr;  // nullptr: the POSIX calls
}  // namespace

ScopedFileCalls::ScopedFileCalls(const FileCalls& calls) : previous_(current_calls) { current_calls = &calls; }
ScopedFileCalls::~ScopedFileCalls() { current_calls = previous_; }

}  // namespace detail

namespace {

const detail::FileCalls& calls() {
  return detail::current_calls ? *detail::current_calls : detail::posix_file_calls();
}

[[noreturn]] void fail(const std::string& step, const std::string& file, int error) {
  throw std::system_error(error, std::generic_category(), "cannot " + step + " '" + file + "'");
}

std::string directory_of(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

/// Creates the temporary file of `path`: ".<name>.tmp-<pid>" beside it (a
/// training run's directory removes stale ones of checkpoints by that name),
/// or ".<name>.tmp-<pid>-<n>" when that exists (a leftover of a crashed
/// process with the same pid, or a second writer in this one).
int create_temporary(const std::string& path, std::string& name) {
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string base = dir + "." + path.substr(slash == std::string::npos ? 0 : slash + 1) + ".tmp-" +
                           std::to_string(::getpid());
  for (int attempt = 0; attempt < 100; ++attempt) {
    name = attempt == 0 ? base : base + "-" + std::to_string(attempt);
    const int fd = calls().open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) return fd;
    if (errno != EEXIST) fail("create a temporary file for", path, errno);
  }
  fail("create a temporary file for", path, EEXIST);
}

}  // namespace

void fsync_directory(const std::string& dir) {
  const int fd = calls().open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
  if (fd < 0) fail("open the directory", dir, errno);
  if (calls().fsync(fd) != 0) {
    const int error = errno;
    calls().close(fd);
    fail("fsync the directory", dir, error);
  }
  calls().close(fd);
}

struct DurableFiles::File {
  std::string path, temp;
  int fd = -1;
  bool renamed = false;
  std::string pending;  // written bytes not yet handed to write(2)

  /// Hands `pending` to the system.
  void flush() {
    for (std::size_t done = 0; done < pending.size();) {
      const ssize_t n = calls().write(fd, pending.data() + done, pending.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("write", temp, errno);
      done += static_cast<std::size_t>(n);
    }
    pending.clear();
  }
};

// Bytes are gathered up to this many before a write(2): callers such as a
// corpus writer append a few bytes at a time.
constexpr std::size_t kWriteChunk = std::size_t{1} << 20;

DurableFiles::DurableFiles() = default;

DurableFiles::~DurableFiles() {
  for (const auto& f : files_) {
    if (f->fd >= 0) calls().close(f->fd);
    if (!f->renamed) ::unlink(f->temp.c_str());
  }
}

std::size_t DurableFiles::open(const std::string& path) {
  auto file = std::make_unique<File>();
  file->path = path;
  file->fd = create_temporary(path, file->temp);
  files_.push_back(std::move(file));
  return files_.size() - 1;
}

void DurableFiles::write(std::size_t index, std::string_view bytes) {
  File& f = *files_.at(index);
  if (f.fd < 0) throw std::logic_error("DurableFiles::write: '" + f.path + "' was already committed");
  f.pending.append(bytes);
  if (f.pending.size() >= kWriteChunk) f.flush();
}

void DurableFiles::commit() {
  for (const auto& f : files_) {
    if (f->fd < 0) continue;
    f->flush();
    if (calls().fsync(f->fd) != 0) fail("fsync", f->temp, errno);
    // close() may report a deferred write error (NFS); the descriptor is
    // released either way.
    const int fd = f->fd;
    f->fd = -1;
    if (calls().close(fd) != 0) fail("close", f->temp, errno);
  }
  std::set<std::string> directories;
  for (const auto& f : files_) {
    if (f->renamed) continue;
    if (calls().rename(f->temp.c_str(), f->path.c_str()) != 0) fail("rename '" + f->temp + "' to", f->path, errno);
    f->renamed = true;
    directories.insert(directory_of(f->path));
  }
  for (const auto& dir : directories) fsync_directory(dir);
}

void write_file_durably(const std::string& path, std::string_view bytes) {
  DurableFiles files;
  files.write(files.open(path), bytes);
  files.commit();
}

}  // namespace attnkit::base
