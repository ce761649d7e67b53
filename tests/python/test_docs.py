"""Every ```python block of README.md and docs/*.md runs as written (issue 14:
every code example in the README and docs runs as a test). Each block runs in
a fresh namespace with the working directory at a scratch directory; a block
that raises fails, named by its file and first line."""
import pathlib
import re
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks():
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
            line = text.count("\n", 0, match.start()) + 2
            yield pytest.param(match.group(1), id=f"{path.relative_to(ROOT)}:{line}")


BLOCKS = list(python_blocks())


def test_the_docs_have_python_examples():
    assert any("README.md" in block.id for block in BLOCKS), "README.md has no ```python block"


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs(code, tmp_path, monkeypatch):
    # From a file: torch.jit.script reads the source of what it compiles.
    monkeypatch.chdir(tmp_path)
    block = tmp_path / "block.py"
    block.write_text(code)
    runpy.run_path(str(block), run_name="docs")
