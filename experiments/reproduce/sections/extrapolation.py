"""extrapolation: section 11 of docs/EXPERIMENTS.md, positions that
extrapolate (issue 30). ALiBi's claim (Press, Smith and Lewis, "Train Short,
Test Long", ICLR 2022): a language model trained on short inputs and
evaluated on longer ones keeps (or improves) its perplexity with ALiBi, while
sinusoidal positions degrade sharply and rotary ones degrade too. Here: a
decoder character model on KJV with causal full attention, trained at context
256 with `--positions sinusoidal`, `alibi`, `rope` (rotary over every feature
of the head, the default fraction) and `none` (no positions at all: a causal
decoder can still infer a position from how many keys it sees, so it is the
natural control for extrapolation); 3 seeds, the same budget for all. Each
trained model is evaluated on the whole test split at contexts 256 to 4096
(`attnkit eval --context C`: the split cut into non-overlapping windows of C,
every character scored once, each window starting from an empty context).

`learned` positions are left out: their table has one trained row per
position up to the training context's max_length, and a position past the
trained rows has no row at all (the model refuses it), so there is nothing to
extrapolate. The sinusoidal table is fixed but finite (max_length 2048, the
model's default; `attnkit train --max-length` came later): beyond 2048 its runs are
evaluated through a copy with a longer table of the same formula and the same
trained weights (longer_table.py, which checks that the copy computes the
same logits).

The budget: about 100 minutes of one core for the 12 runs, so about 7
minutes per run with its evaluations. A 40-step run on one thread, beside
other builds, trained the model below at 7-11 k characters/s, and the
evaluations of one model at 256, 1024 and 4096 took 8, 13 and 21 s: 750
steps of 16 x 256 would have been about 6 minutes of training and 1 of
evaluation. When the runs started the load had doubled (5 k characters/s),
so 600 steps (2.5 M characters, 0.68 passes over KJV's train split); the
validation every 60 steps says whether the curves flattened (issue 29's
rule, agglomerative_controls.flattening: they had not)."""

import os
import sys

import plots
import runner
import stats
from sections import agglomerative_lm
from sections.agglomerative_controls import FLAT_BPC, flattening
from sections.agglomerative_lm import bpc_problem, collect as collect_runs

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 11

CORPUS = "kjv"

# The sinusoidal table's rows in a model of `attnkit train` (TransformerOptions'
# max_length default, which these runs keep): contexts beyond it are
# evaluated through longer_table.py's copy.
SINUSOIDAL_ROWS = 2048

LONGER_TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "longer_table.py")

EXPERIMENT = {
    "title": "Positions that extrapolate: ALiBi, rotary, sinusoidal and none, character language model",
    "paper": {"source": "Press, Smith and Lewis, Train Short, Test Long (ICLR 2022), Figure 1 and section 4 "
                        "(WikiText-103, trained at 512 and 1024 tokens, evaluated at up to 16k)",
              "claim": "ALiBi keeps or improves perplexity on inputs longer than training; sinusoidal positions "
                       "degrade sharply beyond the training length; rotary ones degrade too"},
    # name -> (attention, position flags); causal full attention in every block.
    "configurations": [("sinusoidal", "full", ["--positions", "sinusoidal"]),
                       ("alibi", "full", ["--positions", "alibi"]),
                       ("rope", "full", ["--positions", "rope"]),
                       ("none", "full", ["--positions", "none"])],
    "model": ["--layers", "4", "--width", "128", "--heads", "4", "--ffn", "512", "--dropout", "0.1"],
    # 600 steps of 16 x 256 characters (2.5 M characters, 0.68 passes over
    # KJV's train split), validation every 60 steps; docs/EXPERIMENTS.md,
    # section 11, says how the budget was chosen.
    "trainer": ["--context", "256", "--batch", "16", "--steps", "600", "--lr", "2e-3", "--min-lr", "1e-4",
                "--warmup", "100", "--log-every", "25", "--eval-every", "60", "--eval-batches", "8",
                "--checkpoint-every", "60"],
    # The test split's contexts, the training context first; the table shows
    # table_contexts, the plot every one.
    "contexts": [256, 512, 1024, 2048, 4096],
    "table_contexts": [256, 1024, 4096],
    "smoke_model": ["--layers", "2", "--width", "16", "--heads", "2", "--ffn", "32", "--dropout", "0.1"],
    "smoke_trainer": ["--context", "16", "--batch", "4", "--steps", "6", "--lr", "2e-3", "--min-lr", "1e-4",
                      "--warmup", "2", "--log-every", "2", "--eval-every", "3", "--eval-batches", "2",
                      "--checkpoint-every", "3"],
    # The last smoke context is past the sinusoidal table, so the smoke takes the longer table's path.
    "smoke_contexts": [16, 64, 4096],
    "smoke_table_contexts": [16, 4096],
    "seeds": [1, 2, 3],
}


def test_path(run_dir, context, trained_context):
    """The JSON of the test metric at CONTEXT: test.json at the training context."""
    return os.path.join(run_dir, "test.json" if context == trained_context else f"test-context-{context}.json")


