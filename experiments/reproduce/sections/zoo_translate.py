"""zoo-translate: the classic zoo of *Attention in a Nutshell* in the model it
was made for, a recurrent encoder-decoder (models/seq2seq.h), translating
German dictionary entries into English character by character (Debian's
dict-freedict-deu-eng: scripts/fetch-corpus freedict-deu-eng). One run per
score function (additive, general, dot, scaled dot, location) and one without
attention, 3 seeds each, the same model and budget. Each run is one
`attnkit-experiments translate`, which writes its own result.json (greedy
outputs on the whole test split: exact match against any listed sense,
character error rate, both by source length, and the attention weights of a
few test entries), so this section has its own course, as node-classify."""

import os

import checkpoints
import paths
import plots
import runner
import stats

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 10

CORPUS = "freedict-deu-eng"

EXPERIMENT = {
    "title": "The classic zoo in a recurrent encoder-decoder, German-English dictionary entries",
    "paper": {"source": "Attention in a Nutshell, sections 2-3 (no numbers: the claim is that attention "
                        "helps an encoder-decoder, the more the longer the input)"},
    "configurations": ["none", "additive", "general", "dot", "scaled-dot", "location"],
    # 32-dimensional character embeddings, a bidirectional GRU of 2 x 64 and
    # a GRU decoder of 128 (195 k parameters with additive scores); AdamW
    # 2e-3, 4000 batches of 64 entries (256 k examples, 0.8 passes over the
    # 324 k train sources). About 0.3 s per step on one loaded core: 20
    # minutes per run, 6 CPU-hours for the 18.
    "flags": ["--steps", "4000", "--batch", "64", "--embedding", "32", "--hidden", "64", "--lr", "2e-3",
              "--eval-every", "500", "--valid-examples", "500", "--attention-examples", "6"],
    "smoke_flags": ["--steps", "6", "--batch", "8", "--embedding", "8", "--hidden", "8", "--eval-every", "3",
                    "--valid-examples", "8", "--test-examples", "16", "--attention-examples", "2"],
    "seeds": [1, 2, 3],
}

# The smoke's dictionary: German number words 1-999 (experiments/tests/data/make-numbers-dictd).
SMOKE_DATA = os.path.join(paths.ROOT, "experiments", "tests", "data", "numbers-deu-eng")

# Source lengths (characters) pooled for the accuracy-by-length plot and table.
LENGTH_BINS = [(1, 6), (7, 9), (10, 12), (13, 15), (16, 19), (20, 24), (25, 32)]

# Flattened: less than this exact-match gain on validation over the last fifth of the steps.
FLAT_EXACT = 0.005


def jobs(exp, out, data, attnkit, seeds, smoke):
    flags = exp["smoke_flags" if smoke else "flags"]
    planned = []
    for seed in seeds:  # replica 1 of every configuration first
        for score in exp["configurations"]:
            run_dir = os.path.join(out, score, f"seed-{seed}")
            argv = runner.attnkit_command(attnkit, "translate", [
                "--data", data, "--score", score, *flags, "--seed", str(seed), "--threads", "1", "--out", run_dir])
            planned.append({"dir": run_dir, "train": argv, "seed": seed, "config": score,
                            "steps": int(runner.flag_value(flags, "--steps")), "label": f"{score} seed {seed}"})
    return planned


# One run: skipped when its result.json is at the full budget, resumed when it has a checkpoint.
run_job = runner.own_result_run(
    lambda result, job: result["step"] == job["steps"],
    lambda result: f"test exact match {result['test']['exact']:.4f}, character error rate {result['test']['cer']:.4f}")


def valid_gain_last_fifth(curve):
    """Validation exact match gained over the last fifth of the steps (None with fewer than two records)."""
    if len(curve) < 2:
        return None
    cut = 0.8 * curve[-1]["step"]
    before = [r["valid_exact"] for r in curve if r["step"] <= cut]
    return curve[-1]["valid_exact"] - (before[-1] if before else curve[0]["valid_exact"])


