#!/usr/bin/python3
"""Swap the attention of a trained model: evaluate the same weights with exact
attention and with approximations, without retraining.

    build/attnkit train --task char-lm --data data/kjv --attention full --steps 500 --out runs/full
    python3 examples/swap_attention.py --run runs/full \\
        --attention sparse-local-causal:span=16 sparse-strided:stride=8 linear

A decoder's attention must be causal: clustered attention, which is not, is refused
(an encoder, e.g. the copy task's, takes it).
"""
import argparse
import json
import math
import pathlib

import torch

import attnkit

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--run", required=True, help="a run directory of `attnkit train` (or Transformer.save)")
parser.add_argument("--attention", nargs="+", required=True, help="registry specs to swap in")
parser.add_argument("--batches", type=int, default=8, help="validation windows of 16 sequences")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

model = attnkit.models.Transformer.load(args.run)  # eval mode
info = model.run_info
context = info["trainer"]["context"]
text = (pathlib.Path(info["task"]["data_dir"]) / "valid.txt").read_bytes()
ids = torch.tensor([0 if c == 32 else c - 96 for c in text], dtype=torch.long)
generator = torch.Generator().manual_seed(args.seed)
starts = torch.randint(0, len(ids) - context - 1, (args.batches, 16), generator=generator)
print(f"run {args.run} (step {info['step']}, trained with {model.options['attention']}); "
      f"seed {args.seed}, {args.batches} x 16 windows of {context} characters")


def bpc():
    total = 0.0
    with torch.no_grad():
        for batch in starts:
            windows = torch.stack([ids[s:s + context + 1] for s in batch.tolist()])
            logits = model(windows[:, :-1])
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, 27), windows[:, 1:].reshape(-1)).item()
    return total / len(starts) / math.log(2)


results = {"trained": model.options["attention"], "bpc": {}}
for spec in [model.options["attention"][0], *args.attention]:
    model.set_attention(spec)
    results["bpc"][spec] = bpc()
    print(f"{spec:45s} valid bpc {results['bpc'][spec]:.4f}")
print(json.dumps(results))
