"""approx-trained: section 3 of docs/EXPERIMENTS.md, clustered and
improved-clustered attention swapped into trained full-attention models (a
bidirectional character model trained here, copy-clustered's copy models)
without retraining, and their distance to full attention; a local window and
linear attention swapped in as controls.

The copy models are copy-clustered's runs (--copy-runs). `--configurations
full` runs the character model alone; a copy model whose run has not
finished here (its run directory missing) then keeps its numbers from the
previous RESULTS/approx-trained.json, marked "kept" there and in the table's
note, rather than dropping out of the results."""

import json
import math
import os
import shlex
import statistics

import checkpoints
import paths
import plots
import runner
import stats
from sections import copy_clustered

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 3

CORPUS = True

# Section 3 of docs/EXPERIMENTS.md. The paper (clustered attention, the
# pretrained-BERT experiment): a trained model's softmax attention replaced by
# improved-clustered attention (25 clusters) keeps its accuracy without
# retraining. Clustered attention has no causal form, so the model is a
# bidirectional character model (masked-char) rather than char-lm's decoder.
EXPERIMENT = {
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
    # Controls swapped into the character model the same way: a local window
    # of 4 characters each side, and linear attention (no distances: approx
    # compares the clustered mechanisms only).
    "controls": ["sparse-local:span=4", "linear"],
    "seeds": [1],
}


def swaps(exp, smoke):
    """(name, spec) of every mechanism swapped into the trained model."""
    topk = exp["smoke_topk" if smoke else "topk"]
    swapped = []
    for C in exp["smoke_clusters" if smoke else "clusters"]:
        swapped.append((f"clustered-{C}", f"clustered:clusters={C}"))
        swapped.append((f"improved-clustered-{C}", f"improved-clustered:clusters={C},topk={topk}"))
    return swapped


def controls(exp):
    """(name, spec) of the controls swapped into the character model: the mechanism's name, then its spec."""
    return [(spec.split(":")[0], spec) for spec in exp["controls"]]


def copy_swaps(exp, smoke):
    """(name, spec) swapped into the copy models: section 2's cluster counts, then the controls."""
    clusters = copy_clustered.EXPERIMENT["smoke_clusters" if smoke else "clusters"]
    swapped = [(f"{m}-{C}", f"{m}:clusters={C}") for m in ("clustered", "improved-clustered") for C in clusters]
    return swapped + [(spec.split(":")[0], spec) for spec in exp["copy_swaps"]]


def jobs(exp, out, data, attnkit, seeds, smoke):
    """The character model per seed (test metric, the swaps, the controls,
    then `attnkit approx`), then copy-clustered's full-attention models (trained with its
    command where missing: EXPERIMENT["copy_runs"]) with their swaps."""
    model = exp["smoke_model" if smoke else "model"]
    trainer = exp["smoke_trainer" if smoke else "trainer"]
    clusters = exp["smoke_clusters" if smoke else "clusters"]
    steps = int(runner.flag_value(trainer, "--steps"))
    planned = []
    for seed in seeds:
        run_dir = os.path.join(out, f"full-seed-{seed}")
        train = runner.train_command(attnkit, ["--data", data, *model, *trainer], seed, run_dir)
        evals = runner.test_evals(attnkit, run_dir, swaps(exp, smoke) + controls(exp))
        path = os.path.join(run_dir, "approx.json")
        evals.append((runner.attnkit_command(attnkit, "approx", [
            "--run", run_dir, "--split", "test", "--sequences",
            str(exp["smoke_approx_sequences" if smoke else "approx_sequences"]),
            "--clusters", ",".join(map(str, clusters)),
            "--topk", str(exp["smoke_topk" if smoke else "topk"]), "--threads", "1", "--json", path]), path))
        planned.append({"dir": run_dir, "train": train, "evals": evals, "steps": steps, "seed": seed,
                        "config": "full", "label": f"masked-char full seed {seed}"})
    for job in copy_clustered.jobs(copy_clustered.EXPERIMENT, exp["copy_runs"], None, attnkit, seeds[:1], smoke):
        if job["config"] != "full":
            continue
        planned.append(dict(job, evals=runner.test_evals(attnkit, job["dir"], copy_swaps(exp, smoke)),
                            config="copy-full", label=f"copy length {job['length']} full"))
    return planned


