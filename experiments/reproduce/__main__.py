"""Re-runs an experiment of docs/EXPERIMENTS.md with the attnkit and attnkit-experiments tools.

    python3 experiments/reproduce --list
    python3 experiments/reproduce NAME [--smoke] [--out DIR] [--data DIR] [--jobs N]
                                       [--replicas 1,2,3] [--results DIR] [--attnkit PATH]
                                       [--configurations A,B] [--collect-only] [--copy-runs DIR]
                                       [--records DIR]

NAME:
  agglomerative-lm   section 1: full vs agglomerative attention x sinusoidal
                     vs convolutional positions, a universal-transformer
                     character model on the KJV corpus; 3 replicas (seeds 1-3).
  agglomerative-controls
                     section 1 again with the control it lacked: the same
                     model without attention (`none`) beside full and
                     agglomerative attention, each with sinusoidal and with
                     convolutional positions; 4x section 1's steps, 3
                     replicas, on KJV; whether validation flattened and each
                     configuration's gap to `none`.
  agglomerative-controls-gcide
                     the same on a second corpus, dict-gcide
                     (scripts/fetch-corpus gcide; --data default
                     build/data/gcide).
  copy-clustered     section 2: the masked copy task at lengths 64-512 for
                     clustered and improved-clustered attention with 15-90
                     clusters, and full, causal-linear, agglomerative and
                     local sparse attention; one replica (seed 1).
  copy-long          section 2 again at L = 512 with 4x the steps: full and
                     improved-clustered attention with 15 and 90 clusters,
                     validation every 1000 steps; 2 replicas.
  approx-trained     section 3: a bidirectional character model (masked-char)
                     trained with full attention on KJV, evaluated with
                     clustered and improved-clustered attention swapped in
                     (10-100 clusters), and their distance to full attention
                     on the model's own queries and keys per layer; a local
                     window and linear attention as controls; the same swaps
                     into copy-clustered's full-attention models (--copy-runs).
                     `--configurations full`: the character model alone (the
                     copy models keep their numbers from the previous
                     results).
  lookup             section 4's lookup table: `attnkit bench-lookup` at
                     n = 100 to 100,000 states, k = 100, 1-1024 lookups; one
                     command at a time on one thread (an idle machine).
  speed              section 5: figure-clustered and figure-agglomerative
                     re-run, and a model's training step (time and memory
                     per token) for every mechanism at contexts 512-16384;
                     one command at a time on one thread (an idle machine).
  sac-copy-entropy   section 6's entropy bonus: SAC with edge credit and
                     `entropy=0.01` on the masked copy task at L = 64, with
                     sac-copy's model and budget; 2 replicas.
  sac-controls       section 7 again with what sac-lm lacked: every
                     mechanism with the convolution alone and with a learned
                     position table (full also with relative positions), no
                     attention and random edges as controls, SAC at alphas 2
                     and 4 with both rewards, decoded by beam search and by
                     sampling; section 3's swaps into the trained full
                     models; 3 replicas (SAC's variants: 1).
  node-classify      section 8: node classification on the Debian package
                     graph (scripts/package-graph, written to --data, default
                     build/data/package-graph, when missing): attention over
                     the input edges (GAT), full, input plus random edges, and
                     SAC from the input graph; 3 replicas (seeds 1-3). Each run
                     is `attnkit-experiments node-classify`, which writes its own
                     result.json; re-running skips finished runs and resumes
                     interrupted ones from their checkpoints.
  cloze-long         section 4 again in the paper's regime: 320-word
                     paragraphs read into k = 64 (n / k = 5), read-outs
                     none, linear, gated, gated with its gate opened at the
                     start (--gate-bias 4), softmax; 3 replicas. Each run is
                     `attnkit-experiments cloze` with its own result.json.
  node-controls      section 8 again with its controls: the features alone
                     (each node attends to itself), the input graph plus one
                     same-class edge per node (an oracle), plus random edges,
                     and SAC warm-started from the trained GAT; 3 replicas.
  zoo-translate      the classic zoo: a recurrent encoder-decoder with each
                     score function (additive, general, dot, scaled dot,
                     location) and without attention, translating German
                     dictionary entries into English character by character
                     (scripts/fetch-corpus freedict-deu-eng; --data default
                     build/data/freedict-deu-eng); 3 replicas. Each run is
                     `attnkit-experiments translate` with its own result.json,
                     as node-classify's.
  extrapolation      section 11: positions that extrapolate. A decoder
                     character model with causal full attention trained at
                     context 256 with sinusoidal, ALiBi, rotary or no
                     positions, its test bpc at contexts 256, 1024 and 4096
                     (`attnkit eval --context`; a sinusoidal model past its
                     2048-row table through a copy with a longer table,
                     longer_table.py); 3 replicas, on KJV.
  modern-block       section 12: the decoder block of today (`--block llama
                     --kv-heads 2`: RMSNorm, SwiGLU, no biases, rotary,
                     grouped-query heads) against the classic block, with
                     sinusoidal and with rotary positions, at equal
                     parameters; section 11's model and budget, 3 replicas,
                     on KJV.

Every run lives in OUT/CONFIG/seed-S (default OUT: build/runs/NAME, outside
git). A run whose directory holds a checkpoint continues it (`attnkit train
--resume` with the same flags: a run made with other flags is refused, not
continued); a run with its test result (test.json) at the full budget is
skipped. So re-running the command continues where it stopped (Ctrl-C makes
the trainers checkpoint and exit). Runs go N at a time (--jobs, default 2),
each on one thread, replica 1 of every configuration first.
A finished run leaves a record in experiments/records/NAME (--records): its
measurements, its metric logs and its last checkpoint's header, committed
with the results, so that a new checkout or machine neither loses it nor runs
it again: a run directory that is missing or empty is first filled from its
record (checkpoints and text logs are not kept, so a recorded run cannot be
continued to a larger budget).
--configurations A,B runs only those configurations (say, the controls
first when the budget is short); the results collect every finished run.

At the end the results are collected into RESULTS/NAME.json and a plot
RESULTS/NAME.png (default RESULTS: docs/experiments); the plot needs
matplotlib (Debian: python3-matplotlib) and is skipped with a message without it.

--smoke runs every configuration for a few steps of a tiny model on
tests/data/genesis-1-2.txt (prepared with `attnkit data char-lm`; zoo-translate:
the German number words of experiments/tests/data/numbers-deu-eng) in a
temporary directory, runs the script a second time over it (every run must
then be skipped and the results must not change), and checks the results; it
writes nothing into the repository.

--data: the corpus directory `scripts/fetch-corpus CORPUS --out DIR` wrote
(default build/data/CORPUS, fetch-corpus's default; CORPUS is kjv but for
agglomerative-controls-gcide and zoo-translate).
"""