def by_length_bins(rows):
    """A run's test_by_source_length pooled into LENGTH_BINS: [{lo, hi, examples, exact, cer}]."""
    out = []
    for lo, hi in LENGTH_BINS:
        inside = [r for r in rows if lo <= r["length"] <= hi]
        n = sum(r["examples"] for r in inside)
        out.append({"lo": lo, "hi": hi, "examples": n,
                    "exact": sum(r["exact"] * r["examples"] for r in inside) / n if n else None,
                    "cer": sum(r["cer"] * r["examples"] for r in inside) / n if n else None})
    return out


def rounded_weights(examples):
    """The attention examples with their weights to 3 decimals (a heat map's
    resolution; the run's result.json keeps them whole)."""
    return [dict(e, weights=[[round(w, 3) for w in row] for row in e["weights"]]) if "weights" in e else e
            for e in examples]


def collect(exp, jobs, data, command):
    configs = []
    for score in exp["configurations"]:
        runs = []
        for job in (j for j in jobs if j["config"] == score):
            r = checkpoints.read_json(os.path.join(job["dir"], "result.json"))
            if r is None or r["step"] != job["steps"]:
                continue
            curve = stats.curve(checkpoints.read_jsonl(os.path.join(job["dir"], "metrics.jsonl")),
                                ["step", "loss", "valid_loss", "valid_exact", "valid_cer"])
            runs.append({"seed": job["seed"], "test_exact": r["test"]["exact"], "test_cer": r["test"]["cer"],
                         "test_loss": r["test"]["loss"], "test_examples": r["test"]["examples"],
                         "valid_exact": r["valid"]["exact"], "parameters": r["parameters"],
                         "by_length": by_length_bins(r["test_by_source_length"]), "curve": curve,
                         "valid_gain_last_fifth": valid_gain_last_fifth(curve),
                         "attention_examples": rounded_weights(r["attention_examples"]),
                         "train_seconds": r["train_seconds"],
                         "loadavg": r["session"]["loadavg_end"]})
        exact, exact_se = stats.mean_se([r["test_exact"] for r in runs])
        cer, cer_se = stats.mean_se([r["test_cer"] for r in runs])
        gains = [r["valid_gain_last_fifth"] for r in runs]
        bins = []
        for i, (lo, hi) in enumerate(LENGTH_BINS):
            mean, se = stats.mean_se([r["by_length"][i]["exact"] for r in runs if r["by_length"][i]["exact"] is not None])
            bin_cer, bin_cer_se = stats.mean_se([r["by_length"][i]["cer"] for r in runs
                                                 if r["by_length"][i]["cer"] is not None])
            bins.append({"lo": lo, "hi": hi, "exact": mean, "exact_se": se, "cer": bin_cer, "cer_se": bin_cer_se,
                         "examples": runs[0]["by_length"][i]["examples"] if runs else 0})
        configs.append({"name": score, "n": len(runs), "runs": runs, "parameters": runs[0]["parameters"] if runs else None,
                        "test_exact": exact, "test_exact_se": exact_se, "test_cer": cer, "test_cer_se": cer_se,
                        "flattened": bool(runs) and all(g is not None and g < FLAT_EXACT for g in gains),
                        "by_length": bins})
    meta = checkpoints.read_json(os.path.join(data, "meta.json")) or {}
    return {"experiment": exp["title"], "command": command, "paper": exp["paper"], "flags": exp["flags"],
            "data": meta, "flat_exact": FLAT_EXACT, "configurations": configs}


def _pm(mean, se, scale=100, digits=1):
    if mean is None:
        return ""
    return f"{scale * mean:.{digits}f}" + (f" ± {scale * se:.{digits}f}" if se is not None else "")


