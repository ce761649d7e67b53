"""Block masks with torch 2's FlexAttention API (torch.nn.attention.flex_attention):
``create_block_mask``, ``BlockMask``, ``and_masks``, ``or_masks``,
``noop_mask``; the named mask_mods of the common patterns are in
``attnkit.masks``.

A mask_mod is a plain function ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``,
True where query ``q_idx`` of batch entry ``b`` and head ``h`` sees key
``kv_idx``, written with tensor operations so that it broadcasts::

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = attnkit.create_block_mask(causal, None, None, 4096, 4096)

create_block_mask evaluates it once for every (query, key) pair, a chunk of
query rows at a time (``q_idx`` of shape (rows, 1), ``kv_idx`` (1, S), ``b``
and ``h`` 0-dimensional; int64, where torch passes int32: the same values,
and tensors torch 1.13 can index with), never over the whole L x S grid, and
keeps the result by blocks of ``BLOCK_SIZE`` queries x keys: each block empty,
full or partial, a partial block with one bit per pair. The mask's memory is
one byte and one int32 per block plus ``q_block * ceil(kv_block / 8)`` bytes
per partial block (``BlockMask.bytes()``). The C++ type is
``attnkit::BlockMask`` (include/attnkit/block_mask.h); both are described in
docs/API.md, "Block masks".
"""
import math
import operator
from typing import Callable, Optional, Tuple, Union

import torch

__all__ = ["BlockMask", "create_block_mask", "and_masks", "or_masks", "noop_mask"]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# The bools one chunk of a mask_mod's evaluation may hold (16 Mi): at least
# one row of blocks is evaluated at a time.
_CHUNK_ELEMENTS = 1 << 24

_KINDS = ("empty", "full", "partial")


def noop_mask(b, h, q_idx, kv_idx):
    """Every query sees every key."""
    return torch.ones((), dtype=torch.bool)


def _combined(name: str, combine, mask_mods) -> MaskMod:
    """A mask_mod folding ``mask_mods``' results with ``combine`` (& or |)."""
    if not mask_mods or not all(callable(m) for m in mask_mods):
        raise TypeError(f"attnkit.{name}: give one or more mask_mod functions")

    def mask_mod(b, h, q_idx, kv_idx):
        result = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            result = combine(result, m(b, h, q_idx, kv_idx))
        return result
    return mask_mod


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod true where every one of ``mask_mods`` is."""
    return _combined("and_masks", operator.and_, mask_mods)


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod true where any of ``mask_mods`` is."""
    return _combined("or_masks", operator.or_, mask_mods)


def _block_sizes(BLOCK_SIZE) -> Tuple[int, int]:
    """(q_block, kv_block) from torch's BLOCK_SIZE: an int for both, or a
    (Q_BLOCK_SIZE, KV_BLOCK_SIZE) pair."""
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(sizes) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
        raise ValueError(f"attnkit.create_block_mask: BLOCK_SIZE must be a positive int or a pair of them "
                         f"(Q_BLOCK_SIZE, KV_BLOCK_SIZE), got {BLOCK_SIZE!r}")
    return sizes


