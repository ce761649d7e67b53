// Shared by the training tests: scratch directories and the char-lm data of the shipped text.
#pragma once

#include <attnkit/tasks/char_lm.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace attnkit::testing {

/// An empty directory under the system's temporary directory, unique to this
/// process and `name`.
inline std::string fresh_dir(const std::string& name) {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("attnkit_train_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

/// A char-lm data directory made once per process by tasks::prepare_char_lm
/// from the shipped text (tests/data/genesis-1-2.txt, 7 kB: Genesis 1-2, KJV).
inline const std::string& char_lm_data() {
  static const std::string dir = [] {
    const auto d = fresh_dir("char_lm_data");
    tasks::prepare_char_lm({std::string(ATTNKIT_TEST_DATA_DIR) + "/genesis-1-2.txt"}, d);
    return d;
  }();
  return dir;
}

}  // namespace attnkit::testing
