"""mixed-precision: section 9 of docs/EXPERIMENTS.md, `--dtype bf16` against
float32. Issue 17's goal: a character model trained with bfloat16 forward and
backward passes (float32 weights and AdamW state) ends within 0.01 bpc of the
float32 run after the same steps. The runs are section 1's full-sinusoidal
configuration, the two dtypes trained with the same seeds (the same initial
weights, batches and dropout), 3 seeds, so that the bf16 - float32 difference
of each seed can be set against the seed-to-seed spread. Each trained run is
measured in float32 by `attnkit eval` on the whole validation split (the
number the goal is about) and on the test split."""

import os
import statistics

import checkpoints
import plots
import runner
import stats
from sections import agglomerative_lm
from sections.agglomerative_controls import replaced

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 9

CORPUS = "kjv"

# The goal: bf16 within this many bits per character of float32.
GOAL_BPC = 0.01

SECTION_1 = agglomerative_lm.EXPERIMENT
EXPERIMENT = {
    "title": "Mixed precision: --dtype bf16 against float32, character model",
    "dtypes": ["float32", "bf16"],
    "positions": ["--positions", "sinusoidal"],
    # Section 1's model and its 1200 steps; validation once, at the end, on
    # the whole split (--eval-every 0 --eval-batches 0: the run's own number,
    # in its dtype), log every 100 steps.
    "model": SECTION_1["model"],
    "trainer": replaced(SECTION_1["trainer"], log_every=100, eval_every=0, eval_batches=0),
    "smoke_model": SECTION_1["smoke_model"],
    "smoke_trainer": replaced(SECTION_1["smoke_trainer"], eval_every=0, eval_batches=0),
    "seeds": [1, 2, 3],
}


def eval_on(attnkit, run_dir, split):
    """`attnkit eval` of the trained run on SPLIT, whole, float32, one thread: (argv, the JSON it writes)."""
    path = os.path.join(run_dir, f"{split}.json")
    return (runner.attnkit_command(attnkit, "eval", ["--run", run_dir, "--split", split, "--threads", "1",
                                                     "--json", path]), path)


def jobs(exp, out, data, attnkit, seeds, smoke):
    """agglomerative-lm's jobs with one configuration per dtype (both dtypes of
    seed 1 first), each measured on the test split (what the runner reports)
    and then on the validation split (the goal's number)."""
    configured = dict(exp, configurations=[(dtype, "full", [*exp["positions"], "--dtype", dtype])
                                           for dtype in exp["dtypes"]])
    planned = agglomerative_lm.jobs(configured, out, data, attnkit, seeds, smoke)
    for job in planned:
        job["evals"] = [eval_on(attnkit, job["dir"], "test"), eval_on(attnkit, job["dir"], "valid")]
    return planned


def collect(exp, jobs, data, command):
    meta = checkpoints.data_meta(data)
    configs = []
    for dtype in exp["dtypes"]:
        runs = []
        for job in (j for j in jobs if j["config"] == dtype):
            results = runner.finished(job)
            if results is None:
                continue
            test, valid = results
            header = checkpoints.latest_header(job["dir"])
            metrics = checkpoints.read_jsonl(os.path.join(job["dir"], "metrics.jsonl"))
            own = [r["valid_bpc"] for r in metrics if "valid_bpc" in r]
            runs.append({
                "seed": job["seed"], "dir": job["dir"], "valid_bpc": valid["bpc"], "test_bpc": test["bpc"],
                "own_valid_bpc": own[-1] if own else None, "parameters": header["parameters"],
                "steps": metrics[-1]["step"], "train_seconds": metrics[-1]["elapsed"],
                "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in metrics if "tokens_per_s" in r),
                "sessions": checkpoints.read_jsonl(os.path.join(job["dir"], "sessions.jsonl")),
                "curve": stats.curve(metrics, ("step", "loss", "bpc", "elapsed")),
            })
        valid_mean, valid_se = stats.mean_se([r["valid_bpc"] for r in runs])
        test_mean, test_se = stats.mean_se([r["test_bpc"] for r in runs])
        configs.append({"name": dtype, "n": len(runs), "valid_bpc_mean": valid_mean, "valid_bpc_se": valid_se,
                        "test_bpc_mean": test_mean, "test_bpc_se": test_se, "runs": runs})
    by_name = {c["name"]: c for c in configs}
    paired = stats.paired_differences(by_name, [("bf16", "float32")], "valid_bpc")
    paired += stats.paired_differences(by_name, [("bf16", "float32")], "test_bpc")
    for p, key in zip(paired, ("valid_bpc", "test_bpc")):
        p["metric"] = key
    return {
        "experiment": exp["title"],
        "command": command,
        "goal_bpc": GOAL_BPC,
        **agglomerative_lm.char_lm_setting(data, meta, jobs, configs),
        "configurations": configs,
        "paired": paired,
    }


