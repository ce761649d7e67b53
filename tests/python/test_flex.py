"""attnkit.flex_attention (python/attnkit/flex.py): torch 2's FlexAttention
call on the exact kernel (score_mods traced into it) or the composite.
Checked: the kernel path against a float64 formula written here, values and
gradients, over block masks with empty, full and partial blocks and rows that
see nothing, L != S, GQA, sinks and lse; traced score_mods against the same
formula (soft-capping, ALiBi written as a function, a relative-position bias
table that requires grad, whose gradient is checked; tests/python/
test_score_mods.py has the rest);
merge_attention of split keys == attention over all of them; the dispatch
strings and the errors; and on torch 2, torch's own eager flex_attention on
the same functions (relative 1e-5)."""
import math

import pytest
import torch

import attnkit
from attnkit import masks


def formula(q, k, v, visible, scale, score=None, sinks=None):
    """Attention in float64 with the scores changed by `score` (a function of
    the score tensor) and a bool (B or 1, H or 1, L, S) mask; (out, lse)."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if score is not None:
        s = score(s)
    B, H, L, S = s.shape
    s = s.masked_fill(~visible.expand(B, H, L, S), -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, L, 1)], -1)
    seen = torch.isfinite(s).any(-1, keepdim=True)
    safe = s.masked_fill(~seen, 0.0)
    w = torch.softmax(safe, -1).masked_fill(~seen, 0.0)[..., :S]
    return w @ v, torch.logsumexp(safe, -1).masked_fill(~seen.squeeze(-1), -math.inf)


from conftest import finite_rel_err as error  # noqa: E402


def random_rows(B, H, L, S, seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(B, H, L, S, generator=g) < 0.4
    table[..., : L // 3, : S // 2] = True
    table[..., L // 2:, S // 2:] = False
    table[:, -1, -1] = False  # a row that sees nothing
    return table


@pytest.mark.parametrize("L, S, H, Hkv, sinks", [(130, 130, 4, 4, False), (70, 200, 4, 2, True), (1, 90, 2, 1, True)])
def test_the_kernel_path_matches_float64(L, S, H, Hkv, sinks):
    torch.manual_seed(L + S)
    table = random_rows(2, H, L, S, 3)
    mask = attnkit.create_block_mask(lambda b, h, q, kv: table[b, h][q, kv], 2, H, L, S, BLOCK_SIZE=(32, 48))
    q = torch.randn(2, H, L, 16, requires_grad=True)
    k, v = torch.randn(2, Hkv, S, 16, requires_grad=True), torch.randn(2, Hkv, S, 8, requires_grad=True)
    sink = torch.randn(H, requires_grad=True) if sinks else None
    assert attnkit.flex_attention_dispatch(q, k, v, None, mask) == "kernel over the block mask's non-empty blocks"
    out, lse = attnkit.flex_attention(q, k, v, block_mask=mask, scale=0.3, enable_gqa=Hkv != H, return_lse=True,
                                      sinks=sink)
    leaves = [q, k, v] + ([sink] if sinks else [])
    cot, cot_lse = torch.randn_like(out), torch.randn_like(lse)
    loss = lambda o, l: (o * cot).sum() + (l.masked_fill(~torch.isfinite(l), 0) * cot_lse).sum()
    got = torch.autograd.grad(loss(out, lse), leaves)
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    want_out, want_lse = formula(*leaves64[:3], table, 0.3, sinks=leaves64[3] if sinks else None)
    want = torch.autograd.grad(loss(want_out, want_lse), leaves64)
    assert error(out, want_out) <= 1e-5 and error(lse, want_lse) <= 1e-5
    for g, w in zip(got, want):
        assert error(g, w) <= 1e-5


def test_score_mods_run_in_the_kernel_with_gradients_into_captured_tensors():
    torch.manual_seed(5)
    B, H, L, S = 2, 3, 50, 50
    q = torch.randn(B, H, L, 8, requires_grad=True)
    k, v = torch.randn(B, H, S, 8, requires_grad=True), torch.randn(B, H, S, 8, requires_grad=True)
    table = torch.randn(H, 2 * S - 1, requires_grad=True)  # a learned relative-position bias
    slopes = attnkit.alibi_slopes(H)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + S - 1]

    causal = attnkit.create_block_mask(masks.causal(L, S), None, None, L, S, BLOCK_SIZE=16)
    i, j = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    rules = [(softcap, lambda s: 20.0 * torch.tanh(s / 20.0)),
             (alibi, lambda s: s - slopes.double().view(1, H, 1, 1) * (i - j).abs()),
             (relative, lambda s: s + table.double()[:, (i - j + S - 1)].unsqueeze(0))]
    for score_mod, rule in rules:
        assert attnkit.flex_attention_dispatch(q, k, v, score_mod, causal).startswith(
            "kernel over the block mask's non-empty blocks, with the score_mod traced into")
        out = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=causal)
        leaves = [q, k, v] + ([table] if score_mod is relative else [])
        got = torch.autograd.grad(out.sum(), leaves)
        want_out, _ = formula(q, k, v, causal.to_dense(), 8 ** -0.5, rule)
        want = torch.autograd.grad(want_out.sum(), leaves)
        assert error(out, want_out) <= 1e-5, score_mod.__name__
        for g, w in zip(got, want):
            assert error(g, w) <= 1e-5, score_mod.__name__


def test_the_softcap_option_equals_the_softcap_score_mod():
    """The kernel's soft-capping against the same cap as a score_mod (the
    composite path), values and gradients, over a causal block mask."""
    torch.manual_seed(7)
    q = torch.randn(1, 2, 150, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 150, 16, requires_grad=True), torch.randn(1, 2, 150, 8, requires_grad=True)
    mask = attnkit.create_block_mask(masks.causal(150, 150), None, None, 150, 150, BLOCK_SIZE=64)
    kernel = attnkit.flex_attention(q, k, v, block_mask=mask, softcap=1.5)
    composite = attnkit.flex_attention(q, k, v, block_mask=mask,
                                       score_mod=lambda s, b, h, i, j: 1.5 * torch.tanh(s / 1.5))
    cot = torch.randn_like(kernel)
    got, want = (torch.autograd.grad((o * cot).sum(), (q, k, v)) for o in (kernel, composite))
    assert error(kernel, composite.double()) <= 1e-5
    for g, w in zip(got, want):
        assert error(g, w.double()) <= 1e-5
    with pytest.raises(ValueError, match="softcap must be finite"):
        attnkit.flex_attention(q, k, v, softcap=-1.0)


def test_merge_attention_of_split_keys_is_attention_over_all_of_them():
    torch.manual_seed(9)
    q, k, v = torch.randn(1, 2, 30, 8), torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 4)
    whole, whole_lse = attnkit.flex_attention(q, k, v, return_lse=True)
    parts = [attnkit.flex_attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in ((0, 40), (40, 100))]
    out, lse = attnkit.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert torch.allclose(out, whole, atol=1e-6) and torch.allclose(lse, whole_lse, atol=1e-5)


def test_errors_name_the_problem():
    q = torch.randn(1, 4, 8, 8)
    k = torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        attnkit.flex_attention(q, k, k)
    with pytest.raises(ValueError, match="does not fit"):
        attnkit.flex_attention(q, q, q, block_mask=attnkit.create_block_mask(masks.causal(9, 9), None, None, 9, 9))
    with pytest.raises(TypeError, match="block_mask must be"):
        attnkit.flex_attention(q, q, q, block_mask=torch.ones(8, 8))
    with pytest.raises(TypeError, match="score_mod must return a floating tensor"):
        attnkit.flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: i > j)
    with pytest.raises(ValueError, match="sinks must be"):
        attnkit.flex_attention(q, q, q, sinks=torch.zeros(3))


TORCH_2 = int(torch.__version__.split(".")[0]) >= 2


@pytest.mark.skipif(not TORCH_2, reason=f"torch {torch.__version__} has no flex_attention (torch 2)")
def test_equal_to_torchs_eager_flex_attention():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(11)
    B, H, L, E = 2, 4, 200, 16
    q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
    table = torch.randn(H, 2 * L - 1)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx < 40) | (kv_idx < 4))

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L - 1]

    theirs_mask = flex.create_block_mask(sliding, None, None, L, L, device="cpu", BLOCK_SIZE=128)
    ours_mask = attnkit.create_block_mask(sliding, None, None, L, L)
    for score_mod in (None, softcap, relative):
        theirs, theirs_lse = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=theirs_mask,
                                                 return_lse=True)
        ours, ours_lse = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=ours_mask,
                                                return_lse=True)
        name = getattr(score_mod, "__name__", "none")
        assert error(ours, theirs.double()) <= 1e-5, name
        assert error(ours_lse, theirs_lse.double()) <= 1e-5, name
        # torch's own BlockMask is accepted too (its mask_mod evaluated again).
        assert torch.equal(attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=theirs_mask), ours)
