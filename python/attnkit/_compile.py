"""attnkit.nn and attnkit.models modules under torch.compile and torch.export (torch 2).

Eagerly a BridgedModule runs its C++ module through ``attnkit::module_forward``,
whose first argument is a TorchScript object holding the parameters: a tracer
sees neither the parameters as inputs nor what the op does with them. Under a
tracer (``torch.compiler.is_compiling()``) the module calls
``attnkit::_bridged_forward`` instead, an op defined here that takes

* the module by a handle (a string the tracer keeps as a constant; the module
  registers itself under it when it is built or unpickled),
* its parameters, as tensor inputs: they reach the graph, so AOTAutograd and
  torch.export see them as the graph's inputs and give them gradients,
* the forward's inputs and flags.

Its implementation is the eager one: the C++ module computes with the
parameters passed, which are its own Parameters in a compiled module (other
tensors of the same shapes, from torch.func.functional_call or a loaded
exported program, are bound to the Parameters for the call: so two threads
must not call one module that way at once). Its fake
implementation shapes the outputs by running the C++ module on fake inputs
in a fake-tensor mode of its own (its parameters taken as metadata, nothing
computed; a module whose forward reads values, SAC, once for real on zeros,
leaving no trace): the same C++ code decides the shapes, so they cannot
drift from the eager ones. Its backward, ``attnkit::_bridged_backward``,
runs the forward again with autograd on and differentiates it with respect
to the parameters and the floating inputs: the same operations as eager
autograd, so the gradients are eager's. The forward hands the backward the
CPU generator's state it started from, so a recomputed dropout draws what the
forward drew. The cost: a compiled training step runs each bridged module's
forward twice (whole-module activation checkpointing); inference pays
nothing extra.

Known limits: the fake implementation reads sizes as integers, so shapes are
specialised (as for the kernel ops; torch.export's dynamic_shapes cannot make
them symbolic); the op is declared pure to the tracer, so a graph that calls
one module twice on the very same inputs in training (Monte Carlo dropout)
may have the two calls merged into one by common-subexpression elimination,
drawing dropout once.

Why this rather than the alternatives the issue names: a Python composition
of each module from ops would be a second implementation of every module and
mechanism (the builder has tens of options) that could drift from the C++ one
the CLI and trainer run; a fake class for the TorchScript object would still
need the shapes of every method's outputs, and the object's parameters would
stay hidden from the graph.
"""
import contextlib
import itertools
import uuid
import weakref
from typing import List, Optional

import torch
from torch import Tensor

__all__ = ["available", "register", "bridged_forward"]

# torch.library.custom_op and its fake / autograd registration: torch >= 2.4.
available = hasattr(torch.library, "custom_op") and hasattr(torch, "compiler")

_modules = weakref.WeakValueDictionary()
_handles = itertools.count(1)
# Handles name this process too: an exported program loaded in another
# process finds no module under its handle (a clear error) rather than some
# other module that happens to have the same number there.
_PROCESS = uuid.uuid4().hex[:12]
_RNG_STATE_SIZE = torch.get_rng_state().numel()


def register(module) -> str:
    """A new handle for `module` (a BridgedModule), which the ops find it by:
    a string, which a tracer keeps as a constant (an int may become symbolic)."""
    handle = f"attnkit.module.{_PROCESS}.{next(_handles)}"
    _modules[handle] = module
    return handle


def _module(handle: str):
    module = _modules.get(handle)
    if module is None:
        raise RuntimeError(f"attnkit: no live attnkit module has handle '{handle}' (a compiled graph or an exported "
                           "program outlived the module it was traced from, or was loaded in another process: "
                           "attnkit modules export portably with TorchScript, docs/API.md)")
    return module


@contextlib.contextmanager
def _bound(module, given: List[Tensor], differentiable: bool = False):
    """The module's Parameters computing with the tensors the graph passed:
    its own (nothing to do), or others of the same shapes and dtypes
    (torch.func.functional_call, the state of an exported program after
    torch.export.load), bound to the Parameters' data for the block and given
    back afterwards. `differentiable`: every Parameter requires grad in the
    block (the tensors passed may need gradients where the module's own
    are frozen). Yields the Parameters."""
    own = list(module.parameters())
    if len(own) != len(given) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(own, given)):
        raise RuntimeError(f"attnkit: {type(module).__name__} under a tracer was passed parameters that are not "
                           "its own shapes and dtypes (expected "
                           f"{[(tuple(p.shape), p.dtype) for p in own]}, got "
                           f"{[(tuple(p.shape), p.dtype) for p in given]})")
    pairs = [(p, g) for p, g in zip(own, given) if p.data_ptr() != g.data_ptr()]
    saved = [p.data for p, _ in pairs]
    frozen = [p for p in own if not p.requires_grad] if differentiable else []
    try:
        for p, g in pairs:
            p.data = g.detach()
        for p in frozen:
            p.requires_grad_(True)
        yield own
    finally:
        for (p, _), data in zip(pairs, saved):
            p.data = data
        for p in frozen:
            p.requires_grad_(False)