def goal_holds(results):
    """Whether every seed's bf16 - float32 validation difference is within the goal; None without a pair."""
    valid = [p for p in results["paired"] if p["metric"] == "valid_bpc"]
    if not valid:
        return None
    return all(abs(d) < results["goal_bpc"] for d in valid[0]["differences"])


def table(results):
    print("| `--dtype` | seed | valid bpc (`attnkit eval`, float32) | the run's own validation | test bpc | "
          "train s | tokens/s (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in results["configurations"]:
        for r in c["runs"]:
            own = f"{r['own_valid_bpc']:.5f}" if r["own_valid_bpc"] is not None else ""
            print(f"| {c['name']} | {r['seed']} | {r['valid_bpc']:.5f} | {own} | {r['test_bpc']:.5f} | "
                  f"{r['train_seconds']:.0f} | {r['tokens_per_s_median']:.0f} |")
    print()
    print("| bf16 minus float32 (same seed) | per seed | mean ± s.e. |")
    print("|---|---|---|")
    for p in results["paired"]:
        per_seed = ", ".join(f"{d:+.5f}" for d in p["differences"])
        se = f" ± {p['se']:.5f}" if p["se"] is not None else ""
        print(f"| {p['metric'].replace('_', ' ')} | {per_seed} | {p['mean']:+.5f}{se} |")
    print()
    print("| `--dtype` | valid bpc ± s.e. (n) | test bpc ± s.e. (n) |")
    print("|---|---|---|")
    for c in results["configurations"]:
        if c["n"] == 0:
            print(f"| {c['name']} | no finished run | |")
            continue
        vse = f" ± {c['valid_bpc_se']:.4f}" if c["valid_bpc_se"] is not None else ""
        tse = f" ± {c['test_bpc_se']:.4f}" if c["test_bpc_se"] is not None else ""
        print(f"| {c['name']} | {c['valid_bpc_mean']:.4f}{vse} ({c['n']}) | {c['test_bpc_mean']:.4f}{tse} ({c['n']}) |")


COLOURS = {"float32": "#1f77b4", "bf16": "#d62728"}


def plot(results, png):
    """Left: the training loss of each run (solid float32, dashed bf16).
    Right: each seed's validation bpc in both dtypes, joined by a line."""
    plt = plots.pyplot()
    if plt is None:
        return False
    fig, (curves, seeds) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1.5, 1]})
    for c in results["configurations"]:
        for r in c["runs"]:
            points = [(p["step"], p["loss"]) for p in r["curve"] if "loss" in p]
            curves.plot([p[0] for p in points], [p[1] for p in points], "-" if c["name"] == "float32" else "--",
                        lw=1, color=COLOURS[c["name"]], label=f"{c['name']} seed {r['seed']}")
    curves.set_xlabel("step (batch {batch} x context {context} characters)".format(**results["budget"]))
    curves.set_ylabel("training loss (nats per character)")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    by_name = {c["name"]: {r["seed"]: r["valid_bpc"] for r in c["runs"]} for c in results["configurations"]}
    for seed in sorted(set(by_name.get("float32", {})) & set(by_name.get("bf16", {}))):
        seeds.plot([0, 1], [by_name["float32"][seed], by_name["bf16"][seed]], "-o", ms=4, lw=1, label=f"seed {seed}")
    seeds.set_xticks([0, 1])
    seeds.set_xticklabels(["float32", "bf16"])
    seeds.set_xlim(-0.3, 1.3)
    seeds.set_ylabel("validation bits per character (float32 eval)")
    seeds.grid(alpha=0.3)
    seeds.legend(fontsize=7)
    fig.suptitle("Section 9: bfloat16 against float32 training, same seeds", fontsize=10)
    return plots.save(plt, fig, png, dpi=80)


def smoke_check(first):
    problems = []
    for c in first["configurations"]:
        if c["n"] != 1 or not c["runs"][0]["valid_bpc"] > 0 or not c["runs"][0]["test_bpc"] > 0:
            problems.append(f"{c['name']}: expected one finished run with positive valid and test bpc, got {c['n']}")
    if len(first["paired"]) != 2:
        problems.append(f"expected the valid and test differences, got {len(first['paired'])}")
    return problems
