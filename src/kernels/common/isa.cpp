// The level decision (isa.h). Compiled once, for the library's default target:
// nothing here may need more than the oldest x86-64 CPU has.
#include "kernels/common/isa.h"
#include "kernels/common/onednn_compat.h"

#include <oneapi/dnnl/dnnl.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#define ATTNKIT_X86 1
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define ATTNKIT_X86 0
#endif

namespace attnkit::kernels::isa {

namespace {

constexpr const char* kNames[kLevels] = {"baseline", "avx2", "avx512", "avx512_bf16", "amx"};

bool bit(unsigned reg, int b) { return (reg >> b) & 1u; }

#if ATTNKIT_X86

struct Registers {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

/// CPUID leaf/subleaf; all zero when the leaf does not exist.
Registers cpuid(unsigned leaf, unsigned subleaf = 0) {
  Registers r;
  if (!__get_cpuid_count(leaf, subleaf, &r.a, &r.b, &r.c, &r.d)) return {};
  return r;
}

/// XCR0: the register state the OS saves on a context switch (zero unless
/// the OS has enabled XSAVE, CPUID.1:ECX.OSXSAVE).
uint64_t xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

/// Linux hands out the 8 KiB of AMX tile state only to processes that ask.
bool amx_tiles_permitted() {
#if defined(__linux__)
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

std::optional<Level> detect() {
  const Registers l1 = cpuid(1);
  const Registers l7 = cpuid(7);
  const Registers l7s1 = l7.a >= 1 ? cpuid(7, 1) : Registers{};
  const Registers ext = cpuid(0x80000001u);

  // x86-64-v2: SSE3, SSSE3, SSE4.1, SSE4.2, POPCNT, CMPXCHG16B, LAHF/SAHF.
  if (!(bit(l1.c, 0) && bit(l1.c, 9) && bit(l1.c, 19) && bit(l1.c, 20) && bit(l1.c, 23) &&
        bit(l1.c, 13) && bit(ext.c, 0)))
    return std::nullopt;
  const bool os_xsave = bit(l1.c, 27);
  const uint64_t xcr = os_xsave ? xcr0() : 0;
  // x86-64-v3: AVX, AVX2, FMA, F16C, MOVBE, BMI1, BMI2, LZCNT; the OS saves
  // the SSE and AVX registers (XCR0 bits 1 and 2).
  const bool avx2 = bit(l1.c, 28) && bit(l7.b, 5) && bit(l1.c, 12) && bit(l1.c, 29) &&
                    bit(l1.c, 22) && bit(l7.b, 3) && bit(l7.b, 8) && bit(ext.c, 5) &&
                    (xcr & 0x6) == 0x6;
  if (!avx2) return Level::baseline;
  // x86-64-v4: AVX-512 F, DQ, CD, BW, VL; the OS saves the mask registers and
  // all 32 zmm registers (XCR0 bits 5, 6, 7).
  const bool avx512 = bit(l7.b, 16) && bit(l7.b, 17) && bit(l7.b, 28) && bit(l7.b, 30) &&
                      bit(l7.b, 31) && (xcr & 0xe0) == 0xe0;
  if (!avx512) return Level::avx2;
  if (!bit(l7s1.a, 5)) return Level::avx512;  // AVX512_BF16
  // AMX-TILE and AMX-BF16, the tile state saved by the OS (XCR0 bits 17, 18),
  // and this process allowed to use it.
  const bool amx = bit(l7.d, 24) && bit(l7.d, 22) && (xcr & 0x60000) == 0x60000;
  if (!amx || !amx_tiles_permitted()) return Level::avx512_bf16;
  return Level::amx;
}

/// oneDNN's name of the same ceiling (SSE4.1 is oneDNN's lowest level).
dnnl_cpu_isa_t onednn_isa(Level level) {
  switch (level) {
    case Level::baseline: return dnnl_cpu_isa_sse41;
    case Level::avx2: return dnnl_cpu_isa_avx2;
    case Level::avx512: return dnnl_cpu_isa_avx512_core;
    case Level::avx512_bf16: return dnnl_cpu_isa_avx512_core_bf16;
    case Level::amx: return dnnl_cpu_isa_avx512_core_amx;
  }
  return onednn::kNoIsaCap;
}

#else  // not x86: the scalar build is the only one

std::optional<Level> detect() { return Level::baseline; }

#endif

/// The state behind current(): the cap asked for, then the decision. `level`
/// is -1 until decided; once set it never changes, so readers need no lock
/// (every kernel call and sgemm reads it).
struct Decision {
  std::mutex mutex;
  std::optional<Level> requested_cap;  // set_max()
  void (*hook)() = nullptr;            // on_decision()
  std::atomic<int> level{-1};
  std::string description;             // written once, before `level`
};

Decision& decision() {
  static Decision d;
  return d;
}

/// Caps oneDNN to `level` unless the user set oneDNN's own variable (their
/// setting wins) or oneDNN is already in use; says what happened.
std::string cap_onednn(Level level) {
#if ATTNKIT_X86
  for (const char* variable : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    const char* value = std::getenv(variable);
    if (value && *value) return std::string("oneDNN capped by ") + variable + "=" + value;
  }
  if (dnnl_set_max_cpu_isa(onednn_isa(level)) != dnnl_success)
    return "oneDNN NOT capped: it was in use before attnkit's first kernel call";
  return std::string("oneDNN capped to ") + name(level);
#else
  (void)level;
  return "oneDNN uncapped";
#endif
}

}  // namespace

const char* name(Level level) { return kNames[static_cast<int>(level)]; }

std::optional<Level> parse(std::string_view text) {
  for (int l = 0; l < kLevels; ++l)
    if (text == kNames[l]) return static_cast<Level>(l);
  return std::nullopt;
}

std::optional<Level> machine() {
  static const std::optional<Level> level = detect();
  return level;
}

Level current() {
  Decision& d = decision();
  const int decided = d.level.load(std::memory_order_acquire);
  if (decided >= 0) return static_cast<Level>(decided);
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.level.load(std::memory_order_relaxed) >= 0) return static_cast<Level>(d.level.load());
  const std::optional<Level> best = machine();
  if (!best)
    throw std::runtime_error(
        "attnkit: this CPU lacks the baseline level attnkit is built for (x86-64-v2: SSE4.2, "
        "SSSE3, POPCNT, CMPXCHG16B)");
  std::optional<Level> cap = d.requested_cap;
  std::string cap_source = "set_max_isa";
  if (!cap) {
    const char* env = std::getenv("ATTNKIT_MAX_ISA");
    if (env && *env) {
      cap = parse(env);
      if (!cap)
        throw std::runtime_error(std::string("attnkit: ATTNKIT_MAX_ISA must be one of baseline, "
                                             "avx2, avx512, avx512_bf16, amx; got '") + env + "'");
      cap_source = std::string("ATTNKIT_MAX_ISA=") + env;
    }
  }
  const Level level = cap && *cap < *best ? *cap : *best;
  d.description = name(level);
  d.description += " (";
  if (cap && *cap < *best) d.description += "capped by " + cap_source + "; ";
  d.description += std::string("CPU: ") + name(*best);
  // Capping oneDNN below what the CPU has makes it run what a smaller CPU runs.
  if (level < *best) d.description += "; " + cap_onednn(level);
  d.description += ")";
  if (d.hook) d.hook();
  d.level.store(static_cast<int>(level), std::memory_order_release);
  return level;
}

void on_decision(void (*hook)()) {
  Decision& d = decision();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.hook = hook;
  if (d.level.load() >= 0) hook();
}

bool set_max(Level cap) {
  Decision& d = decision();
  std::lock_guard<std::mutex> lock(d.mutex);
  if (d.level.load() >= 0) return false;
  d.requested_cap = cap;
  return true;
}

std::string describe() {
  current();
  Decision& d = decision();
  std::lock_guard<std::mutex> lock(d.mutex);
  return d.description;
}

std::string cpu_model() {
#if ATTNKIT_X86
  if (cpuid(0x80000000u).a < 0x80000004u) return "unknown";
  char brand[49] = {};
  for (unsigned leaf = 0; leaf < 3; ++leaf) {
    const Registers r = cpuid(0x80000002u + leaf);
    const unsigned words[4] = {r.a, r.b, r.c, r.d};
    for (int w = 0; w < 4; ++w)
      for (int b = 0; b < 4; ++b) brand[leaf * 16 + w * 4 + b] = static_cast<char>(words[w] >> (8 * b));
  }
  std::string name(brand);
  const auto first = name.find_first_not_of(' '), last = name.find_last_not_of(' ');
  return first == std::string::npos ? "unknown" : name.substr(first, last - first + 1);
#else
  return "unknown";
#endif
}

std::optional<Level> best_built(unsigned built) {
  for (int l = static_cast<int>(current()); l >= 0; --l)
    if (bit(built, l)) return static_cast<Level>(l);
  return std::nullopt;
}

}  // namespace attnkit::kernels::isa
