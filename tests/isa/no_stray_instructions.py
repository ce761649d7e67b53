#!/usr/bin/env python3
"""No instruction outside the ISA level that may run it (src/kernels/common/isa.h).

    no_stray_instructions.py [--expect-levels baseline,avx2,...] FILE...
    no_stray_instructions.py --self-test

Disassembles FILE (libattnkit.so, or any ELF object) with objdump, splits it
into functions and fails (exit 1) when a function holds an instruction that
the level of its namespace may not run:

    namespace of the function     may run, beyond x86-64-v2
    isa_avx2                      AVX, AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE (x86-64-v3)
    isa_avx512                    + AVX-512 F/BW/DQ/VL/CD (x86-64-v4)
    isa_avx512_bf16               + AVX512_BF16
    isa_amx                       + AMX-TILE, AMX-BF16
    anything else                 nothing (x86-64-v2 is the library's baseline)

A function belongs to a level when its demangled name has that level's
namespace as a component (`...::isa_avx2::...`), which takes in the lambdas,
the OpenMP regions (`... [clone ._omp_fn.0]`) and the template instances
(`std::vector<...isa_avx2::X>::...`) of that level's code: their mangled names
are the level's own, so no other level's copy can replace them at link time.
What this catches is the copy that CAN be replaced: an inline function or
template instance outside the level namespaces (say std::vector<long>::
_M_fill_assign) compiled in an avx512 translation unit is a weak symbol, the
linker keeps one copy of it for the whole library, and if it keeps the
avx512 one every caller runs AVX-512 instructions. Hence: check the linked
library, not the objects.

A local function outside the level namespaces is a clone GCC made in one
translation unit (`std::__introsort_loop<long*, ...> [clone .isra.0]` in a
level's sort): only that unit's code can call it, so it may run what all of
its callers (direct calls, tail calls, address taken) may run; nothing when
no instruction refers to it (a pointer in data, which this cannot follow).
That needs addresses: in object files (each section at 0) local functions
get their namespace's rule like the others.

An instruction's class is decided by its encoding (the raw bytes: a VEX prefix
C4/C5 is AVX-class, an EVEX prefix 62 is AVX-512; in 64-bit mode these bytes
are nothing else) and, independently, by its text: registers (%ymm, %zmm,
%xmm16-31, %ymm16-31, opmask %k0-7), EVEX-only decorations ({z}, {1to16},
{sae}), mnemonics (AVX in AT&T syntax starts with v; BMI1/2, LZCNT, MOVBE;
EVEX-only mnemonics; AVX512_BF16; AMX). Either way counts, so one rule's blind
spot is the other's check. TZCNT is not flagged: GCC emits `rep bsf`, which
objdump shows as tzcnt and older CPUs run as bsf.

--expect-levels L1,L2,...: also fail unless each of those level namespaces has
functions, and the levels above baseline hold instructions of their own class
(isa_avx2 some AVX, isa_avx512 some AVX-512, isa_amx some AMX): a build whose
levels lost their flags, or a checker whose rules stopped matching, then fails
instead of passing everything.

--self-test: compiles a few tiny objects with g++, links them into two shared
libraries (the same code, linked in two orders) and checks that this script
flags exactly the planted offenders (exit 0 when it does).

Exit status: 0 clean, 1 offenders (or an expectation unmet), 2 usage or tool errors.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Level namespaces, lowest first, and the instruction classes each may run.
LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
ALLOWED = {
    "baseline": set(),
    "avx2": {"avx"},
    "avx512": {"avx", "avx512"},
    "avx512_bf16": {"avx", "avx512", "avx512_bf16"},
    "amx": {"avx", "avx512", "avx512_bf16", "amx"},
}
# What a violation of each class is called in the report.
CLASS_NAMES = {
    "avx": "AVX/AVX2/FMA/BMI outside isa_avx2/isa_avx512/isa_avx512_bf16/isa_amx",
    "avx512": "AVX-512 outside isa_avx512/isa_avx512_bf16/isa_amx",
    "avx512_bf16": "AVX512_BF16 outside isa_avx512_bf16/isa_amx",
    "amx": "AMX outside isa_amx",
    "no_level": "an extension no level has (VNNI, VBMI, VPOPCNTDQ, IFMA, ...)",
}
# The class whose presence shows that a level was really compiled for it.
SIGNATURE_CLASS = {"avx2": "avx", "avx512": "avx512", "avx512_bf16": "avx512_bf16", "amx": "amx"}

# A namespace component isa_<level>:: (isa_generic, the code compiled once,
# matches too and has no privileges). avx512_bf16 before avx512.
NAMESPACE_RE = re.compile(r"(?<![\w])isa_(baseline|avx2|avx512_bf16|avx512|amx|generic)::")
# The same in a name objdump could not demangle (GCC mangles some lambdas of
# templates in a form libiberty rejects, and their OpenMP regions with them):
# the source name with its length, e.g. 8isa_avx2. A digit before the length
# would make it part of a longer length (18isa_avx2..., another identifier).
MANGLED_NAMESPACE_RE = re.compile(
    "(?<!\\d)(?:" + "|".join(f"{len(n)}{n}" for n in (
        "isa_baseline", "isa_avx2", "isa_avx512_bf16", "isa_avx512", "isa_amx", "isa_generic"))
    + ")")

# objdump -d -w lines: `0000000000001a10 <name>:` opens a function,
# `    1a10:\tc5 f8 77 \tvzeroupper` is an instruction (address, bytes, text).
FUNCTION_RE = re.compile(r"^([0-9a-f]+) <(.*)>:$")
INSTRUCTION_RE = re.compile(r"^\s*([0-9a-f]+):\t([0-9a-f ]*)\t(.*)$")
# Where an instruction's annotations start: `# 8 <symbol>`, `<symbol+0x10>`.
ANNOTATION_RE = re.compile(r"[#<]")

# Tokens objdump prints before the mnemonic.
PREFIXES = {
    "rep", "repz", "repe", "repnz", "repne", "lock", "notrack", "bnd", "xacquire", "xrelease",
    "data16", "data32", "addr16", "addr32", "cs", "ds", "es", "ss", "fs", "gs",
    "{vex}", "{vex2}", "{vex3}", "{evex}", "{rex}", "{rex2}", "{load}", "{store}", "{disp8}",
    "{disp16}", "{disp32}", "{nf}",
}
# Bytes that may come before a VEX/EVEX prefix (segment overrides, address
# size) or before a legacy opcode (operand size, rep, lock, REX).
PREFIX_BYTES = {0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x66, 0x67, 0xF0, 0xF2, 0xF3} | set(range(0x40, 0x50))

# Mnemonics starting with v that are not AVX (segment verification, VMX/SVM).
NOT_AVX_V = {
    "verr", "verw", "vmcall", "vmlaunch", "vmresume", "vmxoff", "vmxon", "vmread", "vmwrite",
    "vmptrld", "vmptrst", "vmclear", "vmfunc", "vmrun", "vmload", "vmsave", "vmmcall", "vmgexit",
}
# x86-64-v3 instructions outside the v namespace: BMI1, BMI2, LZCNT, MOVBE.
V3_LEGACY = {
    "andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "mulx", "pdep", "pext", "rorx", "sarx",
    "shlx", "shrx", "lzcnt", "movbe",
}
AMX_RE = re.compile(r"^(ldtilecfg|sttilecfg|tilerelease|tilezero|tileloadd|tileloaddt1|tilestored"
                    r"|tdp\w+|tcmm\w+)$")
BF16_RE = re.compile(r"^(vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16)$")
# AVX-512 extensions beyond x86-64-v4 that no level enables (and AVX-VNNI,
# which shares vpdpbusd & co): VNNI, VBMI, VBMI2, BITALG, VPOPCNTDQ, IFMA,
# VP2INTERSECT, 4FMAPS/4VNNIW, ER, PF.
NO_LEVEL_RE = re.compile(
    r"^(vpopcnt[bwdq]|vpdp(bus|wss)ds?|vpermb|vperm[it]2b|vpmultishiftqb|vpcompress[bw]|vpexpand[bw]"
    r"|vpsh[lr]dv?[wdq]|vpshufbitqmb|vpmadd52[lh]uq|vp2intersect[dq]|v4fn?madd[ps]s|vp4dpwssds?"
    r"|vexp2p[sd]|vrcp28\w+|vrsqrt28\w+|v(gather|scatter)pf[01]\w+)$")
# AVX-512 (F, BW, DQ, VL, CD) mnemonics that exist in EVEX form only. Those
# that always name an opmask or zmm register are caught by the register rule.
EVEX_ONLY_RE = re.compile(
    r"^(k(mov|and|andn|or|xor|xnor|not|ortest|test|shiftl|shiftr|add)[bwdq]|kunpck(bw|wd|dq)"
    r"|vmovdq[au](8|16|32|64)|vpternlog[dq]|vperm[it]2(w|d|q|ps|pd)|vpermw"
    r"|vpcompress[dq]|vpexpand[dq]|vcompressp[sd]|vexpandp[sd]|vrcp14\w+|vrsqrt14\w+"
    r"|vgetexp\w+|vgetmant\w+|vrndscale\w+|vreduce\w+|vrange\w+|vscalef\w+|vfixupimm\w+"
    r"|vfpclass\w+|vpmov(s|us)?(qb|qw|qd|db|dw|wb)|vpmov[bwdq]2m|vpmovm2[bwdq]"
    r"|vcvtt?(ps|pd|ss|sd)2u(dq|qq|si)|vcvtt?(ps|pd)2qq|vcvtu?qq2p[sd]|vcvtu(dq|si)2\w+"
    r"|vpabsq|vpm(ax|in)[su]q|vpmullq|vpsraq|vpsravq|vpsravw|vpsllvw|vpsrlvw|vpro[lr]v?[dq]"
    r"|vpconflict[dq]|vplzcnt[dq]|vpbroadcastm\w+|valign[dq]|vdbpsadbw|vpcmpu?[bwdq]"
    r"|vshuf[fi](32x4|64x2)|vextract[fi](32x4|32x8|64x2|64x4)|vinsert[fi](32x4|32x8|64x2|64x4)"
    r"|vbroadcast[fi](32x2|32x4|32x8|64x2|64x4)|vptestn?m[bwdq])$")
# Operands only AVX-512 has: zmm, the upper 16 vector registers, opmasks,
# zeroing, embedded broadcast and rounding.
AVX512_OPERAND_RE = re.compile(
    r"%zmm\d|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[0-7]\b|\{z\}|\{1to\d+\}|\{(rn-|rd-|ru-|rz-)?sae\}")


def tool_error(message):
    """Exits with status 2: the check could not run."""
    print(f"no_stray_instructions: {message}", file=sys.stderr)
    sys.exit(2)


def encoding(raw):
    """'evex', 'vex' or 'legacy' from the instruction's bytes (hex, spaced)."""
    for token in raw.split():
        byte = int(token, 16)
        if byte in PREFIX_BYTES:
            continue
        if byte == 0x62:
            return "evex"
        if byte in (0xC4, 0xC5):
            return "vex"
        return "legacy"
    return "legacy"


