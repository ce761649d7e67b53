#include "kernels/gemm_bf16.h"

#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <type_traits>

#include "base/memory.h"
#include "kernels/common/gemm.h"
#include "kernels/common/isa.h"
#include "kernels/common/onednn_compat.h"

namespace attnkit::kernels {

// ---------------------------------------------------------------------------
// Conversions
// ---------------------------------------------------------------------------

namespace {

// Below this many values a conversion runs on the calling thread: a team's
// start costs more than the work.
constexpr int64_t kThreadedConversion = int64_t{1} << 16;

/// dst (rows, cols) dense = src (rows, cols) with row stride ld, as float32.
void widen_matrix(const bf16* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
#pragma omp parallel for schedule(static) if (rows * cols >= kThreadedConversion)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) dst[r * cols + j] = to_float(src[r * ld + j]);
}

}  // namespace

void to_float(const bf16* src, float* dst, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kThreadedConversion)
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

void to_bf16(const float* src, bf16* dst, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kThreadedConversion)
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

// ---------------------------------------------------------------------------
// Which path
// ---------------------------------------------------------------------------

namespace {

std::atomic<bool> g_force_float32{false};

bool forced_by_environment() {
  const char* env = std::getenv("ATTNKIT_BF16_GEMM");
  if (!env || !*env) return false;
  const std::string value(env);
  if (value == "float32") return true;
  if (value == "auto") return false;
  throw std::runtime_error("attnkit: environment variable ATTNKIT_BF16_GEMM must be 'auto' or "
                           "'float32', got '" + value + "'");
}

Bf16Path path_from_isa() {
  // Decided first: it caps oneDNN, whose ISA the query below fixes.
  const isa::Level level = isa::current();
  // oneDNN's ISA values are nested bit sets: a level includes every bit of
  // the levels below it (avx512_core_amx = 0x3e7 contains avx512_core_bf16 =
  // 0xe7; avx2_vnni = 0x407 does not).
  const auto onednn = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  const auto has = [onednn](dnnl::cpu_isa bits_of) {
    const auto bits = static_cast<unsigned>(bits_of);
    return (onednn & bits) == bits;
  };
  if (level >= isa::Level::amx && has(dnnl::cpu_isa::avx512_core_amx)) return Bf16Path::amx;
  if (level >= isa::Level::avx512_bf16 && has(dnnl::cpu_isa::avx512_core_bf16))
    return Bf16Path::avx512_bf16;
  return Bf16Path::float32;
}

}  // namespace

Bf16Path bf16_gemm_isa_path() {
  static const Bf16Path path = path_from_isa();
  return path;
}

bool bf16_float32_forced() {
  static const bool by_environment = forced_by_environment();
  return by_environment || g_force_float32.load(std::memory_order_relaxed);
}

bool force_bf16_float32(bool on) { return g_force_float32.exchange(on); }

Bf16Path bf16_gemm_path() {
  const Bf16Path isa_path = bf16_gemm_isa_path();  // decides the level first, forced or not
  return bf16_float32_forced() ? Bf16Path::float32 : isa_path;
}

bool bf16_gemm_native() { return bf16_gemm_path() != Bf16Path::float32; }

bool onednn_runs_bf16_matmul() {
  using dt = dnnl::memory::data_type;
  try {
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);  // not cpu_engine(): it decides the level
    const dnnl::memory::desc square({16, 16}, dt::bf16, dnnl::memory::format_tag::ab);
    onednn::matmul_primitive_desc(engine, square, square, {}, square);
    return true;
  } catch (const dnnl::error&) {
    return false;
  }
}

const char* to_string(Bf16Path path) {
  switch (path) {
    case Bf16Path::amx: return "amx";
    case Bf16Path::avx512_bf16: return "avx512_bf16";
    case Bf16Path::float32: return "float32 conversion";
  }
  return "?";
}

// ---------------------------------------------------------------------------
// The float32 conversion path
// ---------------------------------------------------------------------------

