"""agglomerative-lm: section 1 of docs/EXPERIMENTS.md, full vs agglomerative
attention x sinusoidal vs convolutional positions, a universal-transformer
character model on the KJV corpus. Its jobs, collection and plot serve every
character-model section (sac-lm too)."""

import math
import os
import shlex
import statistics

import checkpoints
import plots
import runner
import stats

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 1

CORPUS = True

# Section 1 of docs/EXPERIMENTS.md. The paper (agglomerative attention, Table 1,
# Figure 2): a universal-transformer decoder, one block's weights applied 5
# times, width 64, context 128, character-level text8.
EXPERIMENT = {
    "title": "Agglomerative attention, character language model",
    "paper": {
        "source": "agglomerative-attention paper, Table 1 and Figure 2 (text8, 5 replicas)",
        "test_bpc": {"full-sinusoidal": [2.271, 0.0048], "full-conv": [2.177, 0.0040],
                     "agglomerative-sinusoidal": [2.52, 0.013], "agglomerative-conv": [2.183, 0.0035]},
        "parameters": {"full-sinusoidal": 64200, "full-conv": 88500,
                       "agglomerative-sinusoidal": 57000, "agglomerative-conv": 81400},
        "epoch_seconds": {"full-sinusoidal": 75, "full-conv": 81,
                          "agglomerative-sinusoidal": 54, "agglomerative-conv": 57},
    },
    # name -> (attention, position flags)
    "configurations": [
        ("full-sinusoidal", "full", ["--positions", "sinusoidal"]),
        ("full-conv", "full", ["--positions", "conv", "--conv-width", "8"]),
        ("agglomerative-sinusoidal", "agglomerative:classes=8", ["--positions", "sinusoidal"]),
        ("agglomerative-conv", "agglomerative:classes=8", ["--positions", "conv", "--conv-width", "8"]),
    ],
    # The same budget for every configuration: 1200 steps of 32 x 128
    # characters (4.9 M characters, 1.36 passes over KJV's train split);
    # docs/EXPERIMENTS.md gives the wall time per run.
    "model": ["--shared-weights", "--layers", "5", "--width", "64", "--heads", "8", "--ffn", "256",
              "--dropout", "0.1"],
    "trainer": ["--context", "128", "--batch", "32", "--steps", "1200", "--lr", "2e-3", "--min-lr", "1e-4",
                "--warmup", "100", "--log-every", "25", "--eval-every", "200", "--eval-batches", "8",
                "--checkpoint-every", "200"],
    # The smoke version: the same flags at a tiny size, a few steps.
    "smoke_model": ["--shared-weights", "--layers", "2", "--width", "16", "--heads", "8", "--ffn", "32",
                    "--dropout", "0.1"],
    "smoke_trainer": ["--context", "32", "--batch", "4", "--steps", "6", "--lr", "2e-3", "--min-lr", "1e-4",
                      "--warmup", "2", "--log-every", "2", "--eval-every", "3", "--eval-batches", "2",
                      "--checkpoint-every", "3"],
    "seeds": [1, 2, 3],
}


def jobs(exp, out, data, attnkit, seeds, smoke):
    """One job per seed and configuration, replica 1 of every configuration first."""
    model = exp["smoke_model" if smoke else "model"]
    trainer = exp["smoke_trainer" if smoke else "trainer"]
    steps = int(runner.flag_value(trainer, "--steps"))
    planned = []
    for seed in seeds:
        for name, attention, positions in exp["configurations"]:
            run_dir = os.path.join(out, name, f"seed-{seed}")
            flags = ["--task", exp.get("task", "char-lm"), "--data", data, "--attention", attention, *positions,
                     *model, *trainer]
            planned.append(runner.replica(attnkit, run_dir, flags, seed, steps, config=name,
                                          label=f"{name} seed {seed}"))
    return planned


def collect(exp, jobs, data, command):
    meta = checkpoints.data_meta(data)
    train_chars = meta["splits"]["train"]["characters"]
    configs = []
    for name, attention, positions in exp["configurations"]:
        runs = []
        for job in (j for j in jobs if j["config"] == name):
            results = runner.finished(job)
            if results is None:
                continue
            result = results[0]
            header = checkpoints.latest_header(job["dir"])
            metrics = checkpoints.read_jsonl(os.path.join(job["dir"], "metrics.jsonl"))
            last = metrics[-1]
            trainer = checkpoints.trainer_options(header)
            tokens = last["step"] * trainer["batch"] * trainer["context"]
            sessions = checkpoints.read_jsonl(os.path.join(job["dir"], "sessions.jsonl"))
            runs.append({
                "seed": job["seed"], "dir": job["dir"], "test_bpc": result["bpc"], "test_loss": result["loss"],
                "test_scored": result["scored"], "parameters": header["parameters"], "steps": last["step"],
                "train_seconds": last["elapsed"], "tokens": tokens,
                "epoch_seconds": last["elapsed"] * train_chars / tokens,
                # Less sensitive to a busy machine: the median speed of the logging intervals.
                "epoch_seconds_median_interval": train_chars / statistics.median(
                    r["tokens_per_s"] for r in metrics if "tokens_per_s" in r),
                "sessions": sessions,
                "structure": result.get("structure"),  # edges per node (sparse patterns, SAC)
                "curve": stats.curve(metrics, ("step", "bpc", "valid_bpc", "elapsed")),
            })
        bpc_mean, bpc_se = stats.mean_se([r["test_bpc"] for r in runs])
        epoch_mean, epoch_se = stats.mean_se([r["epoch_seconds"] for r in runs])
        median_mean, median_se = stats.mean_se([r["epoch_seconds_median_interval"] for r in runs])
        configs.append({
            "name": name, "attention": attention, "positions": positions, "n": len(runs),
            "parameters": runs[0]["parameters"] if runs else None,
            "test_bpc_mean": bpc_mean, "test_bpc_se": bpc_se,
            "epoch_seconds_mean": epoch_mean, "epoch_seconds_se": epoch_se,
            "epoch_seconds_median_interval_mean": median_mean, "epoch_seconds_median_interval_se": median_se,
            "paper_test_bpc": exp["paper"].get("test_bpc", {}).get(name),
            "paper_parameters": exp["paper"].get("parameters", {}).get(name),
            "paper_epoch_seconds": exp["paper"].get("epoch_seconds", {}).get(name),
            "runs": runs,
        })
    return {
        "experiment": exp["title"],
        "command": command,
        "paper": exp["paper"]["source"],
        **char_lm_setting(data, meta, jobs, configs),
        "configurations": configs,
    }