def classify(raw, text):
    """The class of one instruction ('amx', 'no_level', 'avx512_bf16',
    'avx512', 'avx'), or None when any x86-64-v2 CPU runs it."""
    # Comments (`# 8 <symbol>`) and branch targets (`<symbol+0x10>`) hold
    # symbol names, which may hold anything; operands never hold # or <.
    text = ANNOTATION_RE.split(text, maxsplit=1)[0]
    tokens = text.split()
    while tokens and (tokens[0] in PREFIXES or tokens[0].startswith("rex")):
        tokens.pop(0)
    if not tokens:
        return None
    mnemonic, operands = tokens[0], " ".join(tokens[1:])
    if mnemonic == "(bad)":  # objdump could not decode it: allowed nowhere
        return "no_level"
    enc = encoding(raw)
    if AMX_RE.match(mnemonic):
        return "amx"
    if NO_LEVEL_RE.match(mnemonic):
        return "no_level"
    if BF16_RE.match(mnemonic):
        return "avx512_bf16"
    if enc == "evex" or EVEX_ONLY_RE.match(mnemonic) or AVX512_OPERAND_RE.search(operands):
        return "avx512"
    if (enc == "vex" or "%ymm" in operands or mnemonic in V3_LEGACY
            or (mnemonic.startswith("v") and mnemonic not in NOT_AVX_V)):
        return "avx"
    return None


