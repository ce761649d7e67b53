// attnkit: command-line front end of the library.
#include <attnkit/runtime.h>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <csignal>
#include <iostream>

#include "commands.h"
#include "launch.h"

int main(int argc, char** argv) {
  // Under a file-size limit (ulimit -f) the write that crosses it raises
  // SIGXFSZ, whose default action kills the process in the middle of a
  // checkpoint and leaves its temporary file behind. Ignored, the write fails
  // with EFBIG instead, which the writers report (naming the file) after
  // removing the temporary file; the previous checkpoint stays intact.
  std::signal(SIGXFSZ, SIG_IGN);
  attnkit::cli::set_command_line(argc, argv);  // `train --nproc` repeats it for its workers
  CLI::App app{"attnkit: fast CPU attention mechanisms (full softmax, clustered, agglomerative, "
               "linear, sparse) with forward and backward passes"};
  app.set_version_flag("--version", "attnkit " + attnkit::version());
  app.require_subcommand(1);
  attnkit::cli::add_bench_command(app);
  attnkit::cli::add_bench_dense_command(app);
  attnkit::cli::add_mechanisms_command(app);
  attnkit::cli::add_figure_agglomerative_command(app);
  attnkit::cli::add_figure_clustered_command(app);
  attnkit::cli::add_approx_command(app);
  attnkit::cli::add_bench_lookup_command(app);
  attnkit::cli::add_data_command(app);
  attnkit::cli::add_train_command(app);
  attnkit::cli::add_eval_command(app);
  attnkit::cli::add_generate_command(app);
  attnkit::cli::add_bench_model_command(app);
  attnkit::cli::add_cloze_command(app);
  attnkit::cli::add_node_classify_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const c10::Error& e) {
    std::cerr << "attnkit: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "attnkit: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