def char_lm_setting(data, meta, jobs, configs):
    """What a character-model section's results say of its setting: the
    corpus, the budget of its train commands, seed 1's command and the wall
    time of the configurations' runs."""
    return {
        "corpus": {"dir": os.path.abspath(data), "format": meta.get("format"),
                   "sources": [os.path.basename(s["path"]) for s in meta.get("sources", [])],
                   "splits": {k: v["characters"] for k, v in meta["splits"].items()}},
        "budget": {"steps": int(runner.flag_value(jobs[0]["train"], "--steps")),
                   "batch": int(runner.flag_value(jobs[0]["train"], "--batch")),
                   "context": int(runner.flag_value(jobs[0]["train"], "--context")),
                   "seeds": sorted({j["seed"] for j in jobs})},
        "train_command_seed_1": shlex.join(jobs[0]["train"]),
        "wall_seconds": stats.wall_seconds([s for c in configs for r in c["runs"] for s in r["sessions"]]),
    }


def plot(results, png):
    plt = plots.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    colors = {"full-sinusoidal": "#d62728", "full-conv": "#ff7f0e",
              "agglomerative-sinusoidal": "#1f77b4", "agglomerative-conv": "#2ca02c"}
    lows = []
    for c in results["configurations"]:
        if not c["runs"]:
            continue
        label = f"{c['name']} (n={c['n']})"
        steps, bpc = stats.mean_curve(c["runs"], "bpc")
        ax.plot(steps, bpc, "-", color=colors.get(c["name"]), lw=1.2, label=f"{label} train")
        vsteps, vbpc = stats.mean_curve(c["runs"], "valid_bpc")
        ax.plot(vsteps, vbpc, "--o", color=colors.get(c["name"]), lw=1.2, ms=3, label=f"{label} valid")
        lows += bpc + vbpc
    if lows:
        low = min(lows)
        ax.set_ylim(low - 0.1, low + 1.6)
    b = results["budget"]
    ax.set_xlabel(f"step (batch {b['batch']} x context {b['context']} characters)")
    ax.set_ylabel("bits per character")
    corpus = ", ".join(results["corpus"]["sources"]) or results["corpus"]["dir"]
    ax.set_title(f"{results['experiment']} on {corpus}: training (solid), validation (dashed)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return plots.save(plt, fig, png, dpi=100)


def table(results):
    """The results as the Markdown table of docs/EXPERIMENTS.md."""
    print("| configuration | parameters | test bpc ± s.e. (n) | paper | s per epoch | at the median speed | paper |")
    print("|---|---:|---|---|---:|---:|---:|")
    for c in results["configurations"]:
        paper = c["paper_test_bpc"]
        paper_bpc = f"{paper[0]} ± {paper[1]}" if paper else ""
        paper_epoch = c["paper_epoch_seconds"] or ""
        if c["n"] == 0:
            print(f"| {c['name']} | | no finished run | {paper_bpc} | | | {paper_epoch} |")
            continue
        se = f" ± {c['test_bpc_se']:.4f}" if c["test_bpc_se"] is not None else ""
        epoch_se = f" ± {c['epoch_seconds_se']:.0f}" if c["epoch_seconds_se"] is not None else ""
        median_se = (f" ± {c['epoch_seconds_median_interval_se']:.0f}"
                     if c["epoch_seconds_median_interval_se"] is not None else "")
        print(f"| {c['name']} | {c['parameters']} | {c['test_bpc_mean']:.3f}{se} ({c['n']}) | {paper_bpc} | "
              f"{c['epoch_seconds_mean']:.0f}{epoch_se} | {c['epoch_seconds_median_interval_mean']:.0f}{median_se} | "
              f"{paper_epoch} |")


def bpc_problem(c):
    """The smoke's check of a character model's configuration: one finished
    run with a finite, positive test bpc; a message, or None."""
    if c["n"] != 1 or not math.isfinite(c["test_bpc_mean"]) or c["test_bpc_mean"] <= 0:
        return (f"{c['name']}: expected one finished run with a finite test bpc, got {c['n']} "
                f"run(s), bpc {c['test_bpc_mean']}")
    return None


def smoke_check(first):
    problems = []
    for c in first["configurations"]:
        problem = bpc_problem(c)
        if problem:
            problems.append(problem)
        if not c["runs"] or c["runs"][0]["epoch_seconds"] <= 0:
            problems.append(f"{c['name']}: no time per epoch")
    params = {c["name"]: c["parameters"] for c in first["configurations"]}
    if not params["full-sinusoidal"] or params["agglomerative-sinusoidal"] == params["full-sinusoidal"]:
        problems.append(f"parameter counts do not tell the mechanisms apart: {params}")
    return problems
