"""torch.jit.trace and torch.jit.script of models built from attnkit's modules.

Every mechanism of the registry in a transformer (attnkit.models.Transformer)
and in a model of attnkit.nn layers, plus the zoo's modules and an
encoder-decoder: each traced and scripted, saved with torch.jit.save, loaded in
Python (torch.jit.load) and run from C++ by attnkit_run_exported
(torch::jit::load; tests/export/run_exported.cpp), the outputs equal to the
eager model's, bitwise (the same kernels on the same inputs and thread count).
"""
import io
import os
import pathlib
import subprocess
import warnings
import zipfile
from typing import Tuple

import pytest
import torch

import attnkit
import attnkit.nn as ann
from attnkit.models import Transformer
from torch import Tensor

# Small settings that keep each mechanism non-trivial at L = 9.
_OPTIONS = {"clustered": "clusters=3,seed=2", "improved-clustered": "clusters=2,topk=3,seed=1",
            "sparse-local": "span=2", "sparse-local-causal": "span=2", "sparse-segments": "segment=3",
            "sparse-segments-causal": "segment=3", "sparse-strided": "stride=2", "sparse-random": "edges=2",
            "sac": "seed=3", "full": "window=4"}
_ENTRIES = attnkit.mechanisms()


def _spec(entry):
    name = entry["name"]
    return name + (":" + _OPTIONS[name] if name in _OPTIONS else "")


def _causal(entry):
    return entry["supports"]["causal"] or entry["always_causal"]


class LayerModel(torch.nn.Module):
    """A user's model of attnkit.nn layers: projection, sinusoidal positions,
    multi-head attention with the mechanism (causal where it can be), and an
    output projection; key padding where the mechanism takes it."""

    def __init__(self, spec: str, causal: bool, padding: bool):
        super().__init__()
        self.inp = ann.Linear(6, 16)
        self.positions = ann.SinusoidalPositionalEncoding(16, max_length=64)
        self.attention = ann.MultiheadAttention(16, 2, attention=spec, batch_first=True)
        self.out = ann.Linear(16, 5, bias=False)
        self.causal, self.padding = causal, padding

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = self.positions(self.inp(x), offset=1)
        a = self.attention(h, h, h, is_causal=self.causal, key_lengths=lengths if self.padding else None)[0]
        return self.out(torch.relu(a + h))


class AgglomerativeModel(torch.nn.Module):
    """The layer-only mechanism as its layer."""

    def __init__(self):
        super().__init__()
        self.inp = ann.Linear(6, 16)
        self.attention = ann.AgglomerativeAttention(16, 4)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = self.inp(x)
        return self.attention(h, None, True) + self.attention(h, h)


class ZooModel(torch.nn.Module):
    """The zoo's modules side by side: scores, location, relative positions,
    linear attention, the gated layer, a registry mechanism over heads
    (clustered: it takes key lengths)."""

    def __init__(self):
        super().__init__()
        self.additive = ann.AdditiveAttention(6, 6, 4)
        self.general = ann.GeneralAttention(6, 6)
        self.dot = ann.DotAttention(scaled=True)
        self.location = ann.LocationAttention(6, 9)
        self.relative = ann.RelativePositionAttention(6, 2, max_relative=3)
        self.linear = ann.LinearAttention("elu", normalize=True, causal=True, rotary_dim=2)
        self.gated = ann.GatedLinearAttention(6)
        self.heads = ann.registry.Clustered(clusters=2, seed=4)

    def forward(self, x: Tensor, lengths: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                           Tensor, Tensor]:
        additive, weights = self.additive(x, x, x, lengths)
        general = self.general(x, x, x)[0]
        dot = self.dot(x, x, x, lengths)[0]
        location = self.location(x, x, lengths)[0]
        relative = self.relative(x, lengths, True)
        q = x.view(x.shape[0], x.shape[1], 2, 3).transpose(1, 2)
        linear = self.linear(q, q, q)
        gated = self.gated(x, x, causal=True)
        heads = self.heads(q, q, q, key_lengths=lengths)
        return additive, weights, general, dot, location, relative, linear, gated, heads


class WeightsModel(torch.nn.Module):
    """Exact attention's output and its averaged weights (need_weights)."""

    def __init__(self):
        super().__init__()
        self.attention = ann.MultiheadAttention(16, 4, kv_heads=2, alibi=True, batch_first=True)

    def forward(self, x: Tensor, lengths: Tensor) -> Tuple[Tensor, Tensor]:
        h = torch.cat([x, x, -x], -1)[..., :16]
        out, weights = self.attention(h, h, h, need_weights=True, key_lengths=lengths, is_causal=True)
        assert weights is not None
        return out, weights


def _tokens(L, seed):
    return torch.randint(0, 11, (2, L), generator=torch.Generator().manual_seed(seed))


def _features(L, seed):
    return torch.randn(2, L, 6, generator=torch.Generator().manual_seed(seed))