import argparse
import os
import shlex
import sys

# Run from the source tree: the modules beside this file are imported from
# it and leave no __pycache__ there. (Python caches this file itself before it
# runs, unless PYTHONDONTWRITEBYTECODE is set or -B given; .gitignore has it.)
sys.dont_write_bytecode = True

import driver  # noqa: E402
import paths  # noqa: E402
from sections import SECTIONS  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", choices=sorted(SECTIONS))
    parser.add_argument("--list", action="store_true",
                        help="name every experiment with its section of docs/EXPERIMENTS.md and its title")
    parser.add_argument("--smoke", action="store_true", help="a few steps on tiny data in a temporary directory")
    parser.add_argument("--out", help="run directories (default build/runs/NAME)")
    parser.add_argument("--data", help="corpus directory (default build/data/kjv, or build/data/gcide)")
    parser.add_argument("--results", help="where NAME.json and NAME.png go (default docs/experiments)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (2)")
    parser.add_argument("--replicas", default=None, help="seeds, comma-separated (default: the experiment's)")
    parser.add_argument("--attnkit", help="the attnkit binary (default $ATTNKIT_BUILD_DIR/attnkit or build/attnkit); "
                        "attnkit-experiments is taken from the same directory")
    parser.add_argument("--configurations", help="run only these configurations (comma-separated names); the "
                        "results still collect every finished run")
    parser.add_argument("--records", help="the finished runs' records, restored into missing run directories and "
                        "written for every finished run (default experiments/records/NAME)")
    parser.add_argument("--collect-only", action="store_true",
                        help="run nothing: collect the finished runs into RESULTS/NAME.json and the plot")
    parser.add_argument("--copy-runs", help="approx-trained: copy-clustered's run directories, whose full-attention "
                                            "models it also swaps into (default build/runs/copy-clustered)")
    args = parser.parse_args()
    if args.list:
        for name, section in sorted(SECTIONS.items(), key=lambda item: (item[1].DOC_SECTION, item[0])):
            print(f"{name:30s} section {section.DOC_SECTION:2d}: {section.EXPERIMENT['title']}")
        return 0
    if args.name is None:
        parser.error("NAME is required (--list names them)")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    section = SECTIONS[args.name]
    exp = section.EXPERIMENT
    attnkit = args.attnkit or os.path.join(os.environ.get("ATTNKIT_BUILD_DIR", os.path.join(paths.ROOT, "build")),
                                           "attnkit")
    for binary in (attnkit, os.path.join(os.path.dirname(attnkit), "attnkit-experiments")):
        if not os.access(binary, os.X_OK):
            sys.exit(f"reproduce: no {os.path.basename(binary)} binary at {binary} "
                     "(build both with scripts/build, or pass --attnkit)")
    seeds = [int(s) for s in args.replicas.split(",")] if args.replicas else exp.get("seeds", [])
    command = "python3 experiments/reproduce " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    exp["copy_runs"] = paths.directory(args.copy_runs, "build", "runs", "copy-clustered")
    # approx-trained: the copy models whose runs are not finished here keep their numbers from here.
    exp["previous_results"] = None if args.smoke else os.path.join(paths.results_directory(args), f"{args.name}.json")
    if hasattr(section, "run_job"):  # runs that write their own result.json
        return driver.own_result_main(section, args, attnkit, seeds, command)
    if hasattr(section, "commands"):  # measurements, one at a time
        return driver.measurements_main(section, args, attnkit, command)
    if args.smoke:
        return driver.smoke(section, args, attnkit, seeds, command)
    return driver.run(section, args, attnkit, seeds, command)


if __name__ == "__main__":
    sys.exit(main())
