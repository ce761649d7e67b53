"""Random score_mods over the traced op set (python/attnkit/score_mods.py):
expression trees drawn from fixed seeds, each run through the kernel and
through a float64 composite (the same function on all the scores at once),
values and gradients of q, k, v and of a captured table. The trees keep
their values moderate (the kernel runs float32: a tree whose float32 and
float64 values part, such as floor near an integer, is what this would
flag, so such ops see only integers). Then the function shapes a tracer
must refuse, each of which takes the composite with the op named, or, when
the composite cannot run it either, raises the function's own error."""
import math
import random

import pytest
import torch

import attnkit
from attnkit import score_mods

TOLERANCE = 1e-4  # float32 through up to a dozen ops, relative to the largest entry


class Tree:
    """A random function of (s, b, h, i, j) built from the op set; `table`
    (H, 8) is read by gathers."""

    def __init__(self, rng: random.Random, table: torch.Tensor, depth: int = 4):
        self.rng, self.table = rng, table
        self.expr = self.float_expr(depth)

    def int_expr(self, depth):
        r = self.rng
        leaves = [lambda s, b, h, i, j: i, lambda s, b, h, i, j: j, lambda s, b, h, i, j: h,
                  lambda s, b, h, i, j: b, lambda s, b, h, i, j: i - j]
        if depth <= 0 or r.random() < 0.3:
            return r.choice(leaves)
        a, c = self.int_expr(depth - 1), r.randint(1, 5)
        return r.choice([
            lambda s, b, h, i, j: a(s, b, h, i, j) // c,
            lambda s, b, h, i, j: a(s, b, h, i, j) % c,
            lambda s, b, h, i, j: a(s, b, h, i, j).abs(),
            lambda s, b, h, i, j: a(s, b, h, i, j) * c - 1,
            lambda s, b, h, i, j: torch.clamp(a(s, b, h, i, j), -3, 6),
        ])

    def bool_expr(self, depth):
        r = self.rng
        a, c = self.int_expr(depth - 1), r.randint(-2, 4)
        base = r.choice([lambda s, b, h, i, j: a(s, b, h, i, j) < c, lambda s, b, h, i, j: a(s, b, h, i, j) >= c,
                         lambda s, b, h, i, j: a(s, b, h, i, j) == c, lambda s, b, h, i, j: s > 0.1 * c])
        if r.random() < 0.3:
            other = self.bool_expr(depth - 1)
            return r.choice([lambda s, b, h, i, j: base(s, b, h, i, j) & other(s, b, h, i, j),
                             lambda s, b, h, i, j: base(s, b, h, i, j) | ~other(s, b, h, i, j)])
        return base

    def float_expr(self, depth):
        r = self.rng
        if depth <= 0 or r.random() < 0.2:
            return r.choice([lambda s, b, h, i, j: s, lambda s, b, h, i, j: s * 0.5 + 0.25])
        a, x = self.float_expr(depth - 1), r.uniform(0.5, 2.0)
        table = self.table
        unary = [
            lambda s, b, h, i, j: torch.tanh(a(s, b, h, i, j)),
            lambda s, b, h, i, j: torch.sigmoid(a(s, b, h, i, j)) * 2.0,
            lambda s, b, h, i, j: torch.exp(torch.clamp(a(s, b, h, i, j), max=2.0)),
            lambda s, b, h, i, j: torch.log(a(s, b, h, i, j).abs() + 1.0),
            lambda s, b, h, i, j: torch.sqrt(a(s, b, h, i, j) * a(s, b, h, i, j) + x),
            lambda s, b, h, i, j: -a(s, b, h, i, j) / x,
            lambda s, b, h, i, j: torch.relu(a(s, b, h, i, j)) - 0.5,
        ]
        c = self.float_expr(depth - 1)
        n, cond = self.int_expr(depth - 1), self.bool_expr(depth - 1)
        binary = [
            lambda s, b, h, i, j: a(s, b, h, i, j) + c(s, b, h, i, j),
            lambda s, b, h, i, j: a(s, b, h, i, j) * torch.tanh(c(s, b, h, i, j)),
            lambda s, b, h, i, j: torch.maximum(a(s, b, h, i, j), c(s, b, h, i, j) - x),
            lambda s, b, h, i, j: torch.where(cond(s, b, h, i, j), a(s, b, h, i, j), c(s, b, h, i, j)),
            lambda s, b, h, i, j: a(s, b, h, i, j) + n(s, b, h, i, j).float() * 0.1,
            lambda s, b, h, i, j: a(s, b, h, i, j) + table[h, torch.clamp(n(s, b, h, i, j), 0, 7)],
            lambda s, b, h, i, j: a(s, b, h, i, j) - table[(h + 1) % table.shape[0], -1],
        ]
        return r.choice(unary + binary)

    def __call__(self, s, b, h, i, j):
        return self.expr(s, b, h, i, j) * 1.0


