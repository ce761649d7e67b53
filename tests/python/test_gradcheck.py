"""Gradients of every op and module of attnkit from Python.

1. torch.autograd.gradcheck in float64 of every op of torch.ops.attnkit (the
   composites), over awkward shapes: L = 1, L != S, E != M, odd sizes, a row
   with no visible key (key_lengths 0, an empty edge list row, causal with
   L > S) and strided (transposed) inputs.
2. Every module of attnkit.nn and attnkit.models, converted with .double():
   gradients w.r.t. inputs and parameters against central differences
   (conftest.finite_difference_check, gradcheck's tolerances), and
   torch.autograd.gradcheck itself on a few modules (it runs the backward
   once per Jacobian row, with retain_graph).
3. float32 outputs and gradients (the fast kernels) against the same
   computation in float64, with the tolerances stated below.
"""
import copy

import pytest
import torch

import attnkit
from attnkit import nn as ann
from attnkit.models import Transformer

from conftest import finite_difference_check, rel_err

ops = torch.ops.attnkit
f64 = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same global RNG state, whatever ran before it."""
    torch.manual_seed(0)


def _seeded(fn):
    """Builds parametrize cases (tensors made at collection) from a fixed seed,
    without moving the global RNG: the cases do not depend on what was
    collected before."""
    def wrapper():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            return fn()
    return wrapper


def leaf(*shape):
    return torch.randn(*shape, dtype=f64, requires_grad=True)


def positive(*shape):
    """Class weights in (0.1, 1.1): like the agglomerative layer's softmax
    outputs, and far from the clip 1e-3 (where the denominator has a kink)."""
    return (torch.rand(*shape, dtype=f64) + 0.1).requires_grad_()


def lengths(*values):
    return torch.tensor(values, dtype=torch.int64)


def transposed(*shape):
    """A leaf of shape (N, L, H, E) whose (N, H, L, E) view (dims 1 and 2
    swapped) the ops get: strided, not contiguous."""
    return leaf(shape[0], shape[2], shape[1], *shape[3:])


def per_head_edges():
    """H = 2 lists over L = 3 queries and S = 4 keys, one flat columns tensor;
    head 0's last query has no neighbour (its output and gradients are 0)."""
    offsets = torch.tensor([[0, 2, 3, 3], [3, 4, 8, 9]])
    columns = torch.tensor([0, 2, 1, 3, 0, 1, 2, 3, 2])
    return offsets, columns


# ---------------------------------------------------------------------------------------
# 1. gradcheck of every op in float64
# ---------------------------------------------------------------------------------------