def level_of(function):
    """The level namespace a demangled function name belongs to: 'baseline',
    'avx2', ..., 'generic', or None. A name mentioning two levels gets the
    lower one (the stricter rule)."""
    if function.startswith("_Z"):  # not demangled
        found = [m.group(0).lstrip("0123456789")[len("isa_"):]
                 for m in MANGLED_NAMESPACE_RE.finditer(function)]
    else:
        found = [m.group(1) for m in NAMESPACE_RE.finditer(function)]
    if not found:
        return None
    ranked = [level for level in found if level in LEVELS]
    return min(ranked, key=LEVELS.index) if ranked else "generic"


class Function:
    """One function of the disassembly and what its instructions need."""

    __slots__ = ("name", "address", "level", "local", "instructions", "held", "refs")

    def __init__(self, name, address, local):
        self.name, self.address, self.local = name, address, local
        self.level = level_of(name)
        self.instructions = 0
        self.held = {}      # class -> [count, first instruction]
        self.refs = set()   # addresses its instructions branch to or take

    def may_inherit(self):
        """A local function outside the level namespaces: GCC's clones
        (`.isra.0`, `.constprop.0`, `.part.0`) of templates it instantiated in
        a level's translation unit. Only code of its own translation unit can
        call it, so it may run what every caller may run."""
        return self.local and self.level is None


