// Subcommands of the `attnkit` command-line tool, one file each, named after
// the subcommand (`bench-lookup` in bench_lookup.cpp). Each registers its
// options on the app and runs when selected; what several share is in
// bench_util.h.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace attnkit::cli {

/// `attnkit bench`: times mechanisms over lengths, prints a table, writes JSON.
void add_bench_command(CLI::App& app);

/// `attnkit mechanisms`: the registry's table.
void add_mechanisms_command(CLI::App& app);
/// The registry's table as `attnkit mechanisms` and `attnkit bench --list`
/// print it: names, what each supports, options with type, range and default.
std::string describe_mechanisms();

/// `attnkit bench-dense`: the dense layer vs the sgemm peak and libtorch.
void add_bench_dense_command(CLI::App& app);

/// `attnkit bench-lookup`: softmax lookups over stored states vs DocumentMemory lookups.
void add_bench_lookup_command(CLI::App& app);

/// `attnkit data char-lm`: raw text to the char-lm task's train/valid/test files.
void add_data_command(CLI::App& app);

/// `attnkit bench-model`: a Transformer's training step (MFU, libtorch
/// baseline), token-by-token generation and a training step's peak memory.
void add_bench_model_command(CLI::App& app);

/// `attnkit train`: trains a transformer on a task into a run directory (docs/TRAINING.md).
void add_train_command(CLI::App& app);

/// `attnkit eval`: a trained run's metric, optionally with another mechanism swapped in.
void add_eval_command(CLI::App& app);

/// `attnkit generate`: continues a prompt with a trained language model.
void add_generate_command(CLI::App& app);

}  // namespace attnkit::cli
