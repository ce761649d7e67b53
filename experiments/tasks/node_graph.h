// Node classification on one labelled graph (the SAC paper's Table 3 setting,
// transductive like Cora in GAT): every node has a binary bag-of-words feature
// vector and a class; the model sees the whole graph, and is trained on the
// labels of the train nodes, selected on the valid nodes, and scored on the
// test nodes.
//
// A dataset is a directory (`scripts/package-graph` writes one from the Debian
// package index):
//   nodes.tsv       one line per node: name TAB label TAB split TAB features,
//                   label a class index, split train|valid|test|none, features
//                   strictly increasing indices in [0, F) separated by spaces
//   edges.tsv       one line per undirected edge: i TAB j, 0 <= i < j < n, each
//                   pair once
//   vocabulary.txt  F lines, the word of each feature
//   meta.json       {"format": "attnkit-node-graph", "version": 1, "nodes": n,
//                   "edges": m, "features": F, "classes": [names], ...}
#pragma once

#include <attnkit/ops.h>
#include <attnkit/tasks/task.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace attnkit::experiments {

struct NodeGraph {
  std::string directory;
  std::vector<std::string> names;       ///< node names (package names), node order
  std::vector<std::string> classes;     ///< class names, label order
  std::vector<std::string> vocabulary;  ///< the word of each feature
  torch::Tensor features;               ///< float32 (n, F), 0 or 1
  torch::Tensor labels;                 ///< int64 (n), in [0, classes)
  /// int64 (n): 0 train, 1 valid, 2 test, 3 none (in no split).
  torch::Tensor split;
  /// The input graph as attention edges: every undirected edge in both
  /// directions, plus every node's self-edge (rows sorted, each column once).
  EdgeList edges;
  int64_t undirected_edges = 0;  ///< lines of edges.tsv

  int64_t nodes() const { return labels.numel(); }
  /// The nodes of `split`: float32 (n), 1 for the split's nodes, 0 elsewhere.
  torch::Tensor mask(tasks::Split split) const;
  /// Targets and weights for scoring logits (copies, n, classes) with
  /// tasks::loss / tasks::score / tasks::target_log_probs: target the labels
  /// and weight the mask of `split`, repeated `copies` times (input is left
  /// undefined: the model reads `features`).
  tasks::Batch batch(tasks::Split split, int64_t copies = 1) const;
};

/// Loads and checks a dataset directory: every line of every file is checked
/// (column counts, integer syntax, ranges, sorted features, i < j, duplicate
/// edges, counts against meta.json), and an error names the file, the line and
/// what is wrong.
NodeGraph load_node_graph(const std::string& directory);

}  // namespace attnkit::experiments