def copy_dir(run_dir, rows):
    """The run's copy with a sinusoidal table of ROWS rows (longer_table.py)."""
    return os.path.join(run_dir, f"max-length-{rows}")


def evals(attnkit, run_dir, sinusoidal, contexts):
    """The test metric at every context (the training context first); a
    sinusoidal model at a context past its table first gets its copy with a
    table as long as the longest context, which those evaluations read."""
    trained = contexts[0]
    longest = max(contexts)
    out = []
    for context in contexts:
        path = test_path(run_dir, context, trained)
        run = run_dir
        if sinusoidal and context > SINUSOIDAL_ROWS:
            run = copy_dir(run_dir, longest)
            made = run + ".json"
            if not any(p == made for _, p in out):
                out.append(([sys.executable, LONGER_TABLE, "--run", run_dir, "--max-length", str(longest),
                             "--out", run, "--json", made, "--attnkit", attnkit], made))
        out.append((runner.eval_command(attnkit, run, "--context", str(context), "--json", path), path))
    return out


def jobs(exp, out, data, attnkit, seeds, smoke):
    """agglomerative-lm's jobs (seed 1 of every scheme first), each with its
    test metric at every context."""
    contexts = exp["smoke_contexts" if smoke else "contexts"]
    trainer = exp["smoke_trainer" if smoke else "trainer"]
    assert contexts[0] == int(runner.flag_value(trainer, "--context")), "the training context comes first"
    planned = agglomerative_lm.jobs(exp, out, data, attnkit, seeds, smoke)
    for job in planned:
        job["evals"] = evals(attnkit, job["dir"], job["config"] == "sinusoidal", contexts)
        job["contexts"] = contexts
        job["table_contexts"] = exp["smoke_table_contexts" if smoke else "table_contexts"]
    return planned


def is_test(path):
    """Whether an evaluation's JSON is a test metric (not longer_table.py's record)."""
    return os.path.basename(path).startswith("test")


def collect(exp, jobs, data, command):
    results = collect_runs(exp, jobs, data, command)
    by_dir = {j["dir"]: j for j in jobs}
    contexts = jobs[0]["contexts"]
    for c in results["configurations"]:
        for r in c["runs"]:
            job = by_dir[r["dir"]]
            measured = [result for (_, path), result in zip(runner.job_evals(job), runner.finished(job))
                        if is_test(path)]
            r["test_bpc_at"] = {str(m["context"]): m["bpc"] for m in measured}
            r["test_scored_at"] = {str(m["context"]): m["scored"] for m in measured}
            r["test_seconds_at"] = {str(m["context"]): m["seconds"] for m in measured}
            # The contexts measured through the copy with a longer sinusoidal table.
            r["longer_table_at"] = [m["context"] for m in measured
                                    if os.path.abspath(m["run"]) != os.path.abspath(r["dir"])]
        c["test_bpc_at"] = {}
        for context in contexts:
            mean, se = stats.mean_se([r["test_bpc_at"][str(context)] for r in c["runs"]])
            c["test_bpc_at"][str(context)] = {"mean": mean, "se": se}
        # Per run, the bpc at the longest context minus at the training one.
        mean, se = stats.mean_se([r["test_bpc_at"][str(contexts[-1])] - r["test_bpc_at"][str(contexts[0])]
                                  for r in c["runs"]])
        c["change_to_longest"] = {"mean": mean, "se": se}
        gains = [flattening(r) for r in c["runs"]]
        c["valid_gain_last_fifth"] = gains
        c["flattened"] = bool(gains) and all(g is not None and g < FLAT_BPC for g in gains)
    results["contexts"] = contexts
    results["table_contexts"] = jobs[0]["table_contexts"]
    results["sinusoidal_rows"] = SINUSOIDAL_ROWS
    results["flat_bpc"] = FLAT_BPC
    results["paired"] = {str(context): stats.paired_differences(
        {c["name"]: {"runs": [{"seed": r["seed"], "bpc": r["test_bpc_at"][str(context)]} for r in c["runs"]]}
         for c in results["configurations"]}, PAIRS, "bpc") for context in results["table_contexts"]}
    return results


# Same-seed differences of the test bpc (the same batches in the same order
# and the same initial draw for the shared weights), A minus B: positive
# means A is worse.
PAIRS = [("alibi", "sinusoidal"), ("alibi", "rope"), ("alibi", "none"), ("rope", "sinusoidal"), ("rope", "none"),
         ("sinusoidal", "none")]


def cell(value):
    """'mean ± s.e.' of a {mean, se} dict (the mean alone for one run), as the table prints it."""
    mean, se = value["mean"], value["se"]
    return f"{mean:.3f}" + (f" ± {se:.4f}" if se is not None else "")