def table(results):
    print("| score | parameters | test exact match % (n) | test character error rate % | "
          "validation gain, last fifth (points) | flattened |")
    print("|---|---:|---|---|---|---|")
    for c in results["configurations"]:
        if not c["runs"]:
            print(f"| {c['name']} | | no finished run | | | |")
            continue
        gains = ", ".join("" if r["valid_gain_last_fifth"] is None else f"{100 * r['valid_gain_last_fifth']:.1f}"
                          for r in c["runs"])
        print(f"| {c['name']} | {c['parameters']} | {_pm(c['test_exact'], c['test_exact_se'])} ({c['n']}) | "
              f"{_pm(c['test_cer'], c['test_cer_se'])} | {gains} | {'yes' if c['flattened'] else 'no'} |")
    configs = [c for c in results["configurations"] if c["runs"]]
    if not configs:
        return
    bins = configs[0]["by_length"]
    for key, what in (("exact", "exact match %"), ("cer", "character error rate %")):
        print()
        print(f"| source length ({what}) | test entries | " + " | ".join(c["name"] for c in configs) + " |")
        print("|---|---:|" + "---|" * len(configs))
        for i, b in enumerate(bins):
            cells = " | ".join(_pm(c["by_length"][i][key], c["by_length"][i][key + "_se"]) for c in configs)
            print(f"| {b['lo']}-{b['hi']} | {b['examples']} | {cells} |")


def heat_map_example(results):
    """(configuration name, example) to draw: seed 1's attention example with the
    longest source, of the attention configuration with the best test exact match."""
    attending = [c for c in results["configurations"] if c["runs"] and c["name"] != "none"]
    if not attending:
        return None, None
    best = max(attending, key=lambda c: c["test_exact"])
    examples = [e for e in best["runs"][0]["attention_examples"] if "weights" in e]
    if not examples:
        return None, None
    return best["name"], max(examples, key=lambda e: len(e["source"]))


def plot(results, png):
    plt = plots.pyplot()
    if plt is None:
        return False
    configs = [c for c in results["configurations"] if c["runs"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1.2, 1]})
    for c in configs:
        points = [(f"{b['lo']}-{b['hi']}", 100 * b["exact"]) for b in c["by_length"] if b["exact"] is not None]
        left.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3,
                  linestyle="--" if c["name"] == "none" else "-", label=c["name"])
    left.set_xlabel("source length (characters)")
    left.set_ylabel("test exact match % (mean of seeds)")
    left.set_title("Accuracy against source length", fontsize=9)
    left.legend(fontsize=7)
    name, example = heat_map_example(results)
    if example is not None:
        weights = example["weights"]
        right.imshow(weights, cmap="Greys", aspect="auto", vmin=0, vmax=1)
        right.set_xticks(range(len(example["source"])))
        right.set_xticklabels(list(example["source"]), fontsize=7)
        right.set_yticks(range(len(weights)))
        right.set_yticklabels(list(example["output"]) + ["</s>"] * (len(weights) - len(example["output"])),
                              fontsize=7)
        right.set_title(f"{name} attention, seed 1: {example['source']} -> {example['output']}", fontsize=8)
    else:
        right.axis("off")
    return plots.save(plt, fig, png)


def smoke_check(first):
    problems = [f"{c['name']}: {len(c['runs'])} runs" for c in first["configurations"] if len(c["runs"]) != 1]
    params = {c["name"]: c["parameters"] for c in first["configurations"]}
    if params.get("none") != params.get("dot"):
        problems.append(f"none and dot should have the same parameters: {params}")
    for c in first["configurations"]:
        for r in c["runs"]:
            if not (0 <= r["test_exact"] <= 1 and r["test_cer"] >= 0 and r["test_examples"] == 16):
                problems.append(f"{c['name']}: implausible result {r}")
            if len(r["curve"]) != 2 or r["valid_gain_last_fifth"] is None:
                problems.append(f"{c['name']}: expected 2 validation records, got {r['curve']}")
            has_weights = all("weights" in e for e in r["attention_examples"])
            if len(r["attention_examples"]) != 2 or has_weights != (c["name"] != "none"):
                problems.append(f"{c['name']}: attention examples {r['attention_examples']}")
    return problems


def data(args):
    """The dictionary (scripts/fetch-corpus freedict-deu-eng): --data, default build/data/freedict-deu-eng."""
    directory = paths.directory(args.data, "build", "data", CORPUS)
    if not os.path.exists(os.path.join(directory, "meta.json")):
        raise SystemExit(f"reproduce: no dictionary at {directory} (scripts/fetch-corpus {CORPUS} --out {directory})")
    return directory


def smoke_data(tmp, attnkit):
    return SMOKE_DATA
