"""Score modifiers: torch's ``score_mod(score, b, h, q_idx, kv_idx)`` functions
traced once into a small program the exact kernel runs per tile, forward and
backward (docs/MATH.md, "Score modifiers"; the program format is
src/kernels/common/score_program.h).

``trace(score_mod)`` follows the function with ``torch.fx`` (torch 1.13 and
2.x alike: no compiler on the user's machine) and lowers each op to the
program's op set: arithmetic with constants, comparisons, ``where``,
``abs``, ``clamp``, ``floor``, ``log``, ``exp``, ``tanh``, ``sigmoid``, integer
arithmetic on the indices, and indexing into captured tensors
(``table[h, bucket]``), whose gradients the kernel returns when they require
grad. Anything else raises ``ScoreModUnsupported`` naming the op, and
``flex_attention`` then takes its composite path, never a wrong answer.

The named modifiers below (``softcap``, ``alibi``, ``relative_buckets``)
are plain functions of the same kind: they trace to the same programs as
the same code written by hand.
"""
import math
import operator
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx

__all__ = ["ScoreMod", "ScoreModProgram", "ScoreModUnsupported", "trace", "softcap", "alibi", "relative_buckets",
           "t5_bucket"]

# The opcodes of src/kernels/common/score_program.h (ScoreOp).
OPS = {
    "score": 0, "batch": 1, "head": 2, "query": 3, "key": 4, "const": 5,
    "neg": 10, "abs": 11, "exp": 12, "log": 13, "tanh": 14, "sigmoid": 15, "sqrt": 16, "floor": 17,
    "ceil": 18, "trunc": 19, "not": 20, "round": 21,
    "add": 30, "sub": 31, "mul": 32, "div": 33, "floordiv": 34, "mod": 35, "pow": 36, "minimum": 37,
    "maximum": 38, "clamp_min": 39, "clamp_max": 40, "lt": 41, "le": 42, "gt": 43, "ge": 44, "eq": 45,
    "ne": 46, "and": 47, "or": 48,
    "where": 60, "index": 70, "gather": 71,
}

# Larger integers are not exact in the kernel's float32 registers.
_EXACT = 2 ** 24


class ScoreModUnsupported(Exception):
    """A score_mod the kernel cannot run; the message names what and why."""


class ScoreModProgram:
    """A traced score_mod: ``code`` int32 (n, 4) (opcode and operand registers),
    ``values`` float32 (n) (constants and dimension sizes), ``tables`` the
    captured tensors in the order the code reads them (``flat_tables()``
    concatenates them, differentiably)."""

    def __init__(self, code: List[Tuple[int, int, int, int]], values: List[float], tables: List[torch.Tensor]):
        self.code = torch.tensor(code, dtype=torch.int32).view(-1, 4)
        self.values = torch.tensor(values, dtype=torch.float32)
        self.tables = tables

    def __len__(self):
        return self.code.shape[0]

    def flat_tables(self) -> Optional[torch.Tensor]:
        if not self.tables:
            return None
        return torch.cat([t.reshape(-1).to(torch.float32) for t in self.tables])

    def ops(self) -> List[str]:
        """The opcodes by name, for reading a program."""
        names = {v: k for k, v in OPS.items()}
        return [names[int(op)] for op in self.code[:, 0]]


# A value during tracing: a register of the program (with torch's dtype
# kind: 'f' floating, 'i' integer, 'b' boolean), a Python number, or a
# captured tensor (only indexable).
class _Reg:
    __slots__ = ("index", "kind")

    def __init__(self, index: int, kind: str):
        self.index, self.kind = index, kind


class _Table:
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _kind_of_number(x) -> str:
    return "b" if isinstance(x, bool) else "i" if isinstance(x, int) else "f"


def _promote(a: str, b: str) -> str:
    if "f" in (a, b):
        return "f"
    if "i" in (a, b):
        return "i"
    return "b"


