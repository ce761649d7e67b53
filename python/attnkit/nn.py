"""attnkit's modules as torch.nn.Modules: the attention layers and the mechanisms
of the registry, each the library's C++ module behind nn.Parameters (see
attnkit/_bridge.py), so that outputs, gradients, errors and state_dict names
are those of the C++ API (docs/API.md).

Layers::

    mha = attnkit.nn.MultiheadAttention(256, 8, attention="improved-clustered:clusters=25,topk=32",
                                        batch_first=True)
    out, _ = mha(x, x, x, key_padding_mask=pad)          # like torch.nn.MultiheadAttention

Mechanisms over per-head tensors q (N, H, L, E), k (N, H, S, E), v (N, H, S, M)::

    attn = attnkit.nn.Attention("sparse-local:span=64")   # any registry spec
    attn = attnkit.nn.registry.SparseLocal(span=64)      # the same, one class per entry
    out = attn(q, k, v)

Names: a model's width is ``width`` and its head count ``heads`` everywhere
(attnkit.nn, attnkit.models, the C++ API and the CLI), except in
MultiheadAttention, whose ``embed_dim`` and ``num_heads`` keep
torch.nn.MultiheadAttention's signature so that it stays a drop-in
replacement. The old names of the other modules' arguments (``embed_dim``,
``num_heads``, ``d_model``) and ``attnkit.nn.mechanisms`` (now
``attnkit.nn.registry``) still work with a DeprecationWarning.
"""
import functools
import json
import keyword
import sys
import types
import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _library
from ._bridge import BridgedModule

__all__ = [
    "Linear", "MultiheadAttention", "Attention", "registry",
    "AdditiveAttention", "GeneralAttention", "DotAttention", "LocationAttention",
    "RelativePositionAttention", "SinusoidalPositionalEncoding",
    "AgglomerativeAttention", "LinearAttention", "GatedLinearAttention", "DocumentMemory",
]


def _renamed(what, name, value, old_name, old_value):
    """The value of argument `name`, also accepted under its old name (with a
    DeprecationWarning); exactly one of the two must be given."""
    if old_value is None:
        if value is None:
            raise TypeError(f"{what}: missing required argument '{name}'")
        return value
    if value is not None:
        raise TypeError(f"{what}: give '{name}' or its old name '{old_name}', not both")
    warnings.warn(f"{what}: '{old_name}' is deprecated, use '{name}'", DeprecationWarning, stacklevel=3)
    return old_value


def _lengths_from_padding(mask: Optional[Tensor], N: int, S: int, what: str) -> Optional[Tensor]:
    """key_padding_mask (N, S), True (or -inf) where a key is padding, as int64
    key lengths (N). Only trailing padding has a length form; anything else is
    refused rather than silently changed. (TorchScript compiles it.)"""
    if mask is None:
        return None
    if mask.dim() != 2 or mask.shape[0] != N or mask.shape[1] != S:
        raise ValueError(f"{what}: key_padding_mask must be (N, S) = ({N}, {S}), got shape {list(mask.shape)}")
    padded = mask if mask.dtype == torch.bool else torch.isneginf(mask)
    if mask.dtype != torch.bool and not bool(torch.all((mask == 0) | padded)):
        raise ValueError(f"{what}: a float key_padding_mask must hold 0 and -inf only")
    lengths = (~padded).sum(1)
    expected = torch.arange(S, device=mask.device).unsqueeze(0) >= lengths.unsqueeze(1)
    if not torch.equal(padded, expected):
        raise ValueError(f"{what}: key_padding_mask must pad at the end of each row (keys j >= "
                         "length); attnkit takes padding as key lengths")
    return lengths.to(torch.int64)


def _causal_from_mask(attn_mask: Optional[Tensor], L: int, S: int, what: str) -> bool:
    """True when attn_mask is the causal mask (query i sees keys j <= i + S - L).
    (TorchScript compiles it.)"""
    if attn_mask is None:
        return False
    hidden = torch.ones(L, S, dtype=torch.bool, device=attn_mask.device).triu(S - L + 1)
    given = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
    if attn_mask.dim() != 2 or attn_mask.shape[0] != L or attn_mask.shape[1] != S or not torch.equal(
            given, hidden) or (attn_mask.dtype != torch.bool and not bool(torch.all((attn_mask == 0) | given))):
        raise ValueError(f"{what}: attn_mask must be the causal mask of shape ({L}, {S}) (or pass "
                         "is_causal=True); attnkit's mechanisms take masks as the causal flag and key "
                         "lengths, not as arbitrary (L, S) matrices")
    return True


