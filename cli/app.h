// What every attnkit command-line program shares around its subcommands: the
// process settings it runs under and the way it reports errors. The product
// tool (cli/main.cpp) and attnkit-experiments (experiments/cli/main.cpp) both
// use it, so that both behave the same under memory pressure, file-size limits
// and bad input.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace attnkit::cli {

/// Sets the process up for long tensor work: freed memory stays in the heap
/// for reuse (unless GLIBC_TUNABLES sets malloc itself) and a write past a
/// file-size limit fails with EFBIG instead of killing the process.
void prepare_process();

/// `app`'s --version flag: "NAME VERSION" and the kernels' ISA level.
void add_version_flag(CLI::App& app, const std::string& name);

/// Parses and runs `app`; returns the process's exit status. An error that
/// escapes a subcommand is printed once, prefixed with `name`, without a
/// backtrace.
int run(CLI::App& app, const std::string& name, int argc, char** argv);

}  // namespace attnkit::cli