_UNARY = {  # name -> (opcode, result kind given the operand's; None: as the operand)
    "neg": ("neg", None), "abs": ("abs", None), "exp": ("exp", "f"), "log": ("log", "f"),
    "tanh": ("tanh", "f"), "sigmoid": ("sigmoid", "f"), "sqrt": ("sqrt", "f"),
    "floor": ("floor", None), "ceil": ("ceil", None), "round": ("round", None), "trunc": ("trunc", None),
}
_BINARY = {  # name -> opcode; result kinds: Lowering.binary (torch's promotion)
    "add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "div": "div", "floordiv": "floordiv",
    "mod": "mod", "remainder": "mod", "pow": "pow", "minimum": "minimum", "maximum": "maximum",
    "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne",
}
_COMPARISONS = {"lt", "le", "gt", "ge", "eq", "ne"}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


class _Lowering:
    """Lowers one fx graph to a program, instruction by instruction."""

    def __init__(self, module: torch.fx.GraphModule):
        self.module = module
        self.code: List[Tuple[int, int, int, int]] = []
        self.values: List[float] = []
        self.tables: List[torch.Tensor] = []
        self.table_offsets: Dict[int, int] = {}
        self.table_numel = 0
        self.consts: Dict[Tuple[str, float], _Reg] = {}

    # -- emitting -----------------------------------------------------------
    def emit(self, op: str, kind: str, *args: _Reg, value: float = 0.0) -> _Reg:
        regs = [a.index for a in args] + [-1] * (3 - len(args))
        self.code.append((OPS[op], regs[0], regs[1], regs[2]))
        self.values.append(float(value))
        return _Reg(len(self.code) - 1, kind)

    def const(self, x, kind: Optional[str] = None) -> _Reg:
        kind = kind or _kind_of_number(x)
        x = float(x)
        if kind != "f" and abs(x) > _EXACT:
            raise ScoreModUnsupported(f"score_mod uses the integer {int(x)}, beyond 2^24, which the kernel's "
                                      "float32 registers do not hold exactly")
        key = (kind, x)
        if key not in self.consts:
            self.consts[key] = self.emit("const", kind, value=x)
        return self.consts[key]

    def reg(self, x) -> _Reg:
        if isinstance(x, _Reg):
            return x
        if isinstance(x, (bool, int, float)):
            return self.const(x)
        if isinstance(x, _Table):
            raise ScoreModUnsupported("score_mod uses a captured tensor other than by indexing every dimension "
                                      "of it with scalars or index tensors (table[h, bucket])")
        raise ScoreModUnsupported(f"score_mod passes a {type(x).__name__} where the kernel needs a tensor or number")

    # -- ops ----------------------------------------------------------------
    def unary(self, name: str, x):
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            fn = {"neg": operator.neg, "abs": abs, "exp": math.exp, "log": math.log, "tanh": math.tanh,
                  "sqrt": math.sqrt, "floor": math.floor, "ceil": math.ceil, "round": round,
                  "trunc": math.trunc, "sigmoid": lambda v: 1.0 / (1.0 + math.exp(-v))}[name]
            return fn(x)
        x = self.reg(x)
        op, kind = _UNARY[name]
        if kind is None:
            kind = x.kind if x.kind != "b" else "i"
        if name in ("floor", "ceil", "round", "trunc") and x.kind != "f":
            return x  # torch returns integer tensors unchanged
        return self.emit(op, kind, x)

    def binary(self, name: str, a, b):
        numbers = (bool, int, float)
        if isinstance(a, numbers) and isinstance(b, numbers):  # folded in Python, as the function would
            fn = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
                  "div": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
                  "remainder": operator.mod, "pow": operator.pow, "minimum": min, "maximum": max,
                  "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
                  "eq": operator.eq, "ne": operator.ne}[name]
            return fn(a, b)
        ka = a.kind if isinstance(a, _Reg) else _kind_of_number(a) if isinstance(a, numbers) else None
        kb = b.kind if isinstance(b, _Reg) else _kind_of_number(b) if isinstance(b, numbers) else None
        if ka is None or kb is None:
            self.reg(a), self.reg(b)  # raises with the reason
        # torch: a Python number takes the tensor's kind unless it is float
        # against an integer tensor.
        if not isinstance(a, _Reg):
            ka = kb if (ka != "f" or kb == "f") else "f"
        if not isinstance(b, _Reg):
            kb = ka if (kb != "f" or ka == "f") else "f"
        kind = _promote(ka, kb)
        if name in ("add", "sub", "mul", "floordiv", "mod", "pow", "minimum", "maximum") and kind == "b":
            kind = "i"
        if name in ("truediv", "div"):
            kind = "f"
        if name in _COMPARISONS:
            kind = "b"
        ra, rb = self.const(a, ka) if not isinstance(a, _Reg) else a, self.const(b, kb) if not isinstance(b, _Reg) else b
        return self.emit(_BINARY[name], kind, ra, rb)

    def logical(self, name: str, a, b=None):
        if name == "not":
            x = self.reg(a)
            if x.kind != "b":
                raise ScoreModUnsupported("score_mod uses ~ (bitwise not) on a non-boolean tensor, outside the "
                                          "kernel's op set (logical not of booleans only)")
            return self.emit("not", "b", x)
        ra, rb = self.reg(a), self.reg(b)
        if ra.kind != "b" or rb.kind != "b":
            raise ScoreModUnsupported(f"score_mod uses bitwise {name} on integer tensors, outside the kernel's op "
                                      "set (logical and/or of booleans only)")
        return self.emit(name, "b", ra, rb)

    def where(self, cond, a, b):
        rc = self.reg(cond)
        if rc.kind != "b":
            rc = self.emit("ne", "b", rc, self.const(0, rc.kind))
        ka = a.kind if isinstance(a, _Reg) else _kind_of_number(a)
        kb = b.kind if isinstance(b, _Reg) else _kind_of_number(b)
        kind = _promote(ka, kb)
        return self.emit("where", kind, rc, self.reg(a) if isinstance(a, _Reg) else self.const(a, kind),
                         self.reg(b) if isinstance(b, _Reg) else self.const(b, kind))

    def clamp(self, x, lo=None, hi=None):
        r = self.reg(x)
        for bound, op in ((lo, "clamp_min"), (hi, "clamp_max")):
            if bound is None:
                continue
            kind = _promote(r.kind, bound.kind if isinstance(bound, _Reg) else _kind_of_number(bound))
            rb = bound if isinstance(bound, _Reg) else self.const(bound, kind)
            r = self.emit(op, kind, r, rb)
        return r

    def convert(self, x, dtype):
        if isinstance(x, (bool, int, float)):
            if dtype in _FLOAT_DTYPES:
                return float(x)
            if dtype == torch.bool:
                return bool(x)
            return int(x)
        r = self.reg(x)
        if dtype in _FLOAT_DTYPES:
            return _Reg(r.index, "f")
        if dtype == torch.bool:
            return r if r.kind == "b" else self.emit("ne", "b", r, self.const(0, r.kind))
        if dtype in _INT_DTYPES:
            return self.emit("trunc", "i", r) if r.kind == "f" else _Reg(r.index, "i")
        raise ScoreModUnsupported(f"score_mod converts to {dtype}, outside the kernel's op set")

    def constant_like(self, x, value):
        if isinstance(value, _Reg):
            raise ScoreModUnsupported("score_mod fills a tensor with a tensor value")
        kind = (x.kind if isinstance(x, _Reg) else _kind_of_number(x)) if not isinstance(value, float) else "f"
        return self.const(value, kind)

    def index(self, table, key):
        if not isinstance(table, _Table):
            raise ScoreModUnsupported("score_mod indexes something other than a captured tensor (only "
                                      "table[...] with a captured table is in the kernel's op set)")
        t = table.tensor
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != t.dim() or any(k is None or k is Ellipsis or isinstance(k, slice) for k in key):
            raise ScoreModUnsupported(f"score_mod indexes a captured tensor of shape {tuple(t.shape)} with "
                                      f"{len(key)} indices; the kernel gathers single elements (one index per "
                                      "dimension)")
        if not (t.is_floating_point() or t.dtype in _INT_DTYPES or t.dtype == torch.bool):
            raise ScoreModUnsupported(f"score_mod indexes a captured tensor of dtype {t.dtype}")
        if t.numel() == 0 or t.numel() > _EXACT:
            raise ScoreModUnsupported(f"score_mod indexes a captured tensor of {t.numel()} elements; the kernel "
                                      "takes 1 to 2^24")
        if t.device.type != "cpu":
            raise ScoreModUnsupported(f"score_mod captures a tensor on {t.device}")
        if id(t) not in self.table_offsets:
            self.table_offsets[id(t)] = self.table_numel
            self.tables.append(t)
            self.table_numel += t.numel()
        flat = self.table_offsets[id(t)]  # a Python int while every index is one
        stride = 1
        strides = []
        for size in reversed(t.shape):
            strides.append(stride)
            stride *= size
        strides.reverse()
        for k, size, st in zip(key, t.shape, strides):
            if isinstance(k, bool) or not isinstance(k, (int, _Reg)):
                raise ScoreModUnsupported(f"score_mod indexes a captured tensor with a {type(k).__name__}; the "
                                          "kernel takes integer scalars and integer index tensors")
            if isinstance(k, int):
                if not -size <= k < size:
                    raise IndexError(f"score_mod: index {k} is out of range for a dimension of size {size}")
                term = (k + size) % size * st
            else:
                if k.kind == "f":
                    raise ScoreModUnsupported("score_mod indexes a captured tensor with a floating tensor "
                                              "(convert it with .long() first)")
                term = self.binary("mul", self.emit("index", "i", k, value=size), st) if st != 1 else \
                    self.emit("index", "i", k, value=size)
            flat = term if isinstance(flat, int) and flat == 0 else self.binary("add", flat, term)
        kind = "f" if t.is_floating_point() else "b" if t.dtype == torch.bool else "i"
        return self.emit("gather", kind, self.reg(flat))

    # -- the graph ----------------------------------------------------------
    def run(self) -> ScoreModProgram:
        env: Dict[torch.fx.Node, object] = {}
        inputs = ["score", "batch", "head", "query", "key"]
        placeholders = 0
        result = None
        for node in self.module.graph.nodes:
            if node.op == "placeholder":
                if placeholders >= 5:
                    raise ScoreModUnsupported("score_mod must take exactly (score, b, h, q_idx, kv_idx)")
                env[node] = self.emit(inputs[placeholders], "f" if placeholders == 0 else "i")
                placeholders += 1
            elif node.op == "get_attr":
                value = self.module
                for part in node.target.split("."):
                    value = getattr(value, part)
                if not isinstance(value, torch.Tensor):
                    raise ScoreModUnsupported(f"score_mod reads {node.target}, which is not a tensor")
                # A 0-d tensor (a learned temperature) is read where it is
                # named, so that it may take a gradient too.
                env[node] = _Table(value) if value.dim() > 0 else self.index(_Table(value), ())
            elif node.op in ("call_function", "call_method"):
                args = torch.fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
                env[node] = self.call(node, args, kwargs)
            elif node.op == "output":
                result = torch.fx.node.map_arg(node.args[0], lambda n: env[n])
            else:
                raise ScoreModUnsupported(f"score_mod calls a module ({node.target}), outside the kernel's op set")
        if placeholders != 5:
            raise ScoreModUnsupported("score_mod must take exactly (score, b, h, q_idx, kv_idx)")
        if isinstance(result, (bool, int, float)):
            result = self.const(result, "f")
        if not isinstance(result, _Reg):
            raise ScoreModUnsupported("score_mod must return one tensor")
        if result.kind != "f":
            raise ScoreModUnsupported("score_mod returns an integer or boolean tensor; it must return scores")
        return ScoreModProgram(*_live(self.code, self.values, result.index), self.tables)

    def call(self, node, args, kwargs):
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
        if node.op == "call_method" and args and isinstance(args[0], _Table) and name != "__getitem__":
            raise ScoreModUnsupported(f"score_mod calls .{name}() on a captured tensor; only indexing it is in "
                                      "the kernel's op set")
        name = name.strip("_")  # operator.and_, Tensor.__getitem__, __rsub__ ...
        if name == "inv":
            name = "invert"
        if name == "getitem":
            return self.index(args[0], args[1])
        if name in ("add", "sub", "mul", "div", "true_divide") and "alpha" in kwargs:
            raise ScoreModUnsupported(f"score_mod uses {name}(alpha=...), outside the kernel's op set")
        if name == "div" and kwargs.get("rounding_mode") is not None:
            mode = kwargs["rounding_mode"]
            if mode == "floor":
                return self.binary("floordiv", args[0], args[1])
            quotient = self.binary("div", args[0], args[1])
            return self.convert(self.unary("trunc", quotient), torch.int64) if self._integral(args) else \
                self.unary("trunc", quotient)
        if name in ("true_divide", "divide"):
            name = "div"
        if name in ("rsub",):
            return self.binary("sub", args[1], args[0])
        if name in ("radd", "rmul"):
            return self.binary(name[1:], args[1], args[0])
        if name in ("rtruediv", "rfloordiv", "rmod", "rpow"):
            return self.binary(name[1:], args[1], args[0])
        if name in _UNARY and len(args) == 1 and not kwargs:
            return self.unary(name, args[0])
        if name == "pos":
            return args[0]
        if name in ("invert", "logical_not"):
            return self.logical("not", args[0])
        if name in ("and", "logical_and", "bitwise_and"):
            return self.logical("and", args[0], args[1])
        if name in ("or", "logical_or", "bitwise_or"):
            return self.logical("or", args[0], args[1])
        if name in _BINARY and len(args) == 2 and not kwargs:
            return self.binary(name, args[0], args[1])
        if name in ("min", "max") and len(args) == 2 and not kwargs and not isinstance(args[1], int):
            return self.binary("minimum" if name == "min" else "maximum", args[0], args[1])
        if name == "where" and len(args) + len(kwargs) == 3:
            if node.op == "call_method":  # x.where(cond, y)
                return self.where(args[1], args[0], args[2])
            return self.where(*args, **kwargs)
        if name in ("clamp", "clip"):
            lo = kwargs.get("min", args[1] if len(args) > 1 else None)
            hi = kwargs.get("max", args[2] if len(args) > 2 else None)
            return self.clamp(args[0], lo, hi)
        if name == "clamp_min":
            return self.clamp(args[0], lo=args[1] if len(args) > 1 else kwargs["min"])
        if name == "clamp_max":
            return self.clamp(args[0], hi=args[1] if len(args) > 1 else kwargs["max"])
        if name == "relu":
            x = self.reg(args[0])
            return self.where(self.binary("gt", x, 0), x, 0)
        if name == "to":
            dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
            if dtype is None:
                raise ScoreModUnsupported("score_mod calls .to() without a dtype, outside the kernel's op set")
            return self.convert(args[0], dtype)
        if name in ("float", "double", "half", "bfloat16"):
            return self.convert(args[0], torch.float32)
        if name in ("long", "int", "short"):
            return self.convert(args[0], torch.int64)
        if name == "bool":
            return self.convert(args[0], torch.bool)
        if name in ("full_like",):
            return self.constant_like(args[0], args[1] if len(args) > 1 else kwargs["fill_value"])
        if name in ("zeros_like", "ones_like"):
            return self.constant_like(args[0], 0 if name == "zeros_like" else 1)
        if name == "type_as":
            return self.convert(args[0], args[1].dtype if isinstance(args[1], torch.Tensor) else
                                torch.float32 if self.reg(args[1]).kind == "f" else torch.int64)
        raise ScoreModUnsupported(f"score_mod uses {_describe(node)}, outside the op set the kernel runs "
                                  "(docs/MATH.md, \"Score modifiers\")")

    @staticmethod
    def _integral(args) -> bool:
        return all((isinstance(a, _Reg) and a.kind != "f") or (isinstance(a, int)) for a in args[:2])


