#include "app.h"

#include <attnkit/runtime.h>

#include <c10/util/Exception.h>

#include <malloc.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>

namespace attnkit::cli {
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

void prepare_process() {
  keep_freed_memory();
  // Under a file-size limit (ulimit -f) the write that crosses it raises
  // SIGXFSZ, whose default action kills the process in the middle of a
  // checkpoint and leaves its temporary file behind. Ignored, the write fails
  // with EFBIG instead, which the writers report (naming the file) after
  // removing the temporary file; the previous checkpoint stays intact.
  std::signal(SIGXFSZ, SIG_IGN);
}

void add_version_flag(CLI::App& app, const std::string& name) {
  // The second line names the kernels' ISA level (runtime.h: isa_description).
  app.set_version_flag("--version", std::function<std::string()>([name] {
    std::string isa;
    try {
      isa = isa_description();
    } catch (const std::exception& e) {
      isa = std::string("none: ") + e.what();
    }
    return name + " " + version() + "\nisa: " + isa;
  }));
}

std::vector<std::string> with_renamed_flags(int argc, char** argv, const std::vector<RenamedFlag>& renamed,
                                            const std::string& name) {
  std::vector<std::string> args(argv, argv + argc);
  std::string subcommand;  // the first argument that is not an option
  for (size_t i = 1; i < args.size(); ++i) {
    auto& arg = args[i];
    if (subcommand.empty()) {
      if (arg.rfind("-", 0) != 0) subcommand = arg;
      continue;
    }
    if (arg == "--") break;
    for (const auto& r : renamed) {
      const std::string old_name = r.old_name;
      if (subcommand != r.subcommand) continue;
      if (arg != old_name && arg.rfind(old_name + "=", 0) != 0) continue;
      arg = r.new_name + arg.substr(old_name.size());
      std::cerr << name << " " << subcommand << ": " << old_name << " is deprecated, use " << r.new_name
                << " (same meaning)\n";
      break;
    }
  }
  return args;
}

int run(CLI::App& app, const std::string& name, const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  return run(app, name, static_cast<int>(argv.size()), argv.data());
}

int run(CLI::App& app, const std::string& name, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const c10::Error& e) {
    std::cerr << name << ": " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace attnkit::cli
