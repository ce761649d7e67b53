// DocumentMemory: streaming encoding, merging, lookups against the float64
// C q, and its file format: bit-exact round trips, atomic replacement, and
// refusal of truncated, bit-flipped, foreign and other-version files.
#include <attnkit/document_memory.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <iterator>

#include "test_util.h"

namespace attnkit::document_memory_test {
namespace {

using testing::expect_error;
using testing::f32;
using testing::f64;
using testing::rel_err;

// C sums n products per entry in float32: at most n * 2^-24 relative to the
// sum of |terms|, which the diagonal (sums of squares) bounds. n = 750 here:
// 4.5e-5, so kEncodeTol.
constexpr double kEncodeTol = 5e-5;
// Two float32 encodings of the same states differ by at most twice that.
constexpr double kTwoEncodingsTol = 2 * kEncodeTol;

/// A fresh directory for one test's files, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "attnkit_memory_XXXXXX";
    path_ = ::mkdtemp(pattern.data()) ? pattern : "";
    EXPECT_FALSE(path_.empty()) << "mkdtemp failed";
  }
  ~TempDir() {
    for (const auto& name : entries()) ::unlink((path_ + "/" + name).c_str());
    ::rmdir(path_.c_str());
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    if (DIR* dir = ::opendir(path_.c_str())) {
      while (const dirent* e = ::readdir(dir))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..")
          names.push_back(e->d_name);
      ::closedir(dir);
    }
    return names;
  }

 private:
  std::string path_;
};

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The FNV-1a 64 checksum the format ends with (to forge a valid other version).
uint64_t fnv1a64(const std::vector<char>& bytes, size_t size) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < size; ++i)
    h = (h ^ static_cast<unsigned char>(bytes[i])) * 1099511628211ull;
  return h;
}

DocumentMemory encoded(const torch::Tensor& hidden) {
  DocumentMemory memory(hidden.size(1));
  memory.append(hidden);
  return memory;
}

TEST(DocumentMemory, EncodingInChunksEqualsEncodingAtOnce) {
  torch::manual_seed(1);
  const int64_t n = 750, k = 100;  // the cheap-linear-attention paper's setup
  auto h = torch::randn({n, k}, f32());
  const auto exact = torch::matmul(h.to(torch::kDouble).t(), h.to(torch::kDouble));
  DocumentMemory once = encoded(h);
  DocumentMemory stream(k);
  for (int64_t start = 0, size = 1; start < n; start += size, size = size * 3 + 1)
    stream.append(h.narrow(0, start, std::min(size, n - start)));  // chunks 1, 4, 13, 40, ...
  EXPECT_EQ(once.num_states(), n);
  EXPECT_EQ(stream.num_states(), n);
  EXPECT_LT(rel_err(once.matrix(), exact), kEncodeTol);
  EXPECT_LT(rel_err(stream.matrix(), exact), kEncodeTol);
  EXPECT_LT(rel_err(stream.matrix(), once.matrix()), kTwoEncodingsTol);
}

TEST(DocumentMemory, MergeEqualsEncodingTheConcatenation) {
  torch::manual_seed(2);
  const int64_t k = 24;
  auto a = torch::randn({300, k}, f32()), b = torch::randn({450, k}, f32());
  DocumentMemory merged = encoded(a);
  merged.merge(encoded(b));
  DocumentMemory whole = encoded(torch::cat({a, b}));
  EXPECT_EQ(merged.num_states(), 750);
  EXPECT_LT(rel_err(merged.matrix(), whole.matrix()), kTwoEncodingsTol);
  auto exact = torch::matmul(torch::cat({a, b}).to(torch::kDouble).t(),
                             torch::cat({a, b}).to(torch::kDouble));
  EXPECT_LT(rel_err(merged.matrix(), exact), kEncodeTol);
}

TEST(DocumentMemory, LookupIsCqAndTheSeedsLinearAttention) {
  torch::manual_seed(3);
  const int64_t n = 200, k = 20, m = 33;
  auto h = torch::randn({n, k}, f32());
  auto queries = torch::randn({k, m}, f32()).t();  // strided rows: no copy needed to be correct
  DocumentMemory memory = encoded(h);
  auto got = memory.lookup(queries);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{m, k}));
  auto C = memory.matrix().to(torch::kDouble);
  // One GEMM over k products of the stored C: k * 2^-24 relative, far below this.
  constexpr double kLookupTol = 1e-5;
  EXPECT_LT(rel_err(got, torch::matmul(queries.to(torch::kDouble), C.t())), kLookupTol);
  // R = H^T H q: linear attention with identity map, no normaliser, k = v = H.
  auto seed_form =
      linear_attention(queries.view({1, 1, m, k}), h.view({1, 1, n, k}), h.view({1, 1, n, k}));
  EXPECT_LT(rel_err(got, seed_form.view({m, k})), kTwoEncodingsTol);
  EXPECT_EQ(memory.lookup(torch::empty({0, k}, f32())).sizes(), (std::vector<int64_t>{0, k}));
}

