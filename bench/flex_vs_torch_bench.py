"""attnkit.flex_attention against torch 2's own eager flex_attention (issue
48): a causal block mask with a score_mod, forward + backward, one thread,
N = 1, H = 8, E = M = 64, blocks of 128. Both take the same Python functions:
soft-capping, and T5's relative buckets with a learned table (whose
gradient both compute). torch's eager path materialises the scores; attnkit
traces the function into its kernel. attnkit's `softcap` option is timed
too. Needs torch 2 (Debian 13: scripts/in-debian13):

    OMP_NUM_THREADS=1 PYTHONPATH=python python3 bench/flex_vs_torch_bench.py --lengths 1024
    OMP_NUM_THREADS=1 PYTHONPATH=python python3 bench/flex_vs_torch_bench.py --lengths 4096

(one length per process: torch 2.6's eager flex_attention raised
DataDependentOutputException at the second length of one process, inside its
own tracing of the T5 function, 2026-12-07.)

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

    table = torch.randn(8, 32, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, attnkit.score_mods.t5_bucket(kv_idx - q_idx, 32, 128)]

    for L in args.lengths:
        q, k, v, grad = (torch.randn(1, 8, L, 64) for _ in range(4))
        theirs_mask = flex.create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=128)
        ours_mask = attnkit.create_block_mask(causal, None, None, L, L)

        def run(fn):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            table.grad = None
            out = fn(*leaves)
            out.backward(grad)
            return out.detach()

        for name, score_mod in (("softcap", softcap), ("T5 relative buckets", relative)):
            torch_fn = lambda a, b, c: flex.flex_attention(a, b, c, score_mod=score_mod, block_mask=theirs_mask)  # noqa: E731,E501
            ours_fn = lambda a, b, c: attnkit.flex_attention(a, b, c, score_mod=score_mod, block_mask=ours_mask)  # noqa: E731,E501
            assert attnkit.flex_attention_dispatch(q, k, v, score_mod, ours_mask).startswith("kernel")
            want = run(torch_fn)
            difference = float((want - run(ours_fn)).abs().max() / want.abs().max())
            theirs = timed(lambda: run(torch_fn), args.repeats)
            ours = timed(lambda: run(ours_fn), args.repeats)
            print(f"L = {L}, {name}: torch eager flex_attention {theirs * 1e3:.1f} ms, attnkit {ours * 1e3:.1f} ms "
                  f"(traced score_mod), {theirs / ours:.1f}x; outputs differ by {difference:.1e} (relative)",
                  flush=True)
        option = timed(lambda: run(lambda a, b, c: attnkit.flex_attention(a, b, c, block_mask=ours_mask,
                                                                            softcap=cap)), args.repeats)
        print(f"L = {L}: attnkit's softcap option {option * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
