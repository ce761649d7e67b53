#!/usr/bin/python3
"""A copy of a trained run whose sinusoidal position table is longer.

    python3 experiments/reproduce/longer_table.py --run RUN --max-length 4096 --out RUN/max-length-4096 \\
        --json RUN/max-length-4096.json [--attnkit PATH]

The transformer's sinusoidal positions are a fixed table of max_length rows
(2048 by default, `attnkit train --max-length`), PE(p, 2i) =
sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...), and `attnkit eval --context C`
refuses C > max_length. Nothing in the table is trained: a longer table is the
same formula at more positions. So the model of RUN's newest checkpoint is
built again with --max-length rows, its trained parameters copied unchanged,
and written as a run directory of its own (OUT: the checkpoint, with RUN's
task and trainer settings and step), which `attnkit eval --run OUT --context C`
then evaluates. The copy is checked first: its table's first rows equal the
trained model's table, every other buffer and every parameter are equal, and
its logits on a short input equal the trained model's bitwise.

--json writes what was done ({"step", "run", "copy", "max_length", ...}: the
step tells reproduce's skip rule the copy is made). --attnkit names the
attnkit binary whose library (libattnkit.so.0 or libattnkit.so beside it) the
Python package loads (ATTNKIT_LIBRARY); without it, the package's own search.
"""

import argparse
import json
import os
import sys

sys.dont_write_bytecode = True  # run from the source tree: no __pycache__ beside the package

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The buffer of the sinusoidal table (models::TransformerImpl's "sinusoidal" module).
TABLE = "sinusoidal.table"


def library_beside(binary):
    """The libattnkit beside the attnkit binary: the frozen copies keep
    libattnkit.so.0 there, a build tree libattnkit.so."""
    here = os.path.dirname(os.path.abspath(binary))
    for name in ("libattnkit.so.0", "libattnkit.so"):
        if os.path.exists(os.path.join(here, name)):
            return os.path.join(here, name)
    sys.exit(f"longer_table: no libattnkit.so.0 or libattnkit.so beside {binary}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="the trained run directory")
    parser.add_argument("--max-length", type=int, required=True, help="rows of the copy's sinusoidal table")
    parser.add_argument("--out", required=True, help="the copy's run directory (created; must not hold a run)")
    parser.add_argument("--json", required=True, help="where to write what was done")
    parser.add_argument("--attnkit", help="the attnkit binary whose library the Python package loads")
    args = parser.parse_args()
    if args.attnkit:
        os.environ["ATTNKIT_LIBRARY"] = library_beside(args.attnkit)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch
    import attnkit  # noqa: F401  (loads the library)
    from attnkit.models import Transformer

    trained = Transformer.load(args.run)
    info = trained.run_info
    options = trained.options
    if "sinusoidal" not in options["positions"].split("+"):
        sys.exit(f"longer_table: {args.run} has positions '{options['positions']}', no sinusoidal table")
    if args.max_length <= options["max_length"]:
        sys.exit(f"longer_table: --max-length {args.max_length} is not longer than the run's {options['max_length']}")
    vocab = options.pop("vocab_size")
    longer = Transformer(vocab, **dict(options, max_length=args.max_length))
    longer.eval()

    new_params, old_params = dict(longer.named_parameters()), dict(trained.named_parameters())
    if new_params.keys() != old_params.keys():
        sys.exit(f"longer_table: the parameters differ: {sorted(new_params.keys() ^ old_params.keys())}")
    with torch.no_grad():
        for name, p in new_params.items():
            p.copy_(old_params[name])
    new_buffers, old_buffers = dict(longer.named_buffers()), dict(trained.named_buffers())
    rows = old_buffers[TABLE].size(0)
    if not torch.equal(new_buffers[TABLE][:rows], old_buffers[TABLE]):
        sys.exit("longer_table: the longer table's first rows differ from the trained model's table")
    for name, b in old_buffers.items():
        if name != TABLE and not torch.equal(new_buffers[name], b):
            sys.exit(f"longer_table: buffer {name} differs")
    tokens = torch.arange(64).remainder(vocab).unsqueeze(0)
    with torch.no_grad():
        if not torch.equal(longer(tokens), trained(tokens)):
            sys.exit("longer_table: the copy's logits differ from the trained model's")

    if os.path.isdir(args.out) and os.listdir(args.out):
        sys.exit(f"longer_table: {args.out} is not empty")
    task = info["task"]
    checkpoint = longer.save(args.out, task=task["name"], data_dir=task["data_dir"], copy_length=task["copy_length"],
                             step=info["step"], trainer=info["trainer"])
    done = {"step": info["step"], "run": os.path.abspath(args.run), "trained_checkpoint": info["checkpoint"],
            "trained_max_length": rows, "max_length": args.max_length, "copy": os.path.abspath(args.out),
            "checkpoint": checkpoint}
    with open(args.json + ".tmp", "w") as f:
        json.dump(done, f, indent=1)
        f.write("\n")
    os.replace(args.json + ".tmp", args.json)
    print(f"longer_table: {args.run} (step {info['step']}) with a sinusoidal table of {args.max_length} rows "
          f"instead of {rows}: {checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
