"""sac-lm: section 7 of docs/EXPERIMENTS.md, SAC against fixed sparse
patterns with about as many edges per node, and full attention, as
bidirectional character models; the runs, collection and plot of
agglomerative-lm."""

from sections.agglomerative_lm import bpc_problem, collect, jobs, plot

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 7

CORPUS = True

# Section 7 of docs/EXPERIMENTS.md (the SAC issue, part 4.2; the SAC paper's
# Table 2 analogue): SAC against fixed sparse patterns with about as many edges
# per node, and full attention, as character models. SAC has no causal form, so
# the task is masked-char (bidirectional, bits per masked character) with
# section 3's convolutional front end, at a size one core trains in minutes.
EXPERIMENT = {
    "title": "SAC against fixed sparse patterns, character model",
    "task": "masked-char",
    "paper": {"source": "SAC paper, Table 2 (enwik8 / text8 language models)",
              "claim": "a learned structure does better than fixed patterns with as many edges"},
    "configurations": [
        ("full", "full", ["--positions", "conv", "--conv-width", "8"]),
        ("local", "sparse-local:span=2", ["--positions", "conv", "--conv-width", "8"]),
        ("segments", "sparse-segments:segment=3", ["--positions", "conv", "--conv-width", "8"]),
        ("bp-tree", "sparse-bp-tree", ["--positions", "conv", "--conv-width", "8"]),
        ("sac-edge", "sac:alpha=4,variant=all-connected,max_distance=64,reward=edge",
         ["--positions", "conv", "--conv-width", "8"]),
    ],
    # 1000 steps of 16 x 128 characters (2 M characters) for every configuration.
    "model": ["--layers", "2", "--width", "64", "--heads", "4", "--ffn", "256", "--dropout", "0.1"],
    "trainer": ["--context", "128", "--batch", "16", "--steps", "1000", "--lr", "2e-3", "--min-lr", "1e-4",
                "--warmup", "100", "--log-every", "25", "--eval-every", "250", "--eval-batches", "8",
                "--checkpoint-every", "100"],
    "smoke_model": ["--layers", "1", "--width", "16", "--heads", "2", "--ffn", "32", "--dropout", "0.1"],
    "smoke_trainer": ["--context", "16", "--batch", "4", "--steps", "6", "--lr", "2e-3", "--min-lr", "1e-4",
                      "--warmup", "2", "--log-every", "2", "--eval-every", "3", "--eval-batches", "2",
                      "--checkpoint-every", "3"],
    "seeds": [1],
}


def table(results):
    """The table of docs/EXPERIMENTS.md, section 7. A mechanism without a
    measured structure (full attention) has every position of the context as
    its edges."""
    print("| configuration | edges per node | parameters | test bpc (masked characters) | s per epoch |")
    print("|---|---:|---:|---:|---:|")
    for c in results["configurations"]:
        if c["n"] == 0:
            print(f"| {c['name']} | | | no finished run | |")
            continue
        structure = c["runs"][0].get("structure") or {}
        edges = (f"{structure['edges_per_node']:.2f}" if "edges_per_node" in structure
                 else str(results["budget"]["context"]))
        print(f"| {c['name']} | {edges} | {c['parameters']} | {c['test_bpc_mean']:.3f} | "
              f"{c['epoch_seconds_mean']:.0f} |")


def smoke_check(first):
    problems = []
    for c in first["configurations"]:
        problem = bpc_problem(c)
        if problem:
            problems.append(problem)
        elif c["name"] != "full" and not (c["runs"][0].get("structure") or {}).get("edges_per_node"):
            problems.append(f"{c['name']}: no edges per node in its test.json")
    return problems
