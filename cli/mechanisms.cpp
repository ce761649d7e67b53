// `attnkit mechanisms`: the registry's table (nn/registry.h): every mechanism's
// name, its options with their defaults, and what it supports. `attnkit bench
// --list` prints the same table.
#include <attnkit/nn/registry.h>

#include <iostream>

#include "commands.h"

namespace attnkit::cli {

void add_mechanisms_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "mechanisms", "List the attention mechanisms: names, options with defaults, what each supports");
  cmd->callback([] { std::cout << nn::describe_mechanisms(); });
}

}  // namespace attnkit::cli
