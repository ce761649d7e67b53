// DocumentMemory: C = H^T H of the cheap-linear-attention paper (docs/MATH.md,
// "Linear attention") as a streaming, mergeable, persistent document
// representation. Products go through the kernels' sgemm.
#include <attnkit/document_memory.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string_view>
#include <system_error>
#include <vector>

#include "ops/checks.h"
#include "base/durable_file.h"
#include "kernels/common/gemm.h"
#include "kernels/common/threading.h"

namespace attnkit {

namespace {

constexpr char kMagic[8] = {'A', 'T', 'N', 'K', 'D', 'M', 'E', 'M'};
constexpr uint32_t kFloat32 = 1;
constexpr size_t kHeaderBytes = 32;
constexpr size_t kChecksumBytes = 8;

// ---------------------------------------------------------------------------
// Bytes: little-endian integers and the FNV-1a 64 checksum
// ---------------------------------------------------------------------------

void put_u32(std::vector<unsigned char>& out, uint32_t x) {
  for (int b = 0; b < 4; ++b) out.push_back(static_cast<unsigned char>(x >> (8 * b)));
}

void put_u64(std::vector<unsigned char>& out, uint64_t x) {
  for (int b = 0; b < 8; ++b) out.push_back(static_cast<unsigned char>(x >> (8 * b)));
}

uint32_t get_u32(const unsigned char* in) {
  uint32_t x = 0;
  for (int b = 0; b < 4; ++b) x |= static_cast<uint32_t>(in[b]) << (8 * b);
  return x;
}

uint64_t get_u64(const unsigned char* in) {
  uint64_t x = 0;
  for (int b = 0; b < 8; ++b) x |= static_cast<uint64_t>(in[b]) << (8 * b);
  return x;
}

uint64_t fnv1a64(const unsigned char* data, size_t size) {
  uint64_t h = 14695981039346656037ull;
  for (size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 1099511628211ull;
  return h;
}

std::vector<unsigned char> serialize(const torch::Tensor& C, int64_t dim, int64_t num_states) {
  std::vector<unsigned char> bytes(kMagic, kMagic + sizeof(kMagic));
  put_u32(bytes, DocumentMemory::kFormatVersion);
  put_u32(bytes, kFloat32);
  put_u64(bytes, static_cast<uint64_t>(dim));
  put_u64(bytes, static_cast<uint64_t>(num_states));
  const float* c = C.data_ptr<float>();
  for (int64_t i = 0; i < dim * dim; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &c[i], sizeof(bits));
    put_u32(bytes, bits);
  }
  put_u64(bytes, fnv1a64(bytes.data(), bytes.size()));
  return bytes;
}

// ---------------------------------------------------------------------------
// Files: an atomic write and a whole-file read
// ---------------------------------------------------------------------------

std::string errno_text() { return std::strerror(errno); }

/// Writes `bytes` to `path` so that readers see the old content or the new,
/// durably (base/durable_file.h).
void write_atomically(const std::string& path, const std::vector<unsigned char>& bytes) {
  try {
    base::write_file_durably(path, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  } catch (const std::system_error& e) {
    TORCH_CHECK(false, "DocumentMemory::save: ", e.what());
  }
}

std::vector<unsigned char> read_file(const std::string& path) {
  // Only a regular file is a memory file: a directory fails on its first read,
  // a FIFO blocks until a writer appears and a device such as /dev/zero never
  // ends. Open without blocking (a FIFO would block in open() itself), then
  // look at what was opened (fstat: no race with a rename between the check
  // and the read) and read exactly its size.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "DocumentMemory::load: cannot open '", path, "': ", errno_text());
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat info;
  TORCH_CHECK(::fstat(fd, &info) == 0, "DocumentMemory::load: cannot stat '", path, "': ", errno_text());
  TORCH_CHECK(!S_ISDIR(info.st_mode), "DocumentMemory::load: '", path, "' is a directory, not a memory file");
  TORCH_CHECK(S_ISREG(info.st_mode), "DocumentMemory::load: '", path,
              "' is not a regular file (a FIFO, socket or device), not a memory file");
  std::vector<unsigned char> bytes(static_cast<std::size_t>(info.st_size));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t got = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got >= 0, "DocumentMemory::load: cannot read '", path, "': ", errno_text());
    TORCH_CHECK(got > 0, "DocumentMemory::load: '", path, "' ended after ", done, " of its ", bytes.size(),
                " bytes (changed while being read?)");
    done += static_cast<std::size_t>(got);
  }
  return bytes;
}

void check_states(const char* where, const char* name, const torch::Tensor& x, int64_t dim) {
  detail::check_float_tensor(where, name, x, 2);
  TORCH_CHECK(x.scalar_type() == torch::kFloat, where, ": argument '", name,
              "' must be float32 like the memory, got dtype ", x.scalar_type());
  detail::check_dim(where, name, x, 1, dim, "state size k");
}

/// x as a row-major matrix sgemm can read (no copy when its rows are contiguous).
torch::Tensor gemm_operand(const torch::Tensor& x) {
  return x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
}

}  // namespace

