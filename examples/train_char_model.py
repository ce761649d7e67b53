#!/usr/bin/python3
"""A character language model from attnkit.nn modules, trained by a plain PyTorch loop.

    scripts/fetch-corpus kjv --out data/kjv     # or: build/attnkit data char-lm --input any.txt --out data/kjv
    python3 examples/train_char_model.py --data data/kjv --attention causal-linear --steps 300
"""
import argparse, math, pathlib
import torch, attnkit

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", required=True, help="a directory of `attnkit data char-lm` (train.txt, valid.txt)")
p.add_argument("--attention", default="full", help="registry spec, e.g. causal-linear or sparse-local-causal:span=16")
p.add_argument("--steps", type=int, default=300)
p.add_argument("--context", type=int, default=64)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
torch.manual_seed(args.seed)
print(f"seed {args.seed}, attention {args.attention}")

def load(split):  # text8 convention: ' ' -> 0, 'a'..'z' -> 1..26
    text = (pathlib.Path(args.data) / f"{split}.txt").read_bytes()
    return torch.tensor([0 if c == 32 else c - 96 for c in text], dtype=torch.long)

class Block(torch.nn.Module):
    def __init__(self, d, heads, spec):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = attnkit.nn.MultiheadAttention(d, heads, attention=spec, batch_first=True)
        self.ff = torch.nn.Sequential(attnkit.nn.Linear(d, 4 * d), torch.nn.ReLU(), attnkit.nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, is_causal=True)[0]
        return x + self.ff(self.norm2(x))

d = 64  # model width
embed = torch.nn.Embedding(27, d)
model = torch.nn.Sequential(attnkit.nn.SinusoidalPositionalEncoding(d), Block(d, 4, args.attention),
                            Block(d, 4, args.attention), torch.nn.LayerNorm(d), attnkit.nn.Linear(d, 27))
optimizer = torch.optim.AdamW([*embed.parameters(), *model.parameters()], lr=3e-3)
train, valid = load("train"), load("valid")

def batch(data, n=16):
    start = torch.randint(0, len(data) - args.context - 1, (n,))
    windows = torch.stack([data[s:s + args.context + 1] for s in start.tolist()])
    return windows[:, :-1], windows[:, 1:]

def bpc(x, y):
    logits = model(embed(x) * math.sqrt(d))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 27), y.reshape(-1)) / math.log(2)

for step in range(1, args.steps + 1):
    loss = bpc(*batch(train))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 50 == 0 or step == args.steps:
        with torch.no_grad():
            print(f"step {step}: train bpc {loss.item():.3f}, valid bpc {bpc(*batch(valid, 64)).item():.3f}")
