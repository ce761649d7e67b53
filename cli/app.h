// What every attnkit command-line program shares around its subcommands: the
// process settings it runs under and the way it reports errors. The product
// tool (cli/main.cpp) and attnkit-experiments (experiments/cli/main.cpp) both
// use it, so that both behave the same under memory pressure, file-size limits
// and bad input.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace attnkit::cli {

/// Sets the process up for long tensor work: freed memory stays in the heap
/// for reuse (unless GLIBC_TUNABLES sets malloc itself) and a write past a
/// file-size limit fails with EFBIG instead of killing the process.
void prepare_process();

/// `app`'s --version flag: "NAME VERSION" and the kernels' ISA level.
void add_version_flag(CLI::App& app, const std::string& name);

/// A flag of `subcommand` that was renamed: `old_name` is still accepted, means
/// `new_name` and is not listed by --help.
struct RenamedFlag {
  const char* subcommand;
  const char* old_name;
  const char* new_name;
};

/// `argv` with every old name of `renamed` replaced by its new one (also in
/// the --old=value form) where it follows its subcommand; prints one line to
/// stderr, prefixed with `name`, per old name replaced. The one place where
/// the programs' old flag names are read.
std::vector<std::string> with_renamed_flags(int argc, char** argv, const std::vector<RenamedFlag>& renamed,
                                            const std::string& name);

/// Parses and runs `app`; returns the process's exit status. An error that
/// escapes a subcommand is printed once, prefixed with `name`, without a
/// backtrace.
int run(CLI::App& app, const std::string& name, int argc, char** argv);
/// The same with the arguments as strings (argv[0] first).
int run(CLI::App& app, const std::string& name, const std::vector<std::string>& args);

}  // namespace attnkit::cli