def _eager(module, inputs, causal: bool, offset: int, training: bool, weights: int) -> List[Tensor]:
    module._sync()
    return list(torch.ops.attnkit.module_forward(module._bridge, *inputs, causal, offset, training, weights))


@contextlib.contextmanager
def _untouched(module):
    """Runs a block that must leave no trace on the module or the CPU random
    stream: the module's buffers get their values back afterwards."""
    saved = [b.detach().clone() for b in module._bridge.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, value in zip(module._bridge.buffers(), saved):
                    b.copy_(value)


def _unaliased(outputs: List[Tensor], inputs) -> List[Tensor]:
    """An op's outputs must not alias its inputs or each other: a module may
    return an input as it is, a gradient may be the output's gradient itself."""
    seen = {x.untyped_storage().data_ptr() for x in inputs if x is not None and x.numel() > 0}
    result = []
    for o in outputs:
        if o.numel() > 0 and o.untyped_storage().data_ptr() in seen:
            o = o.clone()
        seen.add(o.untyped_storage().data_ptr())
        result.append(o)
    return result


def _state_count(module, training: bool) -> int:
    """How many of _bridged_forward's last outputs are state for its backward."""
    return 1 + (len(module._names[1]) if training else 0)


def _differentiable(t: Optional[Tensor]) -> bool:
    return t is not None and t.is_floating_point()


if available:
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    @torch.library.custom_op("attnkit::_bridged_forward", mutates_args=())
    def _bridged_forward(handle: str, parameters: List[Tensor], input0: Tensor, input1: Optional[Tensor],
                         input2: Optional[Tensor], input3: Optional[Tensor], causal: bool, offset: int,
                         training: bool, weights: int) -> List[Tensor]:
        """The module's outputs, then what its backward needs to run the
        forward again as it ran: the CPU generator's state, and in training
        mode the buffers' values (_state_count), both from before the call."""
        module = _module(handle)
        state = [torch.get_rng_state()] + ([b.detach().clone() for b in module._bridge.buffers()] if training else [])
        inputs = (input0, input1, input2, input3)
        with _bound(module, parameters):
            outputs = _eager(module, inputs, causal, offset, training, weights)
        return _unaliased(outputs, [*parameters, *inputs]) + state

    # The autograd dispatch keys: those between the autocast keys (above)
    # and the backends (below; Tracer, also in between, is never excluded).
    _AUTOGRAD_KEYS = (torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.AutocastCPU)
                      - torch._C._after_autograd_keyset)

    def _autograd_dispatch():
        """Autograd back on inside an op's implementation, which the dispatcher
        runs below autograd (the autograd keys excluded), so that the
        recomputed forward records its graph as an eager one does; every other
        exclusion (autocast's, off unless enabled) stays."""
        return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                               torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS)

    def _concrete(sizes):
        return [int(s) for s in sizes]

    def _like(x, make):
        return None if x is None else make(_concrete(x.shape), _concrete(x.stride()), dtype=x.dtype)

    def _zeros_strided(size, stride, dtype):
        return torch.empty_strided(size, stride, dtype=dtype).zero_()

    def _shapes(outputs):
        return [(list(o.shape), list(o.stride()), o.dtype) for o in outputs]

    @_bridged_forward.register_fake
    def _(handle, parameters, input0, input1, input2, input3, causal, offset, training, weights):
        # The C++ module itself on fake inputs, in a fake-tensor mode of its
        # own that takes the module's real tensors as they are (as metadata,
        # no copy): the C++ code decides the shapes, as it does eagerly.
        module = _module(handle)
        inputs = (input0, input1, input2, input3)
        with unset_fake_temporarily():
            try:
                with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
                    shapes = _shapes(_eager(module, [_like(x, torch.empty_strided) for x in inputs], causal, int(offset),
                                            training, int(weights)))
            except Exception:
                # A module whose forward reads values (SAC samples its graph's
                # edges from its predictor's scores) cannot run on fake
                # inputs: one real forward on zeros of the inputs' shapes
                # shapes it, leaving no trace (the random stream and the
                # buffers, e.g. a reward baseline, are restored). An error of
                # the module's own checks is raised by this run as well.
                with _untouched(module), torch.no_grad():
                    shapes = _shapes(_eager(module, [_like(x, _zeros_strided) for x in inputs], causal, int(offset),
                                            training, int(weights)))
        outputs = [torch.empty_strided(size, stride, dtype=dtype) for size, stride, dtype in shapes]
        buffers = [torch.empty_strided(b.shape, b.stride(), dtype=b.dtype) for b in module._bridge.buffers()] if training else []
        return outputs + [torch.empty(_RNG_STATE_SIZE, dtype=torch.uint8)] + buffers

    @torch.library.custom_op("attnkit::_bridged_backward", mutates_args=())
    def _bridged_backward(handle: str, parameters: List[Tensor], input0: Tensor, input1: Optional[Tensor],
                          input2: Optional[Tensor], input3: Optional[Tensor], causal: bool, offset: int,
                          training: bool, weights: int, state: List[Tensor],
                          grad_outputs: List[Tensor]) -> List[Tensor]:
        """The gradients of the parameters, then of each input (an empty tensor
        for an input that is absent or not floating)."""
        module = _module(handle)
        inputs = [x.detach().requires_grad_() if _differentiable(x) else x
                  for x in (input0, input1, input2, input3)]
        # The forward once more, as it ran: with the same parameters, from its
        # random stream and, in training, the buffers it may update (clustered
        # attention's call counter) as they were; afterwards the buffers and
        # the stream are as they are now.
        with _bound(module, parameters, differentiable=True) as own, _untouched(module), _autograd_dispatch(), \
                torch.enable_grad():
            torch.set_rng_state(state[0])
            with torch.no_grad():
                for b, value in zip(module._bridge.buffers(), state[1:]):
                    b.copy_(value)
            outputs = _eager(module, inputs, causal, offset, training, weights)
            # Every parameter (all require grad here) and the floating inputs.
            needs = [t is not None and t.requires_grad for t in own + inputs]
            wrt = [t for t, need in zip(own + inputs, needs) if need]
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
            grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                         if pairs and wrt else [None] * len(wrt))
        result = []
        for t, need in zip(list(parameters) + inputs, needs):
            if not need:  # an input that is absent or not floating
                result.append(torch.empty(0))
                continue
            g = next(grads)
            # Laid out as the fake implementation says: like the tensor passed.
            if g is None or g.stride() != t.stride():
                g = torch.zeros_like(t) if g is None else torch.empty_like(t).copy_(g)
            result.append(g)
        return _unaliased(result, [*parameters, *inputs, *state, *grad_outputs])

    @_bridged_backward.register_fake
    def _(handle, parameters, input0, input1, input2, input3, causal, offset, training, weights, state,
          grad_outputs):
        return [torch.empty_like(p) for p in parameters] + [
            torch.empty_like(x) if _differentiable(x) else torch.empty(0) for x in (input0, input1, input2, input3)]

    def _setup_context(ctx, inputs, output):
        handle, parameters, input0, input1, input2, input3, causal, offset, training, weights = inputs
        ctx.flags = (handle, len(parameters), [x is not None for x in (input0, input1, input2, input3)], causal,
                     offset, training, weights)
        present = [x for x in (input0, input1, input2, input3) if x is not None]
        states = _state_count(_module(handle), training)
        ctx.save_for_backward(*parameters, *present, *output[-states:])
        ctx.states = states
        ctx.output_shapes = [(o.shape, o.dtype) for o in output[:-states]]

    def _backward(ctx, grads):
        handle, count, given, causal, offset, training, weights = ctx.flags
        saved = list(ctx.saved_tensors)
        parameters, rest, state = saved[:count], iter(saved[count:-ctx.states]), saved[-ctx.states:]
        inputs = [next(rest) if g else None for g in given]
        # An output that had no gradient: zeros (its contribution).
        grad_outputs = [torch.zeros(shape, dtype=dtype) if g is None else g
                        for g, (shape, dtype) in zip(grads, ctx.output_shapes)]
        result = torch.ops.attnkit._bridged_backward(handle, parameters, *inputs, causal, offset, training,
                                                     weights, state, grad_outputs)
        grad_inputs = [g if _differentiable(x) else None for g, x in zip(result[count:], inputs)]
        return (None, list(result[:count]), *grad_inputs, None, None, None, None)

    _bridged_forward.register_autograd(_backward, setup_context=_setup_context)


    # The two tensor factories of the C++ library (registered at the bottom of
    # src/ops/softmax_attention.cpp and src/ops/sparse_attention.cpp):
    # their outputs' shapes follow from their arguments, so the fakes run the
    # real op where that costs nothing: edge_pattern builds the pattern
    # (O(edges), once per trace), attention_dropout_mask validates its
    # arguments on sizes of at most 1 (the errors are the eager ones).
    @torch.library.register_fake("attnkit::attention_dropout_mask")
    def _(N, H, L, S, dropout_p, seed):
        with unset_fake_temporarily():
            torch.ops.attnkit.attention_dropout_mask(*(min(int(d), 1) for d in (N, H, L, S)), dropout_p, seed)
        return torch.empty(N, H, L, S, dtype=torch.bool)

    @torch.library.register_fake("attnkit::edge_pattern")
    def _(name, n, param=0):
        with unset_fake_temporarily():
            offsets, columns = torch.ops.attnkit.edge_pattern(name, n, param)
        return torch.empty(offsets.shape, dtype=torch.int64), torch.empty(columns.shape, dtype=torch.int64)


def bridged_forward(module, inputs, causal: bool, offset: int, weights: int = 0) -> List[Tensor]:
    """The module's forward as attnkit::_bridged_forward (under a tracer)."""
    if not available:
        raise RuntimeError("attnkit: torch.compile of attnkit modules needs torch >= 2.4 (torch.library.custom_op)")
    outputs = torch.ops.attnkit._bridged_forward(module._handle, list(module.parameters()), *inputs, causal, offset,
                                                 module.training, weights)
    return list(outputs[:-_state_count(module, module.training)])