@functools.lru_cache(maxsize=None)
def _always_causal(spec):
    """True for a mechanism that is causal by construction (a causal pattern)."""
    name = spec.split(":", 1)[0]
    return any(entry["name"] == name and entry["always_causal"] for entry in _library.mechanisms())


@functools.lru_cache(maxsize=None)
def _exact_name():
    """The registry's exact softmax attention, the one mechanism that forms the
    (L, S) weight matrix need_weights returns."""
    return next(entry["name"] for entry in _library.mechanisms() if entry["exact"])


class Linear(BridgedModule):
    """y = x W^T + b on attnkit's GEMM; torch.nn.Linear's parameters and initialisation."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__("Linear", {"in_features": in_features, "out_features": out_features, "bias": bias})
        self.in_features, self.out_features = in_features, out_features

    def forward(self, input: Tensor) -> Tensor:
        return self._forward(input)[0]


class MultiheadAttention(BridgedModule):
    """Multi-head attention with any mechanism of the registry behind the
    projections (q_proj, k_proj, v_proj, out_proj).

    torch.nn.MultiheadAttention's conventions where they make sense:
    ``batch_first`` (default False: (L, N, E) inputs), ``key_padding_mask``
    ((N, S), True at padding; trailing padding only), ``attn_mask`` only as the
    causal mask, or ``is_causal=True``. forward returns ``(output, weights)``:
    ``weights`` is None unless ``need_weights=True`` (default False, unlike
    torch's: the (L, S) matrix is formed only when asked), then the attention
    weights (N, L, S) averaged over the heads (``average_attn_weights=False``:
    (N, num_heads, L, S)), differentiable, formed by the C++ module with the
    mechanism's own masks, window and positions; only for exact attention
    ("full").
    ``kv_heads`` (a divisor of num_heads; 0: as many) gives grouped-query
    attention: k_proj and v_proj project to kv_heads heads, each serving
    num_heads / kv_heads query heads (read in place by exact, sparse and
    linear attention and SAC, repeated for mechanisms that do not read groups:
    ``supports["grouped_heads"]``). ``alibi=True`` adds ALiBi's distance
    penalties (attnkit.alibi_slopes(num_heads)) inside the kernel, for
    mechanisms that take them ("full", "sparse-*", "sac";
    ``supports["alibi"]``). ``rotary_dim`` (even, at
    most embed_dim / num_heads; 0: none) gives rotary positions on that many
    features of each head's queries and keys (``rotary_base``: their angles'
    base), inside the kernel for "full" and for "linear" / "causal-linear"
    (RoFormer's form: phi(q), phi(k) turned in the numerator only), on q and
    k before the call for the other mechanisms whose scores are dot products
    (``supports["rotary"]``). ``dropout`` (in [0, 1)) is attention dropout
    on the weights in training mode, inside the exact kernel (``"full"``;
    ``supports["dropout"]``); the weights ``need_weights`` returns are those
    before dropout.
    """

    # embed_dim and num_heads (the width and heads of every other module) keep
    # torch.nn.MultiheadAttention's names: a drop-in replacement (docs/API.md).
    def __init__(self, embed_dim, num_heads, attention="full", bias=True, batch_first=False, kv_heads=0,
                 alibi=False, rotary_dim=0, rotary_base=10000.0, dropout=0.0):
        super().__init__("MultiheadAttention", {"width": embed_dim, "heads": num_heads, "kv_heads": kv_heads,
                                                "alibi": alibi, "rotary_dim": rotary_dim,
                                                "rotary_base": float(rotary_base), "bias": bias,
                                                "dropout": float(dropout), "attention": attention})
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first

    def _settings_changed(self):
        # What forward reads of the settings, as plain attributes, which
        # TorchScript can compile. A scripted module copies them when it is
        # made: it shares the C++ module with this one, so script after
        # set_attention (or script a deepcopy), not before.
        settings = json.loads(self._bridge.settings())
        self._spec = settings["attention"]
        self._exact_name = _exact_name()
        self._exact = self._spec.split(":", 1)[0] == self._exact_name
        self._always_causal = _always_causal(self._spec)
        self._kv_heads = settings["kv_heads"] or settings["heads"]
        self._alibi = settings["alibi"]
        self._rotary_dim, self._rotary_base = settings["rotary_dim"], settings["rotary_base"]

    @property
    def attention_spec(self) -> str:
        """The mechanism's spec (after set_attention, the new one)."""
        return self._spec

    def set_attention(self, spec):
        """Swaps the mechanism behind the same projections."""
        self._command("set_attention", attention=spec)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = False, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False, key_lengths: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        what = "attnkit.nn.MultiheadAttention"
        if need_weights and not self._exact:  # the C++ module refuses too: a Python error type before any work
            raise ValueError(f"{what}: need_weights=True needs exact attention ('{self._exact_name}'); "
                             f"'{self._spec}' forms no (L, S) weight matrix (swap in '{self._exact_name}' with "
                             "set_attention to inspect one)")
        if key_padding_mask is not None and key_lengths is not None:
            raise ValueError(f"{what}: give key_padding_mask or key_lengths, not both")
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        if key_lengths is None:
            key_lengths = _lengths_from_padding(key_padding_mask, key.shape[0], key.shape[1], what)
        causal = bool(is_causal) or _causal_from_mask(attn_mask, query.shape[1], key.shape[1], what)
        if causal and self._always_causal:
            causal = False  # a causal pattern is causal by construction and takes no flag
        # The C++ module forms the weights (nn::MultiheadAttention::attention_weights):
        # 1 per head, 2 averaged over the heads.
        wanted = (2 if average_attn_weights else 1) if need_weights else 0
        outputs = self._forward(query, key, value, key_lengths, causal=causal, weights=wanted)
        out = outputs[0]
        weights: Optional[Tensor] = None
        if need_weights:
            weights = outputs[1]
        return (out if self.batch_first else out.transpose(0, 1)), weights


class Attention(BridgedModule):
    """A registry mechanism over per-head tensors: (q, k, v) -> (N, H, L, M).
    ``spec`` is a registry spec string; keyword options are appended to it."""

    def __init__(self, spec="full", **options):
        if options:
            spec += (":" if ":" not in spec else ",") + ",".join(
                f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
        super().__init__("Attention", {"spec": spec})
        self.spec = spec

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                key_lengths: Optional[Tensor] = None) -> Tensor:
        return self._forward(q, k, v, key_lengths, causal=causal)[0]


class _ScoreAttention(BridgedModule):
    """The zoo's score-based modules: forward(query (N, L, Dq), keys (N, S, Dk),
    values (N, S, Dv), key_lengths=None) -> (context (N, L, Dv), weights (N, L, S))."""

    def forward(self, query: Tensor, keys: Tensor, values: Tensor,
                key_lengths: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        outputs = self._forward(query, keys, values, key_lengths)
        return outputs[0], outputs[1]


class AdditiveAttention(_ScoreAttention):
    """Bahdanau: e_ij = v^T tanh(W s_i + U h_j). forward(query (N, L, Dq), keys
    (N, S, Dk), values (N, S, Dv), key_lengths=None) -> (context (N, L, Dv),
    weights (N, L, S))."""

    def __init__(self, query_dim, key_dim, hidden_dim):
        super().__init__("AdditiveAttention", {"query_dim": query_dim, "key_dim": key_dim,
                                               "hidden_dim": hidden_dim})


class GeneralAttention(_ScoreAttention):
    """Luong's general score e_ij = s_i^T W h_j; AdditiveAttention's call."""

    def __init__(self, query_dim, key_dim):
        super().__init__("GeneralAttention", {"query_dim": query_dim, "key_dim": key_dim})


class DotAttention(_ScoreAttention):
    """e_ij = s_i^T h_j, divided by sqrt(d) when ``scaled``; AdditiveAttention's call."""

    def __init__(self, scaled=True):
        super().__init__("DotAttention", {"scaled": scaled})


class LocationAttention(BridgedModule):
    """Luong's location-based attention a_i = softmax(W s_i) over source
    positions. forward(query (N, L, Dq), values (N, S, Dv), key_lengths=None)."""

    def __init__(self, query_dim, max_source_length):
        super().__init__("LocationAttention", {"query_dim": query_dim,
                                               "max_source_length": max_source_length})

    def forward(self, query: Tensor, values: Tensor, key_lengths: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        outputs = self._forward(query, values, key_lengths)
        return outputs[0], outputs[1]


class RelativePositionAttention(BridgedModule):
    """Shaw et al.'s multi-head self-attention with relative position tables
    (offsets clipped to [-max_relative, max_relative]) over a model of
    ``width`` (a multiple of ``heads``). forward(x (N, L, width),
    key_lengths=None, causal=False) -> (N, L, width)."""

    def __init__(self, width=None, heads=None, max_relative=16, *, embed_dim=None, num_heads=None):
        what = "attnkit.nn.RelativePositionAttention"
        width = _renamed(what, "width", width, "embed_dim", embed_dim)
        heads = _renamed(what, "heads", heads, "num_heads", num_heads)
        super().__init__("RelativePositionAttention", {"width": width, "heads": heads,
                                                       "max_relative": max_relative})

    def forward(self, x: Tensor, key_lengths: Optional[Tensor] = None, causal: bool = False) -> Tensor:
        return self._forward(x, key_lengths, causal=causal)[0]


class SinusoidalPositionalEncoding(BridgedModule):
    """x (N, L, width) + the sinusoidal table's rows [offset, offset + L)."""

    def __init__(self, width=None, max_length=8192, *, d_model=None):
        width = _renamed("attnkit.nn.SinusoidalPositionalEncoding", "width", width, "d_model", d_model)
        super().__init__("SinusoidalPositionalEncoding", {"width": width, "max_length": max_length})

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return self._forward(x, offset=offset)[0]


class AgglomerativeAttention(BridgedModule):
    """The agglomerative-attention layer: ``classes`` classes over a model of
    ``width`` (a multiple of classes). forward(query (N, L, width), reference
    (N, S, width) or None for self-attention, causal=False) -> (N, L, width)."""

    def __init__(self, width=None, classes=None, dropout=0.0, *, embed_dim=None):
        what = "attnkit.nn.AgglomerativeAttention"
        width = _renamed(what, "width", width, "embed_dim", embed_dim)
        if classes is None:
            raise TypeError(f"{what}: missing required argument 'classes'")
        super().__init__("AgglomerativeAttention", {"width": width, "classes": classes,
                                                    "dropout": dropout})

    def forward(self, query: Tensor, reference: Optional[Tensor] = None, causal: bool = False) -> Tensor:
        return self._forward(query, reference, causal=causal)[0]


class LinearAttention(BridgedModule):
    """linear_attention as a module (no parameters): phi(q) (sum phi(k) v^T),
    optionally normalised. Defaults are the op's (identity map, no
    normaliser); the registry's "linear" (mechanisms.Linear) defaults to the
    normalised elu form. rotary_dim > 0 adds rotary positions in RoFormer's
    linear form (phi(q), phi(k) rotated in the numerator only); k and v may
    have fewer heads than q (grouped-query heads)."""

    def __init__(self, feature_map="identity", normalize=False, causal=False, eps=1e-6,
                 rotary_dim=0, rotary_base=10000.0):
        super().__init__("LinearAttention", {"feature_map": feature_map, "normalize": normalize,
                                             "causal": causal, "eps": eps, "rotary_dim": rotary_dim,
                                             "rotary_base": rotary_base})

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self._forward(q, k, v)[0]


class GatedLinearAttention(BridgedModule):
    """The cheap-linear-attention paper's gated layer: f = sigmoid(W h + b) * h,
    C = sum f f^T, a query q reads C q. forward(hidden (N, n, dim), queries
    (N, m, dim), causal=False) -> (N, m, dim); features(hidden) gives f (what a
    DocumentMemory stores)."""

    def __init__(self, dim):
        super().__init__("GatedLinearAttention", {"dim": dim})

    def forward(self, hidden: Tensor, queries: Tensor, causal: bool = False) -> Tensor:
        return self._forward(hidden, queries, causal=causal)[0]

    def features(self, hidden):
        return self._call("features", hidden)[0]


class DocumentMemory:
    """A fixed-size document representation C = sum_t h_t h_t^T (float32
    (dim, dim)): append hidden states (n, dim) as they stream, lookup(queries
    (m, dim)) -> C q in O(m dim^2) whatever the document's length, merge two
    memories, save to and load from a checksummed file. Not an nn.Module: it
    has no parameters."""

    def __init__(self, dim):
        self._memory = torch.classes.attnkit.DocumentMemory(int(dim))

    @classmethod
    def load(cls, path):
        """Reads a file written by save(); a missing, truncated or corrupt file
        raises RuntimeError naming it."""
        self = cls.__new__(cls)
        self._memory = torch.ops.attnkit.load_document_memory(str(path))
        return self

    def append(self, hidden):
        self._memory.append(hidden)
        return self

    def lookup(self, queries):
        return self._memory.lookup(queries)

    def merge(self, other):
        self._memory.merge(other._memory)
        return self

    def save(self, path):
        self._memory.save(str(path))

    @property
    def dim(self):
        return self._memory.dim()

    @property
    def num_states(self):
        return self._memory.num_states()

    def matrix(self):
        """A copy of C."""
        return self._memory.matrix()

    def __reduce__(self):
        raise TypeError("attnkit.nn.DocumentMemory is not picklable; use save(path) and "
                        "DocumentMemory.load(path)")

    def __repr__(self):
        return f"DocumentMemory(dim={self.dim}, num_states={self.num_states})"


def _class_name(mechanism):
    """CamelCase: 'improved-clustered' is ImprovedClustered. A name that would
    be a Python keyword gets 'Attention' appended: 'none' is NoneAttention."""
    name = "".join(part.capitalize() for part in mechanism.split("-"))
    return name + "Attention" if keyword.iskeyword(name) else name


def _mechanism_class(entry):
    name = entry["name"]
    keys = [o["key"] for o in entry["options"]]
    defaults = ", ".join(f"{o['key']}={o['default']}" for o in entry["options"]) or "none"

    def __init__(self, **options):
        unknown = sorted(set(options) - set(keys))
        if unknown:
            raise TypeError(f"attnkit.nn.registry.{_class_name(name)}: unknown option(s) "
                            f"{', '.join(unknown)}; it takes: {', '.join(keys) or 'none'}")
        Attention.__init__(self, name, **options)

    doc = (f"The registry's '{name}': {entry['summary']}.\n\nOptions (defaults): {defaults}. "
           "forward(q, k, v, causal=False, key_lengths=None) -> (N, H, L, M).")
    return type(_class_name(name), (Attention,), {"__init__": __init__, "__doc__": doc,
                                                   "__module__": "attnkit.nn.registry",
                                                   "__qualname__": _class_name(name)})


def _mechanism_classes():
    module = types.ModuleType("attnkit.nn.registry",
                              "One attnkit.nn.Attention subclass per mechanism of the registry "
                              "(attnkit.mechanisms()), named in CamelCase: 'improved-clustered' is "
                              "ImprovedClustered ('none', a keyword, is NoneAttention). "
                              "Layer-only mechanisms (agglomerative) are layers "
                              "of attnkit.nn instead.")
    names = []
    for entry in _library.mechanisms():
        if entry["layer_only"]:
            continue
        cls = _mechanism_class(entry)
        assert cls.__name__.isidentifier() and not keyword.iskeyword(cls.__name__)
        setattr(module, cls.__name__, cls)
        names.append(cls.__name__)
    module.__all__ = names
    sys.modules[module.__name__] = module  # so that pickle finds the classes
    # Pickles written before the rename name the classes' module
    # attnkit.nn.mechanisms: it is the same module.
    sys.modules["attnkit.nn.mechanisms"] = module
    return module


registry = _mechanism_classes()


def __getattr__(name):
    # attnkit.nn.mechanisms was this module's name until it clashed with the
    # function attnkit.mechanisms() (the registry as data).
    if name == "mechanisms":
        warnings.warn("attnkit.nn.mechanisms is deprecated, use attnkit.nn.registry (the same classes)",
                      DeprecationWarning, stacklevel=2)
        return registry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
