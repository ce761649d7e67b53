// The files of a prepared char-lm directory, which prepare_char_lm (corpus.cpp)
// writes and CharLm (char_lm.cpp) reads.
#pragma once

namespace attnkit::tasks {

/// The splits' files in a prepared directory: train, valid, test.
inline constexpr const char* kSplitFiles[3] = {"train.txt", "valid.txt", "test.txt"};

}  // namespace attnkit::tasks