# What scan() finds: the functions, and what each may run.
Scan = collections.namedtuple("Scan", "functions allowed callers")

# An address objdump names: `call 1a10 <f>`, `jmp 1a10 <f+0x8>`, `# 1a10 <f>`.
REFERENCE_RE = re.compile(r"\b([0-9a-f]+) <")


def elf_type(path):
    """'relocatable' (an object file) or 'linked' (a library or executable)."""
    with open(path, "rb") as f:
        header = f.read(18)
    if header[:4] != b"\x7fELF":
        tool_error(f"{path} is not an ELF file")
    return "relocatable" if int.from_bytes(header[16:18], "little") == 1 else "linked"


def local_function_addresses(path):
    """The addresses of the functions that only local symbols name. Fails on
    a stripped file: without its symbol table objdump would credit every
    local function's code to the global function before it."""
    nm = shutil.which("nm")
    if not nm:
        tool_error("nm not found (binutils; scripts/install-deps)")
    run = subprocess.run([nm, "--defined-only", "-P", path], capture_output=True, text=True)
    local, named_globally = set(), set()
    for line in run.stdout.splitlines():
        fields = line.split()  # name type value [size]; mangled names hold no spaces
        if len(fields) < 3 or fields[1] not in "tTwWi":
            continue
        (local if fields[1] == "t" else named_globally).add(int(fields[2], 16))
    if run.returncode != 0 or not (local or named_globally):
        tool_error(f"{path} has no symbol table (stripped?): {run.stderr.strip()}")
    return local - named_globally


