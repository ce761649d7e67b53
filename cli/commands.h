// Subcommands of the `attnkit` command-line tool. Each registers its options on
// the app and runs when selected.
#pragma once

#include <CLI/CLI.hpp>

namespace attnkit::cli {

/// `attnkit bench`: times mechanisms over lengths, prints a table, writes JSON.
void add_bench_command(CLI::App& app);

}  // namespace attnkit::cli
