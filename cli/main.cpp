// attnkit: command-line front end of the library. The paper-specific
// experiments have a tool of their own, attnkit-experiments (experiments/).
#include <CLI/CLI.hpp>

#include "app.h"
#include "commands.h"
#include "launch.h"

int main(int argc, char** argv) {
  attnkit::cli::prepare_process();
  // Flags renamed by the naming pass (CHANGELOG.md); the old names still work.
  const auto args = attnkit::cli::with_renamed_flags(argc, argv,
                                                     {{"train", "--length", "--copy-length"},
                                                      {"bench", "--dim", "--head-dim"},
                                                      {"bench-dense", "--embed", "--width"}},
                                                     "attnkit");
  attnkit::cli::set_command_line(args);  // `train --nproc` repeats it for its workers
  CLI::App app{"attnkit: fast CPU attention mechanisms (full softmax, clustered, agglomerative, "
               "linear, sparse) with forward and backward passes"};
  attnkit::cli::add_version_flag(app, "attnkit");
  app.require_subcommand(1);
  attnkit::cli::add_bench_command(app);
  attnkit::cli::add_bench_dense_command(app);
  attnkit::cli::add_mechanisms_command(app);
  attnkit::cli::add_bench_lookup_command(app);
  attnkit::cli::add_data_command(app);
  attnkit::cli::add_train_command(app);
  attnkit::cli::add_eval_command(app);
  attnkit::cli::add_generate_command(app);
  attnkit::cli::add_bench_model_command(app);
  return attnkit::cli::run(app, "attnkit", args);
}