namespace {

/// Converts A and B (as stored) to dense float32, runs sgemm, rounds C.
template <typename C>
void gemm_via_float32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                      const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta, C* c,
                      int64_t ldc, const bf16* bias) {
  const int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  Buffer<float> af(static_cast<std::size_t>(a_rows * a_cols));
  Buffer<float> bf(static_cast<std::size_t>(b_rows * b_cols));
  widen_matrix(a, a_rows, a_cols, lda, af.data());
  widen_matrix(b, b_rows, b_cols, ldb, bf.data());

  // The float32 C: the caller's own, or a dense copy of the bf16 one.
  constexpr bool c_is_float = std::is_same_v<C, float>;
  Buffer<float> c_buffer(c_is_float ? 0 : static_cast<std::size_t>(m * n));
  float* cf = nullptr;
  int64_t ldcf = 0;
  if constexpr (c_is_float) {
    cf = c, ldcf = ldc;
  } else {
    cf = c_buffer.data(), ldcf = n;
    if (beta != 0.f) widen_matrix(c, m, n, ldc, cf);
  }
  float sgemm_beta = beta;
  if (bias) {  // C = beta C + alpha bias first, then the product is added (beta = 1)
#pragma omp parallel for schedule(static) if (m * n >= kThreadedConversion)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const float start = beta == 0.f ? 0.f : beta * cf[i * ldcf + j];
        cf[i * ldcf + j] = start + alpha * to_float(bias[j]);
      }
    sgemm_beta = 1.f;
  }
  sgemm(trans_a, trans_b, m, n, k, alpha, af.data(), a_cols, bf.data(), b_cols, sgemm_beta, cf,
        ldcf);
  if constexpr (!c_is_float) {
#pragma omp parallel for schedule(static) if (m * n >= kThreadedConversion)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = to_bf16(cf[i * n + j]);
  }
}

// ---------------------------------------------------------------------------
// The native path: oneDNN matmul primitives, cached
// ---------------------------------------------------------------------------

using dt = dnnl::memory::data_type;

