// attnkit: command-line front end of the library.
#include <attnkit/runtime.h>

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <malloc.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "commands.h"
#include "launch.h"

namespace {

/// glibc maps every allocation above its mmap threshold afresh and unmaps it
/// on free, and an aligned allocation (torch's tensors: 64 bytes) never fits
/// the threshold glibc raises to a freed block's size. So each large tensor
/// of every step faulted its pages in again: 2048 page faults per 8 MiB
/// output, a measurable share of a sparse call's time (docs/PERFORMANCE.md,
/// "Why the kernels' constants"). The command line keeps freed memory in the
/// heap for reuse instead, as a caching allocator would: no block is mapped on its own
/// (M_MMAP_MAX 0), and free memory at the heap's top goes back to the system
/// only beyond 1 GiB. The process's resident size then stays near its peak.
/// A user's GLIBC_TUNABLES malloc settings win.
void keep_freed_memory() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables && std::strstr(tunables, "glibc.malloc.")) return;
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace

int main(int argc, char** argv) {
  keep_freed_memory();
  // Under a file-size limit (ulimit -f) the write that crosses it raises
  // SIGXFSZ, whose default action kills the process in the middle of a
  // checkpoint and leaves its temporary file behind. Ignored, the write fails
  // with EFBIG instead, which the writers report (naming the file) after
  // removing the temporary file; the previous checkpoint stays intact.
  std::signal(SIGXFSZ, SIG_IGN);
  attnkit::cli::set_command_line(argc, argv);  // `train --nproc` repeats it for its workers
  CLI::App app{"attnkit: fast CPU attention mechanisms (full softmax, clustered, agglomerative, "
               "linear, sparse) with forward and backward passes"};
  // The second line names the kernels' ISA level (runtime.h: isa_description).
  app.set_version_flag("--version", std::function<std::string()>([] {
    std::string isa;
    try {
      isa = attnkit::isa_description();
    } catch (const std::exception& e) {
      isa = std::string("none: ") + e.what();
    }
    return "attnkit " + attnkit::version() + "\nisa: " + isa;
  }));
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