class BlockMask:
    """Which queries see which keys, by blocks (see the module's docstring).

    Tensors (the C++ attnkit::BlockMask's): ``kinds`` uint8 (B, H, ceil(L /
    q_block), ceil(S / kv_block)), 0 empty, 1 full, 2 partial; ``partial_index``
    int32 of the same shape, a partial block's index into ``bits``, else -1;
    ``bits`` uint8 (P, q_block, ceil(kv_block / 8)): query i of a partial
    block sees key j iff bit j % 8 of byte j // 8 of row i is set. B or H of 1
    broadcast. ``mask_mod`` is the function the mask was made from (None
    when it was combined from others with ``&`` or ``|``)."""

    def __init__(self, kinds, partial_index, bits, q_len: int, kv_len: int, q_block: int, kv_block: int,
                 mask_mod: Optional[MaskMod] = None):
        torch.ops.attnkit._block_mask_check(kinds, partial_index, bits, q_len, kv_len, q_block, kv_block)
        self.kinds, self.partial_index, self.bits = kinds, partial_index, bits
        self.q_len, self.kv_len, self.q_block, self.kv_block = q_len, kv_len, q_block, kv_block
        self.mask_mod = mask_mod

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """(B, H, L, S), torch's BlockMask.shape."""
        return (self.kinds.shape[0], self.kinds.shape[1], self.q_len, self.kv_len)

    @property
    def BLOCK_SIZE(self) -> Tuple[int, int]:
        """(q_block, kv_block), torch's order."""
        return (self.q_block, self.kv_block)

    def bytes(self) -> int:
        """The bytes the mask holds (kinds, partial_index and bits)."""
        return self.kinds.numel() + 4 * self.partial_index.numel() + self.bits.numel()

    def _tensors(self):
        return (self.kinds, self.partial_index, self.bits)

    def as_arguments(self) -> dict:
        """The mask as keyword arguments of ``softmax_attention`` (its op
        takes the three tensors and the block sizes; the grid is the call's
        L x S)::

            out = attnkit.softmax_attention(q, k, v, **mask.as_arguments())"""
        return dict(block_kinds=self.kinds, block_partial_index=self.partial_index, block_bits=self.bits,
                    block_size=[self.q_block, self.kv_block])

    def _grid(self):
        return (self.q_len, self.kv_len, self.q_block, self.kv_block)

    def sparsity(self) -> float:
        """The percentage of blocks that are empty (torch's BlockMask.sparsity)."""
        return 100.0 * float((self.kinds == 0).sum()) / max(1, self.kinds.numel())

    def visited_fraction(self) -> float:
        """The share of the (query, key) pairs in non-empty blocks: what a
        kernel over the mask visits (blocks cut by L or S counted by their
        pairs inside the grid)."""
        return torch.ops.attnkit._block_mask_visited_fraction(*self._tensors(), *self._grid())

    def to_dense(self) -> torch.Tensor:
        """The mask as a bool tensor (B, H, L, S), True where visible: O(L S)."""
        return torch.ops.attnkit._block_mask_to_dense(*self._tensors(), *self._grid())

    def _combine(self, other, how):
        if not isinstance(other, BlockMask):
            return NotImplemented
        if other._grid() != self._grid():
            raise ValueError(f"attnkit.BlockMask {'&' if how == 'and' else '|'}: the masks must cover the same grid "
                             f"with the same blocks, got (L, S, q_block, kv_block) = {self._grid()} and "
                             f"{other._grid()}")
        tensors = torch.ops.attnkit._block_mask_combine(how, *self._tensors(), *other._tensors(), *self._grid())
        return BlockMask(*tensors, *self._grid())

    def __and__(self, other):
        """The pairs both masks make visible (same grid and blocks; B and H broadcast)."""
        return self._combine(other, "and")

    def __or__(self, other):
        """The pairs either mask makes visible (same grid and blocks; B and H broadcast)."""
        return self._combine(other, "or")

    def __repr__(self):
        B, H, L, S = self.shape
        partial = self.bits.shape[0]
        return (f"attnkit.BlockMask(shape=({B}, {H}, {L}, {S}), BLOCK_SIZE=({self.q_block}, {self.kv_block}), "
                f"sparsity={self.sparsity():.2f}%, partial_blocks={partial}, bytes={self.bytes()})")

    @classmethod
    def from_torch(cls, block_mask) -> "BlockMask":
        """The same mask from torch 2's ``torch.nn.attention.flex_attention.BlockMask``,
        whose tensors hold block indices only: its ``mask_mod`` is evaluated
        again (on the CPU, in chunks) for the bits of the partial blocks, with
        its shape and BLOCK_SIZE."""
        try:
            B, H, L, S = block_mask.shape
            q_block, kv_block = block_mask.BLOCK_SIZE
            mask_mod = block_mask.mask_mod
        except AttributeError as e:
            raise TypeError(f"attnkit.BlockMask.from_torch: expected a torch BlockMask (shape, BLOCK_SIZE, "
                            f"mask_mod), got {type(block_mask).__name__}") from e
        return create_block_mask(mask_mod, B, H, L, S, BLOCK_SIZE=(q_block, kv_block))