@_seeded
def _op_cases():
    """(id, function, float64 leaves). Functions close over integer inputs
    (lengths, edge lists) and fixed tensors."""
    T = lambda x: x.transpose(1, 2)  # noqa: E731
    cases = []
    add = lambda name, fn, *xs: cases.append(pytest.param(fn, xs, id=name))  # noqa: E731

    # softmax_attention
    add("softmax L!=S E!=M", lambda q, k, v: ops.softmax_attention(q, k, v),
        leaf(1, 2, 3, 5), leaf(1, 2, 4, 5), leaf(1, 2, 4, 3))
    add("softmax causal L<S", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True),
        leaf(1, 2, 3, 3), leaf(1, 2, 5, 3), leaf(1, 2, 5, 2))
    add("softmax causal L>S (empty rows)", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True),
        leaf(1, 1, 5, 3), leaf(1, 1, 3, 3), leaf(1, 1, 3, 2))
    add("softmax key_lengths with 0", lambda q, k, v: ops.softmax_attention(q, k, v, key_lengths=lengths(0, 3, 5)),
        leaf(3, 1, 2, 3), leaf(3, 1, 5, 3), leaf(3, 1, 5, 2))
    add("softmax causal+key_lengths+scale",
        lambda q, k, v: ops.softmax_attention(q, k, v, causal=True, key_lengths=lengths(2, 4), scale=0.7),
        leaf(2, 1, 4, 3), leaf(2, 1, 4, 3), leaf(2, 1, 4, 3))
    add("softmax L=1", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True),
        leaf(2, 1, 1, 3), leaf(2, 1, 3, 3), leaf(2, 1, 3, 1))
    add("softmax strided", lambda q, k, v: ops.softmax_attention(T(q), T(k), T(v), causal=True),
        transposed(1, 2, 3, 3), transposed(1, 2, 4, 3), transposed(1, 2, 4, 5))
    add("softmax with lse and sinks, causal L>S (empty rows)",
        lambda q, k, v, s: ops.softmax_attention_with_lse(q, k, v, causal=True, sinks=s),
        leaf(1, 2, 5, 3), leaf(1, 2, 3, 3), leaf(1, 2, 3, 2), leaf(2))
    add("softmax with lse, key_lengths",
        lambda q, k, v: ops.softmax_attention_with_lse(q, k, v, key_lengths=lengths(2, 4)),
        leaf(2, 1, 3, 3), leaf(2, 1, 4, 3), leaf(2, 1, 4, 2))
    add("softmax softcap causal", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True, softcap=0.7),
        leaf(1, 2, 3, 3), leaf(1, 2, 5, 3), leaf(1, 2, 5, 2))
    add("merge_attention", lambda o1, o2, l1, l2: ops.merge_attention([o1, o2], [l1, l2]),
        leaf(1, 2, 3, 2), leaf(1, 2, 3, 2), leaf(1, 2, 3), leaf(1, 2, 3))
    add("softmax alibi causal L<S", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True,
                                                                       alibi_slopes=ops.alibi_slopes(2)),
        leaf(1, 2, 3, 3), leaf(1, 2, 5, 3), leaf(1, 2, 5, 2))
    add("softmax rotary causal L<S", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True, rotary_dim=2),
        leaf(1, 2, 3, 3), leaf(1, 2, 5, 3), leaf(1, 2, 5, 2))
    add("softmax window 2 L<S", lambda q, k, v: ops.softmax_attention(q, k, v, window=2),
        leaf(1, 2, 3, 3), leaf(1, 2, 5, 3), leaf(1, 2, 5, 2))
    add("rotary_embedding offset -2", lambda x: ops.rotary_embedding(x, 4, base=50.0, offset=-2), leaf(2, 1, 3, 5))
    add("softmax bias broadcast", lambda q, k, v, b: ops.softmax_attention(q, k, v, causal=True, bias=b),
        leaf(2, 2, 3, 3), leaf(2, 2, 4, 3), leaf(2, 2, 4, 2), leaf(1, 2, 1, 4))
    add("softmax bias full + key_lengths", lambda q, k, v, b: ops.softmax_attention(q, k, v, bias=b,
                                                                                      key_lengths=lengths(0, 2)),
        leaf(2, 1, 3, 2), leaf(2, 1, 3, 2), leaf(2, 1, 3, 2), leaf(2, 1, 3, 3))

    # -inf bias hides keys: row 0 of the bias is all -inf (an empty row).
    inf_bias = torch.zeros(1, 1, 3, 4, dtype=f64)
    inf_bias[..., 0, :] = float("-inf")
    inf_bias[..., 1, 2] = float("-inf")
    add("softmax -inf bias rows", lambda q, k, v: ops.softmax_attention(q, k, v, bias=inf_bias),
        leaf(1, 1, 3, 2), leaf(1, 1, 4, 2), leaf(1, 1, 4, 3))

    # linear_attention: both feature maps, normaliser, causal
    for fm in ("identity", "elu"):
        for normalize in ((False,) if fm == "identity" else (False, True)):
            for causal in (False, True):
                add(f"linear {fm} normalize={normalize} causal={causal}",
                    lambda q, k, v, fm=fm, n=normalize, c=causal: ops.linear_attention(
                        q, k, v, feature_map=fm, normalize=n, causal=c),
                    leaf(1, 2, 4, 3), leaf(1, 2, 5, 3), leaf(1, 2, 5, 2))
    add("linear elu normalize causal L>S", lambda q, k, v: ops.linear_attention(
        q, k, v, feature_map="elu", normalize=True, causal=True), leaf(1, 1, 5, 3), leaf(1, 1, 2, 3), leaf(1, 1, 2, 4))
    add("linear L=1 strided", lambda q, k, v: ops.linear_attention(T(q), T(k), T(v), feature_map="elu", normalize=True),
        transposed(1, 2, 1, 3), transposed(1, 2, 3, 3), transposed(1, 2, 3, 5))
    add("linear grouped heads rotary causal L<S", lambda q, k, v: ops.linear_attention(
        q, k, v, feature_map="elu", normalize=True, causal=True, rotary_dim=2, rotary_base=10.0),
        leaf(1, 4, 3, 4), leaf(1, 2, 5, 4), leaf(1, 2, 5, 2))

    # gated_linear_attention
    gates = lambda *s: (torch.rand(*s, dtype=f64) * 0.5 + 0.5).requires_grad_()  # noqa: E731
    for causal in (False, True):
        add(f"gated causal={causal}", lambda f, q, a, b, c=causal: ops.gated_linear_attention(f, q, a, b, causal=c),
            leaf(2, 1, 4, 3), leaf(2, 1, 4, 3), gates(2, 1, 4), positive(2, 1, 4))
    add("gated L=1", lambda f, q, a, b: ops.gated_linear_attention(f, q, a, b, causal=True),
        leaf(1, 2, 1, 3), leaf(1, 2, 1, 3), gates(1, 2, 1), positive(1, 2, 1))
    add("gated strided", lambda f, q, a, b: ops.gated_linear_attention(T(f), T(q), a, b, causal=True),
        transposed(1, 2, 3, 3), transposed(1, 2, 3, 3), gates(1, 2, 3), positive(1, 2, 3))

    # agglomerative_attention
    for causal in (False, True):
        add(f"agglomerative causal={causal} L!=S", lambda cq, cr, v, c=causal: ops.agglomerative_attention(
            cq, cr, v, causal=c), positive(2, 2, 3), positive(2, 2, 5), leaf(2, 2, 5, 3))
    add("agglomerative causal L>S (empty rows)", lambda cq, cr, v: ops.agglomerative_attention(cq, cr, v, causal=True),
        positive(1, 2, 5), positive(1, 2, 3), leaf(1, 2, 3, 2))
    # cr ~ 1e-4: every (prefix) sum is below the clip, whose denominator is constant.
    small = (torch.rand(1, 2, 4, dtype=f64) + 0.5).mul(1e-4).requires_grad_()
    add("agglomerative clip active", lambda cq, cr, v: ops.agglomerative_attention(cq, cr, v, causal=True),
        positive(1, 2, 4), small, leaf(1, 2, 4, 3))
    add("agglomerative L=1 strided v", lambda cq, cr, v: ops.agglomerative_attention(cq, cr, T(v), clip=0.05),
        positive(1, 2, 1), positive(1, 2, 3), transposed(1, 2, 3, 3))

    # clustered_attention: the labels (hashes, K-means) and top-k sets are
    # piecewise constant in q (docs/MATH.md), so the gradient is defined where
    # they do not change. Through k and v with q fixed they never change.
    qfix = torch.randn(2, 2, 6, 4, dtype=f64)
    for topk in (0, 3):
        add(f"clustered k,v fixed clusters topk={topk}",
            lambda k, v, t=topk: ops.clustered_attention(qfix, k, v, clusters=3, topk=t, seed=5,
                                                         key_lengths=lengths(0, 5)),
            leaf(2, 2, 5, 4), leaf(2, 2, 5, 3))
        # One cluster: the labels cannot depend on q, so q is differentiable too.
        add(f"clustered q,k,v one cluster topk={topk}",
            lambda q, k, v, t=topk: ops.clustered_attention(q, k, v, clusters=1, topk=t, seed=2,
                                                            query_lengths=lengths(3, 5)),
            leaf(2, 1, 5, 3), leaf(2, 1, 4, 3), leaf(2, 1, 4, 2))
    add("clustered k,v L=1 strided", lambda k, v: ops.clustered_attention(
        qfix[:, :, :1], T(k), T(v), clusters=1, topk=2, seed=1), transposed(2, 2, 3, 4), transposed(2, 2, 3, 5))

    # sparse_attention: shared lists (patterns), per-head lists, L != S, an empty row
    for name, n, param in (("local", 5, 1), ("causal", 4, 0), ("bp-tree", 3, 0), ("strided", 5, 2)):
        offsets, columns = ops.edge_pattern(name, n, param)
        size = offsets.numel() - 1
        add(f"sparse {name}", lambda q, k, v, o=offsets, c=columns: ops.sparse_attention(q, k, v, o, c),
            leaf(1, 2, size, 3), leaf(1, 2, size, 3), leaf(1, 2, size, 2))
    offsets, columns = per_head_edges()
    add("sparse per-head L!=S empty row", lambda q, k, v: ops.sparse_attention(q, k, v, offsets, columns, scale=0.9),
        leaf(2, 2, 3, 3), leaf(2, 2, 4, 3), leaf(2, 2, 4, 5))
    o1, c1 = ops.edge_pattern("full", 1)
    add("sparse L=1 strided", lambda q, k, v: ops.sparse_attention(T(q), T(k), T(v), o1, c1),
        transposed(1, 2, 1, 3), transposed(1, 2, 1, 3), transposed(1, 2, 1, 2))
    add("sparse alibi local, grouped heads", lambda q, k, v: ops.sparse_attention(
        q, k, v, *ops.edge_pattern("local", 5, 1), alibi_slopes=ops.alibi_slopes(4)),
        leaf(1, 4, 5, 3), leaf(1, 2, 5, 3), leaf(1, 2, 5, 2))

    # scaled_dot_product_attention (torch 2's API): a float mask with its
    # gradient, is_causal with L != S (top-left), grouped-query heads, 3-D inputs
    sdpa = ops.scaled_dot_product_attention
    add("sdpa float mask scale", lambda q, k, v, m: sdpa(q, k, v, m, scale=0.8),
        leaf(1, 2, 3, 4), leaf(1, 2, 5, 4), leaf(1, 2, 5, 2), leaf(3, 5))
    add("sdpa is_causal L<S gqa", lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True),
        leaf(1, 4, 3, 4), leaf(1, 2, 5, 4), leaf(1, 1, 5, 2))
    add("sdpa 3-D is_causal L>S strided", lambda q, k, v: sdpa(T(q), T(k), T(v), is_causal=True),
        transposed(2, 5, 3), transposed(2, 3, 3), transposed(2, 3, 2))

    # attention dropout with a fixed seed: the float64 composite draws the
    # kernel's mask, a function of the seed (so gradcheck's repeated calls agree)
    add("softmax dropout causal gqa", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True, dropout_p=0.4,
                                                                             dropout_seed=11),
        leaf(2, 4, 3, 4), leaf(2, 2, 5, 4), leaf(2, 2, 5, 3))
    add("softmax dropout window negative seed", lambda q, k, v: ops.softmax_attention(q, k, v, window=2, dropout_p=0.3,
                                                                       dropout_seed=-5),
        leaf(1, 2, 4, 3), leaf(1, 2, 4, 3), leaf(1, 2, 4, 2))

    # packed batches: an empty sequence, a sequence with queries but no key,
    # L != S per sequence, grouped-query heads, strided packed inputs
    cu_q, cu_k = lengths(0, 2, 2, 5, 6), lengths(0, 3, 5, 5, 7)
    add("varlen causal gqa rotary", lambda q, k, v: ops.varlen_attention(q, k, v, cu_q, cu_k, causal=True,
                                                                          rotary_dim=2),
        leaf(6, 4, 4), leaf(7, 2, 4), leaf(7, 2, 3))
    add("varlen window strided", lambda q, k, v: ops.varlen_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                                       v.transpose(0, 1), cu_q, cu_k, window=2),
        leaf(2, 6, 3), leaf(2, 7, 3), leaf(2, 7, 2))
    add("varlen dropout", lambda q, k, v: ops.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.5, dropout_seed=3),
        leaf(6, 2, 3), leaf(7, 2, 3), leaf(7, 2, 2))
    add("varlen linear causal elu", lambda q, k, v: ops.varlen_linear_attention(
            q, k, v, cu_q, cu_k, causal=True, feature_map="elu", normalize=True),
        leaf(6, 2, 3), leaf(7, 1, 3), leaf(7, 1, 2))

    # linear
    add("linear-op 2d", lambda x, w, b: ops.linear(x, w, b), leaf(3, 5), leaf(4, 5), leaf(4))
    add("linear-op 3d no bias", lambda x, w: ops.linear(x, w), leaf(2, 3, 5), leaf(1, 5))
    add("linear-op strided x", lambda x, w, b: ops.linear(x.t(), w, b), leaf(5, 3), leaf(2, 5), leaf(2))
    add("linear-op 1d x", lambda x, w, b: ops.linear(x, w, b), leaf(3), leaf(2, 3), leaf(2))
    return cases


