"""speed: section 5 of docs/EXPERIMENTS.md, speed per element: measurements
(one command at a time, each writing a JSON) rather than training runs."""

import os
import shlex

import checkpoints
import plots
import runner

# Section 5 of docs/EXPERIMENTS.md: speed per element. The kernels' figures
# (clustered-attention paper Figure 4, agglomerative paper Figure 1) re-run,
# and a whole model's training step (time and memory) per token for every
# mechanism at contexts 512-16384. Timings: one thread, one command at a time;
# the machine must be otherwise idle (the load average is recorded).
# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 5

EXPERIMENT = {
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
    "smoke_figure_clustered": ["--lengths", "64,128", "--repeats", "1", "--heads", "2", "--head-dim", "8"],
    "smoke_figure_agglomerative": ["--lengths", "32,64", "--repeats", "1", "--batch", "2", "--width", "32",
                                   "--heads", "2"],
}


def commands(exp, out, attnkit, smoke):
    """(name, argv, json path) of every measurement, in the order they run."""
    key = (lambda k: "smoke_" + k) if smoke else (lambda k: k)
    contexts, tokens, model = exp[key("contexts")], exp[key("tokens_per_step")], exp[key("model")]
    attention = ",".join(exp["attention"])
    planned = []
    for context in contexts:
        path = os.path.join(out, f"train-{context}.json")
        planned.append((f"model step, context {context}",
                        runner.attnkit_command(attnkit, "bench-model", [
                            "--what", "train", "--attention", attention, *model, "--context", str(context),
                            "--batch", str(max(1, tokens // context)), "--repeats", "1" if smoke else "3",
                            "--no-baseline", "--threads", "1", "--json", path]), path))
    path = os.path.join(out, "memory.json")
    planned.append(("model step memory", runner.attnkit_command(attnkit, "bench-model", [
        "--what", "memory", "--attention", attention, *model, "--memory-contexts", ",".join(map(str, contexts)),
        "--memory-batch", "1", "--threads", "1", "--json", path]), path))
    path = os.path.join(out, "figure-clustered.json")
    planned.append(("figure-clustered", runner.attnkit_command(attnkit, "figure-clustered", [
        *exp[key("figure_clustered")], "--threads", "1", "--json", path]), path))
    path = os.path.join(out, "figure-agglomerative.json")
    planned.append(("figure-agglomerative", runner.attnkit_command(attnkit, "figure-agglomerative", [
        *exp[key("figure_agglomerative")], "--threads", "1", "--json", path]), path))
    return planned


def collect(exp, commands, out, command):
    rows, memory = [], []
    for name, argv, path in commands:
        doc = checkpoints.read_json(path)
        if doc is None:
            continue
        if name.startswith("model step, context"):
            context = int(runner.flag_value(argv, "--context"))
            batch = int(runner.flag_value(argv, "--batch"))
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
    sessions = checkpoints.read_jsonl(os.path.join(out, "sessions.jsonl"))
    return {"experiment": exp["title"], "command": command,
            "commands": {name: shlex.join(argv) for name, argv, _ in commands},
            "model_step": rows, "model_memory": memory,
            "figure_clustered": checkpoints.read_json(os.path.join(out, "figure-clustered.json")),
            "figure_agglomerative": checkpoints.read_json(os.path.join(out, "figure-agglomerative.json")),
            "sessions": sessions}


def plot(results, png):
    plt = plots.pyplot()
    if plt is None:
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
    return plots.save(plt, fig, png)


def kernels_table(figure):
    """figure-clustered's measurements: forward+backward us per element per
    length and mechanism, and full attention's time over clustered's."""
    rows = figure["rows"]
    names = list(dict.fromkeys(r["attention"] for r in rows))
    us = {(r["L"], r["attention"]): r["us_per_element"] for r in rows}
    ratio = "full" in names and "clustered" in names
    print("| L | " + " | ".join(names) + (" | full / clustered |" if ratio else " |"))
    print("|---:|" + "---:|" * (len(names) + ratio))
    for length in sorted({r["L"] for r in rows}):
        cells = [f"{us[(length, n)]:.1f}" if (length, n) in us else "" for n in names]
        if ratio:
            cells.append(f"{us[(length, 'full')] / us[(length, 'clustered')]:.1f}x"
                         if (length, "full") in us and (length, "clustered") in us else "")
        print(f"| {length:,} | " + " | ".join(cells) + " |")


def per_context_table(rows, value, digits, ratio):
    """One row per mechanism, one column per context: VALUE(row) with DIGITS
    decimals; with RATIO, a last column of the longest context's value over
    the shortest's."""
    contexts = sorted({r["context"] for r in rows})
    names = list(dict.fromkeys(r["attention"] for r in rows))
    by = {(r["attention"], r["context"]): value(r) for r in rows}
    ratio = ratio and len(contexts) > 1
    print("| mechanism | " + " | ".join(f"{c:,}" for c in contexts) +
          (f" | {contexts[-1]:,} / {contexts[0]:,} |" if ratio else " |"))
    print("|---|" + "---:|" * (len(contexts) + ratio))
    for n in names:
        cells = [f"{by[(n, c)]:.{digits}f}" if (n, c) in by else "" for c in contexts]
        if ratio:
            first, last = by.get((n, contexts[0])), by.get((n, contexts[-1]))
            cells.append(f"{last / first:.2f}x" if first and last else "")
        print(f"| {n} | " + " | ".join(cells) + " |")


def table(results):
    """The tables of docs/EXPERIMENTS.md, section 5: the kernels (figure-clustered),
    a model's training step in us per token, and its memory in MiB (batch 1)."""
    if results["figure_clustered"]:
        kernels_table(results["figure_clustered"])
        print()
    per_context_table(results["model_step"], lambda r: r["us_per_token"], 1, ratio=True)
    print()
    per_context_table(results["model_memory"], lambda r: r["step_mib"], 1, ratio=False)


def smoke_check(first):
    problems = []
    expected = len(EXPERIMENT["attention"]) * len(EXPERIMENT["smoke_contexts"])
    if len(first["model_step"]) != expected or len(first["model_memory"]) != expected:
        problems.append(f"expected {expected} step and memory rows, got {len(first['model_step'])} and "
                        f"{len(first['model_memory'])}")
    if any(not r["us_per_token"] > 0 for r in first["model_step"]):
        problems.append("a step time is not positive")
    return problems

