// Node-classification datasets (experiments/tasks/node_graph.h): reading
// and checking the four files of a dataset directory.
#include "tasks/node_graph.h"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string_view>
#include <utility>

namespace attnkit::experiments {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kWhat = "node graph";

/// The lines of `path` (without their '\n'); a missing file is an error naming
/// what the dataset lacks.
std::vector<std::string> read_lines(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, kWhat, ": cannot read ", path.string(),
              " (a dataset directory holds nodes.tsv, edges.tsv, vocabulary.txt and meta.json; "
              "scripts/package-graph writes one)");
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(std::move(line));
  return lines;
}

std::vector<std::string_view> split_on(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t end = text.find(separator, start);
    parts.push_back(text.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

/// A decimal integer in [lo, hi), or an error naming the place.
int64_t parse_index(std::string_view text, int64_t lo, int64_t hi, const std::string& where,
                    const char* field) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  TORCH_CHECK(ec == std::errc() && end == text.data() + text.size() && !text.empty(), kWhat, ": ",
              where, ": ", field, " '", std::string(text), "' is not an integer");
  TORCH_CHECK(value >= lo && value < hi, kWhat, ": ", where, ": ", field, " ", value,
              " is outside [", lo, ", ", hi, ")");
  return value;
}

std::string place(const fs::path& path, size_t line) {
  return path.filename().string() + " line " + std::to_string(line + 1);
}

}  // namespace

torch::Tensor NodeGraph::mask(tasks::Split which) const {
  return split.eq(static_cast<int64_t>(which)).to(torch::kFloat32);
}

tasks::Batch NodeGraph::batch(tasks::Split which, int64_t copies) const {
  TORCH_CHECK(copies >= 1, kWhat, ": batch needs copies >= 1, got ", copies);
  tasks::Batch b;
  b.target = labels.unsqueeze(0).expand({copies, nodes()}).contiguous();
  b.weight = mask(which).unsqueeze(0).expand({copies, nodes()}).contiguous();
  return b;
}

