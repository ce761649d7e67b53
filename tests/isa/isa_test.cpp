// The ISA level decision (src/kernels/common/isa.h): the detector against the
// kernel's own reading of the CPU (/proc/cpuinfo's flags, which Linux clears
// for state the OS does not save: an oracle independent of our CPUID code),
// the cap, the names, and what the dispatch reports.
#include "kernels/common/isa.h"

#include <attnkit/dispatch.h>
#include <attnkit/ops.h>
#include <attnkit/runtime.h>
#include <gtest/gtest.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>

namespace attnkit::kernels::isa::isa_test {
namespace {

/// The flags line of /proc/cpuinfo (empty where there is none).
std::set<std::string> cpuinfo_flags() {
  std::ifstream info("/proc/cpuinfo");
  std::set<std::string> flags;
  for (std::string line; std::getline(info, line);) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;) flags.insert(w);
    break;
  }
  return flags;
}

/// Whether LZCNT runs as itself. A CPU without it decodes the same bytes as
/// BSR (the index of the highest set bit), which gives 0 for 1 where LZCNT
/// gives 31 leading zeros: an oracle that asks the hardware, not CPUID.
bool lzcnt_executes() {
  uint32_t zeros = 0;
  const uint32_t one = 1;
  asm("lzcnt %1, %0" : "=r"(zeros) : "r"(one) : "cc");
  return zeros == 31;
}

/// The level /proc/cpuinfo's flags allow (AMX counted as avx512_bf16: Linux's
/// permission to use the tiles is not in the flags). LZCNT is Linux's "abm",
/// which some virtual machines leave out of the flags while their CPUID and
/// CPU have it (seen: an "Oxide Virtual Turin-like Processor", Zen 5): there
/// the instruction itself is asked.
Level level_from_flags(const std::set<std::string>& f) {
  const auto all = [&f](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (!f.count(n)) return false;
    return true;
  };
  if (!all({"avx", "avx2", "fma", "f16c", "movbe", "bmi1", "bmi2"}) || !(f.count("abm") || lzcnt_executes()))
    return Level::baseline;
  if (!all({"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"})) return Level::avx2;
  if (!all({"avx512_bf16"})) return Level::avx512;
  return Level::avx512_bf16;
}

TEST(Isa, MachineAgreesWithProcCpuinfo) {
  const auto flags = cpuinfo_flags();
  ASSERT_FALSE(flags.empty()) << "no flags line in /proc/cpuinfo";
  for (const char* v2 : {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm"})
    ASSERT_TRUE(flags.count(v2)) << "the test machine is below x86-64-v2: no " << v2;
  const auto machine = isa::machine();
  ASSERT_TRUE(machine.has_value());
  const Level expected = level_from_flags(flags);
  if (expected == Level::avx512_bf16 && flags.count("amx_tile") && flags.count("amx_bf16"))
    EXPECT_GE(*machine, Level::avx512_bf16);  // amx when Linux grants the tiles
  else
    EXPECT_EQ(*machine, expected) << "cpuinfo says " << name(expected);
  std::cout << "[ machine  ] " << cpu_model() << ": " << name(*machine) << "\n";
}

TEST(Isa, CurrentIsTheMachineCappedByTheEnvironment) {
  const Level level = current();
  const char* cap = std::getenv("ATTNKIT_MAX_ISA");
  if (cap && *cap) {
    const auto parsed = parse(cap);
    ASSERT_TRUE(parsed.has_value()) << cap;
    EXPECT_EQ(level, std::min(*parsed, *machine()));
  } else {
    EXPECT_EQ(level, *machine());
  }
  // Below the machine's level oneDNN is capped the same way (unless the user
  // set oneDNN's own variable), so its sgemm runs what a smaller CPU runs.
  if (level < *machine() && !std::getenv("ONEDNN_MAX_CPU_ISA") && !std::getenv("DNNL_MAX_CPU_ISA")) {
    EXPECT_NE(describe().find(std::string("oneDNN capped to ") + name(level)), std::string::npos)
        << describe();
    const dnnl_cpu_isa_t expected[] = {dnnl_cpu_isa_sse41, dnnl_cpu_isa_avx2, dnnl_cpu_isa_avx512_core,
                                       dnnl_cpu_isa_avx512_core_bf16, dnnl_cpu_isa_avx512_core_amx};
    EXPECT_EQ(dnnl_get_effective_cpu_isa(), expected[static_cast<int>(level)]);
  }
  // Decided once: a later cap is refused and changes nothing.
  EXPECT_FALSE(set_max(Level::baseline));
  EXPECT_EQ(current(), level);
  EXPECT_EQ(describe().rfind(name(level), 0), 0u) << describe();
  std::cout << "[ level    ] " << describe() << "\n";
}

TEST(Isa, NamesRoundTrip) {
  for (int l = 0; l < kLevels; ++l) {
    const auto level = static_cast<Level>(l);
    EXPECT_EQ(parse(name(level)), level);
  }
  EXPECT_FALSE(parse("AVX2").has_value());
  EXPECT_FALSE(parse("").has_value());
  EXPECT_FALSE(parse("avx512f").has_value());
}

TEST(Isa, BestBuiltLevelIsTheHighestNotAboveCurrent) {
  const int now = static_cast<int>(current());
  const unsigned float32 = 0b00111;  // baseline, avx2, avx512
  EXPECT_EQ(static_cast<int>(*best_built(float32)), std::min(now, 2));
  EXPECT_EQ(best_built(0b10000).has_value(), now == 4);  // amx only
  EXPECT_EQ(*best_built(0b00001), Level::baseline);
}

TEST(Isa, RuntimeAndDispatchNameTheLevel) {
  EXPECT_EQ(attnkit::isa(), name(current()));
  EXPECT_EQ(attnkit::isa_description(), describe());
  EXPECT_EQ(attnkit::machine_isa(), name(*machine()));
  EXPECT_THROW(attnkit::set_max_isa("sse2"), c10::Error);
  EXPECT_FALSE(attnkit::set_max_isa("baseline"));  // decided already

  const auto q = torch::randn({1, 1, 4, 8});
  const auto d = attnkit::softmax_attention_dispatch(q, q, q);
  EXPECT_EQ(d.isa, attnkit::isa());
  EXPECT_EQ(d.describe(), "kernel (" + attnkit::isa() + ")");
  const auto q64 = q.to(torch::kDouble);
  const auto composite = attnkit::softmax_attention_dispatch(q64, q64, q64);
  EXPECT_TRUE(composite.isa.empty());
  EXPECT_EQ(composite.describe().rfind("composite (q, k and v are float64", 0), 0u) << composite.describe();
}

}  // namespace
}  // namespace attnkit::kernels::isa::isa_test