def scan(path):
    """Disassembles `path`, sorts every instruction of every function, and
    decides what each function may run."""
    objdump = shutil.which("objdump")
    if not objdump:
        tool_error("objdump not found (binutils; scripts/install-deps)")
    # In an object file every section starts at 0: addresses name nothing,
    # so its local functions get their namespace's rule like any other.
    linked = elf_type(path) == "linked"
    local_addresses = local_function_addresses(path) if linked else set()
    command = [objdump, "-d", "-C", "-w", path]
    functions, function = [], None
    # stderr to a file: a pipe nobody reads while stdout streams could fill.
    with tempfile.TemporaryFile("w+") as errors, \
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True,
                             errors="replace") as process:
        for line in process.stdout:
            line = line.rstrip("\n")
            m = FUNCTION_RE.match(line)
            if m:
                address = int(m.group(1), 16)
                function = Function(m.group(2), address, address in local_addresses)
                functions.append(function)
                continue
            m = INSTRUCTION_RE.match(line)
            if not m or function is None:
                continue
            function.instructions += 1
            if linked and "<" in m.group(3):
                function.refs.update(int(a, 16) for a in REFERENCE_RE.findall(m.group(3)))
            cls = classify(m.group(2), m.group(3))
            if cls is not None:
                held = function.held.setdefault(cls, [0, f"at 0x{m.group(1)}: {m.group(3).strip()}"])
                held[0] += 1
        process.wait()
        errors.seek(0)
        stderr = errors.read()
    if process.returncode != 0:
        tool_error(f"{' '.join(command)} failed ({process.returncode}): {stderr.strip()}")
    if not functions:
        tool_error(f"objdump found no function in {path}")

    # Who refers to each function (calls, tail calls, address taken).
    by_address = {f.address: f for f in functions}
    callers = {id(f): [] for f in functions}
    for f in functions:
        for address in f.refs:
            target = by_address.get(address)
            if target is not None and target is not f:
                callers[id(target)].append(f)
    # What each may run: its namespace's classes; for the functions that
    # inherit, what all their callers may run (the greatest fixed point: start
    # from everything and narrow; none for a function nothing refers to, since
    # then a data reference, which this cannot follow, is what calls it).
    # Only functions a non-inheriting function reaches inherit anything: local
    # functions that refer only to one another (a cycle entered through data)
    # get nothing, rather than the fixed point's starting "everything".
    callees = {id(f): [] for f in functions}
    for f in functions:
        for c in callers[id(f)]:
            callees[id(c)].append(f)
    rooted, stack = set(), [f for f in functions if not f.may_inherit()]
    while stack:
        for g in callees[id(stack.pop())]:
            if g.may_inherit() and id(g) not in rooted:
                rooted.add(id(g))
                stack.append(g)
    everything = set(CLASS_NAMES) - {"no_level"}
    allowed = {id(f): (everything if id(f) in rooted else set()) if f.may_inherit()
               else ALLOWED.get(f.level, set()) for f in functions}
    inheriting = [f for f in functions if id(f) in rooted]
    changed = True
    while changed:
        changed = False
        for f in inheriting:
            narrowed = set.intersection(*(allowed[id(c)] for c in callers[id(f)]))
            if narrowed != allowed[id(f)]:
                allowed[id(f)], changed = narrowed, True
    return Scan(functions, allowed, callers)


def namespace_label(level):
    return "outside the level namespaces" if level is None else f"isa_{level}"


def offences(result):
    """[(function, [(class, count, first instruction)])] of the functions
    holding instructions they may not run."""
    found = []
    for f in result.functions:
        stray = [(cls, *f.held[cls]) for cls in CLASS_NAMES
                 if cls in f.held and cls not in result.allowed[id(f)]]
        if stray:
            found.append((f, stray))
    return found


def report(path, result, expect_levels, out=sys.stdout):
    """Prints the summary and the offenders; returns the exit status."""
    functions, instructions, classes = (collections.Counter(), collections.Counter(),
                                        collections.Counter())
    inherited = 0
    for f in result.functions:
        functions[f.level] += 1
        instructions[f.level] += f.instructions
        for cls, (count, _) in f.held.items():
            classes[(f.level, cls)] += count
        if f.may_inherit() and f.held and result.allowed[id(f)]:
            inherited += 1
    print(f"{path}: {sum(instructions.values())} instructions checked in "
          f"{sum(functions.values())} functions", file=out)
    for level in LEVELS + ("generic", None):
        if not functions[level]:
            continue
        held = ", ".join(f"{classes[(level, c)]} {c}" for c in CLASS_NAMES if classes[(level, c)])
        print(f"  {namespace_label(level):30} {functions[level]:7} functions {instructions[level]:9} "
              f"instructions{'  (' + held + ')' if held else ''}", file=out)
    if inherited:
        print(f"  ({inherited} local functions outside the namespaces, called only by level code, "
              f"run what their callers may)", file=out)
    status = 0
    for level in expect_levels:
        signature = SIGNATURE_CLASS.get(level)
        if not functions[level]:
            print(f"EXPECTED: functions in isa_{level}; there are none (were the namespaces renamed?)",
                  file=out)
            status = 1
        elif signature and not classes[(level, signature)]:
            print(f"EXPECTED: {signature} instructions in isa_{level}; there are none "
                  f"(was the level compiled without its flags?)", file=out)
            status = 1
    stray = offences(result)
    if stray:
        total = sum(count for _, held in stray for _, count, _ in held)
        print(f"FAIL: {len(stray)} functions hold {total} instructions their namespace may not "
              f"run:", file=out)
        for f, held in stray:
            where = namespace_label(f.level)
            if f.may_inherit():
                names = [c.name for c in result.callers[id(f)]]
                where += (f"; local, called by {len(names)}: " + "; ".join(names[:3])
                          + (" ..." if len(names) > 3 else "") if names else "; local, no caller found")
            print(f"  {f.name}\n    [{where}]", file=out)
            for cls, count, first in held:
                print(f"    {CLASS_NAMES[cls]}: {count} instructions, first {first}", file=out)
        status = 1
    elif status == 0:
        print("OK: no instruction outside the level that may run it", file=out)
    return status


