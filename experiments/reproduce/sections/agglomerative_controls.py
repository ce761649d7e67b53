"""agglomerative-controls (KJV) and agglomerative-controls-gcide: section 1 of
docs/EXPERIMENTS.md again, with the control that section lacked. Beside full
and agglomerative attention, each with sinusoidal and with convolutional
positions, the same model without attention (`none`: each position's output
is its own value), so that "agglomerative attention is as good as full
attention" can be told from "the convolution does the work and attention is
unused"; 3 seeds, a budget 4x section 1's, on two corpora. The runs,
collection and plot are agglomerative-lm's; the table adds what says whether
attention is used (each configuration's gap to `none` with the same
positions) and whether validation had flattened."""

import plots
import stats
from sections import agglomerative_lm
from sections.agglomerative_lm import bpc_problem, collect as collect_runs

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 1

CORPUS = "kjv"

CONV = ["--positions", "conv", "--conv-width", "8"]
SINUSOIDAL = ["--positions", "sinusoidal"]

# Flattened: less than this many bits per character gained on validation over
# the last fifth of the steps (issue 29).
FLAT_BPC = 0.005



def print_paired(paired, digits):
    """The table of same-seed differences (stats' paired comparisons), when
    there are any: A minus B per seed, and their mean with its standard error."""
    if not paired:
        return
    print()
    print("| test bpc, A minus B (same seed) | per seed | mean ± s.e. |")
    print("|---|---|---|")
    for p in paired:
        per_seed = ", ".join(f"{d:+.{digits}f}" for d in p["differences"])
        se = f" ± {p['se']:.{digits}f}" if p["se"] is not None else ""
        print(f"| {p['a']} minus {p['b']} | {per_seed} | {p['mean']:+.{digits}f}{se} |")

def replaced(flags, **values):
    """flags with the values of some options replaced in place: steps=4800
    sets --steps 4800."""
    out = list(flags)
    for key, value in values.items():
        out[out.index("--" + key.replace("_", "-")) + 1] = str(value)
    return out


SECTION_1 = agglomerative_lm.EXPERIMENT
EXPERIMENT = {
    "title": "Agglomerative attention with a no-attention control, character language model",
    "paper": SECTION_1["paper"],
    "configurations": [
        ("full-conv", "full", CONV),
        ("agglomerative-conv", "agglomerative:classes=8", CONV),
        ("none-conv", "none", CONV),
        ("full-sinusoidal", "full", SINUSOIDAL),
        ("agglomerative-sinusoidal", "agglomerative:classes=8", SINUSOIDAL),
        ("none-sinusoidal", "none", SINUSOIDAL),
    ],
    # Section 1's model and schedule, 4x its steps: 4800 steps of 32 x 128
    # characters (19.7 M characters, 5.4 passes over KJV's train split),
    # validation every 400 steps.
    "model": SECTION_1["model"],
    "trainer": replaced(SECTION_1["trainer"], steps=4800, log_every=50, eval_every=400),
    "smoke_model": SECTION_1["smoke_model"],
    "smoke_trainer": replaced(SECTION_1["smoke_trainer"], steps=10, eval_every=2, checkpoint_every=5),
    "seeds": [1, 2, 3],
}


def jobs(exp, out, data, attnkit, seeds, smoke):
    """agglomerative-lm's jobs, the convolutional trio (full, agglomerative,
    none) over every seed first: the question of whether attention is used
    at all has its 3 seeds before the sinusoidal variants start, so a budget
    that ends early leaves a complete comparison rather than one seed of
    everything."""
    planned = agglomerative_lm.jobs(exp, out, data, attnkit, seeds, smoke)
    return sorted(planned, key=lambda job: not job["config"].endswith("-conv"))


def flattening(run):
    """Validation bpc gained over the last fifth of a run's steps: the value
    at the last evaluation at or before 80% of the steps minus the final one
    (None with fewer than two evaluations)."""
    valid = [(r["step"], r["valid_bpc"]) for r in run["curve"] if "valid_bpc" in r]
    if len(valid) < 2:
        return None
    cut = 0.8 * valid[-1][0]
    before = [bpc for step, bpc in valid if step <= cut]
    return (before[-1] if before else valid[0][1]) - valid[-1][1]


def collect(exp, jobs, data, command):
    results = collect_runs(exp, jobs, data, command)
    by_name = {c["name"]: c for c in results["configurations"]}
    for c in results["configurations"]:
        gains = [flattening(r) for r in c["runs"]]
        c["valid_gain_last_fifth"] = gains
        c["flattened"] = bool(gains) and all(g is not None and g < FLAT_BPC for g in gains)
        control = by_name.get("none-" + c["name"].split("-", 1)[1])
        c["gap_to_none"] = (control["test_bpc_mean"] - c["test_bpc_mean"]
                            if control and control["n"] and c["n"] else None)
    results["flat_bpc"] = FLAT_BPC
    results["paired"] = stats.paired_differences(by_name, PAIRS, "test_bpc")
    return results


