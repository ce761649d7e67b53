#!/usr/bin/env python3
"""The Python ops at one ISA level, against float64 composites.

    smoke.py LEVEL

tests/isa/qemu_test.cmake runs this under qemu-x86_64 with a CPU model
(Haswell: avx2, Nehalem: baseline) and the installed package on PYTHONPATH:
the kernels the library picks for that CPU must run (no SIGILL) and compute
the right values. Checks, each on small float32 inputs with a float64
reference on the same values, forward and backward:

* attnkit.isa() is LEVEL;
* softmax_attention (plain, causal with L < S), linear_attention (elu,
  normalised, causal; identity), sparse_attention (a local pattern),
  agglomerative_attention (causal; not), clustered_attention (one cluster,
  top-k), attnkit.linear: error relative to the reference's largest entry
  within 2e-5 (1e-5 for linear), the bounds of tests/python/test_ops.py;
* softmax_attention on bfloat16 by the FlashAttention rule of
  tests/kernels/softmax_attention_bf16_test.cpp: its error against float64 at
  most 2x that of the same composite computed in bfloat16.

The references are written here from docs/API.md's definitions with torch
ops; clustered attention's labels come from its hashing and K-means rules, so
its reference is the op itself on float64 inputs, which runs the library's
composite (src/reference) rather than a kernel.

Shapes are small (under qemu `import torch` takes 6x as long, these checks
25x: about 14 s and 1.3 s) but not tiny: lengths and head dimensions that are
not multiples of 8 or 16, so that the vector loops and their tails both run.
Exit status 0 when every check passes.
"""
import math
import sys
import time

started = time.monotonic()
import torch  # noqa: E402

import attnkit  # noqa: E402

imported = time.monotonic()
torch.manual_seed(0)
failures = []