@pytest.mark.parametrize("fn, inputs", _op_cases())
def test_op_gradcheck_float64(fn, inputs):
    out = fn(*inputs)
    for x in out if isinstance(out, tuple) else (out,):  # (out, lse) of the ops that return both
        assert x.dtype == f64 and torch.isfinite(x).all()
    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_covers_every_op():
    """A new op must get cases above: the list of ops is closed."""
    tested = {"softmax_attention", "scaled_dot_product_attention", "linear_attention", "gated_linear_attention", "agglomerative_attention",
              "clustered_attention", "sparse_attention", "linear", "rotary_embedding", "varlen_attention",
              "varlen_linear_attention", "softmax_attention_with_lse", "merge_attention"}
    untensored = {"edge_pattern", "alibi_slopes", "attention_dropout_mask", "isa", "isa_description", "machine_isa", "set_max_isa"}
    # flex_attention and flex_attention_dispatch are Python over the ops above (tests/python/test_flex.py).
    assert set(attnkit.__all__) & {n for n in dir(ops) if not n.startswith("_")} == tested | untensored


def test_empty_rows_pass_exactly_zero_gradients():
    """A row with no visible key outputs 0 and passes exactly 0 to every input
    (docs/API.md): key_lengths 0, causal rows with i + S - L < 0, an empty edge list row."""
    q, k, v = leaf(2, 1, 3, 4), leaf(2, 1, 3, 4), leaf(2, 1, 3, 2)
    for dtype in (torch.float32, f64):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = ops.softmax_attention(*xs, key_lengths=lengths(0, 3))
        out.sum().backward()
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        for x in xs:
            assert torch.equal(x.grad[0], torch.zeros_like(x.grad[0])) and x.grad[1].abs().sum() > 0
    offsets, columns = per_head_edges()
    q, k, v = leaf(1, 2, 3, 3), leaf(1, 2, 4, 3), leaf(1, 2, 4, 2)
    out = ops.sparse_attention(q, k, v, offsets, columns)
    out[0, 0, 2].sum().backward()
    assert torch.equal(out[0, 0, 2], torch.zeros(2, dtype=f64))
    assert all(t.grad is None or torch.equal(t.grad, torch.zeros_like(t)) for t in (q, k, v))