def _cases():
    """name -> (a function building the eager model, its inputs)."""
    lengths = torch.tensor([9, 6])
    cases = {}
    for entry in _ENTRIES:
        spec, causal = _spec(entry), _causal(entry)
        architecture = "decoder" if causal else "encoder"

        def transformer(spec=spec, architecture=architecture):
            return Transformer(11, architecture=architecture, layers=2, width=16, heads=2, ffn=32, attention=spec)
        cases[f"transformer-{entry['name']}"] = (transformer, (_tokens(9, 1),))
        if entry["layer_only"]:
            cases[f"layers-{entry['name']}"] = (AgglomerativeModel, (_features(9, 2), lengths))
        else:
            padding = entry["supports"]["key_lengths"]
            cases[f"layers-{entry['name']}"] = (
                lambda spec=spec, causal=causal, padding=padding: LayerModel(spec, causal, padding),
                (_features(9, 2), lengths))
    cases["zoo"] = (ZooModel, (_features(9, 3), lengths))
    cases["weights"] = (WeightsModel, (_features(9, 6), lengths))
    cases["encoder-decoder"] = (
        lambda: Transformer(11, architecture="encoder-decoder", source_vocab_size=7, layers=1, width=16, heads=2,
                            ffn=32, attention="full", cross_attention="full"),
        (_tokens(5, 4), torch.randint(0, 7, (2, 8), generator=torch.Generator().manual_seed(5)),
         torch.tensor([8, 3])))
    return cases


_CASES = _cases()
_NAMES = [f"{name}-{how}" for name in _CASES for how in ("trace", "script")]


def _as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _export(model, inputs, how):
    if how == "script":
        return torch.jit.script(model)
    with warnings.catch_warnings():
        # The tracer warns of the Python checks it records as constants (the
        # mask checks of MultiheadAttention: a trace keeps no Python code).
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return torch.jit.trace(model, inputs)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every case traced and scripted, saved as DIR/NAME.model.pt with its
    inputs (DIR/NAME.inputs.pt); name -> (eager outputs, inputs, eager model)."""
    directory = tmp_path_factory.mktemp("exported")
    results = {}
    for name, (build, inputs) in _CASES.items():
        for how in ("trace", "script"):
            torch.manual_seed(7)
            model = build().eval()
            with torch.no_grad():
                expected = _as_list(model(*inputs))
            torch.jit.save(_export(model, inputs, how), str(directory / f"{name}-{how}.model.pt"))
            torch.save(tuple(inputs), str(directory / f"{name}-{how}.inputs.pt"))
            results[f"{name}-{how}"] = (expected, inputs, model)
    return directory, results


def test_every_mechanism_has_cases():
    names = {e["name"] for e in _ENTRIES}
    assert {n[len("transformer-"):] for n in _CASES if n.startswith("transformer-")} == names
    assert {n[len("layers-"):] for n in _CASES if n.startswith("layers-")} == names


@pytest.mark.parametrize("name", _NAMES)
def test_loaded_in_python_equals_eager(exported, name):
    directory, results = exported
    expected, inputs, _ = results[name]
    loaded = torch.jit.load(str(directory / f"{name}.model.pt"))
    with torch.no_grad():
        actual = _as_list(loaded(*inputs))
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and torch.equal(a, e)


def _runner():
    """attnkit_run_exported: CTest names it; else the build tree's, beside the library."""
    program = os.environ.get("ATTNKIT_RUN_EXPORTED")
    if program:
        return program
    beside = pathlib.Path(attnkit.library_path).parent / "tests" / "attnkit_run_exported"
    if not beside.exists():
        pytest.skip(f"attnkit_run_exported is not built ({beside}); set ATTNKIT_RUN_EXPORTED")
    return str(beside)


