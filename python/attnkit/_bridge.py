"""torch.nn.Modules over the library's C++ modules (src/bindings/modules.cpp).

Each ``BridgedModule`` holds one ``torch.classes.attnkit.Module``: a module of
attnkit::nn or attnkit::models, the very code the CLI and the trainer run. The
Python object registers an ``nn.Parameter`` (and buffer) for every C++ tensor,
under the same dotted name and sharing its storage, so that optimizers,
``state_dict``, ``.to(dtype)``, ``copy.deepcopy``, pickling and
``DistributedDataParallel`` see an ordinary module.

A call hands the C++ module the Python tensors (it adopts any that differ, e.g.
after ``.to(torch.float64)``), runs it, and when gradients are wanted wraps the
call in an ``autograd.Function``: the C++ call records its graph on the C++
tensors, and the Function's backward maps the gradients back onto the Python
Parameters and inputs. Second derivatives are not supported (the kernels have
none either).
"""
import json

import torch

__all__ = ["BridgedModule"]


class _Call(torch.autograd.Function):
    """One call of a C++ module inside Python's autograd graph."""

    @staticmethod
    def forward(ctx, owner, method, args, counts, *tensors):
        n_params, n_buffers = counts
        params = list(tensors[:n_params])
        buffers = list(tensors[n_params:n_params + n_buffers])
        inputs = list(tensors[n_params + n_buffers:])
        # Fresh leaves for the inputs that need gradients: the C++ graph ends there.
        leaves = [t.detach().requires_grad_() if t is not None and t.requires_grad else t for t in inputs]
        with torch.enable_grad():
            outputs = owner._bridge.call(method, params, buffers, leaves, args, owner.training)
        cpp_params = owner._bridge.parameters()
        ctx.set_materialize_grads(False)
        ctx.outputs = outputs
        ctx.targets = [(i, cpp_params[i]) for i, p in enumerate(params) if p.requires_grad]
        ctx.targets += [(n_params + n_buffers + j, leaf) for j, leaf in enumerate(leaves)
                        if leaf is not None and inputs[j].requires_grad]
        ctx.n_tensors = len(tensors)
        results = tuple(o.detach() for o in outputs)
        ctx.mark_non_differentiable(*[r for r, o in zip(results, outputs) if not o.requires_grad])
        return results

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if g is not None and o.requires_grad]
        found = [None] * len(ctx.targets)
        if pairs:
            found = torch.autograd.grad([o for o, _ in pairs], [t for _, t in ctx.targets],
                                        [g for _, g in pairs], allow_unused=True)
        out = [None] * ctx.n_tensors
        for (position, _), grad in zip(ctx.targets, found):
            out[position] = grad
        ctx.outputs = None  # free the C++ graph
        return (None, None, None, None, *out)


class _Node(torch.nn.Module):
    """A level of a C++ module's name tree (e.g. ``decoder_0`` or ``q_proj``)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("attnkit: a sub-module of a bridged module is not callable on its own; "
                           "call the module that owns it")


class BridgedModule(torch.nn.Module):
    """Base of every attnkit.nn / attnkit.models module (see the module docstring)."""

    def __init__(self, kind, settings):
        super().__init__()
        self._bridge = torch.classes.attnkit.Module(kind, json.dumps(settings))
        self._adopt()

    # --- the C++ module's tensors as Parameters and buffers -------------------------------
    def _adopt(self):
        """Registers a Parameter / buffer for every C++ tensor under its dotted
        name. Tensors Python already holds under a name are kept (optimizers
        refer to them); names the C++ module no longer has are dropped."""
        held = {}
        for name, p in self.named_parameters(recurse=True):
            held[name] = p
        for name, b in self.named_buffers(recurse=True):
            held[name] = b
        for name in [n for n, m in self.named_children() if isinstance(m, _Node)]:
            delattr(self, name)
        self._parameters.clear()
        self._buffers.clear()
        bridge = self._bridge
        self._names = (list(bridge.parameter_names()), list(bridge.buffer_names()))
        for names, tensors, buffer in ((bridge.parameter_names(), bridge.parameters(), False),
                                       (bridge.buffer_names(), bridge.buffers(), True)):
            for name, tensor in zip(names, tensors):
                *path, leaf = name.split(".")
                node = self
                for part in path:
                    child = node._modules.get(part)
                    if child is None:
                        child = _Node()
                        node.add_module(part, child)
                    node = child
                mine = held.get(name)
                if mine is None or mine.shape != tensor.shape:
                    mine = tensor.detach() if buffer else torch.nn.Parameter(tensor.detach())
                if buffer:
                    node.register_buffer(leaf, mine)
                else:
                    node.register_parameter(leaf, mine)

    def _tensors(self):
        """The Python tensors in the C++ module's order (by name: the order of
        Python's name tree can differ, e.g. for a sub-module with buffers only)."""
        param_names, buffer_names = self._names
        params, buffers = dict(self.named_parameters()), dict(self.named_buffers())
        return [params[n] for n in param_names], [buffers[n] for n in buffer_names]

    def _call(self, method, *inputs, **args):
        """Runs `method` of the C++ module on positional tensor `inputs` (None
        for absent ones) with keyword settings `args`; returns its outputs."""
        params, buffers = self._tensors()
        settings = json.dumps(args)
        inputs = list(inputs)
        wants_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params) or
            any(t is not None and t.requires_grad for t in inputs))
        if not wants_grad:
            with torch.no_grad():
                return list(self._bridge.call(method, params, buffers, inputs, settings, self.training))
        return list(_Call.apply(self, method, settings, (len(params), len(buffers)),
                                *params, *buffers, *inputs))

    def _command(self, method, **args):
        """A method that changes the C++ module (e.g. set_attention) and
        returns nothing; the Python side then re-registers its tensors."""
        params, buffers = self._tensors()
        with torch.no_grad():
            self._bridge.call(method, params, buffers, [], json.dumps(args), self.training)
        self._adopt()

    # --- copies and pickles ------------------------------------------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        bridge = state.pop("_bridge")
        state["_bridge_rebuild"] = (bridge.kind(), bridge.settings())
        return state

    def __setstate__(self, state):
        kind, settings = state.pop("_bridge_rebuild")
        self.__dict__.update(state)
        # The rebuilt C++ module's own initial weights are replaced by the
        # unpickled ones at its first call; building it must not move the
        # user's random stream.
        with torch.random.fork_rng(devices=[]):
            self._bridge = torch.classes.attnkit.Module(kind, settings)

    def extra_repr(self):
        return self._bridge.settings()