# ---------------------------------------------------------------------------------------
# 2. Modules in float64: gradients w.r.t. inputs and parameters
# ---------------------------------------------------------------------------------------

@_seeded
def _module_cases():
    """(id, module factory, inputs factory, call). The module is built in
    float32 and converted with .double(); inputs are float64 leaves; `call`
    runs the module on them (with the integer arguments it needs)."""
    T = lambda x: x.transpose(0, 1)  # noqa: E731
    cases = []

    def add(name, make, inputs, call, **kw):
        cases.append(pytest.param(make, inputs, call, id=name, **kw))

    add("Linear", lambda: ann.Linear(5, 3), lambda: [leaf(2, 3, 5)], lambda m, x: m(x))
    add("Linear no bias, strided", lambda: ann.Linear(4, 3, bias=False), lambda: [leaf(4, 2)],
        lambda m, x: m(x.t()))
    add("MultiheadAttention full L!=S kpm", lambda: ann.MultiheadAttention(6, 2, batch_first=True),
        lambda: [leaf(2, 3, 6), leaf(2, 4, 6), leaf(2, 4, 6)],
        lambda m, q, k, v: m(q, k, v, key_padding_mask=torch.tensor([[False] * 4, [False, True, True, True]]))[0])
    add("MultiheadAttention causal batch_first=False", lambda: ann.MultiheadAttention(4, 2),
        lambda: [leaf(3, 2, 4)], lambda m, x: m(x, x, x, is_causal=True)[0])
    add("MultiheadAttention key_lengths 0 no bias", lambda: ann.MultiheadAttention(4, 1, bias=False, batch_first=True),
        lambda: [leaf(2, 3, 4)], lambda m, x: m(x, x, x, key_lengths=lengths(0, 2))[0])
    add("MultiheadAttention linear", lambda: ann.MultiheadAttention(4, 2, attention="linear", batch_first=True),
        lambda: [leaf(1, 3, 4), leaf(1, 5, 4)], lambda m, q, kv: m(q, kv, kv, is_causal=True)[0])
    add("MultiheadAttention sparse-local strided", lambda: ann.MultiheadAttention(
        4, 2, attention="sparse-local:span=1", batch_first=True), lambda: [leaf(5, 1, 4)],
        lambda m, x: m(T(x), T(x), T(x))[0])
    add("MultiheadAttention improved-clustered eval", lambda: ann.MultiheadAttention(
        4, 2, attention="improved-clustered:clusters=1,topk=2,seed=3", batch_first=True).eval(),
        lambda: [leaf(2, 4, 4)], lambda m, x: m(x, x, x)[0])

    # Every non-layer-only mechanism of the registry as a module (no parameters: inputs only).
    for entry in attnkit.mechanisms():
        if entry["layer_only"]:
            continue
        name = entry["name"]
        options = {"clustered": {"clusters": 2, "seed": 1}, "improved-clustered": {"clusters": 1, "topk": 2},
                   "sparse-local": {"span": 1}, "sparse-local-causal": {"span": 1}, "sparse-segments": {"segment": 2},
                   "sparse-segments-causal": {"segment": 2}, "sparse-strided": {"stride": 2}}.get(name, {})
        M = 3 if entry["supports"]["value_dim"] else 4
        # Clustering is piecewise constant in q: with more than one cluster only k, v vary.
        vary_q = name != "clustered"
        qfix = torch.randn(1, 2, 5, 4, dtype=f64)
        add(f"registry.{name}", lambda name=name, options=options: ann.Attention(name, **options).eval(),
            lambda vary_q=vary_q, M=M: ([leaf(1, 2, 5, 4)] if vary_q else []) + [leaf(1, 2, 5, 4), leaf(1, 2, 5, M)],
            (lambda m, q, k, v: m(q, k, v)) if vary_q else (lambda m, k, v, qfix=qfix: m(qfix, k, v)))

    add("AdditiveAttention", lambda: ann.AdditiveAttention(3, 2, 4), lambda: [leaf(2, 2, 3), leaf(2, 3, 2), leaf(2, 3, 5)],
        lambda m, q, k, v: m(q, k, v, key_lengths=lengths(0, 2)))
    add("GeneralAttention L=1", lambda: ann.GeneralAttention(3, 2), lambda: [leaf(2, 1, 3), leaf(2, 3, 2), leaf(2, 3, 1)],
        lambda m, q, k, v: m(q, k, v))
    add("DotAttention unscaled strided", lambda: ann.DotAttention(scaled=False),
        lambda: [leaf(2, 2, 3), leaf(3, 2, 3), leaf(2, 3, 2)], lambda m, q, k, v: m(q, T(k), v, key_lengths=lengths(3, 1)))
    add("LocationAttention", lambda: ann.LocationAttention(3, 5), lambda: [leaf(2, 2, 3), leaf(2, 4, 3)],
        lambda m, q, v: m(q, v, key_lengths=lengths(4, 0)))
    add("RelativePositionAttention", lambda: ann.RelativePositionAttention(4, 2, max_relative=1),
        lambda: [leaf(2, 4, 4)], lambda m, x: m(x, key_lengths=lengths(4, 2), causal=True))
    add("SinusoidalPositionalEncoding", lambda: ann.SinusoidalPositionalEncoding(5, max_length=12),
        lambda: [leaf(2, 3, 5)], lambda m, x: m(x, offset=4))
    add("AgglomerativeAttention self causal", lambda: ann.AgglomerativeAttention(4, 2), lambda: [leaf(2, 3, 4)],
        lambda m, x: m(x, causal=True))
    add("AgglomerativeAttention cross L!=S", lambda: ann.AgglomerativeAttention(6, 3), lambda: [leaf(1, 2, 6), leaf(1, 5, 6)],
        lambda m, x, r: m(x, r))
    add("LinearAttention elu normalize causal", lambda: ann.LinearAttention("elu", normalize=True, causal=True),
        lambda: [leaf(1, 2, 3, 3), leaf(1, 2, 4, 3), leaf(1, 2, 4, 2)], lambda m, q, k, v: m(q, k, v))
    add("GatedLinearAttention", lambda: ann.GatedLinearAttention(3), lambda: [leaf(2, 4, 3), leaf(2, 2, 3)],
        lambda m, h, q: m(h, q, causal=False))
    add("GatedLinearAttention features", lambda: ann.GatedLinearAttention(3), lambda: [leaf(2, 4, 3)],
        lambda m, h: m.features(h))
    add("Transformer decoder", lambda: Transformer(5, layers=1, width=4, heads=2, ffn=6, dropout=0.0, max_length=8),
        lambda: [], lambda m: m(torch.tensor([[1, 2, 3], [4, 0, 1]])))
    add("Transformer encoder-decoder relative", lambda: Transformer(
        5, architecture="encoder-decoder", layers=1, width=4, heads=2, ffn=4, dropout=0.0, positions="relative",
        relative_clip=2, norm="post"),
        lambda: [], lambda m: m(torch.tensor([[1, 2]]), torch.tensor([[3, 4, 0]]), torch.tensor([2])))
    return cases


