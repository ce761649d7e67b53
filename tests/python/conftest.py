"""Shared helpers of test_gradcheck.py and test_modules.py (imported as
``from conftest import ...``; pytest puts this directory on sys.path).

Run from the source tree with the built library:

    ATTNKIT_LIBRARY=build/libattnkit.so PYTHONPATH=python python3 -m pytest tests/python -q
"""
import itertools

import torch

# Helpers only: no fixtures and no imports of attnkit here, so that the other
# test files of this directory run exactly as they would without this file.
# Each test file seeds torch per test with its own autouse fixture.


def rel_err(actual, expected):
    """max |actual - expected| / max |expected|: the error against the largest
    entry of the float64 result (the C++ tests' rel_err, tests/test_util.h)."""
    a = actual.detach().to(torch.float64)
    b = expected.detach().to(torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.numel() == 0:
        return 0.0
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-300)


def finite_rel_err(actual, expected):
    """rel_err over the finite entries, after checking that actual is finite
    exactly where expected is (an lse of -inf for a row that sees nothing)."""
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite)
    return rel_err(actual.masked_fill(~finite, 0), expected.masked_fill(~finite, 0))


def as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def finite_difference_check(fn, leaves, eps=1e-6, atol=1e-5, rtol=1e-3, max_entries=None, cotangents=None):
    """A gradcheck for functions whose backward may run only once per forward
    (see test_gradcheck.py: bridged modules): one forward + one backward of
    sum_o <cot_o, out_o> with random cotangents gives J^T cot for every leaf;
    every entry (or `max_entries` random entries per leaf) is compared with
    the central difference (f(x + eps) - f(x - eps)) / (2 eps) of the same
    scalar, re-running fn each time. Tolerances are gradcheck's defaults
    (|analytic - numeric| <= atol + rtol |numeric|).

    `fn()` must read the leaves (float64, requires_grad, any layout) and
    return a tensor or a tuple of tensors; the leaves are perturbed in place
    (so a module's Parameters can be leaves: the C++ module shares their
    storage). Returns the number of entries checked."""
    outs = as_tuple(fn())
    if cotangents is None:
        cotangents = [torch.randn(o.shape, dtype=o.dtype) for o in outs]
    pairs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad]
    assert pairs, "no output depends on the leaves"
    analytic = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)

    def scalar():
        with torch.no_grad():
            return sum((o.double() * c.double()).sum().item() for o, c in zip(as_tuple(fn()), cotangents))

    checked = 0
    for leaf, grad in zip(leaves, analytic):
        grad = torch.zeros_like(leaf) if grad is None else grad
        assert grad.shape == leaf.shape
        indices = list(itertools.product(*[range(s) for s in leaf.shape]))
        if max_entries is not None and len(indices) > max_entries:
            pick = torch.randperm(len(indices))[:max_entries].tolist()
            indices = [indices[i] for i in pick]
        data = leaf.data
        for idx in indices:
            original = data[idx].item()
            data[idx] = original + eps
            plus = scalar()
            data[idx] = original - eps
            minus = scalar()
            data[idx] = original
            numeric = (plus - minus) / (2 * eps)
            got = grad[idx].item()
            assert abs(got - numeric) <= atol + rtol * abs(numeric), (
                f"gradient entry {idx} of a leaf of shape {tuple(leaf.shape)}: "
                f"analytic {got!r}, numeric {numeric!r}")
            checked += 1
    return checked
