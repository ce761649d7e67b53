"""Re-runs an experiment of docs/EXPERIMENTS.md with the attnkit CLI.

    python3 experiments/reproduce NAME [--smoke] [--out DIR] [--data DIR] [--jobs N]
                                       [--replicas 1,2,3] [--results DIR] [--attnkit PATH]
                                       [--collect-only] [--copy-runs DIR]

NAME:
  agglomerative-lm   section 1: full vs agglomerative attention x sinusoidal
                     vs convolutional positions, a universal-transformer
                     character model on the KJV corpus; 3 replicas (seeds 1-3).
  copy-clustered     section 2: the masked copy task at lengths 64-512 for
                     clustered and improved-clustered attention with 15-90
                     clusters, and full, causal-linear, agglomerative and
                     local sparse attention; one replica (seed 1).
  approx-trained     section 3: a bidirectional character model (masked-char)
                     trained with full attention on KJV, evaluated with
                     clustered and improved-clustered attention swapped in
                     (10-100 clusters), and their distance to full attention
                     on the model's own queries and keys per layer.
  speed              section 5: figure-clustered and figure-agglomerative
                     re-run, and a model's training step (time and memory
                     per token) for every mechanism at contexts 512-16384;
                     one command at a time on one thread (an idle machine).
  node-classify      section 8: node classification on the Debian package
                     graph (scripts/package-graph, written to --data, default
                     build/data/package-graph, when missing): attention over
                     the input edges (GAT), full, input plus random edges, and
                     SAC from the input graph; 3 replicas (seeds 1-3). Each run
                     is `attnkit node-classify`, which writes its own
                     result.json; re-running skips finished runs and resumes
                     interrupted ones from their checkpoints.

Every run lives in OUT/CONFIG/seed-S (default OUT: build/runs/NAME, outside
git). A run whose directory holds a checkpoint continues it (`attnkit train
--resume` with the same flags: a run made with other flags is refused, not
continued); a run with its test result (test.json) at the full budget is
skipped. So re-running the command continues where it stopped (Ctrl-C makes
the trainers checkpoint and exit). Runs go N at a time (--jobs, default 2),
each on one thread, replica 1 of every configuration first.

At the end the results are collected into RESULTS/NAME.json and a plot
RESULTS/NAME.png (default RESULTS: docs/experiments); the plot needs
matplotlib (Debian: python3-matplotlib) and is skipped with a message without it.

--smoke runs every configuration for a few steps of a tiny model on
tests/data/genesis-1-2.txt (prepared with `attnkit data char-lm`) in a
temporary directory, runs the script a second time over it (every run must
then be skipped and the results must not change), and checks the results; it
writes nothing into the repository.

--data: the corpus directory `scripts/fetch-corpus kjv --out DIR` wrote
(default build/data/kjv, fetch-corpus's default).
"""

import argparse
import concurrent.futures
import glob
import json
import math
import os
import shlex
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- experiments

# Section 1 of docs/EXPERIMENTS.md. The paper (agglomerative attention, Table 1,
# Figure 2): a universal-transformer decoder, one block's weights applied 5
# times, width 64, context 128, character-level text8.
AGGLOMERATIVE_LM = {
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
    # about 5 minutes per run on one thread of the 2-core machine.
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



def flag_value(flags, name):
    return flags[flags.index(name) + 1]


# ---------------------------------------------------------------- run files

def read_jsonl(path):
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"reproduce: skipping a malformed line of {path}: {line[:60]!r}", file=sys.stderr)
    return records


def checkpoints(run_dir):
    return sorted(glob.glob(os.path.join(run_dir, "checkpoint-*.ckpt")))


def checkpoint_header(path):
    """The JSON header of a checkpoint (docs/TRAINING.md, "Checkpoint format")."""
    with open(path, "rb") as f:
        head = f.read(28)
        if len(head) != 28 or head[:8] != b"ATNKCKPT":
            raise RuntimeError(f"{path}: not an attnkit checkpoint")
        header_bytes = struct.unpack("<Q", head[12:20])[0]
        return json.loads(f.read(header_bytes).decode())


