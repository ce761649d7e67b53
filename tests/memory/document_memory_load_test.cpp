// DocumentMemory::load on paths that are not memory files (issue 15: a
// directory gave a bare std::exception naming no file).
#include <attnkit/document_memory.h>

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace attnkit::document_memory_load_test {
namespace {

std::string load_error(const std::string& path) {
  try {
    DocumentMemory::load(path);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a c10::Error: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "load('" << path << "') did not throw";
  return "";
}

TEST(DocumentMemoryLoad, DirectoryIsAClearErrorNamingThePath) {
  std::string pattern = ::testing::TempDir() + "attnkit_load_dir_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::string msg = load_error(pattern);
  ::rmdir(pattern.c_str());
  EXPECT_NE(msg.find("DocumentMemory::load"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'" + pattern + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("is a directory"), std::string::npos) << msg;
}

TEST(DocumentMemoryLoad, MissingFileNamesThePathAndTheReason) {
  const std::string path = ::testing::TempDir() + "attnkit_no_such_dir/none.mem";
  const std::string msg = load_error(path);
  EXPECT_NE(msg.find("DocumentMemory::load: cannot open '" + path + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
}

// A FIFO used to block load() forever (in open(), waiting for a writer); a
// device such as /dev/zero would read without end. Both are refused at once.
TEST(DocumentMemoryLoad, FifoAndDeviceAreRefusedWithoutBlocking) {
  std::string dir = ::testing::TempDir() + "attnkit_load_fifo_XXXXXX";
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  const std::string fifo = dir + "/memory.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string msg = load_error(fifo);
  ::unlink(fifo.c_str());
  ::rmdir(dir.c_str());
  EXPECT_NE(msg.find("'" + fifo + "' is not a regular file"), std::string::npos) << msg;

  const std::string device = load_error("/dev/zero");
  EXPECT_NE(device.find("'/dev/zero' is not a regular file"), std::string::npos) << device;
}

}  // namespace
}  // namespace attnkit::document_memory_load_test