TEST(DocumentMemory, SaveLoadRoundTripsBitExactly) {
  torch::manual_seed(4);
  TempDir dir;
  const int64_t k = 37;
  DocumentMemory memory = encoded(torch::randn({90, k}, f32()));
  const auto path = dir.file("doc.mem");
  memory.save(path);
  EXPECT_EQ(read_bytes(path).size(), 32u + 4u * k * k + 8u);
  DocumentMemory loaded = DocumentMemory::load(path);
  EXPECT_EQ(loaded.dim(), k);
  EXPECT_EQ(loaded.num_states(), 90);
  EXPECT_TRUE(torch::equal(loaded.matrix(), memory.matrix()));
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"doc.mem"});  // no temporary left
}

TEST(DocumentMemory, SaveReplacesAnExistingFileWhole) {
  torch::manual_seed(5);
  TempDir dir;
  const auto path = dir.file("doc.mem");
  encoded(torch::randn({10, 8}, f32())).save(path);
  DocumentMemory bigger = encoded(torch::randn({10, 16}, f32()));
  bigger.save(path);
  EXPECT_TRUE(torch::equal(DocumentMemory::load(path).matrix(), bigger.matrix()));
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"doc.mem"});
  expect_error([&] { bigger.save(dir.file("missing/doc.mem")); },
               {"DocumentMemory::save", "missing/doc.mem", "No such file"});
}

TEST(DocumentMemory, TruncatedFilesAreRejected) {
  TempDir dir;
  const auto path = dir.file("doc.mem"), cut = dir.file("cut.mem");
  encoded(torch::randn({5, 3}, f32())).save(path);
  const auto bytes = read_bytes(path);
  for (size_t size = 0; size < bytes.size(); ++size) {
    SCOPED_TRACE("truncated to " + std::to_string(size) + " bytes");
    write_bytes(cut, std::vector<char>(bytes.begin(), bytes.begin() + size));
    expect_error([&] { DocumentMemory::load(cut); }, {"DocumentMemory::load", cut, "truncated"});
  }
}

TEST(DocumentMemory, EveryBitFlipIsRejected) {
  TempDir dir;
  const auto path = dir.file("doc.mem"), bad = dir.file("bad.mem");
  encoded(torch::randn({5, 3}, f32())).save(path);
  const auto bytes = read_bytes(path);
  for (size_t bit = 0; bit < 8 * bytes.size(); ++bit) {
    SCOPED_TRACE("bit " + std::to_string(bit));
    auto flipped = bytes;
    flipped[bit / 8] = static_cast<char>(flipped[bit / 8] ^ (1 << (bit % 8)));
    write_bytes(bad, flipped);
    expect_error([&] { DocumentMemory::load(bad); }, {"DocumentMemory::load", bad});
  }
}

TEST(DocumentMemory, ForeignOtherVersionAndMissingFilesAreRejected) {
  TempDir dir;
  const auto path = dir.file("doc.mem");
  encoded(torch::randn({5, 3}, f32())).save(path);
  auto bytes = read_bytes(path);
  bytes[8] = 2;  // format version 2, with a checksum that matches it
  const uint64_t sum = fnv1a64(bytes, bytes.size() - 8);
  for (int b = 0; b < 8; ++b) bytes[bytes.size() - 8 + b] = static_cast<char>(sum >> (8 * b));
  write_bytes(path, bytes);
  expect_error([&] { DocumentMemory::load(path); }, {"format version 2", "reads version 1"});
  write_bytes(path, std::vector<char>(64, 'x'));
  expect_error([&] { DocumentMemory::load(path); }, {"not an attnkit DocumentMemory file"});
  expect_error([&] { DocumentMemory::load(dir.file("absent.mem")); },
               {"cannot open", "absent.mem"});
}

TEST(DocumentMemory, BadArgumentsAreRejected) {
  expect_error([] { DocumentMemory(0); }, {"DocumentMemory", "dim", "positive"});
  DocumentMemory memory(4);
  expect_error(
      [&] {
        memory.append(torch::randn({3, 5}, f32()));
      },
      {"DocumentMemory::append", "hidden", "state size k", "expected 4"});
  expect_error(
      [&] {
        memory.append(torch::randn({3, 4}, f64()));
      },
      {"DocumentMemory::append", "float32", "Double"});
  expect_error([&] { memory.lookup(torch::randn({4}, f32())); },
               {"DocumentMemory::lookup", "queries", "2 dimensions"});
  expect_error([&] { memory.merge(DocumentMemory(5)); }, {"DocumentMemory::merge", "k = 5"});
}

TEST(DocumentMemory, ThreadCountOnlyChangesRounding) {
  torch::manual_seed(6);
  auto h = torch::randn({500, 64}, f32()), queries = torch::randn({300, 64}, f32());
  const int saved = num_threads();
  set_num_threads(1);
  DocumentMemory one = encoded(h);
  auto r1 = one.lookup(queries);
  set_num_threads(2);
  DocumentMemory two = encoded(h);
  auto r2 = two.lookup(queries);
  set_num_threads(saved);
  // oneDNN may split the sums differently across threads: rounding only.
  EXPECT_LT(rel_err(two.matrix(), one.matrix()), kTwoEncodingsTol);
  EXPECT_LT(rel_err(r2, r1), kTwoEncodingsTol);
}

}  // namespace
}  // namespace attnkit::document_memory_test