def relative_error(got, ref):
    """max |got - ref| / max |ref|, in float64."""
    ref = ref.double()
    scale = ref.abs().max().item()
    diff = (got.double() - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


def check_float32(name, op, reference, inputs, bound):
    """op on float32 copies of `inputs` (float64 tensors) against reference
    on the float64 ones: the output and every input gradient."""
    results = {}
    for dtype, f in ((torch.float, op), (torch.double, reference)):
        xs = [x.to(dtype).requires_grad_(x.is_floating_point()) for x in inputs]
        out = f(*xs)
        if out.dtype != dtype:
            failures.append(f"{name}: {dtype} inputs gave a {out.dtype} output")
            return
        # A cotangent that is not all ones, the same for both dtypes.
        cotangent = (1 + 0.5 * torch.arange(out.numel(), dtype=torch.double).view_as(out).sin()).to(dtype)
        grads = torch.autograd.grad(out, [x for x in xs if x.requires_grad], cotangent)
        results[dtype] = [out.detach(), *grads]
    worst = max(relative_error(a, b) for a, b in zip(results[torch.float], results[torch.double]))
    verdict = "ok" if worst <= bound else "FAIL"
    print(f"{verdict:4} {name}: worst relative error of the output and gradients {worst:.2e} "
          f"(bound {bound:.0e})")
    if worst > bound:
        failures.append(f"{name}: error {worst:.3e} > {bound:.0e}")


# --- the float64 composites (docs/API.md) ---------------------------------

def causal_mask(L, S):
    """True where query i may not see key j: j > i + S - L (bottom-right aligned)."""
    return torch.ones(L, S, dtype=torch.bool).triu(S - L + 1)


def softmax_reference(q, k, v, causal=False):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(causal_mask(q.shape[-2], k.shape[-2]), float("-inf"))
    return torch.softmax(s, -1) @ v


def linear_attention_reference(q, k, v, feature_map="identity", normalize=False, causal=False,
                               eps=1e-6):
    phi = (lambda x: torch.nn.functional.elu(x) + 1) if feature_map == "elu" else (lambda x: x)
    a = phi(q) @ phi(k).transpose(-2, -1)  # (N, H, L, S)
    if causal:
        a = a.masked_fill(causal_mask(q.shape[-2], k.shape[-2]), 0)
    out = a @ v
    return out / (a.sum(-1, keepdim=True) + eps) if normalize else out


def sparse_reference(q, k, v, offsets, columns):
    L, S = q.shape[-2], k.shape[-2]
    allowed = torch.zeros(L, S, dtype=torch.bool)
    for i in range(L):
        allowed[i, columns[offsets[i]:offsets[i + 1]]] = True
    s = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v  # every row of the pattern used here has an edge


def agglomerative_reference(cq, cr, v, causal=False, clip=1e-3):
    L, S = cq.shape[-1], cr.shape[-1]
    weighted = cr.unsqueeze(-1) * v  # (N, H, S, M)
    if causal:  # query i reads the prefix t <= i + S - L (L <= S here: never empty)
        last = torch.arange(L) + S - L
        numerator = weighted.cumsum(-2)[..., last, :]
        denominator = cr.cumsum(-1)[..., last]
    else:
        numerator = weighted.sum(-2, keepdim=True)
        denominator = cr.sum(-1, keepdim=True)
    return cq.unsqueeze(-1) * numerator / denominator.clamp_min(clip).unsqueeze(-1)


def draw(*shape):
    return torch.randn(*shape, dtype=torch.double)


def positive(*shape):  # class weights, as the layer's softmax gives them
    return torch.rand(*shape, dtype=torch.double) + 0.1


def check_bf16_softmax():
    """The FlashAttention rule on bfloat16 inputs (whatever path this level takes)."""
    name = "softmax_attention bfloat16 (causal)"
    q, k, v = (x.to(torch.bfloat16).double() for x in (draw(1, 2, 19, 24), draw(1, 2, 37, 24),
                                                       draw(1, 2, 37, 20)))
    cotangent = draw(1, 2, 19, 20).to(torch.bfloat16).double()

    def run(f, dtype):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = f(*xs, causal=True)
        if out.dtype != dtype:
            failures.append(f"{name}: {dtype} inputs gave a {out.dtype} output")
        grads = torch.autograd.grad(out, xs, cotangent.to(dtype))
        return [t.double() for t in (out.detach(), *grads)]

    exact = run(softmax_reference, torch.double)
    theirs = run(softmax_reference, torch.bfloat16)
    ours = run(attnkit.softmax_attention, torch.bfloat16)
    worst = 0.0
    for what, e, t, o in zip(("out", "dq", "dk", "dv"), exact, theirs, ours):
        e_ours, e_theirs = (o - e).abs().max().item(), (t - e).abs().max().item()
        if not e_theirs > 0 or e_ours > 2 * e_theirs:
            failures.append(f"{name}, {what}: error {e_ours:.3e} against float64, the bfloat16 "
                            f"composite's {e_theirs:.3e} (rule: at most 2x)")
        worst = max(worst, e_ours / e_theirs if e_theirs > 0 else math.inf)
    print(f"{'ok' if worst <= 2 else 'FAIL':4} {name}: worst error ratio to the bfloat16 composite "
          f"{worst:.2f} (bound 2)")


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} LEVEL (baseline, avx2, avx512, avx512_bf16, amx)")
    expected = sys.argv[1]
    level = attnkit.isa()
    print(f"attnkit {attnkit.__version__}, {attnkit.library_path}\nisa: {attnkit.isa_description()}")
    if level != expected:
        failures.append(f"attnkit.isa() is {level!r}, expected {expected!r}")

    ops = attnkit
    # L != S, E != M, none a multiple of 8: vector loops and their tails.
    q, k, v = draw(1, 2, 19, 12), draw(1, 2, 23, 12), draw(1, 2, 23, 10)
    check_float32("softmax_attention", ops.softmax_attention, softmax_reference, [q, k, v], 2e-5)
    check_float32("softmax_attention causal",
                  lambda *x: ops.softmax_attention(*x, causal=True),
                  lambda *x: softmax_reference(*x, causal=True), [q, k, v], 2e-5)
    check_float32("linear_attention elu normalize causal",
                  lambda *x: ops.linear_attention(*x, feature_map="elu", normalize=True, causal=True),
                  lambda *x: linear_attention_reference(*x, feature_map="elu", normalize=True,
                                                        causal=True), [q, k, v], 2e-5)
    check_float32("linear_attention identity", ops.linear_attention, linear_attention_reference,
                  [q, k, v], 2e-5)
    n = 21
    offsets, columns = ops.edge_pattern("local", n, 3)
    check_float32("sparse_attention local span 3",
                  lambda q, k, v: ops.sparse_attention(q, k, v, offsets, columns),
                  lambda q, k, v: sparse_reference(q, k, v, offsets, columns),
                  [draw(1, 2, n, 12), draw(1, 2, n, 12), draw(1, 2, n, 10)], 2e-5)
    cq, cr, cv = positive(1, 3, 19), positive(1, 3, 23), draw(1, 3, 23, 10)
    for causal in (False, True):
        check_float32(f"agglomerative_attention{' causal' if causal else ''}",
                      lambda *x: ops.agglomerative_attention(*x, causal=causal),
                      lambda *x: agglomerative_reference(*x, causal=causal), [cq, cr, cv], 2e-5)
    # One cluster: the labels cannot depend on the dtype's rounding.
    clustered = lambda *x: ops.clustered_attention(*x, clusters=1, topk=5, seed=4)  # noqa: E731
    check_float32("clustered_attention clusters=1 topk=5", clustered, clustered, [q, k, v], 2e-5)
    check_float32("linear", ops.linear, torch.nn.functional.linear,
                  [draw(3, 5, 21), draw(13, 21), draw(13)], 1e-5)
    check_bf16_softmax()

    print(f"import {imported - started:.1f} s, checks {time.monotonic() - imported:.1f} s")
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
