// experiments::load_node_graph (experiments/tasks/node_graph.h): a small dataset
// written by hand into a temporary directory is read back field by field
// (features, labels, split, the attention edges with both directions and
// self-edges), NodeGraph::mask and batch, and every malformed input is refused
// with an error naming the file, the line and the problem.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include "tasks/node_graph.h"
#include "test_util.h"

namespace node_graph_test {

namespace fs = std::filesystem;
using attnkit::experiments::load_node_graph;
using attnkit::experiments::NodeGraph;
using attnkit::tasks::Split;
using attnkit::testing::edge_rows;
using attnkit::testing::expect_error;

namespace {

// A fresh directory for one test's files, removed afterwards.
using TempDir = attnkit::testing::ScratchDir;

// The files of a valid dataset: 5 nodes, 4 features, 3 classes, 4 edges.
// Tests replace one file's text to make it malformed.
std::map<std::string, std::string> valid_files() {
  return {
      {"nodes.tsv",
       "n0\t0\ttrain\t0 2\n"
       "n1\t1\tvalid\t1\n"
       "n2\t2\ttest\t\n"  // no features: the line ends with the tab
       "n3\t0\tnone\t0 1 2 3\n"
       "n4\t1\ttrain\t3\n"},
      {"edges.tsv",
       "0\t1\n"
       "0\t3\n"
       "1\t4\n"
       "2\t3\n"},
      {"vocabulary.txt", "alpha\nbeta\ngamma\ndelta\n"},
      {"meta.json",
       R"({"format": "attnkit-node-graph", "version": 1, "nodes": 5, "edges": 4, "features": 4,
           "classes": ["arcade", "board", "card"], "class_counts": [2, 2, 1]})"},
  };
}

void write_dataset(const fs::path& dir, const std::map<std::string, std::string>& files) {
  fs::create_directories(dir);
  for (const auto& [name, text] : files) std::ofstream(dir / name, std::ios::binary) << text;
}

TEST(NodeGraph, LoadsEveryField) {
  TempDir tmp;
  write_dataset(tmp.path(), valid_files());
  const NodeGraph g = load_node_graph(tmp.path().string());
  EXPECT_EQ(g.directory, tmp.path().string());
  EXPECT_EQ(g.nodes(), 5);
  EXPECT_EQ(g.names, (std::vector<std::string>{"n0", "n1", "n2", "n3", "n4"}));
  EXPECT_EQ(g.classes, (std::vector<std::string>{"arcade", "board", "card"}));
  EXPECT_EQ(g.vocabulary, (std::vector<std::string>{"alpha", "beta", "gamma", "delta"}));
  EXPECT_EQ(g.undirected_edges, 4);

  ASSERT_EQ(g.features.scalar_type(), torch::kFloat32);
  const auto features = torch::tensor({0.f, 0.f, 0.f, 0.f}).repeat({5, 1});
  features[0][0] = 1, features[0][2] = 1;
  features[1][1] = 1;
  features[3].fill_(1);
  features[4][3] = 1;
  EXPECT_TRUE(torch::equal(g.features, features)) << g.features;
  ASSERT_EQ(g.labels.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(g.labels, torch::tensor({0, 1, 2, 0, 1}, torch::kLong)));
  ASSERT_EQ(g.split.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(g.split, torch::tensor({0, 1, 2, 3, 0}, torch::kLong)));

  // Each undirected edge in both directions plus every self-edge, rows sorted.
  EXPECT_FALSE(g.edges.per_head());
  EXPECT_EQ(edge_rows(g.edges),
            (std::vector<std::vector<int64_t>>{{0, 1, 3}, {0, 1, 4}, {2, 3}, {0, 2, 3}, {1, 4}}));
  EXPECT_EQ(g.edges.num_edges(), 5 + 2 * 4);
  EXPECT_NO_THROW(attnkit::check_edge_list(g.edges, 5, 5, 1));
}

TEST(NodeGraph, MaskAndBatch) {
  TempDir tmp;
  write_dataset(tmp.path(), valid_files());
  const NodeGraph g = load_node_graph(tmp.path().string());
  const auto train = g.mask(Split::train), valid = g.mask(Split::valid), test = g.mask(Split::test);
  EXPECT_EQ(train.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(train, torch::tensor({1.f, 0.f, 0.f, 0.f, 1.f})));
  EXPECT_TRUE(torch::equal(valid, torch::tensor({0.f, 1.f, 0.f, 0.f, 0.f})));
  EXPECT_TRUE(torch::equal(test, torch::tensor({0.f, 0.f, 1.f, 0.f, 0.f})));
  // Node 3 ("none") is in no split.
  EXPECT_EQ((train + valid + test)[3].item<float>(), 0.f);

  const auto one = g.batch(Split::valid);
  EXPECT_FALSE(one.input.defined());
  EXPECT_TRUE(torch::equal(one.target, torch::tensor({{0, 1, 2, 0, 1}}, torch::kLong)));
  EXPECT_TRUE(torch::equal(one.weight, torch::tensor({{0.f, 1.f, 0.f, 0.f, 0.f}})));
  const auto three = g.batch(Split::train, 3);
  ASSERT_EQ(three.target.sizes(), (std::vector<int64_t>{3, 5}));
  ASSERT_EQ(three.weight.sizes(), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(three.weight.scalar_type(), torch::kFloat32);
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_TRUE(torch::equal(three.target[r], torch::tensor({0, 1, 2, 0, 1}, torch::kLong))) << r;
    EXPECT_TRUE(torch::equal(three.weight[r], torch::tensor({1.f, 0.f, 0.f, 0.f, 1.f}))) << r;
  }
  // Copies, not views of one row: writing one leaves the others.
  three.weight[0][1] = 5.f;
  EXPECT_EQ(three.weight[1][1].item<float>(), 0.f);
  EXPECT_EQ(g.mask(Split::train)[1].item<float>(), 0.f);
  expect_error([&] { g.batch(Split::train, 0); }, {"node graph", "copies >= 1", "0"});
}

// One malformed file: `file` gets `text`, the rest stay valid; loading must
// fail with every fragment in the message.
void expect_refused(const std::string& file, const std::string& text, const std::vector<std::string>& fragments) {
  SCOPED_TRACE(file + ": " + text);
  TempDir tmp;
  auto files = valid_files();
  files[file] = text;
  write_dataset(tmp.path(), files);
  expect_error([&] { load_node_graph(tmp.path().string()); }, fragments);
}

const std::string kMeta5 =  // meta.json of valid_files() with 5 edges, for a 5-line edges.tsv
    R"({"format": "attnkit-node-graph", "version": 1, "nodes": 5, "edges": 5, "features": 4,
        "classes": ["arcade", "board", "card"]})";