def _live(code, values, output: int):
    """The instructions `output` depends on, renumbered in order, with the
    output last (the program format's rule); the rest is never run."""
    live = {output}
    for t in range(output, -1, -1):
        if t in live:
            live.update(r for r in code[t][1:] if r >= 0)
    order = sorted(live)
    if order[-1] != output:  # cannot happen: every operand precedes its user
        raise AssertionError("score_mod program: the output is not the last live instruction")
    number = {t: n for n, t in enumerate(order)}
    return ([(code[t][0],) + tuple(number[r] if r >= 0 else -1 for r in code[t][1:]) for t in order],
            [values[t] for t in order])


def _describe(node) -> str:
    target = node.target
    if node.op == "call_method":
        return f"the tensor method .{target}()"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", str(target))
    if module in ("_operator", "operator"):
        return f"the operator {name.strip('_')}"

    if module.startswith("torch"):
        return f"torch.{name}" if not module.startswith("torch.nn") else f"{module}.{name}"
    return f"{module}.{name}" if module else name


def trace(score_mod: Callable) -> ScoreModProgram:
    """The program of ``score_mod`` (a function of (score, b, h, q_idx,
    kv_idx)); raises ``ScoreModUnsupported`` naming what it cannot run.
    Any callable: an object with ``__call__`` or a ``functools.partial`` is
    traced through a function of the five arguments that calls it."""
    if not isinstance(score_mod, (types.FunctionType, torch.nn.Module)):
        target = score_mod

        def score_mod(score, b, h, q_idx, kv_idx):
            return target(score, b, h, q_idx, kv_idx)
    try:
        module = torch.fx.symbolic_trace(score_mod)
    except ScoreModUnsupported:
        raise
    except Exception as e:  # fx cannot follow it: Python control flow on a tensor, a call it cannot see into
        raise ScoreModUnsupported(f"score_mod cannot be traced by torch.fx ({type(e).__name__}: {e}); the "
                                  "kernel needs straight-line tensor code (use torch.where, not `if`)") from None
    return _Lowering(module).run()