def us_per_position(result):
    return 1e6 * result["seconds"] / result["positions"]


def kept_copy(exp, jobs, copy, smoke):
    """The copy models planned but not finished here (their runs missing:
    `--configurations full`, another machine), each with its entry of the
    previous results (exp["previous_results"]: RESULTS/approx-trained.json,
    none in a smoke) when it has one for the same swaps, marked "kept" with
    the command that collected it; merged with COPY in the order of the
    lengths."""
    path = exp.get("previous_results")
    if smoke or not path or not os.path.exists(path):
        return copy
    with open(path) as f:
        previous = json.load(f)
    names = [name for name, _ in copy_swaps(exp, smoke)]
    finished = {c["length"] for c in copy}
    lengths = [j["length"] for j in jobs if j["config"] == "copy-full"]
    merged = list(copy)
    for c in previous.get("copy", []):
        if c["length"] in lengths and c["length"] not in finished and [x["name"] for x in c["swaps"]] == names:
            kept = c.get("kept") or {"from": os.path.relpath(path, paths.ROOT), "command": previous["command"]}
            merged.append(dict(c, kept=kept))
    return sorted(merged, key=lambda c: lengths.index(c["length"]))


def control_result(name, spec, r, trained):
    return {"name": name, "attention": spec, "test_bpc": r["bpc"], "bpc_increase": r["bpc"] - trained["bpc"],
            "us_per_position": us_per_position(r)}


def collect(exp, jobs, data, command):
    meta = checkpoints.data_meta(data)
    runs, copy = [], []
    smoke = jobs[0]["steps"] < 100
    for job in (j for j in jobs if j["config"] == "copy-full"):
        results = runner.finished(job)
        if results is None:
            continue
        copy.append({"length": job["length"], "dir": job["dir"], "trained_accuracy": results[0]["accuracy"],
                     "swaps": [{"name": name, "attention": spec, "test_accuracy": r["accuracy"],
                                "us_per_position": us_per_position(r)}
                               for (name, spec), r in zip(copy_swaps(exp, smoke), results[1:])]})
    for job in (j for j in jobs if j["config"] == "full"):
        results = runner.finished(job)
        if results is None:
            continue
        n = len(swaps(exp, smoke))
        trained, swapped, controlled, approx = results[0], results[1:1 + n], results[1 + n:-1], results[-1]
        per_spec = {}
        for row in approx["rows"]:
            key = (row["attention"], row["clusters"])
            per_spec.setdefault(key, {})[row["inputs"]] = {"rel_err": row["rel_err"], "row_l1": row["row_l1"]}
        measured = []
        for (name, spec), r in zip(swaps(exp, smoke), swapped):
            mechanism, clusters = name.rsplit("-", 1)
            distances = per_spec.get((mechanism, int(clusters)), {})
            layers = {k: v for k, v in distances.items() if k.startswith("layer ")}
            measured.append({"name": name, "attention": spec, "mechanism": mechanism, "clusters": int(clusters),
                             "test_bpc": r["bpc"], "bpc_increase": r["bpc"] - trained["bpc"],
                             "us_per_position": us_per_position(r),
                             "layers": layers,
                             "row_l1_layer_mean": statistics.mean(v["row_l1"] for v in layers.values()) if layers else None,
                             "random": distances.get("random"),
                             "clustered_structure": distances.get("clustered-structure")})
        metrics = checkpoints.read_jsonl(os.path.join(job["dir"], "metrics.jsonl"))
        runs.append({"seed": job["seed"], "dir": job["dir"], "test_bpc": trained["bpc"],
                     "us_per_position": us_per_position(trained),
                     "parameters": checkpoints.latest_header(job["dir"])["parameters"],
                     "train_seconds": metrics[-1]["elapsed"] if metrics else None,
                     "approx_shape": approx["config"], "approx_model": approx["model"],
                     "sessions": checkpoints.read_jsonl(os.path.join(job["dir"], "sessions.jsonl")),
                     "curve": stats.curve(metrics, ("step", "bpc", "valid_bpc", "elapsed")),
                     "swaps": measured,
                     "controls": [control_result(name, spec, r, trained)
                                  for (name, spec), r in zip(controls(exp), controlled)]})
    return {
        "experiment": exp["title"], "command": command, "paper": exp["paper"],
        "corpus": {"dir": os.path.abspath(data), "sources": [os.path.basename(x["path"]) for x in meta.get("sources", [])],
                   "splits": {k: v["characters"] for k, v in meta["splits"].items()}},
        "train_command": shlex.join(jobs[0]["train"]),
        "steps": jobs[0]["steps"],
        "runs": runs,
        "copy": kept_copy(exp, jobs, copy, smoke),
    }


