// The one wording of a checkpoint file that is refused (checkpoint.cpp
// defines it; the readers of checkpoint.cpp and run_directory.cpp use it).
#pragma once

#include <string>

namespace attnkit::train {

/// Throws std::runtime_error("checkpoint '<what>' refused: <problem>").
[[noreturn]] void refuse_checkpoint(const std::string& what, const std::string& problem);

}  // namespace attnkit::train
