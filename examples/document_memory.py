#!/usr/bin/python3
"""A fixed-size document memory (the cheap-linear-attention paper): encode a long
document once, in chunks, into C = sum_t f_t f_t^T (dim x dim), then answer many
queries in O(dim^2) each, whatever the document's length; save and reload it.

    python3 examples/document_memory.py --tokens 100000 --queries 10000
"""
import argparse
import pathlib
import tempfile
import time

import torch

import attnkit

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--tokens", type=int, default=100_000, help="document length")
parser.add_argument("--queries", type=int, default=10_000)
parser.add_argument("--dim", type=int, default=128, help="hidden size (the paper's k)")
parser.add_argument("--chunk", type=int, default=4096, help="tokens encoded per append")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
torch.manual_seed(args.seed)
print(f"seed {args.seed}: {args.tokens} tokens, {args.queries} queries, dim {args.dim}")

# The document's hidden states would come from an encoder; random ones stand in here.
layer = attnkit.nn.GatedLinearAttention(args.dim)          # f = sigmoid(W h + b) * h
hidden = torch.randn(args.tokens, args.dim)
queries = torch.randn(args.queries, args.dim)

memory = attnkit.nn.DocumentMemory(args.dim)
start = time.perf_counter()
with torch.no_grad():
    for chunk in hidden.split(args.chunk):
        memory.append(layer.features(chunk))               # C += F^T F, O(chunk dim^2)
encoded = time.perf_counter() - start
start = time.perf_counter()
answers = memory.lookup(queries)                          # (queries, dim): C q for every query
answered = time.perf_counter() - start
print(f"encoded {memory.num_states} states in {encoded:.3f} s; {args.queries} lookups in {answered:.4f} s")

# The same answers from the layer over the whole document (float64 for the check).
with torch.no_grad():
    direct = layer.double()(hidden.double().unsqueeze(0), queries.double().unsqueeze(0))[0]
error = ((answers.double() - direct).norm() / direct.norm()).item()
print(f"relative difference from the layer over the whole document: {error:.2e}")
assert error < 1e-5, error

with tempfile.TemporaryDirectory() as scratch:
    path = pathlib.Path(scratch) / "document.attnkit-mem"
    memory.save(path)
    loaded = attnkit.nn.DocumentMemory.load(path)
    print(f"saved {path.stat().st_size} bytes ({args.dim} x {args.dim} float32 and a header) "
          f"for a {args.tokens}-token document")
    assert torch.equal(loaded.lookup(queries), answers)
