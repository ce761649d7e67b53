// DocumentMemory::load on paths that are not memory files (issue 15: a
// directory gave a bare std::exception naming no file).
#include <attnkit/document_memory.h>

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace attnkit {
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

}  // namespace
}  // namespace attnkit
