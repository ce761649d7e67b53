"""attnkit.models.Transformer and the CLI's runs: a run of `attnkit train` loads
in Python and decodes exactly as `attnkit generate` does; a model saved from
Python is a run that `attnkit eval` and `attnkit generate` read, with the
numbers of the model it came from."""
import json
import os
import pathlib
import subprocess

import pytest
import torch

import attnkit

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI = os.environ.get("ATTNKIT_CLI", str(ROOT / "build" / "attnkit"))
PROMPT = "in the beginning god"


def cli(*args):
    result = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"attnkit {args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def encode(text):
    return torch.tensor([[0 if c == " " else ord(c) - 96 for c in text]], dtype=torch.long)


def decode(ids):
    return "".join(" " if i == 0 else chr(96 + i) for i in ids.tolist())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "genesis"
    cli("data", "char-lm", "--input", ROOT / "tests" / "data" / "genesis-1-2.txt", "--out", out)
    return out


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    cli("train", "--task", "char-lm", "--data", data, "--layers", 2, "--width", 32, "--heads", 2, "--ffn", 64,
        "--context", 32, "--batch", 4, "--steps", 30, "--dropout", 0, "--threads", 1, "--lr", 3e-3,
        "--positions", "learned", "--attention", "full", "--display", "quiet", "--out", out)
    return out


def cli_greedy(run_dir, tokens=24):
    """The continuation `attnkit generate` prints at temperature 0."""
    out = cli("generate", "--run", run_dir, "--prompt", PROMPT, "--tokens", tokens, "--temperature", 0,
              "--threads", 1)
    text = out.strip().splitlines()[-1]
    assert text.startswith(PROMPT), out
    return text[len(PROMPT):len(PROMPT) + tokens]


def cli_eval(run_dir, *extra):
    out_json = pathlib.Path(run_dir) / "eval.json"
    cli("eval", "--run", run_dir, "--max-batches", 3, "--threads", 1, "--json", out_json, *extra)
    return json.loads(out_json.read_text())


def test_a_cli_run_loads_and_decodes_as_the_cli_does(run):
    model = attnkit.models.Transformer.load(run)
    assert not model.training and model.run_info["step"] == 30
    assert model.options["positions"] == "learned" and model.options["width"] == 32
    python = decode(model.generate(encode(PROMPT), tokens=24, temperature=0)[0, len(PROMPT):])
    assert python == cli_greedy(run)


def test_a_python_saved_run_is_read_by_eval_and_generate(run, data, tmp_path):
    model = attnkit.models.Transformer.load(run)
    saved = tmp_path / "saved"
    path = model.save(saved, task="char-lm", data_dir=data, step=30, trainer=model.run_info["trainer"])
    assert pathlib.Path(path).name == "checkpoint-00000030.ckpt"
    # The same weights: eval gives the same numbers, to the last digit.
    assert cli_eval(saved)["loss"] == cli_eval(run)["loss"]
    # Trained on in Python, the weights change, and the CLI sees the new ones.
    torch.manual_seed(0)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    windows = encode(PROMPT * 2)
    loss = torch.nn.functional.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[0, 1:])
    loss.backward()
    optimizer.step()
    model.save(saved, task="char-lm", data_dir=data, step=31, trainer=model.run_info["trainer"])
    assert cli_eval(saved)["loss"] != cli_eval(run)["loss"]
    model.eval()
    python = decode(model.generate(encode(PROMPT), tokens=24, temperature=0)[0, len(PROMPT):])
    assert python == cli_greedy(saved)


def test_save_refuses_what_a_run_cannot_hold(run, data, tmp_path):
    model = attnkit.models.Transformer.load(run)
    with pytest.raises(RuntimeError, match="float32"):
        model.double().save(tmp_path / "x", task="char-lm", data_dir=data)
    with pytest.raises(RuntimeError, match="vocab_size"):
        attnkit.models.Transformer(30, layers=1, width=8, heads=2).save(tmp_path / "y", task="char-lm",
                                                                        data_dir=data)
    with pytest.raises(RuntimeError, match="no checkpoint"):
        attnkit.models.Transformer.load(tmp_path / "nothing-here")


def test_save_takes_the_copy_length_under_its_old_name_too(tmp_path):
    model = attnkit.models.Transformer(12, layers=1, width=8, heads=2, architecture="encoder")
    model.save(tmp_path / "new", task="copy", copy_length=6)
    with pytest.warns(DeprecationWarning, match="'length' is deprecated, use 'copy_length'"):
        model.save(tmp_path / "old", task="copy", length=6)
    for name in ("new", "old"):
        assert attnkit.models.Transformer.load(tmp_path / name).run_info["task"]["copy_length"] == 6
    with pytest.raises(TypeError, match="not both"):
        model.save(tmp_path / "both", task="copy", copy_length=6, length=6)


def test_set_attention_matches_cli_eval_with_a_swapped_mechanism(run):
    model = attnkit.models.Transformer.load(run)
    model.set_attention("sparse-local-causal:span=8")
    assert model.options["attention"] == ["sparse-local-causal:span=8"]
    with pytest.raises(RuntimeError, match="cannot serve a decoder"):
        model.set_attention("clustered:clusters=4")


def test_from_kwargs_builds_every_architecture():
    torch.manual_seed(0)
    for options in ({"architecture": "decoder", "attention": ["full", "causal-linear"]},
                    {"architecture": "encoder", "attention": "improved-clustered:clusters=3,topk=4"},
                    {"architecture": "encoder-decoder", "positions": "learned", "max_length": 64}):
        model = attnkit.models.Transformer.from_kwargs(vocab_size=11, layers=2, width=16, heads=2, ffn=32,
                                                       dropout=0.0, **options)
        tokens = torch.randint(0, 11, (2, 9))
        source = torch.randint(0, 11, (2, 5)) if options["architecture"] == "encoder-decoder" else None
        logits = model(tokens, source)
        assert logits.shape == (2, 9, 11)
        logits.logsumexp(-1).sum().backward()
        assert all(p.grad is not None for n, p in model.named_parameters()), options
    with pytest.raises(TypeError, match="unknown option"):
        attnkit.models.Transformer(11, wdith=16)


def test_cli_mechanisms_table_lists_every_option():
    """`attnkit mechanisms` (and `bench --list`) print the registry as the
    library holds it: every entry, every option as key=default with its type."""
    for args in (["mechanisms"], ["bench", "--list"]):
        table = cli(*args)
        for entry in attnkit.mechanisms():
            assert f"  {entry['name']} " in table, (args, entry["name"])
            for option in entry["options"]:
                assert f"{option['key']}={option['default']}  ({option['accepts']})" in table, (args, option)
                assert option["type"] in ("integer", "real", "boolean", "choice"), option