MODULE_CASES = _module_cases()


def _double_module(make):
    module = make().double()
    for p in module.parameters():
        assert p.dtype == f64
    return module


@pytest.mark.parametrize("make, make_inputs, call", MODULE_CASES)
def test_module_gradients_float64_finite_differences(make, make_inputs, call):
    """Every input and every parameter entry (at most 24 random entries per
    parameter of the larger modules) of the .double() module against central
    differences, with gradcheck's tolerances (atol 1e-5, rtol 1e-3)."""
    module = _double_module(make)
    inputs = make_inputs()
    params = [p for p in module.parameters() if p.requires_grad]
    out = call(module, *inputs)
    for o in (out if isinstance(out, tuple) else (out,)):
        assert o.dtype == f64 and torch.isfinite(o).all()
    checked = finite_difference_check(lambda: call(module, *inputs), inputs + params, max_entries=24)
    assert checked > 0


def test_modules_cover_attnkit_nn():
    """Every module class of attnkit.nn has a gradient case above."""
    names = {p.id.split(" ")[0].split(".")[0] for p in MODULE_CASES}
    modules = {n for n in ann.__all__ if isinstance(getattr(ann, n), type) and issubclass(getattr(ann, n), torch.nn.Module)}
    assert modules - {"Attention"} <= names, modules - names
    assert "registry" in names and "Transformer" in names


@pytest.mark.parametrize("make, make_inputs, call", [p for p in MODULE_CASES if p.id in (
    "Linear", "MultiheadAttention full L!=S kpm", "AdditiveAttention")])
def test_module_torch_gradcheck_float64(make, make_inputs, call):
    module = _double_module(make)
    inputs = make_inputs()
    params = [p for p in module.parameters() if p.requires_grad]
    n = len(inputs)
    assert torch.autograd.gradcheck(lambda *xs: call(module, *xs[:n]), tuple(inputs + params), fast_mode=True)


def test_module_backward_twice_with_retain_graph():
    m = ann.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    y = m(x)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    # d/dx of sum(x W^T + b), twice
    torch.testing.assert_close(x.grad, 2 * torch.ones(4, 2) @ m.weight.detach())


