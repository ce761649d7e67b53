// Instruction-set levels: the one place that decides which build of the
// kernels this process runs.
//
// Every kernel whose speed depends on the instruction set is compiled once per
// level, into translation units of its own (CMakeLists.txt, "level TUs"):
//
//   level        compiled with                      CPUs (examples)
//   baseline     -march=x86-64-v2 (SSE4.2, POPCNT)  every x86-64 CPU since 2009
//   avx2         -march=x86-64-v3 (AVX2, FMA, BMI2) Haswell and later, AMD Zen 1-3
//   avx512       -march=x86-64-v4 (AVX-512 F/BW/DQ/VL/CD)  Skylake-SP, Ice Lake
//   avx512_bf16  avx512 + AVX512_BF16               Cooper Lake, AMD Zen 4
//   amx          avx512_bf16 + AMX-TILE, AMX-BF16   Sapphire Rapids and later
//
// AVX512_VPOPCNTDQ belongs to no level: Cooper Lake has AVX512_BF16 without
// it, so no kernel uses it (kmeans counts bits with AVX-512BW byte shuffles).
// On other architectures only the baseline level is built, from the scalar code.
//
// The level is picked once, at the first kernel call: the best one the CPU
// (CPUID) and the operating system (XCR0: which register state it saves; for
// AMX also Linux's permission to use the tiles) support, lowered by the cap
// (environment variable ATTNKIT_MAX_ISA, or set_max() before the first use).
// The same cap is handed to oneDNN (dnnl_set_max_cpu_isa), so one variable
// makes a capable machine run exactly what a smaller CPU runs.
//
// The one-definition rule. Inline functions and templates of shared headers
// (vec.h, strided.h, parallel.h, ...) compiled under different -march flags
// would otherwise collapse to one copy at link time, and the copy kept might
// carry AVX-512 instructions into baseline code. So every level TU defines
// ATTNKIT_ISA_NAMESPACE (isa_baseline, isa_avx2, ...) and everything it
// compiles lives in attnkit::kernels::<that namespace>, an inline namespace
// that the shared headers open too (ATTNKIT_KERNELS_BEGIN / END, defined in
// base/isa_namespace.h because the bottom folder's helpers use them too), as
// ATen does with CPU_CAPABILITY. Code compiled once (ops, tests, the
// dispatchers) gets isa_generic. tests/isa/no_stray_instructions.py checks the
// linked library: no AVX2 or AVX-512 instruction outside its level's namespace.
//
// A kernel's header declares its entry points in attnkit::kernels; a level TU
// defines them in its own namespace, and kernels/dispatch.cpp defines the
// attnkit::kernels ones, which call the current level's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "base/isa_namespace.h"

namespace attnkit::kernels::isa {

/// Ordered: each level has every instruction of the levels below it.
enum class Level : int { baseline = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx = 4 };
constexpr int kLevels = 5;

/// "baseline", "avx2", "avx512", "avx512_bf16", "amx".
const char* name(Level level);
/// The level named so (as name() spells it); nothing for any other string.
std::optional<Level> parse(std::string_view name);

/// The best level this CPU and operating system support, or nothing when the
/// CPU lacks even the baseline (x86-64-v2: SSE4.2 and POPCNT). Asks Linux for
/// the AMX tile permission when the CPU has AMX. Computed once.
std::optional<Level> machine();

/// The level the kernels run at: machine() lowered by the cap. Decided at the
/// first call (which reads ATTNKIT_MAX_ISA and caps oneDNN), then fixed.
/// Throws std::runtime_error naming what is missing when the CPU is below the
/// baseline, and when ATTNKIT_MAX_ISA holds anything but a level's name.
Level current();

/// Caps the level before the first call of current(): true when taken (the
/// cap replaces ATTNKIT_MAX_ISA's), false once the level has been decided.
bool set_max(Level cap);

/// Registers a function that runs once, right after the level is decided and
/// oneDNN capped, before any caller sees the level (or at once when it has
/// been decided already). The torch layer registers one at load
/// (src/runtime/runtime.cpp: torch's own bf16 products share our oneDNN and
/// its cap). The function must not call current() (the decision holds its
/// lock) and must not throw. At most one function.
void on_decision(void (*hook)());

/// How current() was decided, e.g. "avx2 (CPU: avx2)" or
/// "avx2 (capped by ATTNKIT_MAX_ISA=avx2; CPU: amx; oneDNN capped to avx2)".
std::string describe();

/// The CPU's model name (CPUID's brand string), or "unknown".
std::string cpu_model();

/// The best of the levels a kernel is built for (bit l of `built` set for
/// level l) that does not exceed current(); nothing when none does.
std::optional<Level> best_built(unsigned built);

}  // namespace attnkit::kernels::isa
