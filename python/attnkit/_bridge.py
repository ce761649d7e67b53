"""torch.nn.Modules over the library's C++ modules (src/bindings/modules.cpp).

Each ``BridgedModule`` holds one ``torch.classes.attnkit.Module``: a module of
attnkit::nn or attnkit::models, the very code the CLI and the trainer run. The
Python module registers the C++ module's own tensors, under their C++ dotted
names: each parameter's Python object is made an ``nn.Parameter`` (its class
changes; the tensor is the one the C++ code computes with), each buffer is
registered as it is. So autograd records the C++ computation directly on the
Parameters: gradients, ``retain_graph``, hooks, in-place-modification checks,
optimizers, ``state_dict``, ``.to(dtype)`` (which changes a Parameter's data in
place), ``copy.deepcopy``, pickling and ``DistributedDataParallel`` all behave
as for any module.

Every forward goes through the op ``attnkit::module_forward``, whose typed
schema torch.jit.trace records and torch.jit.script compiles: a model built of
these modules exports (``torch.jit.save``) and the file runs wherever
libattnkit is loaded, in Python (``torch.jit.load``) or in C++
(``torch::jit::load``). The C++ module pickles as its kind, settings and
tensors (src/bindings/modules.cpp); other methods (``generate``,
``set_attention``) are Python's only.

Two things keep it so: a Parameter must not be replaced by a new tensor
(``module.weight = nn.Parameter(...)``; change values in place, e.g. with
``copy_`` or ``load_state_dict``), which a call refuses with an error; and a
buffer that ``.to()`` replaced is handed back to the C++ module before the
next call.
"""
import json
from typing import List, Optional

import torch

from . import _compile

__all__ = ["BridgedModule"]


@torch.jit.unused  # TorchScript compiles forward's other branch only
def _is_compiling() -> bool:
    """True while torch.compile or torch.export traces (torch 2; never on torch 1.13)."""
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()


class _Node(torch.nn.Module):
    """A level of a C++ module's name tree (e.g. ``decoder_0`` or ``q_proj``)."""

    @torch.jit.ignore  # not a method of the exported module: TorchScript skips it
    def forward(self, *args, **kwargs):
        raise RuntimeError("attnkit: a sub-module of a bridged module is not callable on its own; "
                           "call the module that owns it")


def _as_parameter(tensor):
    """The C++ module's tensor itself, as an nn.Parameter (the same TensorImpl)."""
    if not isinstance(tensor, torch.nn.Parameter):
        tensor.__class__ = torch.nn.Parameter
    return tensor


