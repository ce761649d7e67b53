"""node-classify: section 8 of docs/EXPERIMENTS.md, node classification on
the Debian package graph. Each run is one `attnkit-experiments node-classify`, which
writes its own result.json and may stop early, so the train-then-measure
course of the other sections does not fit: its own job and main()."""

import os
import subprocess

import checkpoints
import paths
import plots
import runner
import stats

# Section 8 of docs/EXPERIMENTS.md (issue 13, part 4.3). The SAC paper, Table
# 3: node classification on citation graphs (GAT's transductive setting), SAC
# against GAT. Here: the Debian package graph (scripts/package-graph: the
# desktop sections' largest component), a GAT-style network with dot-product
# attention over the input graph's edges, full attention, the input edges plus
# as many random edges as SAC adds, and SAC initialised from the input graph.
# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 8

EXPERIMENT = {
    "title": "SAC, node classification on the Debian package graph",
    "paper": {"source": "SAC paper, Table 3 (accuracy %, mean of 3 runs)",
              "cora": {"GAT": 83.0, "SAC": 84.8}, "citeseer": {"GAT": 72.5, "SAC": 73.8},
              "pubmed": {"GAT": 79.0, "SAC": 79.7}},
    # name -> (what it attends over: --structure input|input+random:... or
    # --attention full|sac:... ({seed} is the run's seed), extra flags)
    "configurations": [
        ("input", ["--structure", "input"], []),
        ("full", ["--attention", "full"], []),
        ("input+random-2", ["--structure", "input+random:alpha=2,seed={seed}"], []),
        ("sac-2", ["--attention", "sac:alpha=2,variant=all-connected"], []),
        ("sac-2-edge", ["--attention", "sac:alpha=2,variant=all-connected,reward=edge"], []),
        # GAT's layout has no residual connections, which leaves full
        # attention nothing of a node's own features: the same two with them.
        ("input-residual", ["--structure", "input"], ["--residual"]),
        ("full-residual", ["--attention", "full"], ["--residual"]),
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

# The smoke's graph: scripts/package-graph on the hand-written package index.
SMOKE_GRAPH = ["--input", os.path.join(paths.ROOT, "tests", "data", "packages-fixture.txt"),
               "--sections", "games,graphics,sound", "--train-per-class", "2", "--valid", "6",
               "--test", "10", "--min-count", "2"]


def prepare(data, extra):
    """The package graph in DATA: scripts/package-graph EXTRA writes it when it is missing."""
    if not os.path.exists(os.path.join(data, "meta.json")):
        subprocess.run([os.path.join(paths.ROOT, "scripts", "package-graph"), "--out", data, *extra], check=True)


def jobs(exp, out, data, attnkit, seeds, smoke):
    flags = exp["smoke_flags" if smoke else "flags"]
    planned = []
    for seed in seeds:  # replica 1 of every configuration first
        for name, kind, extra in exp["configurations"]:
            run_dir = os.path.join(out, name, f"seed-{seed}")
            argv = runner.attnkit_command(attnkit, "node-classify", [
                "--data", data, *(flag.format(seed=seed, out=out) for flag in kind), *flags, *extra,
                "--seed", str(seed), "--threads", "1", "--out", run_dir])
            planned.append({"dir": run_dir, "train": argv, "seed": seed, "config": name,
                            "label": f"{name} seed {seed}"})
    return planned


# One run: skipped when its result.json exists, resumed when it has a checkpoint.
run_job = runner.own_result_run(
    lambda result, job: True,
    lambda result: f"test accuracy {result['test_accuracy']:.4f}, best epoch {result['best']['epoch']}")


def collect(exp, jobs, data, command):
    meta = checkpoints.data_meta(data)
    configs = []
    for name, kind, extra in exp["configurations"]:
        runs = []
        for job in (j for j in jobs if j["config"] == name):
            r = checkpoints.read_json(os.path.join(job["dir"], "result.json"))
            if r is None:
                continue
            runs.append({"seed": job["seed"], "structure": r.get("structure"), "attention": r["attention"],
                         "test_accuracy": r["test_accuracy"],
                         "valid_accuracy": r["best"]["valid_accuracy"], "best_epoch": r["best"]["epoch"],
                         "epochs_run": r["epochs_run"], "edges_per_node": r["best"]["edges_per_node"],
                         "same_class": r["best"]["same_class"], "train_seconds": r["train_seconds"],
                         "seconds_per_epoch": r["seconds_per_epoch"], "loadavg": r["session"]["loadavg_end"]})
        mean, se = stats.mean_se([r["test_accuracy"] for r in runs])
        configs.append({"name": name, "flags": [*kind, *extra], "runs": runs, "test_accuracy": mean,
                        "test_accuracy_se": se,
                        "same_class": stats.mean_se([r["same_class"] for r in runs])[0],
                        "edges_per_node": stats.mean_se([r["edges_per_node"] for r in runs])[0],
                        "seconds_per_epoch": stats.mean_se([r["seconds_per_epoch"] for r in runs])[0]})
    return {"experiment": exp["title"], "command": command, "paper": exp["paper"],
            "dataset": {k: meta.get(k) for k in ("nodes", "edges", "features", "classes", "class_counts",
                                                 "split_counts", "sections", "source")},
            "flags": exp["flags"], "configurations": configs}


def spread(values, digits):
    """The range of VALUES as printed with DIGITS decimals: 'low-high', or one
    value when they print alike; whole values print whole ('2189')."""
    if all(v == int(v) for v in values):
        digits = 0
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def table(results):
    """The table of docs/EXPERIMENTS.md, section 8: test accuracy (%), the
    mean and each seed's; the evaluated structures' edges per node and
    same-class share, and the seconds per epoch, as their range over the seeds."""
    print("| structure | test accuracy % (mean, seeds) | edges per node | same-section edges | s per epoch |")
    print("|---|---:|---:|---:|---:|")
    for c in results["configurations"]:
        runs = c["runs"]
        if not runs:
            print(f"| {c['name']} | (no finished run) | | | |")
            continue
        seeds = " / ".join(f"{100 * r['test_accuracy']:.1f}" for r in runs)
        print(f"| {c['name']} | {100 * c['test_accuracy']:.1f} ({seeds}) | "
              f"{spread([r['edges_per_node'] for r in runs], 2)} | {spread([r['same_class'] for r in runs], 3)} | "
              f"{spread([r['seconds_per_epoch'] for r in runs], 2)} |")


def plot(results, png):
    plt = plots.pyplot()
    if plt is None:
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
    return plots.save(plt, fig, png)


def smoke_check(first):
    problems = [f"{c['name']}: {len(c['runs'])} runs" for c in first["configurations"] if len(c["runs"]) != 1]
    for c in first["configurations"]:
        for r in c["runs"]:
            if not 0 <= r["test_accuracy"] <= 1 or r["edges_per_node"] < 1:
                problems.append(f"{c['name']}: implausible result {r}")
    return problems


def data(args):
    """The package graph in --data (default build/data/package-graph), made there when missing."""
    directory = paths.directory(args.data, "build", "data", "package-graph")
    prepare(directory, [])
    return directory


def smoke_data(tmp, attnkit):
    """The fixture's graph, prepared in the smoke's directory."""
    directory = os.path.join(tmp, "data")
    prepare(directory, SMOKE_GRAPH)
    return directory