def test_finite_difference_check_detects_a_wrong_gradient():
    """The checker used for the modules fails on a wrong backward (and passes the right one)."""
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, factor):
            ctx.save_for_backward(x)
            ctx.factor = factor
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return ctx.factor * x * g, None

    x = leaf(3, 2)
    assert finite_difference_check(lambda: Square.apply(x, 2.0), [x]) == 6
    with pytest.raises(AssertionError, match="analytic"):
        finite_difference_check(lambda: Square.apply(x, 2.01), [x])


# ---------------------------------------------------------------------------------------
# 3. float32 (the kernels) against float64
# ---------------------------------------------------------------------------------------
#
# Tolerances: rel_err = max |x32 - x64| / max |x64| over each output and each
# gradient. The float32 inputs (and cotangents) are the float64 ones rounded to
# float32 and the float64 run uses exactly those rounded values, so only the
# computation's rounding is measured, not the inputs'. Every result here is a
# sum of at most n ~ 300 products of O(1) float32 values (a row of E + S terms,
# a prefix sum of the chunked scans, a GEMM row) followed by at most one exp or
# division. With u = 6e-8 (float32 unit roundoff) the error of such a sum is
# about sqrt(n) u ~ 1e-6 (rounding errors of random sign; the worst case n u is
# not approached by random data), so 1e-5 leaves a factor of ten, and it is the
# C++ kernel tests' bound for outputs (tests/ops/identities_test.cpp,
# clustered_attention_op_test.cpp). Measured on these cases: at most 4e-7 for outputs.
OP_OUTPUT_TOL = 1e-5
# Gradients sum once more over the queries (dK, dV, dW over N L rows) and
# chain two such sums (dS = P (dP - D) then dQ = dS K), so the bound doubles:
# 2e-5 (tests/python/test_ops.py's bound for the same kernels). Measured: at
# most 1.3e-6.
OP_GRAD_TOL = 2e-5
# Modules chain up to five such stages (projections, attention, output
# projection; the Transformer: embedding, norms, two blocks of attention and
# feed-forward, the tied output layer), each adding its own ~n u relative
# error, and a layer norm divides by a standard deviation computed in float32;
# 5 stages x 1e-5: 5e-5 for outputs and for gradients. Measured: at most
# 2.5e-7 for outputs and 1.5e-6 for gradients.
MODULE_TOL = 5e-5


def _f32_rounded(*shape, positive_=False, low=None):
    x = torch.rand(*shape, dtype=f64) + 0.1 if positive_ else torch.randn(*shape, dtype=f64)
    if low is not None:
        x = x * (1 - low) + low
    return x.float().double()