def table(results):
    contexts = results["table_contexts"]
    print("| positions | parameters | " + " | ".join(f"test bpc at {c} (n)" for c in contexts) +
          f" | change {contexts[0]} to {contexts[-1]} | validation gain, last fifth | flattened |")
    print("|---|---:|" + "---|" * len(contexts) + "---|---|---|")
    for c in results["configurations"]:
        if c["n"] == 0:
            print(f"| {c['name']} | | no finished run |" + " |" * (len(contexts) + 2))
            continue
        at = " | ".join(f"{cell(c['test_bpc_at'][str(x)])} ({c['n']})" for x in contexts)
        change = c["change_to_longest"]
        change_text = f"{change['mean']:+.3f}" + (f" ± {change['se']:.4f}" if change["se"] is not None else "")
        gains = ", ".join("" if g is None else f"{g:.4f}" for g in c["valid_gain_last_fifth"])
        print(f"| {c['name']} | {c['parameters']} | {at} | {change_text} | {gains} | "
              f"{'yes' if c['flattened'] else 'no'} |")
    if any(results["paired"].values()):
        print()
        print("| test bpc, A minus B (same seed) | " + " | ".join(f"at {c}" for c in contexts) + " |")
        print("|---|" + "---|" * len(contexts))
        rows = {}
        for context in contexts:
            for p in results["paired"][str(context)]:
                se = f" ± {p['se']:.4f}" if p["se"] is not None else ""
                rows.setdefault(f"{p['a']} minus {p['b']}", {})[context] = f"{p['mean']:+.4f}{se} ({len(p['seeds'])})"
        for name, values in rows.items():
            print(f"| {name} | " + " | ".join(values.get(c, "") for c in contexts) + " |")


COLOURS = {"sinusoidal": "#d62728", "alibi": "#2ca02c", "rope": "#1f77b4", "none": "#555555"}


def plot(results, png):
    """Left: test bpc against the evaluation context (log2), mean ± s.e.
    over the seeds, one line per positions scheme. Right: validation bpc
    against the step (mean over the seeds), from the second evaluation on."""
    plt = plots.pyplot()
    if plt is None:
        return False
    contexts = results["contexts"]
    configs = [c for c in results["configurations"] if c["runs"]]
    fig, (tests, curves) = plt.subplots(1, 2, figsize=(9, 3.6), gridspec_kw={"width_ratios": [1.3, 1]})
    for c in configs:
        means = [c["test_bpc_at"][str(x)]["mean"] for x in contexts]
        errors = [c["test_bpc_at"][str(x)]["se"] or 0 for x in contexts]
        tests.errorbar(contexts, means, yerr=errors, fmt="-o", ms=4, lw=1.4, capsize=3,
                       color=COLOURS.get(c["name"]), label=f"{c['name']} (n={c['n']})")
        steps, bpc = stats.mean_curve(c["runs"], "valid_bpc")
        curves.plot(steps[1:], bpc[1:], "-o", ms=3, lw=1.2, color=COLOURS.get(c["name"]), label=c["name"])
    trained = contexts[0]
    tests.axvline(trained, color="k", lw=0.8, ls=":")
    tests.set_xscale("log", base=2)
    tests.set_xticks(contexts)
    tests.set_xticklabels([str(x) for x in contexts])
    tests.set_xlabel(f"evaluation context (characters; trained at {trained})")
    tests.set_ylabel("test bits per character")
    tests.set_title("Test, mean ± s.e. over the seeds", fontsize=9)
    tests.grid(alpha=0.3)
    tests.legend(fontsize=7)
    curves.set_xlabel("step (batch {batch} x context {context} characters)".format(**results["budget"]))
    curves.set_ylabel("validation bits per character")
    curves.set_title("Validation during training, mean over the seeds", fontsize=9)
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    corpus = ", ".join(results["corpus"]["sources"]) or results["corpus"]["dir"]
    fig.suptitle(f"Trained at {trained}, evaluated longer: character model on {corpus}", fontsize=10)
    return plots.save(plt, fig, png, dpi=90)


def smoke_check(first):
    problems = [p for p in (bpc_problem(c) for c in first["configurations"]) if p]
    contexts = first["contexts"]
    params = {c["name"]: c["parameters"] for c in first["configurations"]}
    # No scheme adds a trained parameter: the sinusoidal table is fixed,
    # ALiBi's slopes and rotary's angles are computed.
    if len(set(params.values())) != 1:
        problems.append(f"every scheme should have the same parameters: {params}")
    for c in first["configurations"]:
        for r in c["runs"]:
            for x in contexts:
                bpc = r["test_bpc_at"].get(str(x))
                if bpc is None or not bpc > 0:
                    problems.append(f"{c['name']}: no test bpc at context {x}")
            if r["test_bpc_at"].get(str(contexts[0])) != r["test_bpc"]:
                problems.append(f"{c['name']}: test.json is not the training context's")
            longer = [x for x in contexts if x > SINUSOIDAL_ROWS] if c["name"] == "sinusoidal" else []
            if r["longer_table_at"] != longer:
                problems.append(f"{c['name']}: evaluated through the longer table at {r['longer_table_at']}, "
                                f"expected {longer}")
        if c["runs"] and flattening(c["runs"][0]) is None:
            problems.append(f"{c['name']}: fewer than two validation points")
    return problems
