// Subcommands of attnkit-experiments, one file each, named after the
// subcommand (`node-classify` in node_classify.cpp): the papers' experiments
// that are not part of the product. Each registers its options on the app and
// runs when selected; timing and JSON helpers are the product tool's
// (cli/bench_util.h), run-directory helpers are in run_util.h.
#pragma once

#include <CLI/CLI.hpp>

namespace attnkit::cli {

/// `attnkit-experiments figure-agglomerative`: the agglomerative-attention
/// paper, Figure 1 (layer time vs length).
void add_figure_agglomerative_command(CLI::App& app);

/// `attnkit-experiments figure-clustered`: the clustered-attention paper,
/// Figure 4 (time, memory per element vs L) for any mechanisms of the registry.
void add_figure_clustered_command(CLI::App& app);

/// `attnkit-experiments approx`: how far mechanisms of the registry (clustered
/// and improved-clustered by default) are from full attention.
void add_approx_command(CLI::App& app);

/// `attnkit-experiments cloze`: a recurrent reader with one of the
/// cheap-linear-attention paper's read-outs (none, linear, gated, softmax)
/// trained on cloze questions.
void add_cloze_command(CLI::App& app);

/// `attnkit-experiments node-classify`: a graph attention network (input
/// edges, full, random extra edges or SAC's learned edges) on a
/// node-classification dataset.
void add_node_classify_command(CLI::App& app);

/// `attnkit-experiments translate`: a recurrent encoder-decoder with one score
/// function of the classic zoo (or none) on a bilingual dictionary's pairs.
void add_translate_command(CLI::App& app);

}  // namespace attnkit::cli
