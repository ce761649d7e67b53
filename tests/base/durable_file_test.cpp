// base::write_file_durably and DurableFiles (src/base/durable_file.h): the
// content written, and after a failure of each system call in turn, the
// target's old content or its new one, never anything else, and no
// temporary file left behind.
#include "base/durable_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace attnkit::base::durable_file_test {
namespace {

namespace fs = std::filesystem;

/// A fresh empty directory, removed with its contents at the end.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "attnkit-durable-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  std::string file(const std::string& name) const { return (fs::path(path_) / name).string(); }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path().filename().string());
    return out;
  }

 private:
  std::string path_;
};

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void put(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// The calls, with the k-th call of one kind failing with EIO (k counts from 1;
// 0: none fails). Plain function pointers, hence the globals.
enum class Step { open_temp, write, fsync_file, close_file, rename, open_dir, fsync_dir };
const char* name(Step s) {
  switch (s) {
    case Step::open_temp: return "open_temp";
    case Step::write: return "write";
    case Step::fsync_file: return "fsync_file";
    case Step::close_file: return "close_file";
    case Step::rename: return "rename";
    case Step::open_dir: return "open_dir";
    case Step::fsync_dir: return "fsync_dir";
  }
  return "?";
}

Step failing = Step::open_temp;
int fail_at = 0;  // the failing step's occurrence; 0: nothing fails
int seen = 0;     // occurrences of the failing step so far
int open_fds_dirs = 0;

bool should_fail(Step s) { return fail_at > 0 && s == failing && ++seen == fail_at; }

bool is_dir_open(int flags) { return (flags & O_DIRECTORY) != 0; }

const detail::FileCalls& failing_calls() {
  static const detail::FileCalls calls{
      [](const char* path, int flags, mode_t mode) -> int {
        if (should_fail(is_dir_open(flags) ? Step::open_dir : Step::open_temp)) return errno = EIO, -1;
        const int fd = detail::posix_file_calls().open(path, flags, mode);
        if (fd >= 0 && is_dir_open(flags)) open_fds_dirs = fd;
        return fd;
      },
      [](int fd, const void* data, std::size_t size) -> ssize_t {
        if (should_fail(Step::write)) return errno = EIO, -1;
        // Short writes: at most 3 bytes a call, so that the loop is exercised.
        return detail::posix_file_calls().write(fd, data, size < 3 ? size : 3);
      },
      [](int fd) -> int {
        if (should_fail(fd == open_fds_dirs ? Step::fsync_dir : Step::fsync_file)) return errno = EIO, -1;
        return detail::posix_file_calls().fsync(fd);
      },
      [](int fd) -> int {
        const bool dir = fd == open_fds_dirs;
        const int rc = detail::posix_file_calls().close(fd);  // released even when reported failed
        if (dir) open_fds_dirs = -1;
        if (!dir && should_fail(Step::close_file)) return errno = EIO, -1;
        return rc;
      },
      [](const char* from, const char* to) -> int {
        if (should_fail(Step::rename)) return errno = EIO, -1;
        return detail::posix_file_calls().rename(from, to);
      },
  };
  return calls;
}

void arm(Step s, int occurrence) {
  failing = s, fail_at = occurrence, seen = 0, open_fds_dirs = -1;
}

TEST(DurableFile, WritesNewAndReplacesOldContentLeavingNoTemporary) {
  TempDir dir;
  const std::string path = dir.file("result.json");
  write_file_durably(path, "first");
  EXPECT_EQ(read(path), "first");
  write_file_durably(path, std::string(100000, 'x'));
  EXPECT_EQ(read(path), std::string(100000, 'x'));
  write_file_durably(path, "");
  EXPECT_EQ(read(path), "");
  EXPECT_EQ(dir.names(), std::vector<std::string>{"result.json"});
}

TEST(DurableFile, ShortWritesAreContinued) {
  TempDir dir;
  const std::string path = dir.file("a");
  detail::ScopedFileCalls scoped(failing_calls());
  arm(Step::write, 0);
  write_file_durably(path, "0123456789abcdef");
  EXPECT_EQ(read(path), "0123456789abcdef");
}

// A failure at each step leaves the old content before the rename and the new
// one after it (the directory's fsync failing), the temporary file removed,
// and an error that names the step and the file.
TEST(DurableFile, FailureAtEachStepLeavesOldOrNewContent) {
  const struct {
    Step step;
    const char* message;  // a part of what()
    bool renamed;
  } cases[] = {
      {Step::open_temp, "cannot create a temporary file for", false},
      {Step::write, "cannot write", false},
      {Step::fsync_file, "cannot fsync", false},
      {Step::close_file, "cannot close", false},
      {Step::rename, "cannot rename", false},
      {Step::open_dir, "cannot open the directory", true},
      {Step::fsync_dir, "cannot fsync the directory", true},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(name(c.step));
    TempDir dir;
    const std::string path = dir.file("state.bin");
    put(path, "old content");
    detail::ScopedFileCalls scoped(failing_calls());
    arm(c.step, 1);
    try {
      write_file_durably(path, "new content");
      ADD_FAILURE() << "no error";
    } catch (const std::system_error& e) {
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("Input/output error"), std::string::npos) << e.what();
      EXPECT_EQ(e.code().value(), EIO);
    }
    EXPECT_EQ(seen, 1) << "the step was never reached";
    EXPECT_EQ(read(path), c.renamed ? "new content" : "old content");
    EXPECT_EQ(dir.names(), std::vector<std::string>{"state.bin"});
  }
}