def test_result(run_dir):
    path = os.path.join(run_dir, "test.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def loadavg():
    with open("/proc/loadavg") as f:
        return f.read().strip()


# ---------------------------------------------------------------- running

class Runner:
    def __init__(self, attnkit, log_lock, stop):
        self.attnkit = attnkit
        self.lock = log_lock
        self.stop = stop  # set by Ctrl-C: no new run starts

    def say(self, text):
        with self.lock:
            print(time.strftime("%H:%M:%S"), text, flush=True)

    def session(self, run_dir, what, argv, log_name):
        """Runs argv with its output appended to RUN/log_name; records the
        session's wall time and the machine load at its start and end."""
        start, load_start = time.time(), loadavg()
        with open(os.path.join(run_dir, log_name), "a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)
        record = {"what": what, "start": start, "end": time.time(), "loadavg_start": load_start,
                  "loadavg_end": loadavg(), "returncode": rc}
        with open(os.path.join(run_dir, "sessions.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        return rc

    def run(self, job):
        """One replica of one configuration: train (or resume) to the budget,
        then every measurement of the trained run that has no result yet."""
        run_dir, argv, steps, label = job["dir"], job["train"], job["steps"], job["label"]
        evals = job_evals(job)
        if all(result_step(read_json(path)) == steps for _, path in evals):
            result = read_json(evals[0][1])
            self.say(f"{label}: finished (test {result['metric']} {result['value']:.4f}), skipped")
            return True
        if self.stop.is_set():
            return False
        os.makedirs(run_dir, exist_ok=True)
        resumed = bool(checkpoints(run_dir))
        self.say(f"{label}: {'resuming' if resumed else 'starting'} (seed {job['seed']}, budget {steps} steps)")
        rc = self.session(run_dir, "train", argv, "train.log")
        if rc != 0:
            self.say(f"{label}: attnkit train exited {rc}; see {os.path.join(run_dir, 'train.log')}")
            return False
        header = checkpoint_header(checkpoints(run_dir)[-1])
        if header["step"] != steps:  # interrupted (Ctrl-C): the checkpoint is there to resume
            self.say(f"{label}: stopped at step {header['step']} of {steps}; re-run to continue")
            return False
        for eval_argv, path in evals:
            if result_step(read_json(path)) == steps:
                continue
            if self.stop.is_set():
                return False
            rc = self.session(run_dir, "eval", eval_argv, "eval.log")
            if rc != 0:
                self.say(f"{label}: {shlex.join(eval_argv[1:3])} exited {rc}; see {os.path.join(run_dir, 'eval.log')}")
                return False
        result = read_json(evals[0][1])
        self.say(f"{label}: test {result['metric']} {result['value']:.4f}")
        return True


def job_evals(job):
    """The measurements of a trained run: (argv, the JSON it writes), the test metric first."""
    return job.get("evals") or [(job["eval"], os.path.join(job["dir"], "test.json"))]


def read_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def result_step(result):
    """The training step a result was measured at (eval: step; approx: model.step)."""
    if result is None:
        return None
    return result.get("step", result.get("model", {}).get("step"))


def lm_jobs(exp, out, data, attnkit, seeds, smoke):
    model = exp["smoke_model" if smoke else "model"]
    trainer = exp["smoke_trainer" if smoke else "trainer"]
    steps = int(flag_value(trainer, "--steps"))
    jobs = []
    for seed in seeds:  # replica 1 of every configuration first
        for name, attention, positions in exp["configurations"]:
            run_dir = os.path.join(out, name, f"seed-{seed}")
            train = [attnkit, "train", "--task", exp.get("task", "char-lm"), "--data", data, "--attention", attention,
                     *positions,
                     *model, *trainer, "--seed", str(seed), "--threads", "1", "--display", "plain",
                     "--out", run_dir, "--resume"]
            evaluate = [attnkit, "eval", "--run", run_dir, "--split", "test", "--threads", "1",
                        "--json", os.path.join(run_dir, "test.json")]
            jobs.append({"dir": run_dir, "train": train, "eval": evaluate, "steps": steps, "seed": seed,
                         "config": name, "label": f"{name} seed {seed}"})
    return jobs


def run_all(jobs, attnkit, n_jobs):
    """Runs the jobs n_jobs at a time. Ctrl-C reaches the trainers too (one
    process group): they checkpoint and exit, and no further run starts."""
    stop = threading.Event()

    def on_sigint(signum, frame):
        if not stop.is_set():
            print("reproduce: stopping; the trainers checkpoint, re-run to continue", flush=True)
        stop.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        runner = Runner(attnkit, threading.Lock(), stop)
        with concurrent.futures.ThreadPoolExecutor(max_workers=n_jobs) as pool:
            ok = all(list(pool.map(runner.run, jobs)))
    finally:
        signal.signal(signal.SIGINT, previous)
    if stop.is_set():
        sys.exit("reproduce: stopped by Ctrl-C; the same command continues")
    return ok


# ---------------------------------------------------------------- collecting

def mean_se(values):
    n = len(values)
    if n == 0:
        return None, None
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def lm_collect(exp, jobs, data, command):
    with open(os.path.join(data, "meta.json")) as f:
        meta = json.load(f)
    train_chars = meta["splits"]["train"]["characters"]
    configs = []
    for name, attention, positions in exp["configurations"]:
        runs = []
        for job in (j for j in jobs if j["config"] == name):
            result = test_result(job["dir"])
            if result is None or result.get("step") != job["steps"]:
                continue
            header = checkpoint_header(checkpoints(job["dir"])[-1])
            metrics = read_jsonl(os.path.join(job["dir"], "metrics.jsonl"))
            last = metrics[-1]
            trainer = header["trainer"]
            if isinstance(trainer, str):
                trainer = json.loads(trainer)
            tokens = last["step"] * trainer["batch"] * trainer["context"]
            sessions = read_jsonl(os.path.join(job["dir"], "sessions.jsonl"))
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
                "curve": [{k: r[k] for k in ("step", "bpc", "valid_bpc", "elapsed") if k in r} for r in metrics],
            })
        bpc_mean, bpc_se = mean_se([r["test_bpc"] for r in runs])
        epoch_mean, epoch_se = mean_se([r["epoch_seconds"] for r in runs])
        median_mean, median_se = mean_se([r["epoch_seconds_median_interval"] for r in runs])
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
    all_sessions = [s for c in configs for r in c["runs"] for s in r["sessions"]]
    return {
        "experiment": exp["title"],
        "command": command,
        "paper": exp["paper"]["source"],
        "corpus": {"dir": os.path.abspath(data), "format": meta.get("format"),
                   "sources": [os.path.basename(s["path"]) for s in meta.get("sources", [])],
                   "splits": {k: v["characters"] for k, v in meta["splits"].items()}},
        "budget": {"steps": int(flag_value(jobs[0]["train"], "--steps")),
                   "batch": int(flag_value(jobs[0]["train"], "--batch")),
                   "context": int(flag_value(jobs[0]["train"], "--context")),
                   "seeds": sorted({j["seed"] for j in jobs})},
        "train_command_seed_1": shlex.join(jobs[0]["train"]),
        "wall_seconds": (max(s["end"] for s in all_sessions) - min(s["start"] for s in all_sessions))
                        if all_sessions else None,
        "configurations": configs,
    }


def mean_curve(runs, key):
    """The mean of `key` over the replicas at the steps every replica logged it."""
    per_run = [{r["step"]: r[key] for r in run["curve"] if key in r} for run in runs]
    if not per_run:
        return [], []
    steps = sorted(set.intersection(*(set(p) for p in per_run)))
    return steps, [sum(p[s] for p in per_run) / len(per_run) for s in steps]


def lm_plot(results, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("reproduce: matplotlib is missing (Debian: python3-matplotlib); the plot is skipped")
        return False
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    colors = {"full-sinusoidal": "#d62728", "full-conv": "#ff7f0e",
              "agglomerative-sinusoidal": "#1f77b4", "agglomerative-conv": "#2ca02c"}
    lows = []
    for c in results["configurations"]:
        if not c["runs"]:
            continue
        label = f"{c['name']} (n={c['n']})"
        steps, bpc = mean_curve(c["runs"], "bpc")
        ax.plot(steps, bpc, "-", color=colors.get(c["name"]), lw=1.2, label=f"{label} train")
        vsteps, vbpc = mean_curve(c["runs"], "valid_bpc")
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
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True


def lm_table(results):
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


# ---------------------------------------------------------------- section 2

# Section 2 of docs/EXPERIMENTS.md. The paper (clustered attention, appendix
# C.2, Figure 5): the masked copy task at sequence lengths 64-512; full and
# improved-clustered attention solve it everywhere, clustered attention needs
# more clusters as the sequence grows.
COPY_CLUSTERED = {
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


def copy_configurations(exp, smoke):
    """(name, spec, clusters or None) in the order they run: baselines, then the clustered ones."""
    configs = [(name, spec, None) for name, spec in exp["baselines"]]
    for name, spec in exp["clustered"]:
        for C in exp["smoke_clusters" if smoke else "clusters"]:
            configs.append((f"{name}-{C}", f"{spec}:clusters={C}", C))
    return configs


def copy_jobs(exp, out, data, attnkit, seeds, smoke):
    model = exp["smoke_model" if smoke else "model"]
    trainer = exp["smoke_trainer" if smoke else "trainer"]
    tokens = exp["smoke_tokens_per_step" if smoke else "tokens_per_step"]
    steps = int(flag_value(trainer, "--steps"))
    jobs = []
    # Shorter sequences first, so that whole columns of the heat maps finish early;
    # the local sparse pattern last (it was added to the grid after the others).
    order = sorted(copy_configurations(exp, smoke), key=lambda c: c[0] == "sparse-local")
    for seed in seeds:
        for last in (False, True):
            for length in exp["smoke_lengths" if smoke else "lengths"]:
                batch = max(1, round(tokens / (2 * length + 2)))
                for name, spec, clusters in order:
                    if (name == "sparse-local") != last:
                        continue
                    spec = spec.replace("{n}", str(2 * length + 2))  # the sequence length, where a spec needs it
                    run_dir = os.path.join(out, f"length-{length}", name, f"seed-{seed}")
                    train = [attnkit, "train", "--task", "copy", "--length", str(length), "--attention", spec,
                             *model, *trainer, "--batch", str(batch), "--seed", str(seed), "--threads", "1",
                             "--display", "plain", "--out", run_dir, "--resume"]
                    evaluate = [attnkit, "eval", "--run", run_dir, "--split", "test", "--threads", "1",
                                "--json", os.path.join(run_dir, "test.json")]
                    jobs.append({"dir": run_dir, "train": train, "eval": evaluate, "steps": steps, "seed": seed,
                                 "config": name, "length": length, "clusters": clusters, "batch": batch,
                                 "spec": spec, "label": f"length {length} {name} seed {seed}"})
    return jobs


def copy_collect(exp, jobs, data, command):
    cells = []
    for job in jobs:
        result = test_result(job["dir"])
        if result is None or result.get("step") != job["steps"]:
            continue
        metrics = read_jsonl(os.path.join(job["dir"], "metrics.jsonl"))
        speeds = [r["tokens_per_s"] for r in metrics if "tokens_per_s" in r]
        cells.append({
            "length": job["length"], "config": job["config"], "attention": job["spec"],
            "clusters": job["clusters"], "seed": job["seed"], "batch": job["batch"],
            "test_accuracy": result["accuracy"], "test_loss": result["loss"], "test_scored": result["scored"],
            "steps": metrics[-1]["step"] if metrics else None,
            "train_seconds": metrics[-1]["elapsed"] if metrics else None,
            "tokens_per_s_median": statistics.median(speeds) if speeds else None,
            "parameters": checkpoint_header(checkpoints(job["dir"])[-1])["parameters"],
            "structure": result.get("structure"),  # SAC models: edges per node, partner hits
            "sessions": read_jsonl(os.path.join(job["dir"], "sessions.jsonl")),
            "curve": [{k: r[k] for k in ("step", "accuracy", "valid_accuracy", "loss", "elapsed") if k in r}
                      for r in metrics],
        })
    sessions = [x for c in cells for x in c["sessions"]]
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
        "wall_seconds": (max(x["end"] for x in sessions) - min(x["start"] for x in sessions)) if sessions else None,
        "cells": cells,
    }


def copy_values(results, key=lambda c: c["test_accuracy"]):
    """(name, length) -> the values of the finished runs, in seed order."""
    values = {}
    for c in sorted(results["cells"], key=lambda c: c["seed"]):
        v = key(c)
        if v is not None:
            values.setdefault((c["config"], c["length"]), []).append(v)
    return values


def copy_grid(results, names):
    """Mean accuracy over seeds per (name, length) as a list of rows; None where no run finished."""
    values = copy_values(results)
    return [[statistics.mean(values[(n, L)]) if (n, L) in values else None for L in results["lengths"]]
            for n in names]


def per_seed(values, scale=100, digits=1):
    """'a / b / c' for several seeds, 'a' for one, '' for none."""
    return " / ".join(f"{scale * v:.{digits}f}" for v in values or [])


def copy_plot(results, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("reproduce: matplotlib is missing (Debian: python3-matplotlib); the plot is skipped")
        return False
    names = results["configurations"]
    panels = [("clustered", [n for n in names if n.startswith("clustered-")]),
              ("improved-clustered", [n for n in names if n.startswith("improved-clustered-")]),
              ("other mechanisms", [n for n in names if not n.split("-")[-1].isdigit()])]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=80)
    fig.subplots_adjust(wspace=0.5)  # room for the third panel's mechanism names
    for ax, (title, rows) in zip(axes, panels):
        grid = copy_grid(results, rows)
        values = [[float("nan") if v is None else v for v in row] for row in grid]
        image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for i, row in enumerate(grid):
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
    fig.savefig(png, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return True


def copy_table(results):
    lengths = results["lengths"]
    print("| mechanism | " + " | ".join(f"L = {L}" for L in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    names = results["configurations"]
    values = copy_values(results)  # one value per seed, in seed order
    for name in names:
        print(f"| {name} | " + " | ".join(per_seed(values.get((name, L))) for L in lengths) + " |")
    print()
    print("| mechanism | " + " | ".join(f"s at L = {L}" for L in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    seconds = copy_values(results, lambda c: c["train_seconds"])
    for name in names:
        print(f"| {name} | " + " | ".join(per_seed(seconds.get((name, L)), 1, 0) for L in lengths) + " |")


def copy_smoke_check(first):
    problems = []
    for c in first["cells"]:
        if not 0 <= c["test_accuracy"] <= 1:
            problems.append(f"{c['config']} at {c['length']}: accuracy {c['test_accuracy']} outside [0, 1]")
    if first["runs_finished"] != first["runs_planned"]:
        problems.append(f"{first['runs_finished']} of {first['runs_planned']} runs finished")
    return problems


# ---------------------------------------------------------------- SAC, section 6

# Section 6 of docs/EXPERIMENTS.md (the SAC issue, part 4.1): does SAC's edge
# predictor learn a structure that is known? On the masked copy task position i
# must see its twin length + 1 away. SAC with one predicted edge per node
# (all-connected, plus the self-edge), trained with the paper's sequence reward
# and with per-edge credit, against a local pattern with more edges per node
# (span 1: 3) and full attention, on the same budget.
SAC_COPY = {
    "title": "SAC on the masked copy task: does the predictor learn the structure?",
    "paper": {
        "source": "SAC paper, sections 4-5 (the learned structure); the SAC issue, part 4.1",
        "claim": "the edge predictor, trained by REINFORCE, finds the edges the task needs",
    },
    "lengths": [16, 32, 64],
    "clusters": [],
    # {n} is the sequence length 2 L + 2: the distance encoding covers every distance.
    "baselines": [("full", "full"), ("sparse-local", "sparse-local:span=1"),
                  ("sac-sequence", "sac:alpha=1,variant=all-connected,max_distance={n},reward=sequence"),
                  ("sac-edge", "sac:alpha=1,variant=all-connected,max_distance={n},reward=edge")],
    "clustered": [],
    "model": ["--layers", "2", "--width", "64", "--heads", "4", "--ffn", "256", "--dropout", "0"],
    # 1500 steps of about 2048 input tokens (batch 60, 31, 16 for L = 16, 32, 64).
    "tokens_per_step": 2048,
    "trainer": ["--steps", "1500", "--lr", "2e-3", "--min-lr", "1e-4", "--warmup", "100", "--log-every", "50",
                "--eval-every", "500", "--eval-batches", "0", "--checkpoint-every", "250"],
    "smoke_lengths": [4, 6],
    "smoke_clusters": [],
    "smoke_model": ["--layers", "1", "--width", "16", "--heads", "2", "--ffn", "32", "--dropout", "0"],
    "smoke_tokens_per_step": 64,
    "smoke_trainer": ["--steps", "6", "--lr", "2e-3", "--min-lr", "1e-4", "--warmup", "2", "--log-every", "2",
                      "--eval-every", "3", "--eval-batches", "0", "--checkpoint-every", "3"],
    "seeds": [1],
}


def sac_copy_table(results):
    copy_table(results)
    lengths = results["lengths"]
    print()
    print("| SAC run | " + " | ".join(f"partner recall at L = {L}" for L in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    recall = copy_values(results, lambda c: (c.get("structure") or {}).get("partner_recall"))
    for name in results["configurations"]:
        if name.startswith("sac"):
            print(f"| {name} | " + " | ".join(per_seed(recall.get((name, L))) for L in lengths) + " |")


def sac_copy_plot(results, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("reproduce: matplotlib is missing (Debian: python3-matplotlib); the plot is skipped")
        return False
    names, lengths = results["configurations"], results["lengths"]
    accuracy = copy_values(results)
    recall = copy_values(results, lambda c: (c.get("structure") or {}).get("partner_recall"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4), dpi=80)
    width = 0.8 / max(1, len(names))
    for k, name in enumerate(names):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(lengths))]
        # Bars: the mean over seeds; dots: each seed.
        for ax, values in ((left, accuracy),) + (((right, recall),) if name.startswith("sac") else ()):
            means = [100 * statistics.mean(values[(name, L)]) if (name, L) in values else 0 for L in lengths]
            ax.bar(xs, means, width, label=name, color=f"C{k}")
            for x, L in zip(xs, lengths):
                seeds = values.get((name, L), [])
                ax.plot([x] * len(seeds), [100 * v for v in seeds], "k.", ms=3)
    for ax in (left, right):
        ax.set_xticks(range(len(lengths)), [f"L = {L}" for L in lengths])
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    left.set_ylabel("test accuracy on masked tokens (%)")
    right.set_ylabel("masked positions seeing their partner (%)")
    left.set_title("accuracy", fontsize=9)
    right.set_title("SAC's decoded structure (beam search): partner recall", fontsize=9)
    fig.suptitle(f"Masked copy task, {results['budget']['steps']} steps of ~2048 tokens, seeds "
                 f"{results['budget']['seeds']} (bars: mean, dots: seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def sac_copy_smoke_check(first):
    problems = copy_smoke_check(first)
    for c in first["cells"]:
        # SAC runs report partner hits; fixed patterns their edges per node only.
        has = "partner_recall" in (c.get("structure") or {})
        if has != c["config"].startswith("sac"):
            problems.append(f"{c['config']} at {c['length']}: partner hits {'present' if has else 'missing'}")
        elif has and not 0 <= c["structure"]["partner_recall"] <= 1:
            problems.append(f"{c['config']} at {c['length']}: partner recall outside [0, 1]")
    return problems


# Section 7 of docs/EXPERIMENTS.md (the SAC issue, part 4.2; the SAC paper's
# Table 2 analogue): SAC against fixed sparse patterns with about as many edges
# per node, and full attention, as character models. SAC has no causal form, so
# the task is masked-char (bidirectional, bits per masked character) with
# section 3's convolutional front end, at a size one core trains in minutes.
SAC_LM = {
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


def sac_lm_table(results):
    print("| configuration | edges per node | parameters | test bpc (masked characters) | s per epoch |")
    print("|---|---:|---:|---:|---:|")
    for c in results["configurations"]:
        if c["n"] == 0:
            print(f"| {c['name']} | | | no finished run | |")
            continue
        structure = c["runs"][0].get("structure") or {}
        edges = f"{structure['edges_per_node']:.2f}" if "edges_per_node" in structure else "all"
        print(f"| {c['name']} | {edges} | {c['parameters']} | {c['test_bpc_mean']:.3f} | "
              f"{c['epoch_seconds_mean']:.0f} |")


def sac_lm_smoke_check(first):
    problems = []
    for c in first["configurations"]:
        if c["n"] != 1 or not math.isfinite(c["test_bpc_mean"]) or c["test_bpc_mean"] <= 0:
            problems.append(f"{c['name']}: expected one finished run with a finite test bpc")
        elif c["name"] != "full" and not (c["runs"][0].get("structure") or {}).get("edges_per_node"):
            problems.append(f"{c['name']}: no edges per node in its test.json")
    return problems


# ---------------------------------------------------------------- section 3

# Section 3 of docs/EXPERIMENTS.md. The paper (clustered attention, the
# pretrained-BERT experiment): a trained model's softmax attention replaced by
# improved-clustered attention (25 clusters) keeps its accuracy without
# retraining. Clustered attention has no causal form, so the model is a
# bidirectional character model (masked-char) rather than char-lm's decoder.
APPROX_TRAINED = {
    "title": "Approximating a trained model",
    "paper": {
        "source": "clustered-attention paper, section 4.3 (RoBERTa on GLUE and SQuAD)",
        "claim": "improved-clustered attention with 25 clusters swapped into a pretrained model "
                 "without retraining keeps its accuracy; clustered attention does not",
    },
    "clusters": [10, 25, 50, 100],
    "topk": 32,
    # Convolutional positions (width 8, as in section 1): with sinusoidal ones
    # a first run (context 512) stayed at the unigram entropy (4.02 bpc) for
    # 750 steps, its attention still uniform over 512 positions. The
    # convolution sees only the 7 characters to the left, so everything to the
    # right of a masked character still comes through attention.
    "model": ["--task", "masked-char", "--attention", "full", "--positions", "conv", "--conv-width", "8",
              "--layers", "4", "--width", "64", "--heads", "4", "--ffn", "256", "--dropout", "0.1"],
    # 2000 steps of 8 x 512 characters (8.2 M characters, 2.3 passes over KJV's train split).
    "trainer": ["--context", "512", "--batch", "8", "--steps", "2000", "--lr", "2e-3", "--min-lr", "1e-4",
                "--warmup", "100", "--log-every", "50", "--eval-every", "500", "--eval-batches", "16",
                "--checkpoint-every", "250"],
    "approx_sequences": 8,
    "smoke_clusters": [2, 4],
    "smoke_topk": 4,
    "smoke_model": ["--task", "masked-char", "--attention", "full", "--layers", "2", "--width", "16", "--heads", "2",
                    "--ffn", "32", "--dropout", "0.1"],
    "smoke_trainer": ["--context", "32", "--batch", "4", "--steps", "6", "--lr", "2e-3", "--min-lr", "1e-4",
                      "--warmup", "2", "--log-every", "2", "--eval-every", "3", "--eval-batches", "2",
                      "--checkpoint-every", "3"],
    "smoke_approx_sequences": 2,
    # The same swaps into section 2's full-attention copy models (trained here
    # with section 2's command if they are missing), where attention must find
    # one exact position: a sharper test than a character model.
    "copy_swaps": ["sparse-local:span=32", "linear"],
    "seeds": [1],
}


def approx_swaps(exp, smoke):
    """(name, spec) of every mechanism swapped into the trained model."""
    topk = exp["smoke_topk" if smoke else "topk"]
    swaps = []
    for C in exp["smoke_clusters" if smoke else "clusters"]:
        swaps.append((f"clustered-{C}", f"clustered:clusters={C}"))
        swaps.append((f"improved-clustered-{C}", f"improved-clustered:clusters={C},topk={topk}"))
    return swaps


def approx_jobs(exp, out, data, attnkit, seeds, smoke):
    model = exp["smoke_model" if smoke else "model"]
    trainer = exp["smoke_trainer" if smoke else "trainer"]
    clusters = exp["smoke_clusters" if smoke else "clusters"]
    steps = int(flag_value(trainer, "--steps"))
    jobs = []
    for seed in seeds:
        run_dir = os.path.join(out, f"full-seed-{seed}")
        train = [attnkit, "train", "--data", data, *model, *trainer, "--seed", str(seed), "--threads", "1",
                 "--display", "plain", "--out", run_dir, "--resume"]
        evaluate = [attnkit, "eval", "--run", run_dir, "--split", "test", "--threads", "1"]
        evals = [(evaluate + ["--json", os.path.join(run_dir, "test.json")], os.path.join(run_dir, "test.json"))]
        for name, spec in approx_swaps(exp, smoke):
            path = os.path.join(run_dir, f"test-{name}.json")
            evals.append((evaluate + ["--attention", spec, "--json", path], path))
        path = os.path.join(run_dir, "approx.json")
        evals.append(([attnkit, "approx", "--run", run_dir, "--split", "test", "--sequences",
                       str(exp["smoke_approx_sequences" if smoke else "approx_sequences"]),
                       "--clusters", ",".join(map(str, clusters)),
                       "--topk", str(exp["smoke_topk" if smoke else "topk"]), "--threads", "1", "--json", path], path))
        jobs.append({"dir": run_dir, "train": train, "evals": evals, "steps": steps, "seed": seed,
                     "config": "full", "label": f"masked-char full seed {seed}"})
    for job in copy_jobs(COPY_CLUSTERED, exp["copy_runs"], None, attnkit, seeds[:1], smoke):
        if job["config"] != "full":
            continue
        evaluate = [attnkit, "eval", "--run", job["dir"], "--split", "test", "--threads", "1"]
        evals = [(evaluate + ["--json", os.path.join(job["dir"], "test.json")], os.path.join(job["dir"], "test.json"))]
        for name, spec in copy_swap_specs(exp, smoke):
            path = os.path.join(job["dir"], f"test-{name}.json")
            evals.append((evaluate + ["--attention", spec, "--json", path], path))
        jobs.append(dict(job, evals=evals, config="copy-full", label=f"copy length {job['length']} full"))
    return jobs


def copy_swap_specs(exp, smoke):
    """(name, spec) swapped into the copy models: section 2's cluster counts, then the controls."""
    clusters = COPY_CLUSTERED["smoke_clusters" if smoke else "clusters"]
    swaps = [(f"{m}-{C}", f"{m}:clusters={C}") for m in ("clustered", "improved-clustered") for C in clusters]
    return swaps + [(spec.split(":")[0], spec) for spec in exp["copy_swaps"]]


def approx_collect(exp, jobs, data, command):
    with open(os.path.join(data, "meta.json")) as f:
        meta = json.load(f)
    runs, copy = [], []
    smoke = jobs[0]["steps"] < 100
    for job in (j for j in jobs if j["config"] == "copy-full"):
        results = [read_json(path) for _, path in job_evals(job)]
        if any(result_step(r) != job["steps"] for r in results):
            continue
        copy.append({"length": job["length"], "dir": job["dir"], "trained_accuracy": results[0]["accuracy"],
                     "swaps": [{"name": name, "attention": spec, "test_accuracy": r["accuracy"],
                                "us_per_position": 1e6 * r["seconds"] / r["positions"]}
                               for (name, spec), r in zip(copy_swap_specs(exp, smoke), results[1:])]})
    for job in (j for j in jobs if j["config"] == "full"):
        results = [read_json(path) for _, path in job_evals(job)]
        if any(result_step(r) != job["steps"] for r in results):
            continue
        trained, swapped, approx = results[0], results[1:-1], results[-1]
        per_spec = {}
        for row in approx["rows"]:
            key = (row["attention"], row["clusters"])
            per_spec.setdefault(key, {})[row["inputs"]] = {"rel_err": row["rel_err"], "row_l1": row["row_l1"]}
        swaps = []
        for (name, spec), r in zip(approx_swaps(exp, smoke), swapped):
            mechanism, clusters = name.rsplit("-", 1)
            distances = per_spec.get((mechanism, int(clusters)), {})
            layers = {k: v for k, v in distances.items() if k.startswith("layer ")}
            swaps.append({"name": name, "attention": spec, "mechanism": mechanism, "clusters": int(clusters),
                          "test_bpc": r["bpc"], "bpc_increase": r["bpc"] - trained["bpc"],
                          "us_per_position": 1e6 * r["seconds"] / r["positions"],
                          "layers": layers,
                          "row_l1_layer_mean": statistics.mean(v["row_l1"] for v in layers.values()) if layers else None,
                          "random": distances.get("random"), "clustered_structure": distances.get("clustered-structure")})
        metrics = read_jsonl(os.path.join(job["dir"], "metrics.jsonl"))
        runs.append({"seed": job["seed"], "dir": job["dir"], "test_bpc": trained["bpc"],
                     "us_per_position": 1e6 * trained["seconds"] / trained["positions"],
                     "parameters": checkpoint_header(checkpoints(job["dir"])[-1])["parameters"],
                     "train_seconds": metrics[-1]["elapsed"] if metrics else None,
                     "approx_shape": approx["config"], "approx_model": approx["model"],
                     "sessions": read_jsonl(os.path.join(job["dir"], "sessions.jsonl")),
                     "curve": [{k: r[k] for k in ("step", "bpc", "valid_bpc", "elapsed") if k in r} for r in metrics],
                     "swaps": swaps})
    return {
        "experiment": exp["title"], "command": command, "paper": exp["paper"],
        "corpus": {"dir": os.path.abspath(data), "sources": [os.path.basename(x["path"]) for x in meta.get("sources", [])],
                   "splits": {k: v["characters"] for k, v in meta["splits"].items()}},
        "train_command": shlex.join(jobs[0]["train"]),
        "steps": jobs[0]["steps"],
        "runs": runs,
        "copy": copy,
    }


def approx_plot(results, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("reproduce: matplotlib is missing (Debian: python3-matplotlib); the plot is skipped")
        return False
    if not results["runs"]:
        return False
    run = results["runs"][0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    colors = {"clustered": "#1f77b4", "improved-clustered": "#2ca02c"}
    for mechanism, color in colors.items():
        swaps = [x for x in run["swaps"] if x["mechanism"] == mechanism]
        C = [x["clusters"] for x in swaps]
        left.plot(C, [x["test_bpc"] for x in swaps], "-o", color=color, label=mechanism)
        right.plot(C, [x["row_l1_layer_mean"] for x in swaps], "-o", color=color, label=f"{mechanism}, model's q, k")
        right.plot(C, [x["random"]["row_l1"] for x in swaps], ":s", color=color, label=f"{mechanism}, random q, k")
    left.axhline(run["test_bpc"], color="#d62728", lw=1, label="full (trained)")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(results_clusters(run), [str(c) for c in results_clusters(run)])
        ax.set_xlabel("clusters")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("test bits per masked character")
    left.set_title("swapped into the trained model, no retraining", fontsize=9)
    right.set_ylabel("mean L1 distance of attention rows (0..2)")
    right.set_title("distance to full attention, mean over layers", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def results_clusters(run):
    return sorted({x["clusters"] for x in run["swaps"]})


def approx_table(results):
    for run in results["runs"]:
        print(f"seed {run['seed']}: full attention (trained) test bpc {run['test_bpc']:.4f}, "
              f"{run['us_per_position']:.1f} us per position")
        layer_names = sorted(run["swaps"][0]["layers"]) if run["swaps"] else []
        print("| swapped in | clusters | test bpc | change | us per position | row L1 " +
              " | ".join(layer_names) + " | row L1 random q, k |")
        print("|---|---:|---:|---:|---:|" + "---:|" * (len(layer_names) + 1))
        for x in run["swaps"]:
            print(f"| {x['mechanism']} | {x['clusters']} | {x['test_bpc']:.4f} | {x['bpc_increase']:+.4f} | "
                  f"{x['us_per_position']:.1f} | " + " | ".join(f"{x['layers'][n]['row_l1']:.3f}" for n in layer_names) +
                  f" | {x['random']['row_l1']:.3f} |")
    approx_copy_table(results)


def approx_copy_table(results):
    if not results["copy"]:
        return
    names = [x["name"] for x in results["copy"][0]["swaps"]]
    print("| swapped into the copy model | " + " | ".join(f"L = {c['length']}" for c in results["copy"]) + " |")
    print("|---|" + "---:|" * len(results["copy"]))
    print("| full (trained) | " + " | ".join(f"{100 * c['trained_accuracy']:.1f}" for c in results["copy"]) + " |")
    for i, name in enumerate(names):
        print(f"| {name} | " + " | ".join(f"{100 * c['swaps'][i]['test_accuracy']:.1f}" for c in results["copy"]) + " |")


def approx_smoke_check(first):
    problems = []
    if len(first["copy"]) != len(COPY_CLUSTERED["smoke_lengths"]):
        problems.append(f"expected a copy model per smoke length, got {len(first['copy'])}")
    if len(first["runs"]) != 1:
        return [f"expected one finished run, got {len(first['runs'])}"]
    run = first["runs"][0]
    for x in run["swaps"]:
        if not math.isfinite(x["test_bpc"]) or x["test_bpc"] <= 0:
            problems.append(f"{x['name']}: test bpc {x['test_bpc']}")
        if len(x["layers"]) != 2 or x["random"] is None:
            problems.append(f"{x['name']}: distances for {sorted(x['layers'])} and random {x['random']}")
    return problems


# ---------------------------------------------------------------- section 5

# Section 5 of docs/EXPERIMENTS.md: speed per element. The kernels' figures
# (clustered-attention paper Figure 4, agglomerative paper Figure 1) re-run,
# and a whole model's training step (time and memory) per token for every
# mechanism at contexts 512-16384. Timings: one thread, one command at a time;
# the machine must be otherwise idle (the load average is recorded).
SPEED = {
    "title": "Speed per element",
    "contexts": [512, 1024, 2048, 4096, 8192, 16384],
    "tokens_per_step": 16384,
    # An encoder, so that every mechanism applies (clustered attention has no causal form).
    "attention": ["full", "linear", "agglomerative", "clustered", "improved-clustered", "sparse-local:span=64"],
    "model": ["--architecture", "encoder", "--layers", "2", "--width", "128", "--heads", "4", "--ffn", "512",
              "--dropout", "0"],
    "figure_clustered": ["--lengths", "1024,2048,4096,8192,16384", "--repeats", "3", "--max-seconds", "60"],
    "figure_agglomerative": ["--lengths", "256,512,1024,2048,4096,8192", "--repeats", "3"],
    "smoke_contexts": [32, 64],
    "smoke_tokens_per_step": 128,
    "smoke_model": ["--architecture", "encoder", "--layers", "1", "--width", "16", "--heads", "2", "--ffn", "32",
                    "--dropout", "0"],
    "smoke_figure_clustered": ["--lengths", "64,128", "--repeats", "1", "--heads", "2", "--dim", "8"],
    "smoke_figure_agglomerative": ["--lengths", "32,64", "--repeats", "1", "--batch", "2", "--d-model", "32",
                                   "--heads", "2"],
}


def speed_commands(exp, out, attnkit, smoke):
    """(name, argv, json path) of every measurement, in the order they run."""
    key = (lambda k: "smoke_" + k) if smoke else (lambda k: k)
    contexts, tokens, model = exp[key("contexts")], exp[key("tokens_per_step")], exp[key("model")]
    attention = ",".join(exp["attention"])
    commands = []
    for context in contexts:
        path = os.path.join(out, f"train-{context}.json")
        commands.append((f"model step, context {context}",
                         [attnkit, "bench-model", "--what", "train", "--attention", attention, *model,
                          "--context", str(context), "--batch", str(max(1, tokens // context)), "--repeats",
                          "1" if smoke else "3", "--no-baseline", "--threads", "1", "--json", path], path))
    path = os.path.join(out, "memory.json")
    commands.append(("model step memory", [attnkit, "bench-model", "--what", "memory", "--attention", attention,
                                           *model, "--memory-contexts", ",".join(map(str, contexts)),
                                           "--memory-batch", "1", "--threads", "1", "--json", path], path))
    path = os.path.join(out, "figure-clustered.json")
    commands.append(("figure-clustered", [attnkit, "figure-clustered", *exp[key("figure_clustered")],
                                          "--threads", "1", "--json", path], path))
    path = os.path.join(out, "figure-agglomerative.json")
    commands.append(("figure-agglomerative", [attnkit, "figure-agglomerative", *exp[key("figure_agglomerative")],
                                              "--threads", "1", "--json", path], path))
    return commands


def speed_run(commands, out):
    """Runs the commands one at a time; one with its JSON already there is skipped."""
    os.makedirs(out, exist_ok=True)
    for name, argv, path in commands:
        if os.path.exists(path):
            print(time.strftime("%H:%M:%S"), f"{name}: done, skipped", flush=True)
            continue
        print(time.strftime("%H:%M:%S"), f"{name}: running (load {loadavg()})", flush=True)
        start, load_start = time.time(), loadavg()
        with open(os.path.join(out, "bench.log"), "a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)
        with open(os.path.join(out, "sessions.jsonl"), "a") as f:
            f.write(json.dumps({"what": name, "start": start, "end": time.time(), "loadavg_start": load_start,
                                "loadavg_end": loadavg(), "returncode": rc}) + "\n")
        if rc != 0:
            print(f"reproduce: {name} exited {rc}; see {os.path.join(out, 'bench.log')}", file=sys.stderr)
            return False
    return True


def speed_collect(exp, commands, out, command):
    rows, memory = [], []
    for name, argv, path in commands:
        doc = read_json(path)
        if doc is None:
            continue
        if name.startswith("model step, context"):
            context = int(flag_value(argv, "--context"))
            batch = int(flag_value(argv, "--batch"))
            for r in doc["train"]["results"]:
                rows.append({"attention": r["attention"], "context": context, "batch": batch, "ms": r["ms"],
                             "us_per_token": 1e3 * r["ms"] / (batch * context), "gflops": r["gflops"],
                             "mfu": r.get("mfu"), "impl": r.get("impl"),
                             "sgemm_gflops": doc["machine"].get("sgemm_gflops")})
        elif name == "model step memory":
            for r in doc["memory"]["results"]:
                memory.append({"attention": r["attention"], "context": r["context"], "step_mib": r["step_mib"],
                               "kib_per_token": 1024 * r["step_mib"] / r["context"],
                               "tensor_peak_mib": r["tensor_peak_mib"]})
    sessions = read_jsonl(os.path.join(out, "sessions.jsonl"))
    return {"experiment": exp["title"], "command": command,
            "commands": {name: shlex.join(argv) for name, argv, _ in commands},
            "model_step": rows, "model_memory": memory,
            "figure_clustered": read_json(os.path.join(out, "figure-clustered.json")),
            "figure_agglomerative": read_json(os.path.join(out, "figure-agglomerative.json")),
            "sessions": sessions}


def speed_plot(results, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("reproduce: matplotlib is missing (Debian: python3-matplotlib); the plot is skipped")
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    memory_shown = False
    for attention in dict.fromkeys(r["attention"] for r in results["model_step"]):
        xs = [r for r in results["model_step"] if r["attention"] == attention]
        left.plot([r["context"] for r in xs], [r["us_per_token"] for r in xs], "-o", ms=3, label=attention)
        # A step under 1 MiB is below the noise of the idle process's memory (a short context at batch 1).
        ms = [r for r in results["model_memory"] if r["attention"] == attention and r["step_mib"] >= 1]
        right.plot([r["context"] for r in ms], [r["kib_per_token"] for r in ms], "-o", ms=3, label=attention)
        memory_shown = memory_shown or bool(ms)
    if not memory_shown:
        right.text(0.5, 0.5, "no step above 1 MiB", ha="center", transform=right.transAxes)
    for ax in (left, right) if memory_shown else (left,):
        ax.set_yscale("log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens per sequence)")
        ax.grid(alpha=0.3, which="both")
    left.legend(fontsize=7)
    if memory_shown:
        right.legend(fontsize=7)
    left.set_ylabel("training step, us per token (1 thread)")
    right.set_ylabel("step memory, KiB per token (batch 1)")
    left.set_title("2-block encoder, width 128: time per token", fontsize=9)
    right.set_title("peak RSS of the step over the idle process (>= 1 MiB shown)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def speed_table(results):
    contexts = sorted({r["context"] for r in results["model_step"]})
    names = list(dict.fromkeys(r["attention"] for r in results["model_step"]))
    step = {(r["attention"], r["context"]): r for r in results["model_step"]}
    mem = {(r["attention"], r["context"]): r for r in results["model_memory"]}
    print("| mechanism | " + " | ".join(f"{c}" for c in contexts) + " |")
    print("|---|" + "---:|" * len(contexts))
    for n in names:
        cells = []
        for c in contexts:
            r, m = step.get((n, c)), mem.get((n, c))
            cell = f"{r['us_per_token']:.1f} us" if r else ""
            if m:
                cell += f" / {m['kib_per_token']:.0f} KiB"
            cells.append(cell)
        print(f"| {n} | " + " | ".join(cells) + " |")


def speed_main(exp, args, attnkit, command):
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="reproduce-smoke-") as tmp:
            commands = speed_commands(exp, tmp, attnkit, smoke=True)
            if not speed_run(commands, tmp):
                sys.exit("reproduce --smoke: a measurement failed")
            first = speed_collect(exp, commands, tmp, command)
            mtimes = {path: os.path.getmtime(path) for _, _, path in commands}
            speed_run(commands, tmp)  # a second pass skips everything
            problems = [f"{path} re-measured" for _, _, path in commands if os.path.getmtime(path) != mtimes[path]]
            expected = len(exp["attention"]) * len(exp["smoke_contexts"])
            if len(first["model_step"]) != expected or len(first["model_memory"]) != expected:
                problems.append(f"expected {expected} step and memory rows, got {len(first['model_step'])} and "
                                f"{len(first['model_memory'])}")
            if any(not r["us_per_token"] > 0 for r in first["model_step"]):
                problems.append("a step time is not positive")
            speed_table(first)
            speed_plot(first, os.path.join(tmp, "speed.png"))
            if problems:
                sys.exit("reproduce --smoke: " + "; ".join(problems))
            print("reproduce --smoke: ok")
            return 0
    out = os.path.abspath(args.out or os.path.join(ROOT, "build", "runs", args.name))
    results_dir = os.path.abspath(args.results or os.path.join(ROOT, "docs", "experiments"))
    commands = speed_commands(exp, out, attnkit, smoke=False)
    print(f"reproduce {args.name}: {len(commands)} measurements, one at a time on one thread, in {out}; "
          f"nothing else should run (load now {loadavg()})", flush=True)
    ok = True if args.collect_only else speed_run(commands, out)
    results = speed_collect(exp, commands, out, command)
    json_path = write_results(results, results_dir, args.name)
    speed_table(results)
    print("wrote", json_path)
    png = os.path.join(results_dir, f"{args.name}.png")
    if speed_plot(results, png):
        print("wrote", png)
    return 0 if ok else 1


def lm_smoke_check(first):
    problems = []
    for c1 in first["configurations"]:
        if c1["n"] != 1 or not math.isfinite(c1["test_bpc_mean"]) or c1["test_bpc_mean"] <= 0:
            problems.append(f"{c1['name']}: expected one finished run with a finite test bpc, got {c1['n']} "
                            f"run(s), bpc {c1['test_bpc_mean']}")
        if not c1["runs"] or c1["runs"][0]["epoch_seconds"] <= 0:
            problems.append(f"{c1['name']}: no time per epoch")
    params = {c["name"]: c["parameters"] for c in first["configurations"]}
    if not params["full-sinusoidal"] or params["agglomerative-sinusoidal"] == params["full-sinusoidal"]:
        problems.append(f"parameter counts do not tell the mechanisms apart: {params}")
    return problems


AGGLOMERATIVE_LM.update(jobs=lm_jobs, collect=lm_collect, plot=lm_plot, table=lm_table, smoke_check=lm_smoke_check,
                        corpus=True)
COPY_CLUSTERED.update(jobs=copy_jobs, collect=copy_collect, plot=copy_plot, table=copy_table,
                      smoke_check=copy_smoke_check, corpus=False)
APPROX_TRAINED.update(jobs=approx_jobs, collect=approx_collect, plot=approx_plot, table=approx_table,
                      smoke_check=approx_smoke_check, corpus=True)
SAC_COPY.update(jobs=copy_jobs, collect=copy_collect, plot=sac_copy_plot, table=sac_copy_table,
                smoke_check=sac_copy_smoke_check, corpus=False)
SAC_LM.update(jobs=lm_jobs, collect=lm_collect, plot=lm_plot, table=sac_lm_table, smoke_check=sac_lm_smoke_check,
              corpus=True)
SPEED.update(main=speed_main)
# Section 8 of docs/EXPERIMENTS.md (issue 13, part 4.3). The SAC paper, Table
# 3: node classification on citation graphs (GAT's transductive setting), SAC
# against GAT. Here: the Debian package graph (scripts/package-graph: the
# desktop sections' largest component), a GAT-style network with dot-product
# attention over the input graph's edges, full attention, the input edges plus
# as many random edges as SAC adds, and SAC initialised from the input graph.
NODE_CLASSIFY = {
    "title": "SAC, node classification on the Debian package graph",
    "paper": {"source": "SAC paper, Table 3 (accuracy %, mean of 3 runs)",
              "cora": {"GAT": 83.0, "SAC": 84.8}, "citeseer": {"GAT": 72.5, "SAC": 73.8},
              "pubmed": {"GAT": 79.0, "SAC": 79.7}},
    # name -> (attention ({seed} is the run's seed), extra flags)
    "configurations": [
        ("input", "input", []),
        ("full", "full", []),
        ("input+random-2", "input+random:alpha=2,seed={seed}", []),
        ("sac-2", "sac:alpha=2,variant=all-connected", []),
        ("sac-2-edge", "sac:alpha=2,variant=all-connected,reward=edge", []),
        # GAT's layout has no residual connections, which leaves full
        # attention nothing of a node's own features: the same two with them.
        ("input-residual", "input", ["--residual"]),
        ("full-residual", "full", ["--residual"]),
    ],
    # GAT's Cora settings for every configuration (2 layers, 8 heads x 8,
    # dropout 0.6, Adam 0.005 with L2 5e-4), at most 200 epochs with early
    # stopping after 100 without a better validation accuracy; SAC samples 4
    # structures per epoch.
    "flags": ["--epochs", "200", "--patience", "100", "--width", "64", "--heads", "8", "--layers", "2",
              "--dropout", "0.6", "--lr", "0.005", "--weight-decay", "5e-4", "--samples", "4"],
    "smoke_flags": ["--epochs", "4", "--patience", "4", "--eval-every", "2", "--width", "16", "--heads", "2",
                    "--layers", "2", "--samples", "2"],
    "seeds": [1, 2, 3],
}


def node_jobs(exp, out, data, attnkit, seeds, smoke):
    flags = exp["smoke_flags" if smoke else "flags"]
    jobs = []
    for seed in seeds:  # replica 1 of every configuration first
        for name, attention, extra in exp["configurations"]:
            run_dir = os.path.join(out, name, f"seed-{seed}")
            argv = [attnkit, "node-classify", "--data", data, "--attention", attention.format(seed=seed), *flags, *extra,
                    "--seed", str(seed), "--threads", "1", "--out", run_dir]
            jobs.append({"dir": run_dir, "train": argv, "seed": seed, "config": name,
                         "label": f"{name} seed {seed}"})
    return jobs


def node_run(job, runner):
    """One run: skipped when its result.json exists, resumed when it has a checkpoint."""
    run_dir, label = job["dir"], job["label"]
    result = read_json(os.path.join(run_dir, "result.json"))
    if result is not None:
        runner.say(f"{label}: finished (test accuracy {result['test_accuracy']:.4f}), skipped")
        return True
    if runner.stop.is_set():
        return False
    os.makedirs(run_dir, exist_ok=True)
    resumed = bool(glob.glob(os.path.join(run_dir, "checkpoint-*.ckpt")))
    runner.say(f"{label}: {'resuming' if resumed else 'starting'}")
    rc = runner.session(run_dir, "train", job["train"] + (["--resume"] if resumed else []), "train.log")
    result = read_json(os.path.join(run_dir, "result.json"))
    if rc != 0 or result is None:
        runner.say(f"{label}: attnkit node-classify exited {rc} without a result; see "
                   f"{os.path.join(run_dir, 'train.log')} (re-run to continue)")
        return False
    runner.say(f"{label}: test accuracy {result['test_accuracy']:.4f} (best epoch {result['best']['epoch']})")
    return True


def node_collect(exp, jobs, data, command):
    with open(os.path.join(data, "meta.json")) as f:
        meta = json.load(f)
    configs = []
    for name, attention, extra in exp["configurations"]:
        runs = []
        for job in (j for j in jobs if j["config"] == name):
            r = read_json(os.path.join(job["dir"], "result.json"))
            if r is None:
                continue
            runs.append({"seed": job["seed"], "attention": r["attention"], "test_accuracy": r["test_accuracy"],
                         "valid_accuracy": r["best"]["valid_accuracy"], "best_epoch": r["best"]["epoch"],
                         "epochs_run": r["epochs_run"], "edges_per_node": r["best"]["edges_per_node"],
                         "same_class": r["best"]["same_class"], "train_seconds": r["train_seconds"],
                         "seconds_per_epoch": r["seconds_per_epoch"], "loadavg": r["session"]["loadavg_end"]})
        mean, se = mean_se([r["test_accuracy"] for r in runs])
        configs.append({"name": name, "attention": attention, "flags": extra, "runs": runs, "test_accuracy": mean,
                        "test_accuracy_se": se,
                        "same_class": mean_se([r["same_class"] for r in runs])[0],
                        "edges_per_node": mean_se([r["edges_per_node"] for r in runs])[0],
                        "seconds_per_epoch": mean_se([r["seconds_per_epoch"] for r in runs])[0]})
    return {"experiment": exp["title"], "command": command, "paper": exp["paper"],
            "dataset": {k: meta.get(k) for k in ("nodes", "edges", "features", "classes", "class_counts",
                                                 "split_counts", "sections", "source")},
            "flags": exp["flags"], "configurations": configs}


def node_table(results):
    print("| structure | test accuracy % (mean +- se) | per seed | edges/node | same-class edges | s/epoch |")
    print("|---|---|---|---|---|---|")
    for c in results["configurations"]:
        if not c["runs"]:
            print(f"| {c['name']} | (no finished run) | | | | |")
            continue
        se = f" +- {100 * c['test_accuracy_se']:.1f}" if c["test_accuracy_se"] is not None else ""
        seeds = ", ".join(f"{100 * r['test_accuracy']:.1f}" for r in c["runs"])
        print(f"| {c['name']} | {100 * c['test_accuracy']:.1f}{se} | {seeds} | {c['edges_per_node']:.2f} | "
              f"{c['same_class']:.3f} | {c['seconds_per_epoch']:.2f} |")


def node_plot(results, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("reproduce: matplotlib is missing (Debian: python3-matplotlib); no plot")
        return False
    configs = [c for c in results["configurations"] if c["runs"]]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, c in enumerate(configs):
        ax.bar(i, 100 * c["test_accuracy"], color="#8fb3d9")
        ax.scatter([i] * len(c["runs"]), [100 * r["test_accuracy"] for r in c["runs"]], color="k", s=10, zorder=3)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([c["name"] for c in configs], fontsize=8, rotation=20, ha="right")
    ax.set_ylabel("test accuracy %")
    ax.set_title("Debian package graph: structure vs accuracy (bars: mean, dots: seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def node_main(exp, args, attnkit, command):
    """node-classify runs its own jobs: each run writes result.json itself and
    may stop early, so the train-then-eval runner of the other sections does
    not fit."""
    seeds = [int(s) for s in args.replicas.split(",")] if args.replicas else exp["seeds"]
    results_dir = os.path.abspath(args.results or os.path.join(ROOT, "docs", "experiments"))

    def prepare(data, extra):
        if not os.path.exists(os.path.join(data, "meta.json")):
            subprocess.run([os.path.join(ROOT, "scripts", "package-graph"), "--out", data, *extra], check=True)

    def execute(jobs):
        stop = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
        try:
            runner = Runner(attnkit, threading.Lock(), stop)
            with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
                ok = all(list(pool.map(lambda job: node_run(job, runner), jobs)))
        finally:
            signal.signal(signal.SIGINT, previous)
        if stop.is_set():
            sys.exit("reproduce: stopped by Ctrl-C; the runs checkpointed, the same command continues")
        return ok

    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="reproduce-smoke-") as tmp:
            data = os.path.join(tmp, "data")
            prepare(data, ["--input", os.path.join(ROOT, "tests", "data", "packages-fixture.txt"),
                           "--sections", "games,graphics,sound", "--train-per-class", "2", "--valid", "6",
                           "--test", "10", "--min-count", "2"])
            jobs = node_jobs(exp, os.path.join(tmp, "runs"), data, attnkit, seeds[:1], smoke=True)
            if not execute(jobs):
                sys.exit("reproduce --smoke: a run failed")
            first = node_collect(exp, jobs, data, command)
            mtimes = {j["dir"]: os.path.getmtime(os.path.join(j["dir"], "result.json")) for j in jobs}
            if not execute(jobs):
                sys.exit("reproduce --smoke: the second pass failed")
            second = node_collect(exp, jobs, data, command)
            problems = [f"{c['name']}: {len(c['runs'])} runs" for c in first["configurations"] if len(c["runs"]) != 1]
            for j in jobs:
                if os.path.getmtime(os.path.join(j["dir"], "result.json")) != mtimes[j["dir"]]:
                    problems.append(f"{j['label']}: re-run although finished")
            if json.dumps(first, sort_keys=True) != json.dumps(second, sort_keys=True):
                problems.append("the results changed on the second pass")
            for c in first["configurations"]:
                for r in c["runs"]:
                    if not 0 <= r["test_accuracy"] <= 1 or r["edges_per_node"] < 1:
                        problems.append(f"{c['name']}: implausible result {r}")
            node_table(first)
            node_plot(first, os.path.join(tmp, "node-classify.png"))
            if problems:
                sys.exit("reproduce --smoke: " + "; ".join(problems))
            print("reproduce --smoke: ok")
            return 0

    out = os.path.abspath(args.out or os.path.join(ROOT, "build", "runs", "node-classify"))
    data = os.path.abspath(args.data or os.path.join(ROOT, "build", "data", "package-graph"))
    prepare(data, [])
    jobs = node_jobs(exp, out, data, attnkit, seeds, smoke=False)
    print(f"reproduce node-classify: {len(jobs)} runs (seeds {seeds}), {args.jobs} at a time, runs in {out}",
          flush=True)
    print("the first run's command:", shlex.join(jobs[0]["train"]), flush=True)
    ok = True if args.collect_only else execute(jobs)
    results = node_collect(exp, jobs, data, command)
    json_path = write_results(results, results_dir, "node-classify")
    node_table(results)
    print("wrote", json_path)
    png = os.path.join(results_dir, "node-classify.png")
    if node_plot(results, png):
        print("wrote", png)
    return 0 if ok else 1


NODE_CLASSIFY.update(main=node_main)

EXPERIMENTS = {"agglomerative-lm": AGGLOMERATIVE_LM, "copy-clustered": COPY_CLUSTERED,
               "approx-trained": APPROX_TRAINED, "speed": SPEED, "sac-copy": SAC_COPY, "sac-lm": SAC_LM,
               "node-classify": NODE_CLASSIFY}


def write_results(results, results_dir, name):
    os.makedirs(results_dir, exist_ok=True)
    json_path = os.path.join(results_dir, f"{name}.json")
    with open(json_path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    os.replace(json_path + ".tmp", json_path)
    return json_path


# ---------------------------------------------------------------- main

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(EXPERIMENTS))
    parser.add_argument("--smoke", action="store_true", help="a few steps on tiny data in a temporary directory")
    parser.add_argument("--out", help="run directories (default build/runs/NAME)")
    parser.add_argument("--data", help="corpus directory (default build/data/kjv)")
    parser.add_argument("--results", help="where NAME.json and NAME.png go (default docs/experiments)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each (2)")
    parser.add_argument("--replicas", default=None, help="seeds, comma-separated (default: the experiment's)")
    parser.add_argument("--attnkit", help="the attnkit binary (default $ATTNKIT_BUILD_DIR/attnkit or build/attnkit)")
    parser.add_argument("--collect-only", action="store_true",
                        help="run nothing: collect the finished runs into RESULTS/NAME.json and the plot")
    parser.add_argument("--copy-runs", help="approx-trained: copy-clustered's run directories, whose full-attention "
                                            "models it also swaps into (default build/runs/copy-clustered)")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    exp = EXPERIMENTS[args.name]
    attnkit = args.attnkit or os.path.join(os.environ.get("ATTNKIT_BUILD_DIR", os.path.join(ROOT, "build")),
                                           "attnkit")
    if not os.access(attnkit, os.X_OK):
        sys.exit(f"reproduce: no attnkit binary at {attnkit} (build it with scripts/build, or pass --attnkit)")
    seeds = [int(s) for s in args.replicas.split(",")] if args.replicas else exp.get("seeds", [])
    command = "python3 experiments/reproduce " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    exp["copy_runs"] = os.path.abspath(args.copy_runs or os.path.join(ROOT, "build", "runs", "copy-clustered"))
    if "main" in exp:  # measurements rather than training runs
        return exp["main"](exp, args, attnkit, command)
    if args.smoke:
        return smoke(exp, args, attnkit, seeds, command)

    out = os.path.abspath(args.out or os.path.join(ROOT, "build", "runs", args.name))
    data = os.path.abspath(args.data or os.path.join(ROOT, "build", "data", "kjv")) if exp["corpus"] else None
    results_dir = os.path.abspath(args.results or os.path.join(ROOT, "docs", "experiments"))
    if data and not os.path.exists(os.path.join(data, "meta.json")):
        sys.exit(f"reproduce: no corpus at {data} (scripts/fetch-corpus kjv --out {data})")
    jobs = exp["jobs"](exp, out, data, attnkit, seeds, smoke=False)
    print(f"reproduce {args.name}: {len(jobs)} runs (seeds {seeds}), budget {jobs[0]['steps']} steps each, "
          f"{args.jobs} at a time, runs in {out}", flush=True)
    print("the first run's command:", shlex.join(jobs[0]["train"]), flush=True)
    ok = True if args.collect_only else run_all(jobs, attnkit, args.jobs)
    results = exp["collect"](exp, jobs, data, command)
    json_path = write_results(results, results_dir, args.name)
    exp["table"](results)
    print("wrote", json_path)
    png = os.path.join(results_dir, f"{args.name}.png")
    if exp["plot"](results, png):
        print("wrote", png)
    return 0 if ok else 1


def smoke(exp, args, attnkit, seeds, command):
    with tempfile.TemporaryDirectory(prefix="reproduce-smoke-") as tmp:
        data = None
        if exp["corpus"]:
            data = os.path.join(tmp, "data")
            text = os.path.join(ROOT, "tests", "data", "genesis-1-2.txt")
            subprocess.run([attnkit, "data", "char-lm", "--input", text, "--out", data], check=True,
                           stdout=subprocess.DEVNULL)
        out = args.out and os.path.abspath(args.out) or os.path.join(tmp, "runs")
        exp["copy_runs"] = os.path.join(out, "copy-clustered")
        if os.path.exists(out) and os.listdir(out):
            sys.exit(f"reproduce --smoke: {out} is not empty (the smoke starts from nothing)")
        jobs = exp["jobs"](exp, out, data, attnkit, seeds[:1], smoke=True)
        print(f"reproduce {args.name} --smoke: {len(jobs)} runs, budget {jobs[0]['steps']} steps, "
              f"seed {seeds[0]}", flush=True)
        if not run_all(jobs, attnkit, args.jobs):
            sys.exit("reproduce --smoke: a run failed")
        first = exp["collect"](exp, jobs, data, command)
        # A second pass skips every finished run and changes nothing.
        mtimes = {j["dir"]: os.path.getmtime(os.path.join(j["dir"], "test.json")) for j in jobs}
        if not run_all(jobs, attnkit, args.jobs):
            sys.exit("reproduce --smoke: the second pass failed")
        second = exp["collect"](exp, jobs, data, command)
        problems = exp["smoke_check"](first)
        for j in jobs:
            if os.path.getmtime(os.path.join(j["dir"], "test.json")) != mtimes[j["dir"]]:
                problems.append(f"{j['label']}: re-run although finished")
        if json.dumps(first, sort_keys=True) != json.dumps(second, sort_keys=True):
            problems.append("the results changed on the second pass")
        exp["table"](first)
        results_dir = args.results and os.path.abspath(args.results)
        if results_dir:
            write_results(first, results_dir, args.name)
        exp["plot"](first, os.path.join(results_dir or tmp, f"{args.name}.png"))
        if problems:
            sys.exit("reproduce --smoke: " + "; ".join(problems))
        print("reproduce --smoke: ok")
        return 0


if __name__ == "__main__":
    sys.exit(main())
