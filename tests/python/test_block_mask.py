"""attnkit.create_block_mask, attnkit.BlockMask (python/attnkit/block_mask.py)
and the named mask_mods of attnkit.masks: each mask_mod against its rule
written out pair by pair (the same rules as tests/edges/block_mask_test.cpp
holds the C++ functions to), the block form against the dense evaluation
(kinds counted, bits, the memory formula) on grids that are not multiples of
the blocks, chunked evaluation, the set operations, torch 2's BlockMask, and
the errors."""
import math

import pytest
import torch

import attnkit
import attnkit.block_mask as block_mask_module
from attnkit import masks


def grid(mask_mod, L, S, b=0, h=0):
    """mask_mod over the whole (L, S) grid at once, as create_block_mask calls it per chunk."""
    q = torch.arange(L)[:, None]
    kv = torch.arange(S)[None, :]
    return mask_mod(torch.tensor(b), torch.tensor(h), q, kv).expand(L, S)


def written_out(rule, L, S):
    return torch.tensor([[bool(rule(q, kv)) for kv in range(S)] for q in range(L)], dtype=torch.bool).reshape(L, S)


def expect_represents(mask, dense):
    """What a BlockMask promises about the dense mask (B, H, L, S) it was built from."""
    B, H, L, S = dense.shape
    assert mask.shape == (B, H, L, S)
    assert torch.equal(mask.to_dense(), dense)
    qb, kvb = mask.BLOCK_SIZE
    QB, KB = math.ceil(L / qb), math.ceil(S / kvb)
    assert mask.kinds.shape == (B, H, QB, KB)
    partial, visited = 0, 0
    for i in range(QB):
        for j in range(KB):
            block = dense[:, :, i * qb:(i + 1) * qb, j * kvb:(j + 1) * kvb].reshape(B, H, -1)
            want = block.any(-1).to(torch.uint8) * 2 - block.all(-1).to(torch.uint8)  # 0 empty, 1 full, 2 partial
            assert torch.equal(mask.kinds[:, :, i, j], want), (i, j)
            partial += int((want == 2).sum())
            visited += int((want != 0).sum()) * block.shape[-1]  # a block cut by L or S counts its pairs in the grid
    assert mask.bits.shape[0] == partial
    assert mask.visited_fraction() == pytest.approx(visited / (B * H * L * S) if L * S else 0.0, rel=1e-12)
    assert mask.bytes() == B * H * QB * KB * 5 + partial * qb * ((kvb + 7) // 8)


def named(L, S):
    shift = S - L
    cases = [
        ("causal", masks.causal(L, S), lambda q, kv: kv <= q + shift),
        ("window 3 causal", masks.sliding_window(L, S, 3), lambda q, kv: q + shift - 3 < kv <= q + shift),
        ("window 3", masks.sliding_window(L, S, 3, causal=False), lambda q, kv: abs(q + shift - kv) <= 2),
        ("prefix 5", masks.prefix_lm(L, S, 5), lambda q, kv: kv < 5 or kv <= q + shift),
        ("globals 2 + window 4 causal", masks.global_window(L, S, 2, 4),
         lambda q, kv: kv <= q + shift and (kv < 2 or kv > q + shift - 4)),
        ("globals 2 + window 4", masks.global_window(L, S, 2, 4, causal=False),
         lambda q, kv: kv < 2 or q + shift < 2 or abs(q + shift - kv) < 4),
        ("dilated 4 causal", masks.dilated(L, S, 4), lambda q, kv: kv <= q + shift and (q + shift - kv) % 4 == 0),
        ("dilated 3", masks.dilated(L, S, 3, causal=False), lambda q, kv: abs(q + shift - kv) % 3 == 0),
    ]
    if L == S:
        starts = [0, min(7, L), min(7, L), min(19, L), L]

        def doc(t):
            return max(d for d in range(len(starts) - 1) if starts[d] <= t) if t < L else -1
        offsets = torch.tensor(starts)
        cases.append(("documents causal", masks.documents(offsets), lambda q, kv: doc(q) == doc(kv) and kv <= q))
        cases.append(("documents", masks.documents(offsets, causal=False), lambda q, kv: doc(q) == doc(kv)))
    return cases


@pytest.mark.parametrize("L,S", [(37, 37), (1, 1), (20, 45), (45, 20)])
def test_named_mask_mods_follow_their_rules_and_blocks_represent_them(L, S):
    for name, mask_mod, rule in named(L, S):
        dense = grid(mask_mod, L, S)
        assert torch.equal(dense, written_out(rule, L, S)), name
        for block in (8, (16, 4), (5, 11), 128):
            expect_represents(attnkit.create_block_mask(mask_mod, None, None, L, S, BLOCK_SIZE=block),
                              dense[None, None])


def test_batch_and_head_masks_and_chunked_evaluation(monkeypatch):
    table = torch.rand(2, 3, 30, 23) < 0.5

    def mask_mod(b, h, q_idx, kv_idx):  # a mask per (batch entry, head) read from a captured table
        return table[b, h, q_idx, kv_idx]

    whole = attnkit.create_block_mask(mask_mod, 2, 3, 30, 23, BLOCK_SIZE=(8, 5))
    expect_represents(whole, table)
    monkeypatch.setattr(block_mask_module, "_CHUNK_ELEMENTS", 1)  # one row of blocks per evaluation
    chunked = attnkit.create_block_mask(mask_mod, 2, 3, 30, 23, BLOCK_SIZE=(8, 5))
    for a, b in zip(whole._tensors(), chunked._tensors()):
        assert torch.equal(a, b)


def test_and_or_of_mask_mods_and_of_block_masks():
    L = S = 29
    causal, window = masks.causal(L, S), masks.sliding_window(L, S, 6, causal=False)
    both = grid(causal, L, S) & grid(window, L, S)
    either = grid(causal, L, S) | grid(window, L, S)
    assert torch.equal(grid(attnkit.and_masks(causal, window), L, S), both)
    assert torch.equal(grid(attnkit.or_masks(causal, window), L, S), either)
    assert torch.equal(grid(attnkit.noop_mask, L, S), torch.ones(L, S, dtype=torch.bool))
    a = attnkit.create_block_mask(causal, None, None, L, S, BLOCK_SIZE=8)
    b = attnkit.create_block_mask(window, None, None, L, S, BLOCK_SIZE=8)
    expect_represents(a & b, both[None, None])
    expect_represents(a | b, either[None, None])
    with pytest.raises(TypeError):
        a & 1
    with pytest.raises(ValueError, match="same grid"):
        a & attnkit.create_block_mask(causal, None, None, L, S, BLOCK_SIZE=4)
    with pytest.raises(TypeError, match="one or more mask_mod"):
        attnkit.and_masks()


def test_memory_and_visited_fraction_of_a_causal_mask():
    mask = attnkit.create_block_mask(masks.causal(4096, 4096), None, None, 4096, 4096)
    assert mask.bits.shape[0] == 32
    assert mask.bytes() == 1024 * 5 + 32 * 128 * 16
    assert mask.visited_fraction() == pytest.approx(32 * 33 / 2 / 1024, abs=1e-12)
    assert mask.sparsity() == pytest.approx(100 * (1024 - 528) / 1024)
    assert "BLOCK_SIZE=(128, 128)" in repr(mask)


def test_errors_name_the_problem():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    with pytest.raises(TypeError, match="bool tensor"):
        attnkit.create_block_mask(lambda b, h, q, kv: (q >= kv).int(), None, None, 4, 4)
    with pytest.raises(TypeError, match="bool tensor"):
        attnkit.create_block_mask(lambda b, h, q, kv: True, None, None, 4, 4)
    with pytest.raises(ValueError, match="does not broadcast"):
        attnkit.create_block_mask(lambda b, h, q, kv: torch.ones(3, dtype=torch.bool), None, None, 4, 4)
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        attnkit.create_block_mask(causal, None, None, 4, 4, BLOCK_SIZE=0)
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        attnkit.create_block_mask(causal, None, None, 4, 4, BLOCK_SIZE=(8, 8, 8))
    with pytest.raises(ValueError, match="CPU"):
        attnkit.create_block_mask(causal, None, None, 4, 4, device="meta")
    with pytest.raises(ValueError, match="B must be an int >= 1"):
        attnkit.create_block_mask(causal, 0, None, 4, 4)
    with pytest.raises(TypeError, match="must be a function"):
        attnkit.create_block_mask(None, None, None, 4, 4)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        masks.sliding_window(4, 4, 0)
    with pytest.raises(ValueError, match="offsets"):
        masks.documents(torch.tensor([1, 3]))
    mask = attnkit.create_block_mask(causal, None, None, 20, 20, BLOCK_SIZE=8)
    kinds = mask.kinds.clone()
    kinds[0, 0, 0, 2] = 3
    with pytest.raises(RuntimeError, match="kinds hold 3"):
        attnkit.BlockMask(kinds, mask.partial_index, mask.bits, 20, 20, 8, 8)


TORCH_2 = int(torch.__version__.split(".")[0]) >= 2


@pytest.mark.skipif(not TORCH_2, reason=f"torch {torch.__version__} has no FlexAttention BlockMask (torch 2)")
def test_a_torch_block_mask_converts_by_evaluating_its_mask_mod():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 40) | (kv_idx < 3)

    theirs = flex.create_block_mask(sliding, None, 2, 300, 300, device="cpu", BLOCK_SIZE=128)
    ours = attnkit.BlockMask.from_torch(theirs)
    assert ours.BLOCK_SIZE == (128, 128) and ours.shape == (1, 2, 300, 300)
    assert torch.equal(ours.to_dense(), flex.create_mask(sliding, 1, 2, 300, 300, device="cpu"))
    with pytest.raises(TypeError, match="expected a torch BlockMask"):
        attnkit.BlockMask.from_torch(object())