# --------------------------------------------------------------------------
# --self-test: planted offenders the scan must find, and nothing else.
# --------------------------------------------------------------------------

# One source, compiled once per part (-DPART_<NAME>) with that part's flags.
SELF_TEST_SOURCE = r"""
#include <immintrin.h>

// An inline function outside every level namespace, compiled differently by
// the translation units that include it: the linker keeps one copy (weak symbol).
namespace selftest {
__attribute__((noinline)) inline float shared_sum(const float* x) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(_mm512_loadu_ps(x));
#else
  float s = 0;
  for (int i = 0; i < 16; ++i) s += x[i];
  return s;
#endif
}
}  // namespace selftest

#if defined(PART_GENERIC)  // default flags: x86-64 baseline
namespace selftest {
void sse_add(float* x) { _mm_storeu_ps(x, _mm_add_ps(_mm_loadu_ps(x), _mm_loadu_ps(x + 4))); }
int trailing_zeros(unsigned x) {
  int n;
  __asm__("rep bsf %1, %0" : "=r"(n) : "r"(x));  // objdump: tzcnt
  return n;
}
void verify_segment(unsigned short s) { __asm__ volatile("verw %0" : : "r"(s)); }
float call_shared(const float* x) { return shared_sum(x); }
}  // namespace selftest

#elif defined(PART_AVX2)  // -march=x86-64-v3, -fopenmp
// Local functions outside the namespaces, as GCC's clones of templates
// (.isra.0, ...) are: called only by the level's code (one directly, one
// through the other), they may run what it runs.
static __attribute__((noinline)) void local_inner(float* x) {
  _mm256_storeu_ps(x + 16, _mm256_setzero_ps());
}
static __attribute__((noinline)) void local_outer(float* x) {
  _mm256_storeu_ps(x + 8, _mm256_setzero_ps());
  local_inner(x);
}
namespace attnkit::kernels::isa_avx2 {
void fma(float* x) {
  const __m256 a = _mm256_loadu_ps(x);
  _mm256_storeu_ps(x, _mm256_fmadd_ps(a, a, a));
  local_outer(x);
}
void parallel_fma(float* x, int n) {
#pragma omp parallel for
  for (int i = 0; i < n; ++i) {  // outlined: parallel_fma(float*, int) [clone ._omp_fn.0]
    const __m256 a = _mm256_loadu_ps(x + 8 * i);
    _mm256_storeu_ps(x + 8 * i, _mm256_fmadd_ps(a, a, a));
  }
}
void (*lambda_fma())(float*) {
  return [](float* x) {
    const __m256 a = _mm256_loadu_ps(x);
    _mm256_storeu_ps(x, _mm256_mul_ps(a, a));
  };
}
// A name the demangler rejects (as it does some of GCC's OpenMP regions of
// lambdas of templates): the level's by its mangled namespace, 8isa_avx2.
void opaque(float* x) __asm__("_ZN7attnkit7kernels8isa_avx26opaqueEv_X");
void opaque(float* x) { _mm256_storeu_ps(x + 32, _mm256_setzero_ps()); }
}  // namespace attnkit::kernels::isa_avx2

#elif defined(PART_AVX512)  // -march=x86-64-v4
namespace attnkit::kernels::isa_avx512 {
void add(float* x) { _mm512_storeu_ps(x, _mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(x))); }
float call_shared(const float* x) { return selftest::shared_sum(x); }
}  // namespace attnkit::kernels::isa_avx512

#elif defined(PART_AMX)  // the amx level's flags
namespace attnkit::kernels::isa_amx {
void release() { _tile_release(); }
void dot(float* x, const void* y) {
  _mm512_storeu_ps(x, _mm512_dpbf16_ps(_mm512_loadu_ps(x), (__m512bh)_mm512_loadu_ps(y),
                                       (__m512bh)_mm512_loadu_ps(y)));
}
}  // namespace attnkit::kernels::isa_amx

#elif defined(PART_BAD_OUTSIDE)  // -march=x86-64-v3, outside the level namespaces
// Local functions with AVX: one called by code outside the levels, one that
// only a table of pointers refers to (which the scan cannot follow).
// (Each function stores at its own offset: GCC folds identical functions.)
static __attribute__((noinline)) void local_stray(float* x) {
  _mm256_storeu_ps(x + 8, _mm256_setzero_ps());
}
static void local_in_table(float* x) { _mm256_storeu_ps(x + 16, _mm256_setzero_ps()); }
extern void (*const selftest_table[])(float*) = {local_in_table};  // extern: kept
namespace selftest {
void call_local_stray(float* x) { local_stray(x); }
void avx2_outside(float* x) { _mm256_storeu_ps(x, _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x))); }
unsigned bmi2_outside(unsigned a, unsigned b) { return _bzhi_u32(a, b); }
void opaque(float* x) __asm__("_ZN8selftest6opaqueEv_X");  // not demangled either
void opaque(float* x) { _mm256_storeu_ps(x + 24, _mm256_setzero_ps()); }
}  // namespace selftest

#elif defined(PART_BAD_AVX512_IN_AVX2)  // -march=x86-64-v4 in isa_avx2: a wrong namespace
namespace attnkit::kernels::isa_avx2 {
void wide(float* x) { _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(x))); }
}  // namespace attnkit::kernels::isa_avx2

#elif defined(PART_BAD_IN_AVX512)  // the amx level's flags in isa_avx512
namespace attnkit::kernels::isa_avx512 {
void tiles() { _tile_release(); }
void dot_bf16(float* x, const void* y) {
  _mm512_storeu_ps(x, _mm512_dpbf16_ps(_mm512_loadu_ps(x), (__m512bh)_mm512_loadu_ps(y),
                                       (__m512bh)_mm512_loadu_ps(y)));
}
}  // namespace attnkit::kernels::isa_avx512
#endif
"""