// Without an old file, a failure before the rename leaves no file at all.
TEST(DurableFile, FailureBeforeTheRenameLeavesAnAbsentFileAbsent) {
  TempDir dir;
  const std::string path = dir.file("new.bin");
  detail::ScopedFileCalls scoped(failing_calls());
  arm(Step::fsync_file, 1);
  EXPECT_THROW(write_file_durably(path, "content"), std::system_error);
  EXPECT_TRUE(dir.names().empty());
}

TEST(DurableFile, TemporaryNameBesideTheTargetAndUniqueWhenTaken) {
  TempDir dir;
  const std::string path = dir.file("checkpoint-00000004.ckpt");
  // A leftover of a crashed process that had this pid.
  const std::string leftover = dir.file(".checkpoint-00000004.ckpt.tmp-" + std::to_string(::getpid()));
  put(leftover, "stale");
  DurableFiles files;
  files.write(files.open(path), "new");
  auto names = dir.names();
  std::sort(names.begin(), names.end());
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[1], ".checkpoint-00000004.ckpt.tmp-" + std::to_string(::getpid()) + "-1");
  files.commit();
  EXPECT_EQ(read(path), "new");
  EXPECT_EQ(read(leftover), "stale");  // not ours to remove
}

TEST(DurableFiles, SeveralFilesCommitTogether) {
  TempDir dir;
  const std::string a = dir.file("a.txt"), b = dir.file("b.txt");
  put(a, "old a");
  put(b, "old b");
  {
    // Each file fsynced before any is renamed: a failing fsync of the second
    // leaves both old.
    detail::ScopedFileCalls scoped(failing_calls());
    arm(Step::fsync_file, 2);
    DurableFiles files;
    files.write(files.open(a), "new a");
    files.write(files.open(b), "new b");
    EXPECT_THROW(files.commit(), std::system_error);
  }
  EXPECT_EQ(read(a), "old a");
  EXPECT_EQ(read(b), "old b");
  EXPECT_EQ(dir.names().size(), 2u);
  {
    DurableFiles files;
    const std::size_t ia = files.open(a), ib = files.open(b);
    files.write(ib, "new ");
    files.write(ia, "new a");
    files.write(ib, "b");
    files.commit();
    EXPECT_THROW(files.write(ia, "late"), std::logic_error);
  }
  EXPECT_EQ(read(a), "new a");
  EXPECT_EQ(read(b), "new b");
  EXPECT_EQ(dir.names().size(), 2u);
}

TEST(DurableFiles, UncommittedFilesAreRemovedAndTargetsKept) {
  TempDir dir;
  const std::string a = dir.file("a.txt");
  put(a, "old a");
  {
    DurableFiles files;
    files.write(files.open(a), "new a");
    files.write(files.open(dir.file("b.txt")), "new b");
    EXPECT_EQ(dir.names().size(), 3u);
  }
  EXPECT_EQ(read(a), "old a");
  EXPECT_EQ(dir.names(), std::vector<std::string>{"a.txt"});
}

TEST(DurableFile, MissingDirectoryIsAClearError) {
  TempDir dir;
  const std::string path = dir.file("no-such-dir/out.json");
  try {
    write_file_durably(path, "x");
    ADD_FAILURE() << "no error";
  } catch (const std::system_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create a temporary file for '" + path + "'"), std::string::npos)
        << e.what();
    EXPECT_EQ(e.code().value(), ENOENT);
  }
}

}  // namespace
}  // namespace attnkit::base::durable_file_test
