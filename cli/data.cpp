// `attnkit data char-lm --input FILE... --out DIR [--force]`: raw text to the
// text8 convention (lowercase a-z and single spaces; the rules are in
// attnkit/tasks/char_lm.h), split 90/5/5 into DIR/train.txt, valid.txt and
// test.txt, with DIR/meta.json describing what was done.
#include <attnkit/tasks/char_lm.h>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"

namespace attnkit::cli {

namespace {

struct CharLmConfig {
  std::vector<std::string> inputs;
  std::string out;
  bool force = false;
};

void run_char_lm(const CharLmConfig& config) {
  const auto report = tasks::prepare_char_lm(config.inputs, config.out, config.force);
  const auto& c = report.counts;
  const auto total = report.train + report.valid + report.test;
  std::cout << "data char-lm: " << report.inputs.size() << " input file"
            << (report.inputs.size() == 1 ? "" : "s") << ", " << report.input_bytes
            << " bytes -> " << total << " characters (a-z and space)\n"
            << "  input characters: " << c.kept << " kept (a-z), " << c.mapped
            << " mapped (A-Z, accented letters, digits spelled out), " << c.dropped
            << " dropped (everything else; each run became at most one space)";
  if (c.non_ascii_dropped > 0) std::cout << ", " << c.non_ascii_dropped << " of them non-ASCII";
  if (c.latin1_bytes > 0) std::cout << "; " << c.latin1_bytes << " bytes were not UTF-8 and read as Latin-1";
  std::cout << "\n  " << report.out_dir << "/train.txt " << report.train << ", valid.txt "
            << report.valid << ", test.txt " << report.test << " characters; meta.json\n";
}

}  // namespace

void add_data_command(CLI::App& app) {
  auto* data = app.add_subcommand("data", "Prepare the data of a task (see `attnkit data char-lm --help`)");
  data->require_subcommand(1);
  auto config = std::make_shared<CharLmConfig>();
  auto* char_lm = data->add_subcommand(
      "char-lm",
      "Raw text to the text8 convention (lowercase a-z and single spaces: A-Z lowercased, accented "
      "Latin letters folded, digits spelled out, every other run of characters one space), split "
      "90/5/5 into DIR/train.txt, valid.txt, test.txt plus DIR/meta.json");
  char_lm->add_option("--input", config->inputs, "Text files (UTF-8 or Latin-1), joined in order")
      ->required()
      ->expected(1, -1);
  char_lm->add_option("--out", config->out, "Output directory (created if missing)")->required();
  char_lm->add_flag("--force", config->force, "Overwrite the data already in the output directory");
  char_lm->callback([config] { run_char_lm(*config); });
}

}  // namespace attnkit::cli
