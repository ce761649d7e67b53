"""cloze-long: section 4 of docs/EXPERIMENTS.md again, in the paper's regime
(issue 29). Section 4's paragraphs (n = 60 words) were shorter than the
reader's states (k = 128), the case where C = H^T H holds more numbers than H
and gains no memory; here n / k = 5 (320-word paragraphs, k = 64). The
read-outs: none, linear, gated, gated with its gate opened at the start
(bias 4: sigmoid = 0.98, so C starts at 0.96 of linear's instead of about a
quarter; the hypothesis section 4 offered for gated < linear), and softmax;
3 seeds, the same model and budget. Each run is one `attnkit-experiments
cloze`, which writes its own result.json."""

import os
import subprocess

import checkpoints
import paths
import plots
import runner
import stats

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 4

CORPUS = "kjv"

EXPERIMENT = {
    "title": "Cheap linear attention in its regime: documents five times the memory's size, cloze questions",
    "paper": {"source": "de Brebisson and Vincent, section 5 and Figure 1 (CNN cloze questions; curves, "
                        "no numbers)",
              "claim": "validation accuracy orders none < linear < gated linear < softmax"},
    # name -> the read-out's flags
    "configurations": [("none", ["--readout", "none"]), ("linear", ["--readout", "linear"]),
                       ("gated", ["--readout", "gated"]),
                       ("gated-open", ["--readout", "gated", "--gate-bias", "4"]),
                       ("softmax", ["--readout", "softmax"])],
    # Section 4's reader at k = 2 x 32 = 64 over 320-word paragraphs (n / k =
    # 5), 12-word queries, one GRU for document and query (section 4's main
    # setting); AdamW 3e-3, 3000 batches of 32.
    "flags": ["--paragraph", "320", "--query", "12", "--embedding", "64", "--hidden", "32", "--shared-encoder",
              "--steps", "3000", "--batch", "32", "--lr", "3e-3", "--eval-every", "250",
              "--valid-examples", "1000", "--test-examples", "4000"],
    "smoke_flags": ["--paragraph", "40", "--query", "6", "--embedding", "8", "--hidden", "8", "--shared-encoder",
                    "--min-count", "1", "--stop-words", "10", "--steps", "6", "--batch", "4", "--eval-every", "3",
                    "--valid-examples", "8", "--test-examples", "16"],
    "seeds": [1, 2, 3],
}

# Flattened: less than this validation accuracy gained over the last fifth of the steps.
FLAT_ACCURACY = 0.005


def jobs(exp, out, data, attnkit, seeds, smoke):
    flags = exp["smoke_flags" if smoke else "flags"]
    planned = []
    for seed in seeds:  # replica 1 of every configuration first
        for name, readout in exp["configurations"]:
            run_dir = os.path.join(out, name, f"seed-{seed}")
            argv = runner.attnkit_command(attnkit, "cloze", ["--data", data, *readout, *flags, "--seed", str(seed),
                                                             "--threads", "1", "--out", run_dir])
            planned.append({"dir": run_dir, "train": argv, "seed": seed, "config": name,
                            "steps": int(runner.flag_value(flags, "--steps")), "label": f"{name} seed {seed}"})
    return planned


# One run: skipped when its result.json is at the full budget, resumed when it has a checkpoint.
run_job = runner.own_result_run(
    lambda result, job: result["step"] == job["steps"],
    lambda result: f"test accuracy {result['test_accuracy']:.4f}")


def data(args):
    """The KJV corpus (scripts/fetch-corpus kjv): --data, default build/data/kjv."""
    directory = paths.directory(args.data, "build", "data", CORPUS)
    if not os.path.exists(os.path.join(directory, "meta.json")):
        raise SystemExit(f"reproduce: no corpus at {directory} (scripts/fetch-corpus {CORPUS} --out {directory})")
    return directory


def smoke_data(tmp, attnkit):
    """The shipped text, prepared by `attnkit data char-lm` in the smoke's directory."""
    directory = os.path.join(tmp, "data")
    text = os.path.join(paths.ROOT, "tests", "data", "genesis-1-2.txt")
    subprocess.run(runner.attnkit_command(attnkit, "data", ["char-lm", "--input", text, "--out", directory]),
                   check=True, stdout=subprocess.DEVNULL)
    return directory


def valid_gain_last_fifth(curve):
    """Validation accuracy gained over the last fifth of the steps (None with fewer than two records)."""
    if len(curve) < 2:
        return None
    cut = 0.8 * curve[-1]["step"]
    before = [r["valid_accuracy"] for r in curve if r["step"] <= cut]
    return curve[-1]["valid_accuracy"] - (before[-1] if before else curve[0]["valid_accuracy"])