TEST(NodeGraph, RefusesMalformedNodes) {
  const std::string ok0 = "n0\t0\ttrain\t0 2\n", ok2 = "n2\t2\ttest\t\nn3\t0\tnone\t0 1 2 3\nn4\t1\ttrain\t3\n";
  expect_refused("nodes.tsv", ok0 + "n1\t1\tvalid\n" + ok2,
                 {"nodes.tsv line 2", "expected 4 tab-separated fields", "got 3"});
  expect_refused("nodes.tsv", ok0 + "n1\t1\tvalid\t1\tx\n" + ok2, {"nodes.tsv line 2", "got 5"});
  expect_refused("nodes.tsv", ok0 + "n1\tone\tvalid\t1\n" + ok2,
                 {"nodes.tsv line 2", "label 'one' is not an integer"});
  expect_refused("nodes.tsv", ok0 + "n1\t1.0\tvalid\t1\n" + ok2, {"nodes.tsv line 2", "label '1.0'"});
  expect_refused("nodes.tsv", ok0 + "n1\t3\tvalid\t1\n" + ok2,
                 {"nodes.tsv line 2", "label 3 is outside [0, 3)"});
  expect_refused("nodes.tsv", ok0 + "n1\t-1\tvalid\t1\n" + ok2, {"nodes.tsv line 2", "label -1 is outside"});
  expect_refused("nodes.tsv", ok0 + "n1\t1\tdev\t1\n" + ok2,
                 {"nodes.tsv line 2", "split 'dev'", "train, valid, test, none"});
  expect_refused("nodes.tsv", ok0 + "n1\t1\tvalid\t2 0\n" + ok2,
                 {"nodes.tsv line 2", "strictly increasing", "2 then 0"});
  expect_refused("nodes.tsv", ok0 + "n1\t1\tvalid\t1 1\n" + ok2,
                 {"nodes.tsv line 2", "strictly increasing", "1 then 1"});
  expect_refused("nodes.tsv", ok0 + "n1\t1\tvalid\t1 4\n" + ok2,
                 {"nodes.tsv line 2", "feature 4 is outside [0, 4)"});
  expect_refused("nodes.tsv", ok0 + "n1\t1\tvalid\t1  2\n" + ok2,  // two spaces: an empty feature
                 {"nodes.tsv line 2", "feature '' is not an integer"});
  expect_refused("nodes.tsv", ok0 + "\t1\tvalid\t1\n" + ok2, {"nodes.tsv line 2", "empty node name"});
  // The last line is checked like the others.
  expect_refused("nodes.tsv", ok0 + "n1\t1\tvalid\t1\nn2\t2\ttest\t\nn3\t0\tnone\t0 1 2 3\nn4\t1\tTrain\t3\n",
                 {"nodes.tsv line 5", "split 'Train'"});
}