NodeGraph load_node_graph(const std::string& directory) {
  const fs::path dir(directory);
  TORCH_CHECK(fs::is_directory(dir), kWhat, ": '", directory, "' is not a directory");
  NodeGraph graph;
  graph.directory = directory;

  // meta.json: the sizes every other file is checked against.
  const auto meta_path = dir / "meta.json";
  json meta;
  int64_t n = 0, F = 0, m = 0;
  {
    std::ifstream in(meta_path);
    TORCH_CHECK(in, kWhat, ": cannot read ", meta_path.string(),
                " (scripts/package-graph writes a dataset directory)");
    try {
      in >> meta;
      if (meta.value("format", "") != "attnkit-node-graph")
        throw std::runtime_error("\"format\" is not \"attnkit-node-graph\"");
      if (meta.value("version", 0) != 1)
        throw std::runtime_error("unsupported \"version\" " + meta.value("version", json(0)).dump() +
                                 " (this build reads version 1)");
      meta.at("classes").get_to(graph.classes);
      meta.at("nodes").get_to(n);
      meta.at("features").get_to(F);
      meta.at("edges").get_to(m);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, kWhat, ": ", meta_path.string(), ": ", e.what());
    }
  }
  const int64_t C = static_cast<int64_t>(graph.classes.size());
  TORCH_CHECK(n >= 1 && F >= 1 && C >= 2 && m >= 0, kWhat, ": ", meta_path.string(),
              ": needs at least 1 node, 1 feature and 2 classes; says ", n, ", ", F, ", ", C);

  graph.vocabulary = read_lines(dir / "vocabulary.txt");
  TORCH_CHECK(static_cast<int64_t>(graph.vocabulary.size()) == F, kWhat, ": vocabulary.txt has ",
              graph.vocabulary.size(), " words, meta.json says ", F, " features");

  // nodes.tsv
  const auto nodes_path = dir / "nodes.tsv";
  const auto node_lines = read_lines(nodes_path);
  TORCH_CHECK(static_cast<int64_t>(node_lines.size()) == n, kWhat, ": nodes.tsv has ", node_lines.size(),
              " lines, meta.json says ", n, " nodes");
  graph.features = torch::zeros({n, F}, torch::kFloat32);
  graph.labels = torch::empty({n}, torch::kInt64);
  graph.split = torch::empty({n}, torch::kInt64);
  float* features = graph.features.data_ptr<float>();
  int64_t* labels = graph.labels.data_ptr<int64_t>();
  int64_t* splits = graph.split.data_ptr<int64_t>();
  graph.names.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const auto where = place(nodes_path, i);
    const auto fields = split_on(node_lines[i], '\t');
    TORCH_CHECK(fields.size() == 4, kWhat, ": ", where, ": expected 4 tab-separated fields (name, label, "
                "split, features), got ", fields.size());
    TORCH_CHECK(!fields[0].empty(), kWhat, ": ", where, ": empty node name");
    graph.names.emplace_back(fields[0]);
    labels[i] = parse_index(fields[1], 0, C, where, "label");
    const std::string split_name(fields[2]);
    if (split_name == "none") {
      splits[i] = 3;
    } else {
      TORCH_CHECK(split_name == "train" || split_name == "valid" || split_name == "test", kWhat, ": ",
                  where, ": split '", split_name, "' is not one of train, valid, test, none");
      splits[i] = static_cast<int64_t>(tasks::split_from_string(split_name));
    }
    if (fields[3].empty()) continue;
    int64_t previous = -1;
    for (const auto word : split_on(fields[3], ' ')) {
      const int64_t f = parse_index(word, 0, F, where, "feature");
      TORCH_CHECK(f > previous, kWhat, ": ", where, ": features must be strictly increasing; ", previous,
                  " then ", f);
      features[i * F + f] = 1.0f;
      previous = f;
    }
  }

  // edges.tsv -> rows of both directions plus self-edges.
  const auto edges_path = dir / "edges.tsv";
  const auto edge_lines = read_lines(edges_path);
  TORCH_CHECK(static_cast<int64_t>(edge_lines.size()) == m, kWhat, ": edges.tsv has ", edge_lines.size(),
              " lines, meta.json says ", m, " edges");
  std::vector<std::vector<int64_t>> rows(n);
  for (int64_t i = 0; i < n; ++i) rows[i].push_back(i);
  std::map<std::pair<int64_t, int64_t>, size_t> line_of_edge;  // (i, j) -> its line, to name both lines of a repeat
  for (size_t e = 0; e < edge_lines.size(); ++e) {
    const auto where = place(edges_path, e);
    const auto fields = split_on(edge_lines[e], '\t');
    TORCH_CHECK(fields.size() == 2, kWhat, ": ", where, ": expected 2 tab-separated node indices, got ",
                fields.size(), " fields");
    const int64_t a = parse_index(fields[0], 0, n, where, "node");
    const int64_t b = parse_index(fields[1], 0, n, where, "node");
    TORCH_CHECK(a < b, kWhat, ": ", where, ": an edge is written once, smaller index first; got ", a, " ", b);
    const auto [first, added] = line_of_edge.emplace(std::make_pair(a, b), e);
    TORCH_CHECK(added, kWhat, ": ", where, ": the edge ", a, " ", b, " is listed twice (first on line ",
                first->second + 1, ")");
    rows[a].push_back(b);
    rows[b].push_back(a);
  }
  std::vector<int64_t> offsets{0}, columns;
  columns.reserve(n + 2 * m);
  for (int64_t i = 0; i < n; ++i) {
    auto& r = rows[i];
    std::sort(r.begin(), r.end());  // each column once: i < j and repeats were refused above
    columns.insert(columns.end(), r.begin(), r.end());
    offsets.push_back(static_cast<int64_t>(columns.size()));
  }
  graph.edges = {torch::tensor(offsets, torch::kInt64), torch::tensor(columns, torch::kInt64)};
  graph.undirected_edges = m;
  return graph;
}

}  // namespace attnkit::experiments