def _evaluate(mask_mod: MaskMod, b: int, h: int, q0: int, q1: int, S: int) -> torch.Tensor:
    """mask_mod over queries [q0, q1) and every key, as a bool (q1 - q0, S) tensor."""
    q_idx = torch.arange(q0, q1, dtype=torch.int64)[:, None]
    kv_idx = torch.arange(S, dtype=torch.int64)[None, :]
    rows = mask_mod(torch.tensor(b, dtype=torch.int64), torch.tensor(h, dtype=torch.int64), q_idx, kv_idx)
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bool:
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise TypeError(f"attnkit.create_block_mask: mask_mod must return a bool tensor (True: the query sees "
                        f"the key), got {got}")
    try:
        return rows.expand(q1 - q0, S)
    except RuntimeError as e:
        raise ValueError(f"attnkit.create_block_mask: mask_mod returned shape {list(rows.shape)}, which does "
                         f"not broadcast to the (queries, keys) = ({q1 - q0}, {S}) its indices make") from e


def create_block_mask(mask_mod: MaskMod, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int,
                      device: Union[str, torch.device] = "cpu", BLOCK_SIZE: Union[int, Tuple[int, int]] = 128,
                      _compile: bool = False) -> BlockMask:
    """torch 2's ``create_block_mask``: the block mask of ``mask_mod`` over a
    (B, H, Q_LEN, KV_LEN) problem. B or H of None: one mask for every batch
    entry or head (mask_mod then gets b = 0 or h = 0). ``device`` must be the
    CPU; ``_compile`` is accepted and ignored (nothing is compiled)."""
    if not callable(mask_mod):
        raise TypeError(f"attnkit.create_block_mask: mask_mod must be a function, got {type(mask_mod).__name__}")
    if torch.device(device).type != "cpu":
        raise ValueError(f"attnkit.create_block_mask: attnkit runs on the CPU, got device {device!r}")
    q_block, kv_block = _block_sizes(BLOCK_SIZE)
    B, H = 1 if B is None else B, 1 if H is None else H
    for name, value, least in (("B", B, 1), ("H", H, 1), ("Q_LEN", Q_LEN, 0), ("KV_LEN", KV_LEN, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"attnkit.create_block_mask: {name} must be an int >= {least}"
                             f"{' or None' if name in 'BH' else ''}, got {value!r}")
    QB, KB = math.ceil(Q_LEN / q_block), math.ceil(KV_LEN / kv_block)
    kinds = torch.zeros(B, H, QB, KB, dtype=torch.uint8)
    partial_index = torch.full((B, H, QB, KB), -1, dtype=torch.int32)
    bits, count = [], 0
    chunk = max(1, _CHUNK_ELEMENTS // max(1, q_block * KV_LEN))  # query blocks per evaluation
    for b in range(B):
        for h in range(H):
            for qb in range(0, QB, chunk):
                q0, q1 = qb * q_block, min(Q_LEN, (qb + chunk) * q_block)
                rows = _evaluate(mask_mod, b, h, q0, q1, KV_LEN)
                k, p, x = torch.ops.attnkit._block_mask_blocks(rows[None, None], q_block, kv_block, count)
                kinds[b, h, qb:qb + k.shape[2]] = k[0, 0]
                partial_index[b, h, qb:qb + k.shape[2]] = p[0, 0]
                bits.append(x)
                count += x.shape[0]
    bits = torch.cat(bits) if bits else torch.zeros(0, q_block, (kv_block + 7) // 8, dtype=torch.uint8)
    return BlockMask(kinds, partial_index, bits, Q_LEN, KV_LEN, q_block, kv_block, mask_mod)
