// Preparing a char-lm corpus (`attnkit data char-lm`): the inputs normalised,
// split 90/5/5 into train/valid/test.txt and described by meta.json.
#include <attnkit/runtime.h>
#include <attnkit/tasks/char_lm.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "base/durable_file.h"
#include "tasks/corpus.h"

namespace fs = std::filesystem;

namespace attnkit::tasks {

namespace {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// Streams every input through `normalizer`, in order, in 1 MiB reads.
void normalize_files(const std::vector<std::string>& inputs, TextNormalizer& normalizer) {
  std::vector<char> chunk(1 << 20);
  for (const auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in, "data char-lm: cannot open input '", path, "'");
    while (in) {
      in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
      normalizer.feed(chunk.data(), static_cast<size_t>(in.gcount()));
    }
    TORCH_CHECK(in.eof(), "data char-lm: reading input '", path, "' failed");
    normalizer.end_document();
  }
  normalizer.finish();
}

// The text of meta.json: the format, the sources, the splits (`cuts`: their
// first characters, then the total) and the normalisation counts. Written by
// hand to keep the file's layout and key order.
std::string meta_json(const CharLmReport& report, const int64_t (&cuts)[4]) {
  const auto& inputs = report.inputs;
  const int64_t n = cuts[3];
  std::ostringstream meta;
  const auto& c = report.counts;
  meta << "{\n  \"format\": \"text8: lowercase a-z and single spaces\",\n"
       << "  \"alphabet\": \" abcdefghijklmnopqrstuvwxyz\",\n"
       << "  \"attnkit_version\": " << json_string(attnkit::version()) << ",\n"
       << "  \"sources\": [";
  for (size_t i = 0; i < inputs.size(); ++i) {
    meta << (i ? ", " : "") << "{\"path\": " << json_string(inputs[i])
         << ", \"bytes\": " << fs::file_size(inputs[i]) << "}";
  }
  meta << "],\n  \"input_bytes\": " << report.input_bytes << ",\n"
       << "  \"characters\": " << n << ",\n  \"splits\": {";
  const int64_t sizes[3] = {report.train, report.valid, report.test};
  const char* names[3] = {"train", "valid", "test"};
  for (int s = 0; s < 3; ++s) {
    meta << (s ? ", " : "") << "\"" << names[s] << "\": {\"file\": \"" << kSplitFiles[s]
         << "\", \"offset\": " << cuts[s] << ", \"characters\": " << sizes[s] << "}";
  }
  meta << "},\n  \"mapping\": {\"kept\": " << c.kept << ", \"mapped\": " << c.mapped
       << ", \"dropped\": " << c.dropped << ", \"non_ascii_dropped\": " << c.non_ascii_dropped
       << ", \"latin1_bytes\": " << c.latin1_bytes << "}\n}\n";
  return meta.str();
}

}  // namespace

CharLmReport prepare_char_lm(const std::vector<std::string>& inputs, const std::string& out_dir,
                             bool force) {
  TORCH_CHECK(!inputs.empty(), "data char-lm: no input files (--input FILE...)");
  TORCH_CHECK(!out_dir.empty(), "data char-lm: no output directory (--out DIR)");
  CharLmReport report;
  report.inputs = inputs;
  report.out_dir = out_dir;
  for (const auto& path : inputs) {
    std::error_code error;
    TORCH_CHECK(fs::is_regular_file(path, error), "data char-lm: input '", path,
                "' does not exist or is not a file");
    const auto bytes = fs::file_size(path, error);
    TORCH_CHECK(!error, "data char-lm: cannot read the size of input '", path, "': ",
                error.message());
    TORCH_CHECK(bytes > 0, "data char-lm: input '", path, "' is empty");
    report.input_bytes += static_cast<int64_t>(bytes);
  }
  const fs::path dir(out_dir);
  if (fs::exists(dir)) {
    TORCH_CHECK(fs::is_directory(dir), "data char-lm: output '", out_dir,
                "' exists and is not a directory");
    for (const char* name : {"train.txt", "valid.txt", "test.txt", "meta.json"}) {
      TORCH_CHECK(force || !fs::exists(dir / name), "data char-lm: '", (dir / name).string(),
                  "' exists; pass --force to overwrite the data in '", out_dir, "'");
    }
  }

  // Pass 1: how long is the text?
  TextNormalizer counter([](const char*, size_t) {});
  normalize_files(inputs, counter);
  const int64_t n = counter.counts().output;
  TORCH_CHECK(n > 0, "data char-lm: the inputs hold no letters or digits (", report.input_bytes,
              " bytes)");
  const int64_t cuts[4] = {0, n * 9 / 10, n * 19 / 20, n};
  TORCH_CHECK(cuts[1] > 0 && cuts[2] > cuts[1] && cuts[3] > cuts[2], "data char-lm: the text is ",
              n, " characters after normalisation, too short for three non-empty splits (90/5/5); "
              "give at least 20");

  // Pass 2: write the splits.
  fs::create_directories(dir);
  // The splits and meta.json replace a previous preparation together, and
  // durably (base/durable_file.h); nothing is replaced if anything fails.
  attnkit::base::DurableFiles files;
  std::size_t streams[3];
  for (int s = 0; s < 3; ++s) streams[s] = files.open((dir / kSplitFiles[s]).string());
  int64_t position = 0;
  int split = 0;
  TextNormalizer writer([&](const char* data, size_t size) {
    while (size > 0) {
      while (split < 3 && position == cuts[split + 1]) ++split;
      TORCH_CHECK(split < 3, "data char-lm: the inputs grew while being read");
      const auto take = std::min<int64_t>(static_cast<int64_t>(size), cuts[split + 1] - position);
      files.write(streams[split], std::string_view(data, static_cast<size_t>(take)));
      data += take;
      size -= static_cast<size_t>(take);
      position += take;
    }
  });
  normalize_files(inputs, writer);
  TORCH_CHECK(position == n, "data char-lm: the inputs changed while being read (", n,
              " characters, then ", position, ")");
  report.counts = writer.counts();
  report.train = cuts[1];
  report.valid = cuts[2] - cuts[1];
  report.test = cuts[3] - cuts[2];

  const std::string meta = meta_json(report, cuts);
  files.write(files.open((dir / "meta.json").string()), meta);
  files.commit();
  return report;
}

}  // namespace attnkit::tasks
