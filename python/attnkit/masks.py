"""Named mask_mods for ``attnkit.create_block_mask``: the common attention
patterns, with the library's alignment (query i of L sits at key position
i + S - L, the causal mask's bottom-right alignment; with L = S, torch's
``q_idx >= kv_idx``). Each returns a mask_mod, to pass on or to combine with
``attnkit.and_masks`` / ``or_masks``::

    mask = attnkit.create_block_mask(attnkit.masks.documents(offsets, causal=True), None, None, T, T)

The C++ functions of the same names are in ``attnkit::masks``
(include/attnkit/block_mask.h); the tests hold both to the same definitions,
written out pair by pair (tests/edges/block_mask_test.cpp,
tests/python/test_block_mask.py).
"""
import torch

__all__ = ["causal", "sliding_window", "documents", "prefix_lm", "global_window", "dilated"]


def _check(name, **values):
    for key, (value, least) in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"attnkit.masks.{name}: {key} must be an int >= {least}, got {value!r}")


def causal(L: int, S: int):
    """kv <= q + S - L."""
    _check("causal", L=(L, 0), S=(S, 0))
    shift = S - L

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + shift
    return mask_mod


def sliding_window(L: int, S: int, window: int, causal: bool = True):
    """The keys within window - 1 of the query's position q + S - L: before it
    when causal, on both sides otherwise (softmax_attention's ``window``)."""
    _check("sliding_window", L=(L, 0), S=(S, 0), window=(window, 1))
    shift = S - L

    def mask_mod(b, h, q_idx, kv_idx):
        d = q_idx + shift - kv_idx
        return ((d >= 0) & (d < window)) if causal else ((d > -window) & (d < window))
    return mask_mod


def documents(offsets: torch.Tensor, causal: bool = True):
    """Packed documents over one sequence of L = S tokens: ``offsets`` (int64,
    from 0 to L, not decreasing; varlen_attention's cu_seqlens) start each
    document, and a query sees the keys of its own (causal: up to itself)."""
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype != torch.int64 \
            or offsets.numel() < 1 or int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("attnkit.masks.documents: offsets must be an int64 tensor (D + 1) from 0 to the "
                         "sequence's length, not decreasing")
    document = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets[1:] - offsets[:-1])

    def mask_mod(b, h, q_idx, kv_idx):
        same = document[q_idx.long()] == document[kv_idx.long()]
        return (same & (kv_idx <= q_idx)) if causal else same
    return mask_mod


def prefix_lm(L: int, S: int, prefix: int):
    """Every query sees the first ``prefix`` keys and the keys up to its own
    position: kv < prefix or kv <= q + S - L."""
    _check("prefix_lm", L=(L, 0), S=(S, 0), prefix=(prefix, 0))
    shift = S - L

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx + shift)
    return mask_mod


def global_window(L: int, S: int, globals: int, window: int, causal: bool = True):
    """A sliding window plus ``globals`` global tokens (Longformer, BigBird):
    the window's keys, every key below ``globals`` and, when not causal,
    every key for the global queries (q + S - L < globals); causal: nothing
    past the query's position."""
    _check("global_window", L=(L, 0), S=(S, 0), globals=(globals, 0), window=(window, 1))
    shift = S - L
    local = sliding_window(L, S, window, causal)

    def mask_mod(b, h, q_idx, kv_idx):
        seen = local(b, h, q_idx, kv_idx) | (kv_idx < globals)
        if causal:
            return seen & (kv_idx <= q_idx + shift)
        return seen | (q_idx + shift < globals)
    return mask_mod


def dilated(L: int, S: int, dilation: int, causal: bool = True):
    """The keys at a multiple of ``dilation`` from the query's position
    ((q + S - L - kv) % dilation == 0), only before it when causal."""
    _check("dilated", L=(L, 0), S=(S, 0), dilation=(dilation, 1))
    shift = S - L

    def mask_mod(b, h, q_idx, kv_idx):
        d = q_idx + shift - kv_idx
        on = torch.remainder(d, dilation) == 0
        return (on & (d >= 0)) if causal else on
    return mask_mod