def collect(exp, jobs, data, command):
    configs = []
    baselines = None
    for name, readout in exp["configurations"]:
        runs = []
        for job in (j for j in jobs if j["config"] == name):
            r = checkpoints.read_json(os.path.join(job["dir"], "result.json"))
            if r is None or r["step"] != job["steps"]:
                continue
            curve = stats.curve(checkpoints.read_jsonl(os.path.join(job["dir"], "metrics.jsonl")),
                                ["step", "loss", "accuracy", "valid_loss", "valid_accuracy", "elapsed"])
            baselines = r["baselines"]
            runs.append({"seed": job["seed"], "test_accuracy": r["test_accuracy"], "test_loss": r["test_loss"],
                         "test_examples": r["test_examples"], "valid_accuracy": r["valid_accuracy"],
                         "parameters": r["parameters"], "curve": curve,
                         "valid_gain_last_fifth": valid_gain_last_fifth(curve),
                         "train_seconds": r["train_seconds"], "loadavg": r["session"]["loadavg_end"]})
        accuracy, accuracy_se = stats.mean_se([r["test_accuracy"] for r in runs])
        gains = [r["valid_gain_last_fifth"] for r in runs]
        configs.append({"name": name, "flags": readout, "n": len(runs), "runs": runs,
                        "parameters": runs[0]["parameters"] if runs else None,
                        "test_accuracy": accuracy, "test_accuracy_se": accuracy_se,
                        "flattened": bool(runs) and all(g is not None and g < FLAT_ACCURACY for g in gains)})
    flags = jobs[0]["train"]
    return {"experiment": exp["title"], "command": command, "paper": exp["paper"],
            "data": os.path.abspath(data), "flags": exp["flags"],
            "paragraph": int(runner.flag_value(flags, "--paragraph")),
            "k": 2 * int(runner.flag_value(flags, "--hidden")),
            "steps": int(runner.flag_value(flags, "--steps")), "seeds": sorted({j["seed"] for j in jobs}),
            "flat_accuracy": FLAT_ACCURACY, "baselines": baselines, "configurations": configs,
            "paired": stats.paired_differences({c["name"]: c for c in configs}, PAIRS, "test_accuracy")}


# Same-seed differences of test accuracy, A minus B (the same examples in the
# same order and the same initial weights where the models share them).
PAIRS = [("linear", "none"), ("gated", "linear"), ("gated-open", "linear"), ("gated-open", "gated"),
         ("softmax", "linear")]


def percent(value, se=None):
    return f"{100 * value:.1f}%" + (f" ± {100 * se:.1f}" if se is not None else "")


def table(results):
    print("| read-out | parameters | test accuracy ± s.e. (n) | per seed | validation gain, last fifth | flattened |")
    print("|---|---:|---|---|---|---|")
    for c in results["configurations"]:
        if c["n"] == 0:
            print(f"| {c['name']} | | no finished run | | | |")
            continue
        per_seed = ", ".join(percent(r["test_accuracy"]) for r in c["runs"])
        gains = ", ".join("" if r["valid_gain_last_fifth"] is None else f"{100 * r['valid_gain_last_fifth']:+.1f}"
                          for r in c["runs"])
        print(f"| {c['name']} | {c['parameters']} | {percent(c['test_accuracy'], c['test_accuracy_se'])} "
              f"({c['n']}) | {per_seed} | {gains} | {'yes' if c['flattened'] else 'no'} |")
    if results["baselines"]:
        b = results["baselines"]["test"]
        print(f"| *most frequent candidate* | | {percent(b['frequency'])} | | | |")
    if results["paired"]:
        print()
        print("| test accuracy, A minus B (same seed) | per seed | mean ± s.e. |")
        print("|---|---|---|")
        for p in results["paired"]:
            per_seed = ", ".join(f"{100 * d:+.1f}" for d in p["differences"])
            se = f" ± {100 * p['se']:.1f}" if p["se"] is not None else ""
            print(f"| {p['a']} minus {p['b']} | {per_seed} | {100 * p['mean']:+.1f}{se} |")


COLOURS = {"none": "#555555", "linear": "#1f77b4", "gated": "#ff7f0e", "gated-open": "#9467bd",
           "softmax": "#d62728"}


def plot(results, png):
    """Validation accuracy against the step, every seed (thin) and the mean (thick)."""
    plt = plots.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in results["configurations"]:
        if not c["runs"]:
            continue
        for r in c["runs"]:
            ax.plot([p["step"] for p in r["curve"]], [100 * p["valid_accuracy"] for p in r["curve"]], "-",
                    color=COLOURS[c["name"]], lw=0.6, alpha=0.5)
        steps, accuracy = stats.mean_curve(c["runs"], "valid_accuracy")
        ax.plot(steps, [100 * a for a in accuracy], "-o", ms=3, lw=1.6, color=COLOURS[c["name"]],
                label=f"{c['name']} (n={c['n']})")
    ax.set_xlabel("step (32 questions each)")
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(f"Read-outs of a {results['paragraph']}-word paragraph into k = {results['k']} "
                 f"(n / k = {results['paragraph'] / results['k']:.0f})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return plots.save(plt, fig, png, dpi=90)


def smoke_check(first):
    problems = [f"{c['name']}: {c['n']} runs" for c in first["configurations"] if c["n"] != 1]
    by_name = {c["name"]: c for c in first["configurations"]}
    for c in first["configurations"]:
        for r in c["runs"]:
            if not 0 <= r["test_accuracy"] <= 1 or r["test_examples"] != 16 or len(r["curve"]) != 2:
                problems.append(f"{c['name']}: implausible result {r}")
    if by_name["gated"]["n"] and by_name["gated-open"]["n"] and \
            by_name["gated"]["runs"][0]["curve"] == by_name["gated-open"]["runs"][0]["curve"]:
        problems.append("gated-open trained exactly as gated: --gate-bias has no effect")
    return problems
