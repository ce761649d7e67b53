// attnkit-experiments: the papers' experiments on top of the library (figures,
// approximation reports, the cloze reader, node classification, the zoo's
// translator). The product's commands are in `attnkit`; experiments/reproduce
// runs whole experiments with both tools.
#include <CLI/CLI.hpp>

#include "app.h"
#include "commands.h"

int main(int argc, char** argv) {
  attnkit::cli::prepare_process();
  // Flags renamed by the naming pass (CHANGELOG.md); the old names still work.
  // node-classify's --attention input|input+random (now --structure) is
  // translated by node-classify itself, as it depends on the value.
  const auto args = attnkit::cli::with_renamed_flags(argc, argv,
                                                     {{"figure-clustered", "--dim", "--head-dim"},
                                                      {"approx", "--dim", "--head-dim"},
                                                      {"figure-agglomerative", "--d-model", "--width"}},
                                                     "attnkit-experiments");
  CLI::App app{"attnkit-experiments: the experiments of the papers attnkit implements (figures, "
               "approximation error, a cloze reader, node classification, a translator with the classic zoo's "
               "scores)"};
  attnkit::cli::add_version_flag(app, "attnkit-experiments");
  app.require_subcommand(1);
  attnkit::cli::add_figure_agglomerative_command(app);
  attnkit::cli::add_figure_clustered_command(app);
  attnkit::cli::add_approx_command(app);
  attnkit::cli::add_cloze_command(app);
  attnkit::cli::add_node_classify_command(app);
  attnkit::cli::add_translate_command(app);
  return attnkit::cli::run(app, "attnkit-experiments", args);
}