DocumentMemory::DocumentMemory(int64_t dim) : dim_(dim) {
  TORCH_CHECK(dim > 0, "DocumentMemory: argument 'dim' must be positive, got ", dim);
  C_ = torch::zeros({dim, dim}, torch::kFloat);
}

DocumentMemory::DocumentMemory(int64_t dim, torch::Tensor C, int64_t num_states)
    : dim_(dim), C_(std::move(C)), num_states_(num_states) {}

void DocumentMemory::append(const torch::Tensor& hidden) {
  check_states("DocumentMemory::append", "hidden", hidden, dim_);
  const auto h = gemm_operand(hidden.detach());
  kernels::ThreadScope threads;
  kernels::sgemm(true, false, dim_, dim_, h.size(0), 1.f, h.data_ptr<float>(), h.stride(0),
                 h.data_ptr<float>(), h.stride(0), 1.f, C_.data_ptr<float>(), dim_);
  num_states_ += h.size(0);
}

torch::Tensor DocumentMemory::lookup(const torch::Tensor& queries) const {
  check_states("DocumentMemory::lookup", "queries", queries, dim_);
  const auto q = gemm_operand(queries.detach());
  auto out = torch::empty({q.size(0), dim_}, torch::kFloat);
  kernels::ThreadScope threads;
  // Row i of Q C^T is C q_i.
  kernels::sgemm(false, true, q.size(0), dim_, dim_, 1.f, q.data_ptr<float>(), q.stride(0),
                 C_.data_ptr<float>(), dim_, 0.f, out.data_ptr<float>(), dim_);
  return out;
}

void DocumentMemory::merge(const DocumentMemory& other) {
  TORCH_CHECK(other.dim_ == dim_, "DocumentMemory::merge: the other memory has k = ", other.dim_,
              ", expected k = ", dim_);
  C_.add_(other.C_);
  num_states_ += other.num_states_;
}

void DocumentMemory::save(const std::string& path) const {
  write_atomically(path, serialize(C_, dim_, num_states_));
}

DocumentMemory DocumentMemory::load(const std::string& path) {
  constexpr const char* where = "DocumentMemory::load";
  const std::vector<unsigned char> bytes = read_file(path);
  const size_t size = bytes.size();
  TORCH_CHECK(size >= kHeaderBytes + kChecksumBytes, where, ": '", path, "' is truncated: ", size,
              " bytes, fewer than the ", kHeaderBytes + kChecksumBytes,
              " of an empty memory's header and checksum");
  TORCH_CHECK(std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0, where, ": '", path,
              "' is not an attnkit DocumentMemory file (its first bytes are not \"ATNKDMEM\")");
  const uint32_t version = get_u32(&bytes[8]);
  TORCH_CHECK(version == kFormatVersion, where, ": '", path, "' has format version ", version,
              "; this build reads version ", kFormatVersion);
  const uint32_t type = get_u32(&bytes[12]);
  TORCH_CHECK(type == kFloat32, where, ": '", path, "' has element type ", type,
              "; this build reads 1 (float32)");
  const uint64_t dim = get_u64(&bytes[16]);
  const uint64_t body = size - kHeaderBytes - kChecksumBytes;
  // dim <= floats / dim first, so that dim * dim cannot overflow.
  const uint64_t floats = body / 4;
  TORCH_CHECK(dim > 0 && body % 4 == 0 && dim <= floats / dim && dim * dim == floats, where, ": '",
              path, "' has ", size, " bytes, which does not match the k = ", dim,
              " of its header (truncated or corrupt)");
  const uint64_t stored = get_u64(&bytes[size - kChecksumBytes]);
  const uint64_t computed = fnv1a64(bytes.data(), size - kChecksumBytes);
  TORCH_CHECK(stored == computed, where, ": '", path,
              "' is corrupt: its checksum does not match its content");
  const uint64_t num_states = get_u64(&bytes[24]);
  TORCH_CHECK(num_states <= static_cast<uint64_t>(INT64_MAX), where, ": '", path,
              "' is corrupt: state count ", num_states, " out of range");

  const auto k = static_cast<int64_t>(dim);
  auto C = torch::empty({k, k}, torch::kFloat);
  float* c = C.data_ptr<float>();
  for (int64_t i = 0; i < k * k; ++i) {
    const uint32_t bits = get_u32(&bytes[kHeaderBytes + 4 * i]);
    std::memcpy(&c[i], &bits, sizeof(bits));
  }
  return DocumentMemory(k, std::move(C), static_cast<int64_t>(num_states));
}

}  // namespace attnkit
