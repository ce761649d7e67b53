"""torch 2's FlexAttention call, ``flex_attention(query, key, value,
score_mod=None, block_mask=None, scale=None, enable_gqa=False,
return_lse=False)``, on attnkit's exact kernel, for torch 1.13 and 2.x alike
(docs/API.md, "flex_attention").

Two paths, and ``flex_attention_dispatch`` says which one a call takes:

- **The kernel**: the block mask's non-empty blocks only, nothing applied
  inside full blocks, forward and backward, at tile speed. A ``score_mod`` is
  traced once (``attnkit.score_mods.trace``: torch.fx, no compiler) into a
  program the kernel runs on each tile row, and differentiates, gradients
  into captured tensors that require grad included.
- **The composite** when the kernel cannot take the call (a score_mod outside
  the traced op set, whose op the dispatch reason names; inputs neither
  float32 nor bfloat16; bfloat16 with a score_mod): the scores are formed as
  an (B, H, L, S) tensor, ``score_mod(score, b, h, q_idx, kv_idx)`` is called
  once on all of them with broadcasting index tensors (``b`` (B, 1, 1, 1),
  ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, L, 1), ``kv_idx`` (1, 1, 1, S), int64),
  the mask and the softmax follow, and autograd differentiates it all. O(L S)
  memory, as torch's own eager flex_attention.

Beyond torch's signature: ``sinks`` (H), attention sinks, and ``softcap``,
soft-capping of the scaled scores (``softcap * tanh(score / softcap)``, before
the score_mod and the mask), both as ``softmax_attention``'s.

A traced program is kept per function (and the values its closure holds),
so a score_mod called again is not traced again; captured tensors are read
at each call, so a table an optimizer updates in place is seen. Rows that see nothing give 0 and lse -inf (with
sinks: lse = the sink), on both paths.
"""
import math
import weakref
from typing import Callable, Optional, Tuple, Union

import torch

from . import score_mods as _score_mods
from .block_mask import BlockMask

__all__ = ["flex_attention", "flex_attention_dispatch"]

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _as_block_mask(block_mask) -> Optional[BlockMask]:
    if block_mask is None or isinstance(block_mask, BlockMask):
        return block_mask
    if hasattr(block_mask, "mask_mod") and hasattr(block_mask, "BLOCK_SIZE"):
        return BlockMask.from_torch(block_mask)  # torch 2's own: its mask_mod evaluated again
    raise TypeError(f"attnkit.flex_attention: block_mask must be an attnkit.BlockMask or torch's BlockMask, got "
                    f"{type(block_mask).__name__}")


def _check(query, key, value, score_mod, block_mask, enable_gqa, sinks):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"attnkit.flex_attention: {name} must be a floating (B, H, length, features) tensor, "
                             f"got {got}")
    B, H, L, E = query.shape
    Bk, Hk, S, Ek = key.shape
    if (Bk, Hk, S) != tuple(value.shape[:3]) or Bk != B or Ek != E:
        raise ValueError(f"attnkit.flex_attention: key {tuple(key.shape)} and value {tuple(value.shape)} must share "
                         f"B, H and S, and key the query's B and E, query {tuple(query.shape)}")
    if Hk != H and not (enable_gqa and Hk > 0 and H % Hk == 0):
        raise ValueError(f"attnkit.flex_attention: query has {H} heads and key {Hk}: "
                         + ("the key's must divide the query's" if enable_gqa else "pass enable_gqa=True for grouped-query attention"))
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"attnkit.flex_attention: score_mod must be a function, got {type(score_mod).__name__}")
    if block_mask is not None:
        Bm, Hm, Lm, Sm = block_mask.shape
        if (Lm, Sm) != (L, S) or Bm not in (1, B) or Hm not in (1, H):
            raise ValueError(f"attnkit.flex_attention: block_mask of shape {block_mask.shape} does not fit "
                             f"(B, H, L, S) = {(B, H, L, S)} (B and H may be 1)")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (H,)):
        raise ValueError(f"attnkit.flex_attention: sinks must be a tensor of shape (H) = ({H},)")


# Traced programs by function, with the closure values they were traced with.
_programs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _closure_key(fn) -> Tuple:
    cells = getattr(fn, "__closure__", None) or ()
    key = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            value = None
        key.append(value if isinstance(value, (bool, int, float, str, type(None))) else id(value))
    return tuple(key)


def _traced(score_mod) -> Union["_score_mods.ScoreModProgram", str]:
    """A plain function's program, traced once per function and closure, or
    why it has none (ScoreModUnsupported's message)."""
    key = _closure_key(score_mod)
    try:
        cached = _programs.get(score_mod)
    except TypeError:  # not weak-referenceable: traced each call
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    try:
        program = _score_mods.trace(score_mod)
    except _score_mods.ScoreModUnsupported as e:
        program = str(e)
    try:
        _programs[score_mod] = (key, program)
    except TypeError:
        pass
    return program


if hasattr(torch, "_dynamo"):
    # Tracing with torch.fx inside a torch.compile'd region would be traced by
    # dynamo in turn: it runs eagerly instead (a graph break, which
    # score_mods.ScoreMod avoids by tracing when it is made).
    _traced = torch._dynamo.disable(_traced)


def _program(score_mod) -> Union["_score_mods.ScoreModProgram", str]:
    if isinstance(score_mod, _score_mods.ScoreMod):
        return score_mod.program
    return _traced(score_mod)