def run_clusters(run):
    return sorted({x["clusters"] for x in run["swaps"]})


def plot(results, png):
    plt = plots.pyplot()
    if plt is None:
        return False
    if not results["runs"]:
        return False
    run = results["runs"][0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    colors = {"clustered": "#1f77b4", "improved-clustered": "#2ca02c"}
    for mechanism, color in colors.items():
        swapped = [x for x in run["swaps"] if x["mechanism"] == mechanism]
        C = [x["clusters"] for x in swapped]
        left.plot(C, [x["test_bpc"] for x in swapped], "-o", color=color, label=mechanism)
        right.plot(C, [x["row_l1_layer_mean"] for x in swapped], "-o", color=color, label=f"{mechanism}, model's q, k")
        right.plot(C, [x["random"]["row_l1"] for x in swapped], ":s", color=color, label=f"{mechanism}, random q, k")
    left.axhline(run["test_bpc"], color="#d62728", lw=1, label="full (trained)")
    for x, style in zip(run.get("controls", []), ("--", ":")):
        left.axhline(x["test_bpc"], color="#7f7f7f", lw=1, ls=style, label=f"control: {x['attention']}")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(run_clusters(run), [str(c) for c in run_clusters(run)])
        ax.set_xlabel("clusters")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("test bits per masked character")
    left.set_title("swapped into the trained model, no retraining", fontsize=9)
    right.set_ylabel("mean L1 distance of attention rows (0..2)")
    right.set_title("distance to full attention, mean over layers", fontsize=9)
    return plots.save(plt, fig, png)


def table(results):
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
        for x in run.get("controls", []):  # no clusters, no distances (approx compares the clustered ones)
            print(f"| control: {x['attention']} | - | {x['test_bpc']:.4f} | {x['bpc_increase']:+.4f} | "
                  f"{x['us_per_position']:.1f} | " + " | ".join("-" for _ in layer_names) + " | - |")
    copy_table(results)


def copy_table(results):
    if not results["copy"]:
        return
    kept = [c for c in results["copy"] if c.get("kept")]
    if kept:
        print(f"copy models L = {', '.join(str(c['length']) for c in kept)}: not run here, kept from "
              f"{kept[0]['kept']['from']} (collected by: {kept[0]['kept']['command']})")
    names = [x["name"] for x in results["copy"][0]["swaps"]]
    print("| swapped into the copy model | " + " | ".join(f"L = {c['length']}" for c in results["copy"]) + " |")
    print("|---|" + "---:|" * len(results["copy"]))
    print("| full (trained) | " + " | ".join(f"{100 * c['trained_accuracy']:.1f}" for c in results["copy"]) + " |")
    for i, name in enumerate(names):
        print(f"| {name} | " + " | ".join(f"{100 * c['swaps'][i]['test_accuracy']:.1f}" for c in results["copy"]) + " |")


def smoke_check(first):
    problems = []
    if len(first["copy"]) != len(copy_clustered.EXPERIMENT["smoke_lengths"]):
        problems.append(f"expected a copy model per smoke length, got {len(first['copy'])}")
    if len(first["runs"]) != 1:
        return [f"expected one finished run, got {len(first['runs'])}"]
    run = first["runs"][0]
    for x in run["swaps"]:
        if not math.isfinite(x["test_bpc"]) or x["test_bpc"] <= 0:
            problems.append(f"{x['name']}: test bpc {x['test_bpc']}")
        if len(x["layers"]) != 2 or x["random"] is None:
            problems.append(f"{x['name']}: distances for {sorted(x['layers'])} and random {x['random']}")
    if [x["name"] for x in run["controls"]] != [name for name, _ in controls(EXPERIMENT)]:
        problems.append(f"controls: {[x['name'] for x in run['controls']]}")
    for x in run["controls"]:
        if not math.isfinite(x["test_bpc"]) or x["test_bpc"] <= 0:
            problems.append(f"control {x['name']}: test bpc {x['test_bpc']}")
    return problems
