#!/usr/bin/python3
"""Runs the Python examples of README.md as written (issue 14: every code
example in the README runs as a test). Each ```python block of the README is
executed in a fresh namespace; a block that raises fails the test, naming the
block's first line in the README."""
import pathlib
import re
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]


def python_blocks(text):
    """(line number, code) of every ```python block."""
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        yield text.count("\n", 0, match.start()) + 2, match.group(1)


def main():
    blocks = list(python_blocks((ROOT / "README.md").read_text()))
    if not blocks:
        sys.exit("test_readme: README.md has no ```python block: nothing was tested")
    failures = 0
    for line, code in blocks:
        try:
            exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "readme"})
            print(f"README.md:{line}: ok")
        except Exception:
            failures += 1
            print(f"README.md:{line}: FAILED")
            traceback.print_exc()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