def test_runs_from_cpp_with_torch_jit_load(exported):
    directory, results = exported
    done = subprocess.run([_runner(), str(directory)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    for name, (expected, _, _) in results.items():
        # torch::pickle_save's tensor list: torch 2.6's default (weights_only) refuses its format
        actual = torch.load(str(directory / f"{name}.outputs.pt"), weights_only=False)
        assert len(actual) == len(expected), name
        for a, e in zip(actual, expected):
            assert a.shape == e.shape and torch.equal(a, e), name


def test_a_trace_is_not_tied_to_the_traced_shapes(exported):
    # The tracer records the module's forward as one op, not the C++ code's
    # branches and loops on sizes: the traced model runs at other lengths.
    directory, results = exported
    for name in ("transformer-full-trace", "transformer-clustered-trace", "layers-sparse-local-trace"):
        _, inputs, model = results[name]
        loaded = torch.jit.load(str(directory / f"{name}.model.pt"))
        other = (_tokens(4, 8),) if name.startswith("transformer") else (_features(13, 9), torch.tensor([13, 2]))
        with torch.no_grad():
            assert torch.equal(loaded(*other), model(*other)), name


def test_loaded_tensors_are_stored_once_and_shared_with_the_module(exported):
    # The C++ module pickles the very tensors the Python module registered:
    # the file holds each storage once, and after loading the module's
    # parameters and the C++ module's tensors share storage.
    directory, results = exported
    for name in ("layers-full-script", "layers-sac-trace", "transformer-agglomerative-script"):
        path = directory / f"{name}.model.pt"
        _, _, model = results[name]
        storages = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
        with zipfile.ZipFile(path) as archive:
            records = [n for n in archive.namelist() if "/data/" in n]
        assert len(records) == len(storages), (name, len(records), len(storages))
        loaded = torch.jit.load(str(path))
        held = {p.data_ptr() for p in [*loaded.parameters(), *loaded.buffers()]}
        bridged = set()
        for module in loaded.modules():
            if hasattr(module, "_bridge"):
                bridged |= {t.data_ptr() for t in [*module._bridge.parameters(), *module._bridge.buffers()]}
        assert bridged == held, name


def test_a_loaded_file_is_for_inference(exported):
    # The loaded module computes with the C++ module's tensors, which share
    # the file's storage but are not the loaded parameters: no gradient
    # reaches them, and training mode with autograd on is refused.
    directory, results = exported
    expected, inputs, _ = results["layers-full-script"]
    loaded = torch.jit.load(str(directory / "layers-full-script.model.pt"))
    x = inputs[0].clone().requires_grad_(True)
    out = loaded(x, inputs[1])
    assert torch.equal(out.detach(), expected[0])
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()  # gradients for the inputs work
    assert all(p.grad is None for p in loaded.parameters())
    loaded.train()
    with pytest.raises(Exception, match="loaded from a saved file .* runs inference only"):
        loaded(*inputs)
    with torch.no_grad():
        loaded(*inputs)  # training mode without autograd: allowed
    eager = LayerModel(_spec(next(e for e in _ENTRIES if e["name"] == "full")), True, True)
    eager.load_state_dict(loaded.state_dict())  # the way to fine-tune: the same names
    with torch.no_grad():
        assert torch.equal(eager.eval()(*inputs), expected[0])


def test_scripting_hands_replaced_buffers_back_first():
    # .double() replaces the sinusoidal table (a buffer) in Python; scripting
    # must hand it to the C++ module before the scripted module takes it over.
    model = LayerModel("full", True, False).double().eval()
    x = _features(7, 4).double()
    scripted = torch.jit.script(model)
    with torch.no_grad():
        out = scripted(x, torch.tensor([7, 7]))
    assert out.dtype == torch.float64
    assert torch.equal(out, model(x, torch.tensor([7, 7])))


def test_loading_does_not_move_the_random_stream(exported):
    directory, _ = exported
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    torch.jit.load(str(directory / "transformer-sac-script.model.pt"))
    assert torch.equal(torch.rand(4), expected)


def test_scripted_module_keeps_training_mode_and_checks():
    mha = ann.MultiheadAttention(8, 2, batch_first=True, dropout=0.5)
    scripted = torch.jit.script(mha)
    x = torch.randn(1, 6, 8)
    scripted.eval()
    mha.eval()
    assert torch.equal(scripted(x, x, x)[0], mha(x, x, x)[0])
    scripted.train()
    torch.manual_seed(3)
    dropped = scripted(x, x, x)[0]
    mha.train()
    torch.manual_seed(3)
    assert torch.equal(dropped, mha(x, x, x)[0])  # the same in-kernel mask from the same seed
    weights = scripted.eval()(x, x, x, need_weights=True)[1]
    assert weights is not None and torch.allclose(weights.sum(-1), torch.ones(1, 6))
    with pytest.raises(Exception, match="key_padding_mask must pad at the end"):
        scripted(x, x, x, key_padding_mask=torch.tensor([[True, False, False, False, False, False]]))
    with pytest.raises(Exception, match="attn_mask must be the causal mask"):
        scripted(x, x, x, attn_mask=torch.zeros(6, 6, dtype=torch.bool))


def test_the_op_refuses_arguments_a_module_does_not_take():
    linear = ann.Linear(4, 3)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="Linear.forward takes no causal flag"):
        torch.ops.attnkit.module_forward(linear._bridge, x, causal=True)
    with pytest.raises(RuntimeError, match="Linear.forward takes no offset"):
        torch.ops.attnkit.module_forward(linear._bridge, x, offset=2)
    with pytest.raises(RuntimeError, match="Attention: argument '[kv]' is required"):
        torch.ops.attnkit.module_forward(ann.Attention("full")._bridge, x)
    with pytest.raises(RuntimeError, match="Linear.forward returns no attention weights"):
        torch.ops.attnkit.module_forward(linear._bridge, x, weights=1)
    mha = ann.MultiheadAttention(4, 2, batch_first=True)
    with pytest.raises(RuntimeError, match=r"weights must be 0 \(none\), 1 \(per head\) or 2"):
        torch.ops.attnkit.module_forward(mha._bridge, x[None], x[None], x[None], weights=3)


def test_mha_traces_when_its_weights_are_returned():
    # A traced function returns tensors only, and forward's second output is
    # None unless need_weights: wrapped, or with need_weights=True, it traces.
    mha = ann.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)

    class Weighted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=True)

    traced = _export(Weighted(), (x,), "trace")
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    out, weights = torch.jit.load(buffer)(x)
    expected_out, expected_weights = mha(x, x, x, need_weights=True)
    assert torch.equal(out, expected_out) and torch.equal(weights, expected_weights)