@_seeded
def _kernel_cases():
    """(id, op, float64 inputs rounded to float32). Shapes cross the kernels'
    blocks and chunks (32 queries for the linear scans, tiles of the softmax
    kernel), with odd sizes, L != S, E != M, L = 1 and strided inputs."""
    r = _f32_rounded
    T = lambda x: x.transpose(1, 2)  # noqa: E731
    cases = []
    add = lambda name, fn, *xs: cases.append(pytest.param(fn, xs, id=name))  # noqa: E731

    add("softmax L!=S E!=M", lambda q, k, v: ops.softmax_attention(q, k, v), r(2, 3, 37, 16), r(2, 3, 71, 16), r(2, 3, 71, 9))
    add("softmax causal key_lengths", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True,
                                                                            key_lengths=lengths(0, 70, 33)),
        r(3, 2, 67, 8), r(3, 2, 70, 8), r(3, 2, 70, 5))
    add("softmax L=1 strided", lambda q, k, v: ops.softmax_attention(T(q), T(k), T(v), scale=0.3),
        r(2, 1, 3, 7), r(2, 45, 3, 7), r(2, 45, 3, 3))
    # Past the kernels' largest blocks (softmax: 128 queries x 256 keys; clustered: 128 members,
    # 256 keys per backward panel; linear: 256 keys; sparse: dense tiles of 256 keys, rows of up to
    # 300 edges here; agglomerative: 64 rows, crossed by the cases below).
    add("softmax past the blocks", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True,
                                                                         key_lengths=lengths(261, 200)),
        r(2, 1, 131, 8), r(2, 1, 261, 8), r(2, 1, 261, 4))
    add("clustered past the blocks", lambda q, k, v: ops.clustered_attention(q, k, v, clusters=1, topk=40,
                                                                             key_lengths=lengths(261, 250)),
        r(2, 1, 131, 8), r(2, 1, 261, 8), r(2, 1, 261, 4))
    add("linear past the blocks", lambda q, k, v: ops.linear_attention(q, k, v, feature_map="elu", normalize=True),
        r(1, 2, 131, 8), r(1, 2, 261, 8), r(1, 2, 261, 4))
    lo, lc = ops.edge_pattern("causal", 300)
    add("sparse past the blocks", lambda q, k, v: ops.sparse_attention(q, k, v, lo, lc),
        r(1, 2, 300, 8), r(1, 2, 300, 8), r(1, 2, 300, 4))
    # Broadcast heads: k, v of one head expanded to H (stride 0); their gradients sum over the heads.
    add("softmax expanded heads", lambda q, k, v: ops.softmax_attention(q, k.expand(2, 3, 41, 8), v.expand(2, 3, 41, 5),
                                                                        causal=True),
        r(2, 3, 39, 8), r(2, 1, 41, 8), r(2, 1, 41, 5))
    # A bias, constant or trainable, takes the kernel (docs/API.md); a trainable
    # one gets its gradient from the kernel's tiles, summed into its own shape.
    bias = r(1, 2, 1, 40)
    add("softmax bias (kernel)", lambda q, k, v: ops.softmax_attention(q, k, v, causal=True, bias=bias.to(q.dtype)),
        r(2, 2, 33, 8), r(2, 2, 40, 8), r(2, 2, 40, 6))
    add("softmax trainable bias", lambda q, k, v, b: ops.softmax_attention(q, k, v, bias=b),
        r(2, 2, 9, 8), r(2, 2, 11, 8), r(2, 2, 11, 6), r(2, 1, 9, 11))
    for fm, normalize in (("identity", False), ("elu", False), ("elu", True)):
        for causal in (False, True):
            add(f"linear {fm} normalize={normalize} causal={causal}",
                lambda q, k, v, fm=fm, n=normalize, c=causal: ops.linear_attention(q, k, v, feature_map=fm,
                                                                                   normalize=n, causal=c),
                r(2, 2, 70, 6), r(2, 2, 67, 6), r(2, 2, 67, 5))
    add("linear expanded heads", lambda q, k, v: ops.linear_attention(q, k.expand(2, 3, 40, 6), v.expand(2, 3, 40, 5),
                                                                      feature_map="elu", normalize=True, causal=True),
        r(2, 3, 40, 6), r(2, 1, 40, 6), r(2, 1, 40, 5))
    add("linear L=1 strided", lambda q, k, v: ops.linear_attention(T(q), T(k), T(v), feature_map="elu", normalize=True,
                                                                   causal=True), r(1, 1, 2, 4), r(1, 9, 2, 4), r(1, 9, 2, 3))
    for causal in (False, True):
        add(f"gated causal={causal}", lambda f, q, a, b, c=causal: ops.gated_linear_attention(f, q, a, b, causal=c),
            r(2, 2, 69, 5), r(2, 2, 69, 5), r(2, 2, 69, positive_=True, low=0.9), r(2, 2, 69, positive_=True))
    add("gated L=1 strided", lambda f, q, a, b: ops.gated_linear_attention(T(f), T(q), a, b, causal=True),
        r(1, 1, 2, 3), r(1, 1, 2, 3), r(1, 2, 1, positive_=True), r(1, 2, 1, positive_=True))
    for causal in (False, True):
        add(f"agglomerative causal={causal}", lambda cq, cr, v, c=causal: ops.agglomerative_attention(cq, cr, v, causal=c),
            r(2, 3, 61, positive_=True), r(2, 3, 75, positive_=True), r(2, 3, 75, 7))
    add("agglomerative L>S strided", lambda cq, cr, v: ops.agglomerative_attention(cq, cr, T(v), causal=True),
        r(1, 2, 9, positive_=True), r(1, 2, 4, positive_=True), r(1, 4, 2, 3))
    # One cluster: labels cannot depend on the dtype's rounding of the hashes.
    for topk in (0, 5):
        add(f"clustered one cluster topk={topk}", lambda q, k, v, t=topk: ops.clustered_attention(
            q, k, v, clusters=1, topk=t, seed=4, key_lengths=lengths(0, 40), query_lengths=lengths(20, 30)),
            r(2, 2, 30, 8), r(2, 2, 40, 8), r(2, 2, 40, 5))
    offsets, columns = ops.edge_pattern("local", 70, 5)
    add("sparse local", lambda q, k, v: ops.sparse_attention(q, k, v, offsets, columns),
        r(2, 2, 70, 8), r(2, 2, 70, 8), r(2, 2, 70, 5))
    bo, bc = ops.edge_pattern("bp-tree", 20)
    add("sparse bp-tree strided", lambda q, k, v: ops.sparse_attention(T(q), T(k), T(v), bo, bc),
        r(1, 39, 2, 4), r(1, 39, 2, 4), r(1, 39, 2, 6))
    po, pc = per_head_edges()
    add("sparse per-head empty row", lambda q, k, v: ops.sparse_attention(q, k, v, po, pc),
        r(3, 2, 3, 5), r(3, 2, 4, 5), r(3, 2, 4, 2))
    add("linear-op", lambda x, w, b: ops.linear(x, w, b), r(3, 7, 33), r(17, 33), r(17))
    add("linear-op strided", lambda x, w: ops.linear(x.transpose(0, 1), w), r(33, 5), r(3, 33))
    return cases


@pytest.mark.parametrize("fn, inputs", _kernel_cases())
def test_op_float32_matches_float64(fn, inputs):
    results = {}
    cot = None
    for dtype in (f64, torch.float32):
        xs = [x.to(dtype).requires_grad_() for x in inputs]
        out = fn(*xs)
        assert out.dtype == dtype
        if cot is None:
            cot = torch.randn(out.shape, dtype=f64).float().double()
        results[dtype] = [out.detach()] + list(torch.autograd.grad(out, xs, cot.to(dtype)))
    for i, (a, b) in enumerate(zip(results[torch.float32], results[f64])):
        tol = OP_OUTPUT_TOL if i == 0 else OP_GRAD_TOL
        if i == 0:
            assert b.abs().max() > 0, "the output is identically zero: the case tests nothing"
        if b.abs().max() == 0:  # e.g. alpha's gradient at L = 1 (it multiplies C_0 = 0): exactly 0 in float32 too
            assert torch.equal(a, torch.zeros_like(a)), f"result {i}: float64 gives exact zeros, float32 does not"
            continue
        assert rel_err(a, b) <= tol, f"result {i} (0 = output): rel_err {rel_err(a, b):.3g} > {tol}"