V3, V4 = ["-march=x86-64-v3"], ["-march=x86-64-v4"]
AMX_FLAGS = ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
SELF_TEST_PARTS = {
    "GENERIC": [],
    "AVX2": V3 + ["-fopenmp"],
    "AVX512": V4,
    "AMX": AMX_FLAGS,
    "BAD_OUTSIDE": V3,
    "BAD_AVX512_IN_AVX2": V4,
    "BAD_IN_AVX512": AMX_FLAGS,
}

# Functions of the clean parts, each with the class it must hold (so that the
# pass is not vacuous) or None.
SELF_TEST_CLEAN = {
    "selftest::sse_add(float*)": None,
    "selftest::trailing_zeros(unsigned int)": None,
    "selftest::verify_segment(unsigned short)": None,
    "attnkit::kernels::isa_avx2::fma(float*)": "avx",
    "attnkit::kernels::isa_avx2::parallel_fma(float*, int) [clone ._omp_fn.0]": "avx",
    "attnkit::kernels::isa_avx2::lambda_fma()::{lambda(float*)#1}::_FUN(float*)": "avx",
    "_ZN7attnkit7kernels8isa_avx26opaqueEv_X": "avx",
    "local_inner(float*)": "avx",
    "local_outer(float*)": "avx",
    "attnkit::kernels::isa_avx512::add(float*)": "avx512",
    "attnkit::kernels::isa_amx::release()": "amx",
    "attnkit::kernels::isa_amx::dot(float*, void const*)": "avx512_bf16",
}
# The planted offenders: function -> the classes it must be flagged for.
SELF_TEST_OFFENDERS = {
    "selftest::shared_sum(float const*)": {"avx512"},  # when the avx512 object is linked first
    "selftest::avx2_outside(float*)": {"avx"},
    "selftest::bmi2_outside(unsigned int, unsigned int)": {"avx"},
    "_ZN8selftest6opaqueEv_X": {"avx"},
    "local_stray(float*)": {"avx"},
    "local_in_table(float*)": {"avx"},
    "attnkit::kernels::isa_avx2::wide(float*)": {"avx512"},
    "attnkit::kernels::isa_avx512::tiles()": {"amx"},
    "attnkit::kernels::isa_avx512::dot_bf16(float*, void const*)": {"avx512_bf16"},
}


