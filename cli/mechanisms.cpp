// `attnkit mechanisms`: the registry's table (nn/registry.h): every mechanism's
// name, what it supports, and its options with type, range and default.
// `attnkit bench --list` prints the same table.
#include <attnkit/nn/registry.h>

#include <iostream>
#include <sstream>
#include <vector>

#include "commands.h"

namespace attnkit::cli {

std::string describe_mechanisms() {
  // The legend and each row's letters come from the registry's one list of
  // support fields, as attnkit.mechanisms()' JSON does.
  const auto& fields = nn::support_fields();
  std::ostringstream o;
  o << "Mechanisms (spec: NAME[:key=value,...]).\nsupports:";
  std::vector<std::string> items;
  for (const auto& field : fields)
    for (const auto& l : field.letters) items.push_back(std::string(1, l.letter) + " = " + l.meaning);
  size_t column = 9;
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string item = " " + items[i] + (i + 1 < items.size() ? "," : "");
    if (column + item.size() > 96) {
      o << "\n         ";
      column = 9;
    }
    o << item;
    column += item.size();
  }
  o << "\n\n";
  for (const auto& m : nn::mechanisms()) {
    std::string sup;
    for (const auto& field : fields) {
      const auto value = field.value(m.supports);
      char shown = '-';
      for (const auto& l : field.letters)
        if (l.value == value) shown = l.letter;
      sup += shown;
    }
    o << "  " << m.name << std::string(m.name.size() < 24 ? 24 - m.name.size() : 1, ' ') << sup
      << "  " << m.summary << "\n";
    for (const auto& opt : m.options)
      o << "      " << opt.key << "=" << opt.default_value << "  (" << opt.type_name() << ")  "
        << opt.help << "\n";
  }
  return o.str();
}

void add_mechanisms_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "mechanisms", "List the attention mechanisms: names, options with defaults, what each supports");
  cmd->callback([] { std::cout << describe_mechanisms(); });
}

}  // namespace attnkit::cli
