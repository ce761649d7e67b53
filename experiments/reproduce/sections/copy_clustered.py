"""copy-clustered: section 2 of docs/EXPERIMENTS.md, the masked copy task.
Its jobs, collection and table serve sac-copy too, and its full-attention
models approx-trained."""

import os
import shlex
import statistics

import checkpoints
import plots
import runner
import stats

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 2

CORPUS = False

# Section 2 of docs/EXPERIMENTS.md. The paper (clustered attention, appendix
# C.2, Figure 5): the masked copy task at sequence lengths 64-512; full and
# improved-clustered attention solve it everywhere, clustered attention needs
# more clusters as the sequence grows.
EXPERIMENT = {
    "title": "Clustered attention, the masked copy task",
    "paper": {
        "source": "clustered-attention paper, appendix C.2 and Figure 5",
        "claim": "full and improved-clustered attention reach perfect accuracy for every length and "
                 "cluster count; clustered attention needs more clusters as the length grows",
    },
    "lengths": [64, 128, 256, 512],
    "clusters": [15, 30, 60, 90],
    # name -> spec; the clustered ones get :clusters=C appended.
    "baselines": [("full", "full"), ("causal-linear", "causal-linear"), ("agglomerative", "agglomerative"),
                  ("sparse-local", "sparse-local:span=32")],
    "clustered": [("clustered", "clustered"), ("improved-clustered", "improved-clustered")],
    # A smaller model than the paper's (4 layers, 6 heads of 32): 2 blocks of
    # width 64, 4 heads; no dropout (the data are unlimited).
    "model": ["--layers", "2", "--width", "64", "--heads", "4", "--ffn", "256", "--dropout", "0"],
    # The same budget everywhere: 3000 steps of about 4096 input tokens
    # (batch = 4096 / (2 L + 2), rounded: 32, 16, 8, 4 sequences).
    "tokens_per_step": 4096,
    "trainer": ["--steps", "3000", "--lr", "2e-3", "--min-lr", "1e-4", "--warmup", "100", "--log-every", "50",
                "--eval-every", "500", "--eval-batches", "0", "--checkpoint-every", "500"],
    "smoke_lengths": [8, 16],
    "smoke_clusters": [2, 4],
    "smoke_model": ["--layers", "1", "--width", "16", "--heads", "2", "--ffn", "32", "--dropout", "0"],
    "smoke_tokens_per_step": 64,
    "smoke_trainer": ["--steps", "6", "--lr", "2e-3", "--min-lr", "1e-4", "--warmup", "2", "--log-every", "2",
                      "--eval-every", "3", "--eval-batches", "0", "--checkpoint-every", "3"],
    "seeds": [1],
}


def configurations(exp, smoke):
    """(name, spec, clusters or None) in the order they run: baselines, then the clustered ones."""
    configs = [(name, spec, None) for name, spec in exp["baselines"]]
    for name, spec in exp["clustered"]:
        for C in exp["smoke_clusters" if smoke else "clusters"]:
            configs.append((f"{name}-{C}", f"{spec}:clusters={C}", C))
    return configs


def jobs(exp, out, data, attnkit, seeds, smoke):
    model = exp["smoke_model" if smoke else "model"]
    trainer = exp["smoke_trainer" if smoke else "trainer"]
    tokens = exp["smoke_tokens_per_step" if smoke else "tokens_per_step"]
    steps = int(runner.flag_value(trainer, "--steps"))
    planned = []
    # Shorter sequences first, so that whole columns of the heat maps finish early;
    # the local sparse pattern last (it was added to the grid after the others).
    order = sorted(configurations(exp, smoke), key=lambda c: c[0] == "sparse-local")
    for seed in seeds:
        for last in (False, True):
            for length in exp["smoke_lengths" if smoke else "lengths"]:
                batch = max(1, round(tokens / (2 * length + 2)))
                for name, spec, clusters in order:
                    if (name == "sparse-local") != last:
                        continue
                    spec = spec.replace("{n}", str(2 * length + 2))  # the sequence length, where a spec needs it
                    run_dir = os.path.join(out, f"length-{length}", name, f"seed-{seed}")
                    flags = ["--task", "copy", "--copy-length", str(length), "--attention", spec, *model, *trainer,
                             "--batch", str(batch)]
                    planned.append(runner.replica(attnkit, run_dir, flags, seed, steps, config=name, length=length,
                                                  clusters=clusters, batch=batch, spec=spec,
                                                  label=f"length {length} {name} seed {seed}"))
    return planned


