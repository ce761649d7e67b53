// `attnkit mechanisms`: the registry's table (nn/registry.h): every mechanism's
// name, what it supports, and its options with type, range and default.
// `attnkit bench --list` prints the same table.
#include <attnkit/nn/registry.h>

#include <iostream>
#include <sstream>

#include "commands.h"

namespace attnkit::cli {

std::string describe_mechanisms() {
  std::ostringstream o;
  o << "Mechanisms (spec: NAME[:key=value,...]).\n"
    << "supports: c = causal flag, p = key_lengths (padding), x = L != S, m = M != E,\n"
    << "          d = incremental decoding state, g = grouped-query heads (k, v with fewer heads),\n"
    << "          a = ALiBi slopes, R = rotary positions inside the kernel,\n"
    << "          r = rotary positions on q and k before the call\n\n";
  for (const auto& m : nn::mechanisms()) {
    const auto& s = m.supports;
    std::string sup;
    sup += s.causal ? 'c' : '-';
    sup += s.key_lengths ? 'p' : '-';
    sup += s.cross ? 'x' : '-';
    sup += s.value_dim ? 'm' : '-';
    sup += s.decoding_state ? 'd' : '-';
    sup += s.grouped_heads ? 'g' : '-';
    sup += s.alibi ? 'a' : '-';
    sup += s.rotary == nn::RotarySupport::kernel ? 'R' : s.rotary == nn::RotarySupport::inputs ? 'r' : '-';
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
