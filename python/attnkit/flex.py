"""torch 2's FlexAttention call, ``flex_attention(query, key, value,
score_mod=None, block_mask=None, scale=None, enable_gqa=False,
return_lse=False)``, on attnkit's exact kernel, for torch 1.13 and 2.x alike
(docs/API.md, "flex_attention").

Two paths, and ``flex_attention_dispatch`` says which one a call takes:

- **The kernel** when there is no ``score_mod``: the block mask's non-empty
  blocks only, nothing applied inside full blocks, forward and backward, at
  tile speed (``softmax_attention_with_lse`` with the mask's arguments).
- **The composite** when there is one: the scores are formed as an
  (B, H, L, S) tensor, ``score_mod(score, b, h, q_idx, kv_idx)`` is called
  once on all of them with broadcasting index tensors (``b`` (B, 1, 1, 1),
  ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, L, 1), ``kv_idx`` (1, 1, 1, S), int64),
  the mask and the softmax follow, and autograd differentiates it all,
  captured tensors that require grad included. O(L S) memory, as torch's own
  eager flex_attention. Tracing a score_mod into the kernel (issue 48 item 3)
  is not built yet.

Beyond torch's signature: ``sinks`` (H), attention sinks, and ``softcap``,
soft-capping of the scaled scores (``softcap * tanh(score / softcap)``, before
the score_mod and the mask), both as ``softmax_attention``'s. Rows that see nothing give 0 and lse -inf (with
sinks: lse = the sink), on both paths.
"""
import math
from typing import Callable, Optional

import torch

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


def flex_attention_dispatch(query, key, value, score_mod: Optional[ScoreMod] = None, block_mask=None) -> str:
    """Which path flex_attention takes for these arguments, and why."""
    if score_mod is not None:
        return ("composite: a score_mod is evaluated over the whole (B, H, L, S) score tensor "
                "(tracing score_mods into the kernel is not built yet)")
    if query.dtype not in (torch.float32, torch.bfloat16):
        return f"composite: {query.dtype} inputs (the kernel takes float32 and bfloat16)"
    return "kernel" + (" over the block mask's non-empty blocks" if block_mask is not None else "")


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
    if flex_attention_dispatch(query, key, value, score_mod, block_mask).startswith("kernel"):
        arguments = block_mask.as_arguments() if block_mask is not None else {}
        out, lse = torch.ops.attnkit.softmax_attention_with_lse(query, key, value, scale=float(scale), sinks=sinks,
                                                                softcap=float(softcap), **arguments)
    else:
        out, lse = _composite(query, key, value, score_mod, block_mask, scale, sinks, softcap)
        out = out.to(query.dtype)
    return (out, lse) if return_lse else out