def attention_f64(q, k, v, visible):
    """Exact attention in float64 with a bool (B, H, L, S) mask written here,
    independently of the kernel: a row with nothing visible gives 0."""
    q, k, v = (x.double() for x in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return weights @ v


@pytest.mark.parametrize("L, S, block", [(300, 300, 128), (1, 77, 128), (129, 100, (16, 24)), (700, 650, (200, 300))])
def test_softmax_attention_over_a_block_mask_matches_float64(L, S, block):
    """The kernel through the op (BlockMask.as_arguments) against attention_f64
    over the mask_mod's own grid, values and gradients of q, k, v (1e-5,
    relative to the largest entry): named masks, an and of two, and a random
    mask per head with rows that see nothing."""
    torch.manual_seed(L)
    table = torch.rand(2, L, S) < 0.3
    table[:, : L // 3, : S // 2] = True
    table[:, L // 2:, S // 2:] = False
    table[1, -1] = False  # a fully masked row
    mask_mods = [("causal", masks.causal(L, S), None),
                 ("dilated 3 & window 50", attnkit.and_masks(masks.dilated(L, S, 3), masks.sliding_window(L, S, 50)),
                  None),
                 ("random per head", lambda b, h, q, kv: table[h][q, kv], 2)]
    for name, mask_mod, heads in mask_mods:
        mask = attnkit.create_block_mask(mask_mod, None, heads, L, S, BLOCK_SIZE=block)
        dense = torch.stack([grid(mask_mod, L, S, h=h) for h in range(heads or 1)])[None]
        q = torch.randn(2, 2, L, 16, requires_grad=True)
        k = torch.randn(2, 2, S, 16, requires_grad=True)
        v = torch.randn(2, 2, S, 8, requires_grad=True)
        out = attnkit.softmax_attention(q, k, v, **mask.as_arguments())
        grad = torch.randn_like(out)
        got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        want_out = attention_f64(q64, k64, v64, dense)
        want = [want_out, *torch.autograd.grad(want_out, (q64, k64, v64), grad.double())]
        for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            error = float((g.double() - w).abs().max() / w.abs().max().clamp_min(1e-30))
            assert error <= 1e-5, (name, what, error)
        if heads:
            assert torch.equal(out[:, 1, -1], torch.zeros_like(out[:, 1, -1])), name


def test_as_arguments_refuses_a_mask_of_another_problem():
    mask = attnkit.create_block_mask(masks.causal(20, 20), None, 3, 20, 20, BLOCK_SIZE=8)
    q = torch.randn(1, 2, 20, 8)
    with pytest.raises(RuntimeError, match="head count is 3"):
        attnkit.softmax_attention(q, q, q, **mask.as_arguments())
    with pytest.raises(RuntimeError, match="needs all of block_kinds, block_partial_index and block_bits"):
        attnkit.softmax_attention(q, q, q, block_kinds=mask.kinds)