# ---------------------------------------------------------------------------
# Named modifiers: ordinary score_mods, traced like any other.
# ---------------------------------------------------------------------------

class ScoreMod:
    """A score_mod function with its program traced when it is made: a call
    runs the function (as the composite path does), ``program`` is what the
    kernel runs. flex_attention then needs no tracing at call time, so that
    under torch.compile the call compiles without a graph break. The named
    modifiers below return these; ``ScoreMod(fn)`` wraps any function of the
    op set."""

    def __init__(self, fn: Callable, name: Optional[str] = None):
        self.fn = fn
        self.__name__ = name or getattr(fn, "__name__", "score_mod")
        self.program = trace(fn)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.fn(score, b, h, q_idx, kv_idx)

    def __repr__(self):
        return f"attnkit.score_mods.ScoreMod({self.__name__}, {len(self.program)} instructions)"


def softcap(cap: float) -> Callable:
    """Gemma 2's soft-capping, ``cap * tanh(score / cap)``."""
    cap = float(cap)
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"attnkit.score_mods.softcap: cap must be finite and > 0, got {cap}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return ScoreMod(score_mod, f"softcap({cap})")


def alibi(slopes: torch.Tensor) -> Callable:
    """ALiBi: ``score - slopes[h] * |q_idx - kv_idx|`` (slopes (H,), e.g.
    ``attnkit.alibi_slopes(H)``), the symmetric distance penalty; on a causal
    mask this is the usual ``score + slopes[h] * (kv_idx - q_idx)``."""
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1:
        raise ValueError("attnkit.score_mods.alibi: slopes must be a tensor of shape (H,)")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return ScoreMod(score_mod, "alibi")


def t5_bucket(relative, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
    """T5's relative position bucket of ``relative = kv_idx - q_idx`` (an
    integer tensor), as ``transformers``' T5Attention._relative_position_bucket."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket = (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0)
    max_exact = num_buckets // 2
    is_small = relative < max_exact
    large = max_exact + (torch.log(relative.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return bucket + torch.where(is_small, relative, large)


def relative_buckets(table: torch.Tensor, num_buckets: int = 32, max_distance: int = 128,
                     bidirectional: bool = True) -> Callable:
    """T5's learned relative bias: ``score + table[h, bucket(kv_idx - q_idx)]``
    with ``table`` (H, num_buckets), which may require grad."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[1] != num_buckets:
        raise ValueError(f"attnkit.score_mods.relative_buckets: table must have shape (H, num_buckets = "
                         f"{num_buckets})")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, t5_bucket(kv_idx - q_idx, num_buckets, max_distance, bidirectional)]
    return ScoreMod(score_mod, "relative_buckets")
