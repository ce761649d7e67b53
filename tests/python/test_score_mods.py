"""Score modifiers traced into the exact kernel (python/attnkit/score_mods.py,
src/kernels/score_mod.h), through attnkit.flex_attention. Checked against a
float64 composite written here (every score formed, the function applied to
broadcasting index tensors, the mask, the softmax), values and gradients of
q, k, v and of every captured tensor that requires grad:
- the named modifiers and hand-written functions over the op set (where,
  exp, log, abs, sigmoid, floor, //, %, clamp, minimum with ties, pow,
  comparisons and logic, integer index arithmetic, gathers from tables of two
  dimensions, a learned 0-d temperature), with random block masks holding
  empty, full and partial blocks and rows that see nothing, L != S, lengths
  that are not multiples of the block, grouped heads, soft-capping and sinks;
- the named shortcuts trace to the same programs as the same code by hand;
- bitwise the same on 1 and 2 threads;
- functions outside the op set take the composite, whose dispatch reason
  names the op, and give the composite's answer; errors name the problem;
- on torch 2, torch's own eager flex_attention on the same functions."""
import math

import pytest
import torch

import attnkit
from attnkit import score_mods

TOLERANCE = 1e-5  # float32 kernel against float64, relative to the largest entry


def composite64(q, k, v, score_mod, visible, scale, softcap=0.0, sinks=None):
    """(out, lse) in float64: the scores, soft-capped, through score_mod, masked."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if score_mod is not None:
        s = score_mod(s, torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
                      torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)).expand(B, H, L, S)
    s = s.masked_fill(~visible.expand(B, H, L, S), -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, L, 1)], -1)
    seen = torch.isfinite(s).any(-1, keepdim=True)
    safe = s.masked_fill(~seen, 0.0)
    w = torch.softmax(safe, -1).masked_fill(~seen, 0.0)[..., :S]
    return w @ v, torch.logsumexp(safe, -1).masked_fill(~seen.squeeze(-1), -math.inf)


from conftest import finite_rel_err as error  # noqa: E402


def random_visible(B, H, L, S, seed):
    """A pattern with empty, full and partial blocks of 32 x 48, and a row that sees nothing."""
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(B, H, L, S, generator=g) < 0.5
    table[..., : L // 3, : S // 2] = True
    table[..., L // 2:, S // 2:] = False
    table[:, :, -1] = False
    return table


# Functions of the op set, each with the captured tensors it reads (the
# "leaves" whose gradients are checked) made by `make(H)`.
def t5(H):
    table = torch.randn(H, 32, requires_grad=True)
    return score_mods.relative_buckets(table, 32, 64), [table]


def alibi_by_hand(H):
    slopes = attnkit.alibi_slopes(H)
    return (lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx)), []


def mixture(H):
    """Branches, transcendental functions, integer arithmetic and logic."""
    def score_mod(s, b, h, q_idx, kv_idx):
        near = ((q_idx - kv_idx).abs() <= 3) | ((kv_idx % 5 == 0) & ~(q_idx // 7 == 2))
        smooth = torch.where(s > 0, torch.log(s + 1.0), torch.exp(s) - 1.0)
        return torch.where(near, smooth * torch.sigmoid(s), s.abs() * 0.5) + (b * 3 + h).float() * 0.1 \
            - torch.floor(s * 2.0) * 0.01
    return score_mod, []


def clamps_and_ties(H):
    """clamp, minimum with ties (half the gradient each way), pow, sqrt, a 2-d table."""
    table = torch.randn(H, 6, requires_grad=True)

    def score_mod(s, b, h, q_idx, kv_idx):
        tied = torch.minimum(s, torch.zeros_like(s)) + torch.maximum(s.clamp(-1.0, 1.0), s * 0.0)
        return tied + torch.sqrt(s * s + 1.0) ** 1.5 * 0.1 + table[h, (kv_idx - q_idx).clamp(0, 5)]
    return score_mod, [table]


def temperature(H):
    """A learned 0-d tensor and a table (H,) of per-head offsets."""
    temp = torch.tensor(0.7, requires_grad=True)
    offsets = torch.randn(H, requires_grad=True)
    return (lambda s, b, h, q_idx, kv_idx: s * temp + offsets[h]), [temp, offsets]


FUNCTIONS = {"t5": t5, "alibi": alibi_by_hand, "mixture": mixture, "clamps_and_ties": clamps_and_ties,
             "temperature": temperature}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("L, S, H, Hkv, softcap, sinks", [(70, 200, 4, 2, 0.0, True), (130, 130, 2, 2, 1.5, False),
                                                          (1, 90, 2, 1, 0.0, False)])
def test_the_kernel_matches_float64(name, L, S, H, Hkv, softcap, sinks):
    torch.manual_seed(L + S + H)
    score_mod, captured = FUNCTIONS[name](H)
    visible = random_visible(2, H, L, S, 3)
    mask = attnkit.create_block_mask(lambda b, h, q, kv: visible[b, h][q, kv], 2, H, L, S, BLOCK_SIZE=(32, 48))
    q = torch.randn(2, H, L, 16, requires_grad=True)
    k, v = torch.randn(2, Hkv, S, 16, requires_grad=True), torch.randn(2, Hkv, S, 8, requires_grad=True)
    sink = torch.randn(H, requires_grad=True) if sinks else None
    assert attnkit.flex_attention_dispatch(q, k, v, score_mod, mask).startswith("kernel"), name
    out, lse = attnkit.flex_attention(q, k, v, score_mod, mask, 0.3, Hkv != H, True, sinks=sink, softcap=softcap)
    leaves = [q, k, v] + captured + ([sink] if sinks else [])
    cot, cot_lse = torch.randn_like(out), torch.randn_like(lse)
    loss = lambda o, l: (o * cot).sum() + (l.masked_fill(~torch.isfinite(l), 0) * cot_lse).sum()
    got = torch.autograd.grad(loss(out, lse), leaves)
    want_out, want_lse = composite64(q, k, v, score_mod, visible, 0.3, softcap, sink)
    want = torch.autograd.grad(loss(want_out, want_lse), leaves)
    assert error(out, want_out) <= TOLERANCE and error(lse, want_lse) <= TOLERANCE
    for index, (g, w) in enumerate(zip(got, want)):
        assert error(g, w) <= TOLERANCE, f"{name}: gradient {index}"


def test_named_modifiers_trace_to_the_same_programs_as_the_same_code_by_hand():
    table = torch.randn(4, 32)
    slopes = attnkit.alibi_slopes(4)

    def same(a, b):
        pa, pb = a.program, score_mods.trace(b)  # a named modifier carries its program
        return torch.equal(pa.code, pb.code) and torch.equal(pa.values, pb.values) and \
            all(x is y for x, y in zip(pa.tables, pb.tables))

    assert same(score_mods.softcap(30.0), lambda s, b, h, i, j: 30.0 * torch.tanh(s / 30.0))
    assert same(score_mods.alibi(slopes), lambda s, b, h, i, j: s - slopes[h] * (i - j).abs())

    def t5_by_hand(s, b, h, i, j):
        relative = j - i
        bucket = (relative > 0).long() * 16
        relative = relative.abs()
        small = relative < 8
        large = 8 + (torch.log(relative.float() / 8) / math.log(128 / 8) * (16 - 8)).long()
        large = torch.clamp(large, max=15)
        return s + table[h, bucket + torch.where(small, relative, large)]

    assert same(score_mods.relative_buckets(table, 32, 128), t5_by_hand)
    # Unused inputs and dead code cost nothing: the program is what the output reads.
    assert score_mods.trace(lambda s, b, h, i, j: (i * j, s * 2.0)[1]).ops() == ["score", "const", "mul"]


def test_the_same_bits_on_one_and_two_threads():
    torch.manual_seed(21)
    q, k, v = torch.randn(1, 1, 600, 16), torch.randn(1, 1, 600, 16), torch.randn(1, 1, 600, 8)
    table = torch.randn(1, 32)
    mask = attnkit.create_block_mask(attnkit.masks.causal(600, 600), None, None, 600, 600)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            leaves = [x.clone().requires_grad_() for x in (q, k, v, table)]
            out = attnkit.flex_attention(*leaves[:3], score_mods.relative_buckets(leaves[3]), mask)
            results.append([out] + list(torch.autograd.grad(out.square().sum(), leaves)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_functions_outside_the_op_set_take_the_composite_and_say_why():
    torch.manual_seed(23)
    q, k, v = (torch.randn(1, 2, 20, 8, requires_grad=True) for _ in range(3))

    def wavy(s, b, h, i, j):
        return s + torch.sin(s)

    def branchy(s, b, h, i, j):
        return s * 2 if s.sum() > 0 else s

    def bitwise(s, b, h, i, j):
        return s + ((i & j) == 0).float()

    for fn, reason in ((wavy, "torch.sin"), (branchy, "use torch.where"), (bitwise, "bitwise and")):
        path = attnkit.flex_attention_dispatch(q, k, v, fn)
        assert path.startswith("composite: ") and reason in path, path
    out = attnkit.flex_attention(q, k, v, wavy)
    want, _ = composite64(q, k, v, wavy, torch.ones(1, 1, 20, 20, dtype=torch.bool), 8 ** -0.5)
    assert error(out, want) <= TOLERANCE
    assert attnkit.flex_attention_dispatch(q.double(), k.double(), v.double(), score_mods.softcap(5.0)).startswith(
        "composite: torch.float64 inputs")


def test_errors_name_the_problem():
    q = torch.randn(1, 1, 10, 8)
    table = torch.randn(4)
    with pytest.raises(RuntimeError, match="indexes a dimension of 4 entries out of range"):
        attnkit.flex_attention(q, q, q, lambda s, b, h, i, j: s + table[i - j])
    # A bug the function raises itself: tracing fails, and the composite
    # raises what the function does.
    with pytest.raises(IndexError, match="index 7 is out of bounds"):
        attnkit.flex_attention(q, q, q, lambda s, b, h, i, j: s + table[7])
    with pytest.raises(score_mods.ScoreModUnsupported, match="one index per dimension"):
        score_mods.trace(lambda s, b, h, i, j: s + torch.randn(3, 3)[i])
    with pytest.raises(ValueError, match="cap must be finite and > 0"):
        score_mods.softcap(0.0)
    with pytest.raises(ValueError, match=r"table must have shape \(H, num_buckets = 32\)"):
        score_mods.relative_buckets(torch.randn(4, 8))


TORCH_2 = int(torch.__version__.split(".")[0]) >= 2


@pytest.mark.skipif(not TORCH_2, reason=f"torch {torch.__version__} has no flex_attention (torch 2)")
def test_equal_to_torchs_eager_flex_attention():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(29)
    B, H, L, E = 2, 4, 200, 16
    q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
    table = torch.randn(H, 32)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    theirs_mask = flex.create_block_mask(causal, None, None, L, L, device="cpu")
    ours_mask = attnkit.create_block_mask(causal, None, None, L, L)
    for name in ("t5", "alibi", "mixture"):
        score_mod = FUNCTIONS[name](H)[0]
        theirs, theirs_lse = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=theirs_mask,
                                                 return_lse=True)
        ours, ours_lse = attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=ours_mask, return_lse=True)
        assert attnkit.flex_attention_dispatch(q, k, v, score_mod, ours_mask).startswith("kernel"), name
        assert error(ours, theirs.double()) <= TOLERANCE, name
        assert error(ours_lse, theirs_lse.double()) <= TOLERANCE, name
