"""Exact attention over block masks (issue 48): each pattern's forward and
forward + backward against the unmasked kernel scaled by the share of pairs
the mask's non-empty blocks hold, and against the same pattern as a dense
mask (a -inf float bias, which the kernel reads in every tile).

    MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 OMP_NUM_THREADS=1 \\
        PYTHONPATH=python python3 bench/block_mask_bench.py [--lengths 4096 16384]

One process, one thread, N = 1, H = 8, E = M = 64, blocks of 128; each time
is the median of --repeats runs after one warm-up. The kernel runs through its
two ops, as autograd calls them (forward_and_backward says why). glibc
returns large freed blocks to the system, so that every call would fault its
outputs' pages in again (O(L H E) per call, 10-30% of a sparse mask's
time); the command's MALLOC_ variables keep them. Prints one row per
(L, pattern): the visited fraction f, the times, and
    ratio = time / (f x the unmasked kernel's time)   (the issue's goal: <= 1.3)
    dense/block = the dense mask's time / the block mask's.
The dense mask is skipped above --dense-max (its L x S bias alone is 1 GiB
at L = 16384).
"""
import argparse
import os
import statistics
import time

import torch

import attnkit


def patterns(L):
    """(name, mask_mod) for the issue's four patterns, L = S."""
    docs = L // 8

    def documents(b, h, q, kv):
        return (q // docs == kv // docs) & (q >= kv)

    def prefix_lm(b, h, q, kv):
        return (kv < L // 4) | (q >= kv)

    def global_window(b, h, q, kv):
        return (q >= kv) & ((q - kv < 256) | (kv < 16))

    def dilated(b, h, q, kv):
        return (q >= kv) & ((q - kv) % 4 == 0)

    return [("8 causal documents", documents), ("prefix-LM (L/4)", prefix_lm),
            ("causal window 256 + 16 global", global_window), ("dilated 4, causal", dilated)]


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_and_backward(q, k, v, grad, bias=None, mask=None, causal=False, softcap=0.0, score_mod=None):
    """The kernel's forward and forward + backward as callables, through its
    two ops (torch.ops.attnkit._softmax_attention_forward / _backward): what
    autograd runs, without autograd's own work (allocating and accumulating
    the gradients), which does not follow the mask. score_mod: a function
    traced into the kernel (attnkit.score_mods), with its captured tensors'
    gradient."""
    forward_op = torch.ops.attnkit._softmax_attention_forward
    backward_op = torch.ops.attnkit._softmax_attention_backward
    constants = (None, None, q.shape[-1] ** -0.5, causal, 0, 10000.0, 0, 0.0, 0)
    blocks = dict(mask.as_arguments() if mask is not None else {}, softcap=softcap)
    if score_mod is not None:
        program = attnkit.score_mods.trace(score_mod)
        blocks.update(score_code=program.code, score_values=program.values, score_tables=program.flat_tables())

    def forward():
        return forward_op(q, k, v, bias, *constants, **blocks)

    def both():
        out, lse = forward()
        backward_op(grad, q, k, v, out, lse, bias, *constants, False, **blocks)
    return forward, both


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-max", type=int, default=4096)
    parser.add_argument("--softcap", type=float, default=0.0,
                        help="instead of the patterns: the unmasked kernel with soft-capping at this cap against "
                             "without, not causal and causal, and the same cap as a traced score_mod")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"attnkit {attnkit.isa()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"torch threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}; seed 0")
    torch.manual_seed(0)
    for L in args.lengths:
        q, k, v = (torch.randn(1, 8, L, 64) for _ in range(3))
        if args.softcap > 0:
            grad = torch.randn(1, 8, L, 64)
            cap = args.softcap
            traced = attnkit.score_mods.softcap(cap).fn
            for causal in (False, True):
                plain, capped, modded = ([timed(f, args.repeats) for f in
                                          forward_and_backward(q, k, v, grad, causal=causal, **extra)]
                                         for extra in ({}, dict(softcap=cap), dict(score_mod=traced)))
                print(f"L = {L}, causal {causal}: forward {plain[0] * 1e3:.1f} / {capped[0] * 1e3:.1f} / "
                      f"{modded[0] * 1e3:.1f} ms (x{capped[0] / plain[0]:.2f} / x{modded[0] / plain[0]:.2f}), "
                      f"forward + backward {plain[1] * 1e3:.1f} / {capped[1] * 1e3:.1f} / {modded[1] * 1e3:.1f} ms "
                      f"(x{capped[1] / plain[1]:.2f} / x{modded[1] / plain[1]:.2f}): none / the softcap option / "
                      f"softcap {cap} as a traced score_mod", flush=True)
            continue
        grad = torch.randn(1, 8, L, 64)
        base_f, base_b = (timed(f, args.repeats) for f in forward_and_backward(q, k, v, grad))
        print(f"L = {L}: unmasked forward {base_f * 1e3:.1f} ms, forward + backward {base_b * 1e3:.1f} ms")
        print(f"  {'pattern':32s} {'f':>6s} {'fwd ms':>8s} {'ratio':>6s} {'f+b ms':>8s} {'ratio':>6s}"
              f" {'mask ms':>8s} {'dense/block fwd':>16s} {'f+b':>6s}")
        for name, mask_mod in patterns(L):
            start = time.perf_counter()
            mask = attnkit.create_block_mask(mask_mod, None, None, L, L)
            build = time.perf_counter() - start
            f = mask.visited_fraction()
            fwd, both = (timed(g, args.repeats)
                         for g in forward_and_backward(q, k, v, grad, mask=mask))
            row = (f"  {name:32s} {f:6.3f} {fwd * 1e3:8.1f} {fwd / (f * base_f):6.2f} {both * 1e3:8.1f}"
                   f" {both / (f * base_b):6.2f} {build * 1e3:8.1f}")
            if L <= args.dense_max:
                bias = torch.zeros(L, L).masked_fill(~mask.to_dense()[0, 0], float("-inf"))
                dense_f, dense_b = (timed(g, args.repeats) for g in forward_and_backward(q, k, v, grad, bias=bias))
                row += f" {dense_f / fwd:16.1f} {dense_b / both:6.1f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