/// Everything a primitive is specialised for. The thread count is part of it
/// because oneDNN plans its partitioning when the primitive is created (its own
/// primitive cache keys on it too).
struct Key {
  bool trans_a, trans_b, c_bf16, bias;
  int64_t m, n, k, lda, ldb, ldc;
  uint32_t alpha_bits, beta_bits;
  int threads;
  auto tie() const {
    return std::tie(trans_a, trans_b, c_bf16, bias, m, n, k, lda, ldb, ldc, alpha_bits, beta_bits,
                    threads);
  }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Entry {
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c, bias, scratchpad;
  uint64_t last_use = 0;
};

/// At most this many primitives are kept; the least recently used goes first.
/// A model has a few distinct shapes per layer and pass; the bound only stops
/// a stream of ever-new shapes (growing decode lengths) from growing the map.
constexpr std::size_t kCacheCapacity = 256;

std::mutex g_cache_mutex;
std::map<Key, Entry> g_cache;
uint64_t g_clock = 0;

const dnnl::engine& cpu_engine() {
  isa::current();  // the level decision caps oneDNN, before oneDNN's first use
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

/// The calling thread's stream (a oneDNN stream is not shared between threads).
dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

Entry create(const Key& key) {
  using dims = dnnl::memory::dims;
  const int64_t m = key.m, n = key.n, k = key.k;
  Entry e;
  // op(A) (m, k): stored (m, k) with row stride lda, or (k, m) read transposed.
  e.a = dnnl::memory::desc({m, k}, dt::bf16, key.trans_a ? dims{1, key.lda} : dims{key.lda, 1});
  e.b = dnnl::memory::desc({k, n}, dt::bf16, key.trans_b ? dims{1, key.ldb} : dims{key.ldb, 1});
  e.c = dnnl::memory::desc({m, n}, key.c_bf16 ? dt::bf16 : dt::f32, dims{key.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // per call: thread-safe execution
  float alpha, beta;
  std::memcpy(&alpha, &key.alpha_bits, sizeof alpha);
  std::memcpy(&beta, &key.beta_bits, sizeof beta);
  // C = alpha (op(A) op(B) + bias) + beta C, as the float32 path computes it.
  dnnl::post_ops ops;
  if (alpha != 1.f) onednn::append_multiply(ops, alpha);
  if (beta != 0.f) ops.append_sum(beta);
  if (ops.len() > 0) attr.set_post_ops(ops);
  if (key.bias) e.bias = dnnl::memory::desc({1, n}, dt::bf16, dims{n, 1});
  const auto pd = onednn::matmul_primitive_desc(cpu_engine(), e.a, e.b, e.bias, e.c, attr);
  e.scratchpad = pd.scratchpad_desc();
  e.primitive = dnnl::matmul(pd);
  return e;
}

Entry lookup(const Key& key) {
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    auto it = g_cache.find(key);
    if (it != g_cache.end()) {
      it->second.last_use = ++g_clock;
      return it->second;  // a copy: handles are reference-counted
    }
  }
  // Created outside the lock (it takes a while); two threads missing the same
  // key at once both create, and the first to insert wins.
  Entry fresh = create(key);
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  auto [it, inserted] = g_cache.emplace(key, std::move(fresh));
  it->second.last_use = ++g_clock;
  if (inserted && g_cache.size() > kCacheCapacity) {
    auto oldest = g_cache.begin();
    for (auto j = g_cache.begin(); j != g_cache.end(); ++j)
      if (j->second.last_use < oldest->second.last_use) oldest = j;
    g_cache.erase(oldest);  // never the one just inserted: it is the newest
  }
  return it->second;
}

template <typename C>
void gemm_native(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta, C* c,
                 int64_t ldc, const bf16* bias) {
  const Key key{trans_a,          trans_b,          std::is_same_v<C, bf16>, bias != nullptr, m, n, k,
                lda,              ldb,              ldc,
                float_bits(alpha), float_bits(beta), omp_get_max_threads()};
  try {
    const Entry e = lookup(key);
    const auto& engine = cpu_engine();
    Buffer<unsigned char> scratch(e.scratchpad.get_size());
    auto* mutable_a = const_cast<bf16*>(a);
    auto* mutable_b = const_cast<bf16*>(b);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, dnnl::memory(e.a, engine, mutable_a)},
        {DNNL_ARG_WEIGHTS, dnnl::memory(e.b, engine, mutable_b)},
        {DNNL_ARG_DST, dnnl::memory(e.c, engine, c)},
        {DNNL_ARG_SCRATCHPAD, dnnl::memory(e.scratchpad, engine, scratch.data())}};
    if (bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(e.bias, engine, const_cast<bf16*>(bias)));
    auto& stream = thread_stream();
    e.primitive.execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& err) {
    throw std::runtime_error("attnkit: oneDNN bf16 matmul failed (m = " + std::to_string(m) +
                             ", n = " + std::to_string(n) + ", k = " + std::to_string(k) +
                             ", lda = " + std::to_string(lda) + ", ldb = " + std::to_string(ldb) +
                             ", ldc = " + std::to_string(ldc) + "): " + err.what());
  }
}

template <typename C>
void gemm_any(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
              const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta, C* c,
              int64_t ldc, const bf16* bias) {
  if (m == 0 || n == 0) return;
  // oneDNN rejects K = 0; the float32 path handles it (C = alpha bias + beta C).
  if (k == 0 || !bf16_gemm_native())
    gemm_via_float32(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bias);
  else
    gemm_native(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bias);
}

}  // namespace

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta, float* c,
               int64_t ldc, const bf16* bias) {
  gemm_any(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bias);
}

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float beta, bf16* c,
               int64_t ldc, const bf16* bias) {
  gemm_any(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bias);
}

int64_t gemm_bf16_cached_primitives() {
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  return static_cast<int64_t>(g_cache.size());
}

}  // namespace attnkit::kernels
