"""torch.compile and torch.export of attnkit.nn modules and attnkit.models.Transformer
(torch 2 only; on torch 1.13 every test is skipped with the reason).

The models are test_export.py's: a Transformer and a model of attnkit.nn
layers for every mechanism of the registry, the zoo's modules, exact
attention's weights and an encoder-decoder. Each compiles with
fullgraph=True (torch._dynamo.explain: one graph, no break); its parameters
are inputs of the graph (python/attnkit/_compile.py), and the compiled
model's outputs and gradients (towards every parameter and the floating
inputs) equal eager's within float32 rounding: the compiled graph runs the
very C++ modules eager runs, and the backward recomputes their forward with
autograd.
"""
import io

import pytest
import torch

from attnkit.models import Transformer
from conftest import rel_err
from test_export import _CASES, _as_list

TORCH_2 = int(torch.__version__.split(".")[0]) >= 2
pytestmark = pytest.mark.skipif(not TORCH_2, reason=f"torch {torch.__version__} has no torch.compile / "
                                "torch.export (torch 2)")

# conftest.rel_err, relative to the largest entry: the compiled graph calls
# the same C++ code; only AOTAutograd's bookkeeping differs.
TOLERANCE = 1e-5


def _build(name, train=False):
    build, inputs = _CASES[name]
    torch.manual_seed(7)
    model = build()
    model.train(train)
    return model, inputs


def _outputs_and_grads(model, fn, inputs, seed=3):
    """fn(*inputs)'s floating outputs and the gradients of a fixed random
    projection of them towards every parameter and floating input."""
    inputs = [x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs]
    torch.manual_seed(seed)  # the same dropout draws for eager and compiled
    outputs = [o for o in _as_list(fn(*inputs)) if o.is_floating_point()]
    leaves = list(model.parameters()) + [x for x in inputs if x.requires_grad]
    generator = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=generator)).sum() for o in outputs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    # A parameter the forward does not use ("none" has q and k projections)
    # gets None eagerly and zeros compiled (docs/API.md): compared as zeros.
    return [o.detach() for o in outputs] + [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


def _check_equal(actual, expected, what):
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape, (what, i)
        assert rel_err(a, e) < TOLERANCE, (what, i, rel_err(a, e))


@pytest.mark.parametrize("name", list(_CASES))
def test_compiled_equals_eager_without_graph_break(name):
    model, inputs = _build(name)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    expected = _outputs_and_grads(model, model, inputs)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _check_equal(_outputs_and_grads(model, compiled, inputs), expected, name)


def test_parameters_are_graph_inputs():
    # A step of an optimiser changes the parameters in place: the compiled
    # model computes with the new values, without recompiling.
    model, inputs = _build("transformer-full")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    before = compiled(*inputs).detach()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    after = compiled(*inputs)
    assert rel_err(after, model(*inputs)) < TOLERANCE
    assert rel_err(after, before) > 1e-2


def test_training_with_dropout_inductor():
    # Training mode, dropout in the blocks and on the attention weights,
    # inductor (the default backend): the backward's recomputed forward draws
    # the forward's dropout, so the gradients are eager's.
    torch.manual_seed(7)
    model = Transformer(11, layers=2, width=16, heads=2, ffn=32, dropout=0.2, attention_dropout=0.2)
    model.train()
    tokens = _CASES["transformer-full"][1]
    expected = _outputs_and_grads(model, model, tokens)
    compiled = torch.compile(model, fullgraph=True)
    _check_equal(_outputs_and_grads(model, compiled, tokens), expected, "training")
    # Another seed, other draws: dropout is really on.
    assert rel_err(_outputs_and_grads(model, compiled, tokens, seed=4)[0], expected[0]) > 1e-2


def test_frozen_module_with_parameters_that_need_gradients():
    # The module's own parameters frozen, functional_call with tensors that
    # need gradients: those get them (the recompute differentiates every
    # parameter, whatever the module's own flags).
    model, inputs = _build("layers-full")
    model.requires_grad_(False)
    given = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    compiled = torch.compile(lambda *x: torch.func.functional_call(model, given, x), fullgraph=True,
                             backend="aot_eager")
    compiled(*inputs).sum().backward()
    twin, _ = _build("layers-full")
    twin(*inputs).sum().backward()
    for n, p in twin.named_parameters():
        assert given[n].grad is not None and rel_err(given[n].grad, p.grad) < TOLERANCE, n
    assert not any(p.requires_grad for p in model.parameters())


def test_training_updates_buffers_as_eager():
    # Clustered attention advancing its seed per training call (a buffer the
    # forward updates): compiled, the counter and the gradients follow eager,
    # call after call (the backward recomputes from the buffers as they were).
    def build():
        torch.manual_seed(7)
        return Transformer(11, architecture="encoder", layers=1, width=16, heads=2, ffn=32, dropout=0.0,
                           attention="clustered:clusters=3,seed=2,advance_seed=true").train()

    eager, compiled_model = build(), build()
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    tokens = _CASES["transformer-full"][1]
    for step in range(3):
        expected = _outputs_and_grads(eager, eager, tokens, seed=step)
        _check_equal(_outputs_and_grads(compiled_model, compiled, tokens, seed=step), expected, f"step {step}")
    assert all(torch.equal(a, b) for a, b in zip(eager.buffers(), compiled_model.buffers()))


def test_a_frozen_parameter_gets_no_gradient():
    model, inputs = _build("layers-full")
    model.inp.weight.requires_grad_(False)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(*inputs).sum().backward()
    assert model.inp.weight.grad is None
    assert model.inp.bias.grad is not None and model.attention.q_proj.weight.grad is not None


def test_functional_call_computes_with_the_parameters_given():
    # torch.func.functional_call under torch.compile: the module computes
    # with the tensors given (bound to its Parameters for the call), and its
    # own are untouched afterwards.
    model, inputs = _build("layers-full")
    torch.manual_seed(8)
    other = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    own = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled = torch.compile(lambda *x: torch.func.functional_call(model, other, x), fullgraph=True,
                             backend="aot_eager")
    actual = compiled(*inputs)
    twin, _ = _build("layers-full")
    twin.load_state_dict(other, strict=False)  # the parameters; the buffers are the same
    assert rel_err(actual, twin(*inputs)) < TOLERANCE
    assert all(torch.equal(p, own[n]) for n, p in model.named_parameters())
    wrong = {**other, "inp.weight": torch.randn(3, 3)}
    with pytest.raises(Exception, match="not its own shapes and dtypes"):
        torch.compile(lambda *x: torch.func.functional_call(model, wrong, x), fullgraph=True,
                      backend="aot_eager")(*inputs)


@pytest.mark.parametrize("name", ["transformer-full", "transformer-clustered", "zoo", "encoder-decoder"])
def test_export(name):
    model, inputs = _build(name)
    with torch.no_grad():
        expected = _as_list(model(*inputs))
    program = torch.export.export(model, tuple(inputs))
    # The parameters are the program's inputs.
    assert {n for n, _ in model.named_parameters()} <= set(program.state_dict)
    with torch.no_grad():
        actual = _as_list(program.module()(*inputs))
    _check_equal(actual, expected, name)
    # Saved and loaded (in this process, where the module lives): the loaded
    # program computes with the parameters it holds, not the module's, which
    # change after the save.
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
        _check_equal(_as_list(loaded.module()(*inputs)), expected, name + " loaded")