TEST(NodeGraph, RefusesMalformedEdges) {
  expect_refused("edges.tsv", "0\t1\n3\t0\n1\t4\n2\t3\n",
                 {"edges.tsv line 2", "smaller index first", "3 0"});
  expect_refused("edges.tsv", "0\t1\n0\t3\n4\t4\n2\t3\n", {"edges.tsv line 3", "smaller index first", "4 4"});
  expect_refused("edges.tsv", "0\t1\n0\t5\n1\t4\n2\t3\n", {"edges.tsv line 2", "node 5 is outside [0, 5)"});
  expect_refused("edges.tsv", "0\t1\n0\tx\n1\t4\n2\t3\n", {"edges.tsv line 2", "node 'x' is not an integer"});
  expect_refused("edges.tsv", "0\t1\n0 3\n1\t4\n2\t3\n",
                 {"edges.tsv line 2", "expected 2 tab-separated node indices", "got 1"});
  expect_refused("edges.tsv", "0\t1\n0\t3\t7\n1\t4\n2\t3\n", {"edges.tsv line 2", "got 3"});
  // A duplicate edge: the error names the line of the repeat and the pair.
  TempDir tmp;
  auto files = valid_files();
  files["edges.tsv"] = "0\t1\n0\t3\n1\t4\n2\t3\n0\t3\n";
  files["meta.json"] = kMeta5;
  write_dataset(tmp.path(), files);
  expect_error([&] { load_node_graph(tmp.path().string()); },
               {"edges.tsv line 5", "0 3", "listed twice", "line 2"});
}

TEST(NodeGraph, RefusesCountsThatDisagreeWithMeta) {
  const auto files = valid_files();
  expect_refused("nodes.tsv", files.at("nodes.tsv") + "n5\t0\ttrain\t1\n",
                 {"nodes.tsv has 6 lines", "meta.json says 5 nodes"});
  expect_refused("edges.tsv", "0\t1\n0\t3\n1\t4\n", {"edges.tsv has 3 lines", "meta.json says 4 edges"});
  expect_refused("vocabulary.txt", "alpha\nbeta\ngamma\n", {"vocabulary.txt has 3 words", "meta.json says 4"});
  expect_refused("meta.json", kMeta5, {"edges.tsv has 4 lines", "meta.json says 5 edges"});
}

TEST(NodeGraph, RefusesWrongMetaAndMissingFiles) {
  expect_refused("meta.json",
                 R"({"format": "attnkit-char-lm", "version": 1, "nodes": 5, "edges": 4, "features": 4,
                     "classes": ["a", "b", "c"]})",
                 {"meta.json", "\"format\" is not \"attnkit-node-graph\""});
  expect_refused("meta.json",
                 R"({"format": "attnkit-node-graph", "version": 2, "nodes": 5, "edges": 4, "features": 4,
                     "classes": ["a", "b", "c"]})",
                 {"meta.json", "unsupported \"version\" 2"});
  expect_refused("meta.json", R"({"format": "attnkit-node-graph", "version": 1, "nodes": 5, "edges": 4})",
                 {"meta.json", "classes"});
  expect_refused("meta.json", "{not json", {"meta.json", "parse"});
  expect_refused("meta.json",
                 R"({"format": "attnkit-node-graph", "version": 1, "nodes": 5, "edges": 4, "features": 4,
                     "classes": ["a"]})",
                 {"meta.json", "2 classes"});
  for (const std::string file : {"nodes.tsv", "edges.tsv", "vocabulary.txt", "meta.json"}) {
    SCOPED_TRACE("without " + file);
    TempDir tmp;
    write_dataset(tmp.path(), valid_files());
    fs::remove(tmp.path() / file);
    expect_error([&] { load_node_graph(tmp.path().string()); }, {"cannot read", file});
  }
  TempDir tmp;
  expect_error([&] { load_node_graph((tmp.path() / "absent").string()); }, {"absent", "is not a directory"});
}

}  // namespace

}  // namespace node_graph_test