class BridgedModule(torch.nn.Module):
    """Base of every attnkit.nn / attnkit.models module (see the module docstring)."""

    def __init__(self, kind, settings):
        super().__init__()
        self._bridge = torch.classes.attnkit.Module(kind, json.dumps(settings))
        self._handle = _compile.register(self)  # how a compiled graph names this module
        self._adopt()

    # --- the C++ module's tensors as Parameters and buffers -------------------------------
    def _slot(self, name):
        """(the sub-module holding dotted `name`, its last part), creating the levels."""
        *path, leaf = name.split(".")
        node = self
        for part in path:
            child = node._modules.get(part)
            if child is None:
                child = _Node()
                node.add_module(part, child)
            node = child
        return node, leaf

    def _adopt(self, values=None):
        """Registers the C++ module's tensors under their names, replacing the
        name tree. With `values` (name -> tensor, e.g. an unpickled state), the
        C++ tensors first take those values (and dtype, and requires_grad)."""
        for name in [n for n, m in self._modules.items() if isinstance(m, _Node)]:
            delattr(self, name)
        self._parameters.clear()
        self._buffers.clear()
        bridge = self._bridge
        self._names = (list(bridge.parameter_names()), list(bridge.buffer_names()))
        for names, tensors, buffer in ((self._names[0], bridge.parameters(), False),
                                       (self._names[1], bridge.buffers(), True)):
            for name, tensor in zip(names, tensors):
                if values is not None and name in values:
                    source = values[name]
                    with torch.no_grad():
                        if source.dtype == tensor.dtype and source.shape == tensor.shape:
                            tensor.copy_(source)
                        else:
                            tensor.data = source.detach().clone()
                    if not buffer:
                        tensor.requires_grad_(source.requires_grad)
                node, leaf = self._slot(name)
                if buffer:
                    node.register_buffer(leaf, tensor)
                else:
                    node.register_parameter(leaf, _as_parameter(tensor))
        self._settings_changed()

    def _settings_changed(self):
        """Called when the module is built, unpickled or changed by a method:
        a subclass keeps here what its forward reads of the settings."""

    def _sync(self):
        """Before a call: the C++ module must compute with the tensors Python
        holds. Parameters are the same tensors unless one was replaced (refused);
        a buffer that `.to()` replaced goes back to the C++ module."""
        mine = dict(self.named_parameters())
        for name, tensor in zip(self._names[0], self._bridge.parameters()):
            if mine.get(name) is not tensor:
                raise RuntimeError(
                    f"attnkit: parameter '{name}' of {type(self).__name__} is no longer the module's own "
                    "tensor (it was replaced, e.g. by assigning a new nn.Parameter); change parameters in "
                    "place instead (copy_, load_state_dict), so that the C++ module computes with them")
        held = dict(self.named_buffers())
        for name, tensor in zip(self._names[1], self._bridge.buffers()):
            given = held.get(name)
            if given is not tensor:
                if given is None or given.shape != tensor.shape:
                    raise RuntimeError(f"attnkit: buffer '{name}' of {type(self).__name__} was removed or "
                                       "changed shape")
                tensor.data = given
                node, leaf = self._slot(name)
                node._buffers[leaf] = tensor

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first: the C++ module must hold the
        # tensors the scripted module will (a buffer `.to()` replaced).
        self._sync()
        return self

    def _forward(self, input0: torch.Tensor, input1: Optional[torch.Tensor] = None,
                 input2: Optional[torch.Tensor] = None, input3: Optional[torch.Tensor] = None,
                 causal: bool = False, offset: int = 0, weights: int = 0) -> List[torch.Tensor]:
        """The C++ module's forward on its positional inputs (None for absent
        ones): the op torch.jit.trace records and torch.jit.script compiles.
        ``weights`` (MultiheadAttention): 1 or 2 add the attention weights, per
        head or averaged over the heads, as a second output."""
        if not torch.jit.is_scripting():
            if _is_compiling():
                return self._traced_forward([input0, input1, input2, input3], causal, offset, weights)
            self._sync()
        return torch.ops.attnkit.module_forward(self._bridge, input0, input1, input2, input3, causal, offset,
                                                self.training, weights)

    @torch.jit.unused
    def _traced_forward(self, inputs: List[Optional[torch.Tensor]], causal: bool, offset: int,
                        weights: int) -> List[torch.Tensor]:
        """Under torch.compile or torch.export: the forward as an op that takes
        the parameters as inputs (attnkit/_compile.py says how and why)."""
        return _compile.bridged_forward(self, inputs, causal, offset, weights)

    def _call(self, method, *inputs, **args):
        """Runs `method` (other than forward) of the C++ module on positional
        tensor `inputs` (None for absent ones) with keyword settings `args`;
        returns its outputs."""
        self._sync()
        return list(self._bridge.call(method, list(inputs), json.dumps(args), self.training))

    def _command(self, method, **args):
        """A method that changes the C++ module (e.g. set_attention) and
        returns nothing; the Python side then registers its tensors anew."""
        self._sync()
        with torch.no_grad():
            self._bridge.call(method, [], json.dumps(args), self.training)
        self._adopt()

    # --- copies and pickles ------------------------------------------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        bridge = state.pop("_bridge")
        state["_bridge_rebuild"] = (bridge.kind(), bridge.settings())
        return state

    def __setstate__(self, state):
        kind, settings = state.pop("_bridge_rebuild")
        # nn.Module's own __setstate__: it also adds what a newer torch's
        # modules hold and an older torch's pickle lacks (torch 2's
        # _backward_pre_hooks, ... for a module pickled under torch 1.13).
        torch.nn.Module.__setstate__(self, state)
        values = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        # A new C++ module takes the unpickled values; building it must not
        # move the user's random stream.
        with torch.random.fork_rng(devices=[]):
            self._bridge = torch.classes.attnkit.Module(kind, settings)
        self._handle = _compile.register(self)  # a copy is a module of its own
        self._adopt(values)

    def extra_repr(self):
        return self._bridge.settings()
