"""The scripts of examples/ run end to end with small settings (the numbers
they print are checked for sanity, not for quality: a few steps of training)."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CLI = os.environ.get("ATTNKIT_CLI", str(ROOT / "build" / "attnkit"))


def run(*args, cwd):
    result = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "genesis"
    subprocess.run([CLI, "data", "char-lm", "--input", ROOT / "tests" / "data" / "genesis-1-2.txt",
                    "--out", out], check=True, capture_output=True)
    return out


def test_train_char_model_is_short_and_learns(data, tmp_path):
    source = (EXAMPLES / "train_char_model.py").read_text()
    assert len(source.splitlines()) < 60, "the issue promises a character model in under 60 lines"
    out = run(EXAMPLES / "train_char_model.py", "--data", data, "--steps", 100, "--attention",
              "sparse-local-causal:span=8", cwd=tmp_path)
    bpc = [float(x) for x in re.findall(r"train bpc ([0-9.]+)", out)]
    assert len(bpc) == 2, out
    assert bpc[-1] < 3.5, f"100 steps should get below 3.5 bpc (uniform over 27 symbols: 4.75):\n{out}"


def test_swap_attention_evaluates_each_spec(data, tmp_path):
    run_dir = tmp_path / "run"
    subprocess.run([CLI, "train", "--task", "char-lm", "--data", data, "--layers", "1", "--width", "32",
                    "--heads", "2", "--ffn", "64", "--context", "32", "--batch", "4", "--steps", "10",
                    "--dropout", "0", "--threads", "1", "--display", "quiet", "--out", run_dir],
                   check=True, capture_output=True)
    out = run(EXAMPLES / "swap_attention.py", "--run", run_dir, "--batches", 2, "--attention",
              "sparse-local-causal:span=4", "causal-linear", cwd=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["trained"] == ["full"]
    assert set(result["bpc"]) == {"full", "sparse-local-causal:span=4", "causal-linear"}
    assert len(set(result["bpc"].values())) == 3, "swapping the mechanism must change the output"


def test_document_memory_answers_like_the_layer(tmp_path):
    out = run(EXAMPLES / "document_memory.py", "--tokens", 5000, "--queries", 500, "--dim", 32, cwd=tmp_path)
    error = float(re.search(r"relative difference .*: ([0-9.e+-]+)", out).group(1))
    assert error < 1e-5, out