@_seeded
def _module_f32_cases():
    T = lambda x: x.transpose(0, 1)  # noqa: E731
    r = _f32_rounded
    cases = []

    def add(name, make, inputs, call):
        cases.append(pytest.param(make, inputs, call, id=name))

    add("Linear", lambda: ann.Linear(33, 17), lambda: [r(4, 9, 33)], lambda m, x: m(x))
    for spec in ("full", "linear", "causal-linear", "gated-linear", "sparse-local:span=4",
                 "improved-clustered:clusters=1,topk=8"):
        add(f"MultiheadAttention {spec}", lambda spec=spec: ann.MultiheadAttention(16, 2, attention=spec),
            lambda: [r(37, 2, 16)], lambda m, x: m(x, x, x)[0])
    add("MultiheadAttention full cross causal kpm", lambda: ann.MultiheadAttention(12, 3, batch_first=True),
        lambda: [r(2, 35, 12), r(2, 40, 12)],
        lambda m, q, kv: m(q, kv, kv, is_causal=True,
                           key_padding_mask=torch.arange(40).unsqueeze(0) >= torch.tensor([[40], [21]]))[0])
    add("AdditiveAttention", lambda: ann.AdditiveAttention(7, 5, 9), lambda: [r(2, 11, 7), r(2, 13, 5), r(2, 13, 6)],
        lambda m, q, k, v: m(q, k, v, key_lengths=lengths(13, 0)))
    add("GeneralAttention", lambda: ann.GeneralAttention(7, 5), lambda: [r(2, 11, 7), r(2, 13, 5), r(2, 13, 6)],
        lambda m, q, k, v: m(q, k, v))
    add("DotAttention", lambda: ann.DotAttention(), lambda: [r(2, 11, 7), r(2, 13, 7), r(2, 13, 6)],
        lambda m, q, k, v: m(q, k, v, key_lengths=lengths(1, 13)))
    add("LocationAttention", lambda: ann.LocationAttention(7, 20), lambda: [r(2, 11, 7), r(2, 13, 6)],
        lambda m, q, v: m(q, v))
    add("RelativePositionAttention", lambda: ann.RelativePositionAttention(12, 3, max_relative=4),
        lambda: [r(2, 23, 12)], lambda m, x: m(x, causal=True))
    add("SinusoidalPositionalEncoding", lambda: ann.SinusoidalPositionalEncoding(9), lambda: [r(2, 23, 9)],
        lambda m, x: m(x, offset=100))
    add("AgglomerativeAttention", lambda: ann.AgglomerativeAttention(12, 3), lambda: [r(2, 41, 12), r(2, 37, 12)],
        lambda m, x, ref: m(x, ref, causal=True))
    add("LinearAttention", lambda: ann.LinearAttention("elu", normalize=True, causal=True),
        lambda: [r(2, 2, 40, 6), r(2, 2, 45, 6), r(2, 2, 45, 4)], lambda m, q, k, v: m(q, k, v))
    add("GatedLinearAttention", lambda: ann.GatedLinearAttention(6), lambda: [r(2, 41, 6), r(2, 9, 6)],
        lambda m, h, q: m(h, q, causal=False))
    add("GatedLinearAttention causal strided", lambda: ann.GatedLinearAttention(6), lambda: [r(41, 2, 6)],
        lambda m, h: m(T(h), T(h), causal=True))
    add("Transformer", lambda: Transformer(11, layers=2, width=12, heads=3, ffn=20, dropout=0.0,
                                           attention=["full", "causal-linear"]),
        lambda: [], lambda m: m(torch.randint(0, 11, (2, 19))))
    return cases


@pytest.mark.parametrize("make, make_inputs, call", _module_f32_cases())
def test_module_float32_matches_float64(make, make_inputs, call):
    m32 = make()
    m64 = copy.deepcopy(m32).double()  # the same weights, exactly (float32 values are float64 values)
    inputs = make_inputs()
    torch.manual_seed(1)  # the same integer inputs (tokens) in both calls
    state = torch.get_rng_state()
    results = {}
    for dtype, module in ((torch.float32, m32), (f64, m64)):
        torch.set_rng_state(state)
        xs = [x.to(dtype).requires_grad_() for x in inputs]
        params = [p for p in module.parameters()]
        out = call(module, *xs)
        outs = out if isinstance(out, tuple) else (out,)
        for o in outs:
            assert o.dtype == dtype
        torch.manual_seed(2)
        cots = [torch.randn(o.shape, dtype=f64).float().to(dtype) for o in outs]
        grads = torch.autograd.grad(outs, xs + params, cots, allow_unused=True)
        results[dtype] = [o.detach() for o in outs] + [g if g is not None else torch.zeros_like(t)
                                                       for g, t in zip(grads, xs + params)]
    names = [f"output {i}" for i in range(len(results[f64]) - len(inputs) - len(list(m32.parameters())))]
    names += [f"input {i}" for i in range(len(inputs))] + [f"parameter {n}" for n, _ in m32.named_parameters()]
    by_name = dict(zip(names, zip(results[torch.float32], results[f64])))
    for name, (a, b) in by_name.items():
        assert a.dtype == torch.float32 and b.dtype == f64
        scale = b
        sibling = by_name.get(name[:-len("bias")] + "weight") if name.endswith(".bias") else None
        if sibling is not None and b.abs().max() <= 1e-9 * sibling[1].abs().max():
            # An exactly-zero gradient: k_proj.bias under a softmax over keys (adding
            # the same vector to every key shifts a query's scores by a constant).
            # float64 gives rounding noise (~1e-16), float32 the rounding noise of
            # the same sum of dK rows, whose size is that of the k_proj.weight
            # gradient (dK^T x with inputs x of unit size): measure against it.
            scale = sibling[1]
        err = (a.double() - b).abs().max().item() / scale.abs().max().item()
        assert err <= MODULE_TOL, f"{name}: rel_err {err:.3g} > {MODULE_TOL}"