def composite64(q, k, v, fn, scale):
    q, k, v = (x.double() for x in (q, k, v))
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    s = fn(q @ k.transpose(-1, -2) * scale, torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
           torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)).expand(B, H, L, S)
    return torch.softmax(s, -1) @ v


def rel(got, want, floor=1e-30):
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(floor))


@pytest.mark.parametrize("seed", range(40))
def test_random_functions_match_float64(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, H, L, S = 2, 3, rng.randint(1, 40), rng.randint(1, 300)
    table = torch.randn(H, 8, requires_grad=True)
    fn = Tree(rng, table)
    q = torch.randn(B, H, L, 8, requires_grad=True)
    k, v = torch.randn(B, H, S, 8, requires_grad=True), torch.randn(B, H, S, 4, requires_grad=True)
    path = attnkit.flex_attention_dispatch(q, k, v, fn)
    assert path.startswith("kernel"), path
    out = attnkit.flex_attention(q, k, v, fn, scale=0.4)
    cot = torch.randn_like(out)
    leaves = [q, k, v, table]
    got = torch.autograd.grad((out * cot).sum(), leaves, allow_unused=True)
    want_out = composite64(q, k, v, fn, 0.4)
    want = torch.autograd.grad((want_out * cot).sum(), leaves, allow_unused=True)
    assert rel(out, want_out) <= TOLERANCE
    for index, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None or float(g.abs().max()) == 0.0, index
            continue
        g = torch.zeros_like(w) if g is None else g
        # A gradient that cancels to ~0 (a table entry added to every score
        # of a row, which the softmax ignores) is float32 noise of ~1e-7 in
        # the kernel: relative to at least 1e-2 (the others are of order 1).
        assert rel(g, w, 1e-2) <= TOLERANCE, f"seed {seed}: gradient {index}"


def test_shapes_a_tracer_must_refuse_take_the_composite_or_raise_the_functions_error():
    q = torch.randn(1, 2, 6, 4)
    table = torch.randn(2, 3)
    cases = [
        (lambda s, b, h, i, j: s + torch.cos(s), "torch.cos"),
        (lambda s, b, h, i, j: s + table[h], "one index per dimension"),  # a row, not an element
        (lambda s, b, h, i, j: s + table[h, 0:2].sum(), "one index per dimension"),
        (lambda s, b, h, i, j: s * (i | j).float(), "bitwise or"),
        (lambda s, b, h, i, j: s.softmax(-1), ".softmax()"),
        (lambda s, b, h, i, j: s + table[h, s.long()], "kernel, with"),  # indices from the scores: allowed, checked
        (lambda s, b, h, i, j: (s > 0), "returns an integer or boolean"),
        (lambda s, b, h, i, j: s + float(i.sum()), "cannot be traced"),
    ]
    for fn, reason in cases:
        path = attnkit.flex_attention_dispatch(q, q, q, fn)
        assert reason in path, (reason, path)
    # What the composite cannot run either raises as torch would.
    with pytest.raises(TypeError, match="score_mod must return a floating tensor"):
        attnkit.flex_attention(q, q, q, lambda s, b, h, i, j: s > 0)
    with pytest.raises(score_mods.ScoreModUnsupported, match="exactly"):
        score_mods.trace(lambda s, b, h: s)
    with pytest.raises(TypeError, match="score_mod must be a function"):
        attnkit.flex_attention(q, q, q, 3.0)