def flex_attention_dispatch(query, key, value, score_mod: Optional[ScoreMod] = None, block_mask=None) -> str:
    """Which path flex_attention takes for these arguments, and why."""
    if query.dtype not in (torch.float32, torch.bfloat16):
        return f"composite: {query.dtype} inputs (the kernel takes float32 and bfloat16)"
    where = " over the block mask's non-empty blocks" if block_mask is not None else ""
    if score_mod is None:
        return "kernel" + where
    if query.dtype != torch.float32:
        return f"composite: {query.dtype} inputs with a score_mod (the kernel runs score_mods on float32)"
    program = _program(score_mod)
    if isinstance(program, str):
        return "composite: " + program
    return f"kernel{where}, with the score_mod traced into {len(program)} instructions"


class _ScoreModAttention(torch.autograd.Function):
    """The kernel ops with a traced score_mod: out and lse, gradients for q,
    k, v, the sinks and the program's flat tables."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, tables, program, scale, softcap, mask):
        out, lse = torch.ops.attnkit._softmax_attention_forward(
            query, key, value, None, None, None, scale, False, 0, 10000.0, 0, 0.0, 0, *mask, sinks, softcap,
            program.code, program.values, tables)
        ctx.save_for_backward(query, key, value, out, lse, sinks, tables, *mask[:3])
        ctx.program, ctx.scale, ctx.softcap, ctx.block_size = program, scale, softcap, mask[3]
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse, sinks, tables, kinds, partial_index, bits = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        program = ctx.program
        dq, dk, dv, _, dsinks, dtables = torch.ops.attnkit._softmax_attention_backward(
            grad_out, query, key, value, out, lse, None, None, None, ctx.scale, False, 0, 10000.0, 0, 0.0, 0,
            False, kinds, partial_index, bits, ctx.block_size, sinks,
            grad_lse.contiguous() if grad_lse is not None else None, ctx.softcap, program.code, program.values,
            tables)
        return (dq, dk, dv, dsinks if sinks is not None and ctx.needs_input_grad[3] else None,
                dtables if tables is not None and ctx.needs_input_grad[4] else None, None, None, None, None)


def _kernel_with_score_mod(query, key, value, program, block_mask, scale, sinks, softcap):
    if block_mask is not None:
        arguments = block_mask.as_arguments()
        mask = (arguments["block_kinds"], arguments["block_partial_index"], arguments["block_bits"],
                list(arguments["block_size"]))
    else:
        mask = (None, None, None, [128, 128])
    return _ScoreModAttention.apply(query, key, value, sinks, program.flat_tables(), program, float(scale),
                                    float(softcap), mask)


def _composite(query, key, value, score_mod, block_mask, scale, sinks, softcap):
    B, H, L, _ = query.shape
    S = key.shape[2]
    group = H // key.shape[1]
    keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if score_mod is not None:
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.arange(H).view(1, H, 1, 1)
        q_idx = torch.arange(L).view(1, 1, L, 1)
        kv_idx = torch.arange(S).view(1, 1, 1, S)
        scores = score_mod(scores, b, h, q_idx, kv_idx)
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
            raise TypeError("attnkit.flex_attention: score_mod must return a floating tensor")
        scores = scores.expand(B, H, L, S)
    visible = (block_mask.to_dense() if block_mask is not None
               else torch.ones(1, 1, L, S, dtype=torch.bool)).expand(B, H, L, S)
    masked = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        masked = torch.cat([masked, sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, L, 1)], -1)
        seen = torch.ones(B, H, L, 1, dtype=torch.bool)
    else:
        seen = visible.any(-1, keepdim=True)
    # A row that sees nothing: scores of 0 where the softmax and lse are
    # formed (no NaN, zero gradients), then 0 out and -inf lse.
    safe = masked.masked_fill(~seen, 0.0)
    weights = torch.softmax(safe, -1).masked_fill(~seen, 0.0)
    lse = torch.logsumexp(safe, -1).masked_fill(~seen.squeeze(-1), -math.inf)
    if sinks is not None:
        weights = weights[..., :S]
    return torch.matmul(weights, values), lse


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Optional[ScoreMod] = None, block_mask=None, scale: Optional[float] = None,
                   enable_gqa: bool = False, return_lse: bool = False, *, sinks: Optional[torch.Tensor] = None,
                   softcap: float = 0.0):
    """torch 2's ``flex_attention`` (see the module's docstring): query (B, H, L,
    E), key (B, Hkv, S, E), value (B, Hkv, S, Ev) -> (B, H, L, Ev), and with
    ``return_lse`` the rows' log-sum-exp (B, H, L) too, both differentiable.
    ``block_mask``: an ``attnkit.BlockMask`` or torch's own. ``scale``: None
    for 1 / sqrt(E)."""
    block_mask = _as_block_mask(block_mask)
    _check(query, key, value, score_mod, block_mask, enable_gqa, sinks)
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"attnkit.flex_attention: softcap must be finite and >= 0 (0: none), got {softcap}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    path = flex_attention_dispatch(query, key, value, score_mod, block_mask)
    if path.startswith("kernel") and score_mod is not None:
        out, lse = _kernel_with_score_mod(query, key, value, _program(score_mod), block_mask, scale, sinks, softcap)
    elif path.startswith("kernel"):
        arguments = block_mask.as_arguments() if block_mask is not None else {}
        out, lse = torch.ops.attnkit.softmax_attention_with_lse(query, key, value, scale=float(scale), sinks=sinks,
                                                                softcap=float(softcap), **arguments)
    else:
        out, lse = _composite(query, key, value, score_mod, block_mask, scale, sinks, softcap)
        out = out.to(query.dtype)
    return (out, lse) if return_lse else out