def self_test():
    """Returns 0 when the scan flags exactly the planted offenders."""
    compiler = shutil.which("g++")
    if not compiler:
        print("self-test: g++ not found (build-essential; scripts/install-deps)")
        return 2
    failures = []
    with tempfile.TemporaryDirectory(prefix="no_stray_self_test.") as work:
        source = os.path.join(work, "parts.cpp")
        with open(source, "w") as f:
            f.write(SELF_TEST_SOURCE)
        objects = {}
        for part, flags in SELF_TEST_PARTS.items():
            objects[part] = os.path.join(work, part.lower() + ".o")
            subprocess.run([compiler, "-std=c++17", "-O2", "-fPIC", "-c", f"-DPART_{part}", *flags,
                            source, "-o", objects[part]], check=True)
        # The clean objects alone, the generic one first: the linker keeps its
        # copy of shared_sum. Then the same objects with the avx512 one first
        # (the linker keeps the AVX-512 copy, which the generic caller would
        # run) and the bad parts.
        clean = ["GENERIC", "AVX2", "AVX512", "AMX"]
        planted = ["AVX512", "GENERIC", "AVX2", "AMX", "BAD_OUTSIDE", "BAD_AVX512_IN_AVX2",
                   "BAD_IN_AVX512"]
        for name, parts, expected in (("clean.so", clean, {}),
                                      ("planted.so", planted, SELF_TEST_OFFENDERS)):
            library = os.path.join(work, name)
            subprocess.run([compiler, "-shared", "-fopenmp", "-o", library,
                            *[objects[p] for p in parts]], check=True)
            result = scan(library)
            # Exactly the planted functions, each for (at least) its planted
            # classes: the compiler may add AVX around an AVX-512 body.
            found = {f.name: {cls for cls, _, _ in held} for f, held in offences(result)}
            if set(found) != set(expected) or any(not expected[f] <= found[f] for f in expected):
                failures.append(f"{name}: flagged {sorted(found.items())}, expected "
                                f"{sorted(expected.items())}")
            # The clean functions were seen, and hold what makes their pass a test.
            held = {f.name: set(f.held) for f in result.functions}
            for function, cls in SELF_TEST_CLEAN.items():
                if function not in held:
                    failures.append(f"{name}: {function} not found in the disassembly")
                elif cls and cls not in held[function]:
                    failures.append(f"{name}: {function} holds no {cls} instruction "
                                    f"(only {sorted(held[function])})")
            # The command line: exit status and the offenders named.
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--expect-levels",
                                  "avx2,avx512,amx", library], capture_output=True, text=True)
            if run.returncode != (1 if expected else 0) or any(f not in run.stdout for f in expected):
                failures.append(f"{name}: the command line exited {run.returncode}:\n"
                                f"{run.stdout}{run.stderr}")
    for failure in failures:
        print("self-test FAIL:", failure)
    if not failures:
        print(f"self-test OK: {len(SELF_TEST_OFFENDERS)} planted offenders flagged (the shared inline "
              f"copy only when linked first), {len(SELF_TEST_CLEAN)} clean functions passed")
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", metavar="FILE")
    parser.add_argument("--expect-levels", default="",
                        help="comma-separated levels whose namespaces must hold functions")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    if not args.files:
        parser.error("give the library to check (or --self-test)")
    expect = [level for level in args.expect_levels.split(",") if level]
    for level in expect:
        if level not in LEVELS:
            parser.error(f"--expect-levels: unknown level {level!r} (one of {', '.join(LEVELS)})")
    status = 0
    for path in args.files:
        if not os.path.isfile(path):
            tool_error(f"{path}: no such file")
        status = max(status, report(path, scan(path), expect))
    return status


if __name__ == "__main__":
    sys.exit(main())
