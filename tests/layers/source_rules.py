#!/usr/bin/env python3
"""Rules of the source tree that no compiler enforces (issue 47):

  mechanism-names  models/, train/, cli/, bindings/ and python/attnkit ask the
                   registry (include/attnkit/nn/registry.h) what a mechanism
                   is; none compares a spec's name with a mechanism's name
                   (`name == "full"`, `.rfind("sparse-", 0) == 0`,
                   `spec.startswith("sac")`, `name in ("full", ...)`). The
                   position scheme and read-out "none" are not mechanism
                   names here.
  base-torch-free  src/base includes no torch, ATen or c10 header: it is the
                   bottom layer, below the kernels.
  op-registration  every op file of src/ops registers its own schemas, in
                   exactly one TORCH_LIBRARY_FRAGMENT(attnkit, ...), and no
                   file of src/ holds a non-fragment TORCH_LIBRARY(attnkit, ...).

  source_rules.py ROOT --cli ATTNKIT   checks the tree at ROOT; the mechanism
                                       names are the registry's, as
                                       `ATTNKIT mechanisms` lists them
  source_rules.py --self-test          shows that each rule catches what it
                                       should and passes what it should

Exits 1 with one line per violation (file:line: rule: text).
"""
import argparse
import pathlib
import re
import subprocess
import sys

# Where mechanism names must not be compared, and the files checked there.
NAME_FOLDERS = ["src/models", "src/train", "cli", "src/bindings", "python/attnkit"]
SUFFIXES = {".cpp", ".h", ".py"}
# Words that are mechanism names but also something else in these folders.
NOT_MECHANISMS = {"none"}


def registry_names(cli):
    """The registry's names, from `attnkit mechanisms` (rows: two spaces, the
    name, spaces, the support letters)."""
    out = subprocess.run([cli, "mechanisms"], check=True, capture_output=True, text=True).stdout
    names = re.findall(r"^  (\S+) +[-A-Za-z]{6,} ", out, flags=re.M)
    if len(names) < 5:
        sys.exit(f"source_rules: found only {names} in `{cli} mechanisms`; has its format changed?")
    return names


def name_comparisons(text, names):
    """(line, literal) for every comparison of a string literal naming a
    mechanism, or a prefix of one, in C++ or Python source."""
    banned = [n for n in names if n not in NOT_MECHANISMS]
    # Prefixes a comparison could test ("sparse-" for the patterns).
    prefixes = {n.split("-")[0] + "-" for n in banned if "-" in n}
    lit = r"""["']([A-Za-z0-9_:=,.-]+)["']"""
    patterns = [
        r"(?:==|!=)\s*" + lit,                       # x == "full"
        lit + r"\s*(?:==|!=)",                       # "full" == x
        r"\.(?:rfind|find|startswith|starts_with|compare)\(\s*" + lit,  # prefix tests
        r"\bin\s*[\(\[\{]\s*" + lit,                 # x in ("full", ...)
    ]
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        code = re.split(r"//|#(?!include)", line, maxsplit=1)[0] if not line.lstrip().startswith("#include") else ""
        for pattern in patterns:
            for m in re.finditer(pattern, code):
                word = m.group(1).split(":", 1)[0]
                if word in banned or word in prefixes:
                    hits.append((number, m.group(0).strip()))
    return hits


TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10)/', re.M)
FRAGMENT = re.compile(r"^\s*TORCH_LIBRARY_FRAGMENT\(\s*attnkit\s*,", re.M)
LIBRARY = re.compile(r"^\s*TORCH_LIBRARY\(\s*attnkit\s*,", re.M)


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


def check(root, names):
    problems = []
    for folder in NAME_FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES or "__pycache__" in path.parts:
                continue
            for number, what in name_comparisons(path.read_text(), names):
                problems.append(f"{path.relative_to(root)}:{number}: mechanism-names: {what} "
                                "(ask the registry: MechanismInfo's fields)")
    for path in sorted((root / "src/base").rglob("*")):
        if path.suffix in SUFFIXES:
            text = path.read_text()
            for m in TORCH_INCLUDE.finditer(text):
                problems.append(f"{path.relative_to(root)}:{line_of(text, m.start())}: base-torch-free: "
                                f"{m.group(0).strip()}")
    for path in sorted((root / "src/ops").glob("*.cpp")):
        text = path.read_text()
        count = len(FRAGMENT.findall(text))
        if count != 1:
            problems.append(f"{path.relative_to(root)}:1: op-registration: {count} "
                            "TORCH_LIBRARY_FRAGMENT(attnkit, ...) blocks, expected 1 (its own schemas)")
    for path in sorted((root / "src").rglob("*.cpp")):
        text = path.read_text()
        for m in LIBRARY.finditer(text):
            problems.append(f"{path.relative_to(root)}:{line_of(text, m.start())}: op-registration: "
                            "TORCH_LIBRARY(attnkit, ...): register with a fragment in the op's own file")
    return problems


def self_test():
    names = ["full", "linear", "causal-linear", "agglomerative", "sparse-local", "sac", "none"]
    caught = [
        'if (info->name == "agglomerative") {',
        'TORCH_CHECK(spec.name != "sac", "x");',
        'if ("full" == name) return;',
        'note = info.name.rfind("sparse-", 0) == 0 ? "a" : "b";',
        'self._exact = self._spec.split(":", 1)[0] == "full"',
        'if name in ("full", "linear"):',
        "if spec.startswith('sparse-'):",
        'return spec == "sparse-local:span=8";',
    ]
    passed = [
        'if (name == "none") return Positions::none;',  # a position scheme
        'auto info = find_mechanism("full");',           # a lookup, not a comparison
        '// compare: name == "full" is what we no longer do',
        'x = torch.ops.attnkit.linear(a, w)',
        '#include "nn/mechanisms/full.h"',
        'if (kind == "multihead") return;',
    ]
    failures = []
    for line in caught:
        if not name_comparisons(line, names):
            failures.append(f"not caught: {line}")
    for line in passed:
        if name_comparisons(line, names):
            failures.append(f"wrongly caught: {line}")
    for text, expected in [('#include <torch/types.h>\n', 1), ('#include "base/bf16.h"\n', 0),
                           ('  #include <c10/util/Half.h>\n', 1)]:
        if len(TORCH_INCLUDE.findall(text)) != expected:
            failures.append(f"base-torch-free: {text.strip()} should give {expected}")
    if len(FRAGMENT.findall("TORCH_LIBRARY_FRAGMENT(attnkit, m) {\n}\n")) != 1 or LIBRARY.findall(
            "TORCH_LIBRARY_FRAGMENT(attnkit, m) {\n}\n") or len(LIBRARY.findall("TORCH_LIBRARY(attnkit, m) {\n")) != 1:
        failures.append("op-registration patterns")
    for f in failures:
        print("source_rules self-test:", f)
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", type=pathlib.Path)
    parser.add_argument("--cli", help="the attnkit tool, whose `mechanisms` lists the registry")
    parser.add_argument("--self-test", action="store_true")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    if args.root is None or args.cli is None:
        parser.error("give ROOT and --cli, or --self-test")
    problems = check(args.root, registry_names(args.cli))
    for p in problems:
        print(p)
    if problems:
        print(f"source_rules: {len(problems)} violation(s); see the rules at the top of {__file__}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
