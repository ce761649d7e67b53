"""attnkit.flex_attention against torch 2's own eager flex_attention (issue
48): a causal block mask with soft-capping, forward + backward, one thread,
N = 1, H = 8, E = M = 64, blocks of 128. torch takes the cap as a score_mod
(its eager path materialises the scores); attnkit as its `softcap` option
(the kernel). Needs torch 2 (Debian 13: scripts/in-debian13):

    OMP_NUM_THREADS=1 PYTHONPATH=python python3 bench/flex_vs_torch_bench.py [--lengths 1024 4096]

Prints each length's median times (of --repeats after a warm-up), the
speed-up, and the outputs' largest relative difference (to show both compute
the same thing).
"""
import argparse
import os

import torch

import attnkit
from block_mask_bench import timed  # bench/, the script's own directory


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap", type=float, default=30.0)
    args = parser.parse_args()
    flex = __import__("torch.nn.attention.flex_attention", fromlist=["flex_attention"])
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, attnkit {attnkit.isa()}; torch threads {torch.get_num_threads()}; "
          f"load {os.getloadavg()[0]:.2f}; seed 0")
    torch.manual_seed(0)
    cap = args.cap

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    for L in args.lengths:
        q, k, v, grad = (torch.randn(1, 8, L, 64) for _ in range(4))
        theirs_mask = flex.create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=128)
        ours_mask = attnkit.create_block_mask(causal, None, None, L, L)

        def run(fn):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = fn(*leaves)
            out.backward(grad)
            return out.detach()

        torch_fn = lambda a, b, c: flex.flex_attention(a, b, c, score_mod=softcap, block_mask=theirs_mask)  # noqa: E731
        ours_fn = lambda a, b, c: attnkit.flex_attention(a, b, c, block_mask=ours_mask, softcap=cap)  # noqa: E731
        difference = float((run(torch_fn) - run(ours_fn)).abs().max() / run(torch_fn).abs().max())
        theirs = timed(lambda: run(torch_fn), args.repeats)
        ours = timed(lambda: run(ours_fn), args.repeats)
        print(f"L = {L}: torch eager flex_attention {theirs * 1e3:.1f} ms, attnkit {ours * 1e3:.1f} ms, "
              f"{theirs / ours:.1f}x; outputs differ by {difference:.1e} (relative)", flush=True)


if __name__ == "__main__":
    main()