# Test-bpc differences between configurations trained with the same seed:
# the same batches in the same order (a batch is a pure function of the seed
# and the step) and the same seed for the initial weights, so the difference
# cancels what the data order adds to each run's spread. A minus B: positive
# means A is worse.
PAIRS = [("agglomerative-conv", "full-conv"), ("none-conv", "full-conv"), ("none-conv", "agglomerative-conv"),
         ("agglomerative-sinusoidal", "full-sinusoidal"), ("none-sinusoidal", "full-sinusoidal"),
         ("none-sinusoidal", "agglomerative-sinusoidal")]


def table(results):
    print("| configuration | parameters | test bpc ± s.e. (n) | below `none` (same positions) | "
          "validation gain, last fifth | flattened | paper |")
    print("|---|---:|---|---:|---|---|---|")
    for c in results["configurations"]:
        paper = c["paper_test_bpc"]
        paper_bpc = f"{paper[0]} ± {paper[1]}" if paper else ""
        if c["n"] == 0:
            print(f"| {c['name']} | | no finished run | | | | {paper_bpc} |")
            continue
        se = f" ± {c['test_bpc_se']:.4f}" if c["test_bpc_se"] is not None else ""
        gap = f"{c['gap_to_none']:.3f}" if c["gap_to_none"] is not None and not c["name"].startswith("none") else ""
        gains = ", ".join("" if g is None else f"{g:.4f}" for g in c["valid_gain_last_fifth"])
        print(f"| {c['name']} | {c['parameters']} | {c['test_bpc_mean']:.3f}{se} ({c['n']}) | {gap} | "
              f"{gains} | {'yes' if c['flattened'] else 'no'} | {paper_bpc} |")
    print_paired(results.get("paired"), digits=4)


# One colour per attention, solid for convolutional and dashed for sinusoidal positions.
COLOURS = {"full": "#d62728", "agglomerative": "#2ca02c", "none": "#555555"}


def plot(results, png):
    """Left: validation bpc against the step (mean over the seeds), from the
    second evaluation on, where the configurations separate. Right: each
    configuration's test bpc, seeds as dots, the mean as a line."""
    plt = plots.pyplot()
    if plt is None:
        return False
    configs = [c for c in results["configurations"] if c["runs"]]
    fig, (curves, tests) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1.5, 1]})
    for c in configs:
        attention, positions = c["name"].split("-", 1)
        steps, bpc = stats.mean_curve(c["runs"], "valid_bpc")
        curves.plot(steps[1:], bpc[1:], "-o" if positions == "conv" else "--o", ms=3, lw=1.2,
                    color=COLOURS[attention], label=f"{c['name']} (n={c['n']})")
    curves.set_xlabel("step (batch {batch} x context {context} characters)".format(**results["budget"]))
    curves.set_ylabel("validation bits per character")
    curves.set_title("Validation, mean over the seeds", fontsize=9)
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    for i, c in enumerate(configs):
        attention = c["name"].split("-", 1)[0]
        tests.hlines(c["test_bpc_mean"], i - 0.3, i + 0.3, color=COLOURS[attention], lw=3)
        tests.scatter([i] * len(c["runs"]), [r["test_bpc"] for r in c["runs"]], color="k", s=10, zorder=3)
    if configs:
        values = [r["test_bpc"] for c in configs for r in c["runs"]]
        tests.set_ylim(min(values) - 0.02, max(values) + 0.02)
    tests.set_xticks(range(len(configs)))
    tests.set_xticklabels([c["name"] for c in configs], fontsize=7, rotation=20, ha="right")
    tests.set_ylabel("test bits per character")
    tests.set_title("Test (lines: mean; dots: seeds)", fontsize=9)
    corpus = ", ".join(results["corpus"]["sources"]) or results["corpus"]["dir"]
    fig.suptitle(f"Full and agglomerative attention against no attention, character model on {corpus}",
                 fontsize=10)
    return plots.save(plt, fig, png, dpi=90)


def smoke_check(first):
    problems = [p for p in (bpc_problem(c) for c in first["configurations"]) if p]
    params = {c["name"]: c["parameters"] for c in first["configurations"]}
    # `none` keeps every parameter of the block (the query and key maps go
    # unused), so it has full attention's count.
    if params.get("none-conv") != params.get("full-conv"):
        problems.append(f"none and full should have the same parameters: {params}")
    for c in first["configurations"]:
        if c["runs"] and flattening(c["runs"][0]) is None:
            problems.append(f"{c['name']}: fewer than two validation points")
        if c["name"] != "none-conv" and c["name"].endswith("-conv") and c["gap_to_none"] is None:
            problems.append(f"{c['name']}: no gap to none-conv")
    return problems