def collect(exp, jobs, data, command):
    cells = []
    for job in jobs:
        results = runner.finished(job)
        if results is None:
            continue
        result = results[0]
        metrics = checkpoints.read_jsonl(os.path.join(job["dir"], "metrics.jsonl"))
        speeds = [r["tokens_per_s"] for r in metrics if "tokens_per_s" in r]
        cells.append({
            "length": job["length"], "config": job["config"], "attention": job["spec"],
            "clusters": job["clusters"], "seed": job["seed"], "batch": job["batch"],
            "test_accuracy": result["accuracy"], "test_loss": result["loss"], "test_scored": result["scored"],
            "steps": metrics[-1]["step"] if metrics else None,
            "train_seconds": metrics[-1]["elapsed"] if metrics else None,
            "tokens_per_s_median": statistics.median(speeds) if speeds else None,
            "parameters": checkpoints.latest_header(job["dir"])["parameters"],
            "structure": result.get("structure"),  # SAC models: edges per node, partner hits
            "sessions": checkpoints.read_jsonl(os.path.join(job["dir"], "sessions.jsonl")),
            "curve": stats.curve(metrics, ("step", "accuracy", "valid_accuracy", "loss", "elapsed")),
        })
    return {
        "experiment": exp["title"],
        "command": command,
        "paper": exp["paper"],
        "lengths": sorted({j["length"] for j in jobs}),
        "clusters": sorted({j["clusters"] for j in jobs if j["clusters"] is not None}),
        "configurations": [j["config"] for j in jobs if j["length"] == jobs[0]["length"]
                           and j["seed"] == jobs[0]["seed"]],
        "budget": {"steps": jobs[0]["steps"], "tokens_per_step": {j["length"]: j["batch"] * (2 * j["length"] + 2)
                                                                  for j in jobs},
                   "seeds": sorted({j["seed"] for j in jobs})},
        "train_command_first": shlex.join(jobs[0]["train"]),
        "runs_planned": len(jobs),
        "runs_finished": len(cells),
        "wall_seconds": stats.wall_seconds([x for c in cells for x in c["sessions"]]),
        "cells": cells,
    }


def values(results, key=lambda c: c["test_accuracy"]):
    """(name, length) -> the values of the finished runs, in seed order."""
    found = {}
    for c in sorted(results["cells"], key=lambda c: c["seed"]):
        v = key(c)
        if v is not None:
            found.setdefault((c["config"], c["length"]), []).append(v)
    return found


def grid(results, names):
    """Mean accuracy over seeds per (name, length) as a list of rows; None where no run finished."""
    accuracy = values(results)
    return [[statistics.mean(accuracy[(n, L)]) if (n, L) in accuracy else None for L in results["lengths"]]
            for n in names]


def plot(results, png):
    plt = plots.pyplot()
    if plt is None:
        return False
    names = results["configurations"]
    panels = [("clustered", [n for n in names if n.startswith("clustered-")]),
              ("improved-clustered", [n for n in names if n.startswith("improved-clustered-")]),
              ("other mechanisms", [n for n in names if not n.split("-")[-1].isdigit()])]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=80)
    fig.subplots_adjust(wspace=0.5)  # room for the third panel's mechanism names
    for ax, (title, rows) in zip(axes, panels):
        cells = grid(results, rows)
        shown = [[float("nan") if v is None else v for v in row] for row in cells]
        image = ax.imshow(shown, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for i, row in enumerate(cells):
            for j, v in enumerate(row):
                ax.text(j, i, "-" if v is None else f"{100 * v:.0f}", ha="center", va="center",
                        color="0.5" if v is None else "white" if v < 0.6 else "black", fontsize=8)
        ax.set_xticks(range(len(results["lengths"])), [str(L) for L in results["lengths"]])
        labels = [r.split("-")[-1] if r.split("-")[-1].isdigit() else r for r in rows]
        ax.set_yticks(range(len(rows)), labels)
        ax.set_xlabel("symbols per half (sequence 2 L + 2)")
        ax.set_ylabel("clusters" if title != "other mechanisms" else "")
        ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=axes, fraction=0.02, label="test accuracy on masked tokens")
    fig.suptitle(f"Masked copy task, {results['budget']['steps']} steps of ~4096 tokens, seed "
                 f"{results['budget']['seeds']}: test accuracy (%)", fontsize=10)
    return plots.save(plt, fig, png, tight_layout=False, bbox_inches="tight")


def per_length_rows(results, names, found, scale=100, digits=1, suffix=""):
    """A row per name: its label (name + SUFFIX), then per length the values found
    for (name, length) (values()), one per seed, as stats.per_seed(SCALE, DIGITS)."""
    for name in names:
        print(f"| {name}{suffix} | " + " | ".join(stats.per_seed(found.get((name, L)), scale, digits)
                                                  for L in results["lengths"]) + " |")


def accuracy_table(results):
    """Test accuracy (%) per mechanism and length, one value per seed."""
    print("| mechanism | " + " | ".join(f"L = {L}" for L in results["lengths"]) + " |")
    print("|---|" + "---:|" * len(results["lengths"]))
    per_length_rows(results, results["configurations"], values(results))


def seconds_table(results):
    """Training seconds per mechanism and length, one value per seed."""
    print("| mechanism | " + " | ".join(f"s at L = {L}" for L in results["lengths"]) + " |")
    print("|---|" + "---:|" * len(results["lengths"]))
    per_length_rows(results, results["configurations"], values(results, lambda c: c["train_seconds"]), 1, 0)


def table(results):
    """The accuracy table of docs/EXPERIMENTS.md, section 2, then the training seconds."""
    accuracy_table(results)
    print()
    seconds_table(results)


def smoke_check(first):
    problems = []
    for c in first["cells"]:
        if not 0 <= c["test_accuracy"] <= 1:
            problems.append(f"{c['config']} at {c['length']}: accuracy {c['test_accuracy']} outside [0, 1]")
    if first["runs_finished"] != first["runs_planned"]:
        problems.append(f"{first['runs_finished']} of {first['runs_planned']} runs finished")
    return problems
