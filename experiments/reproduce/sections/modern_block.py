"""modern-block: section 12 of docs/EXPERIMENTS.md, the decoder block
practitioners train today against seed 003's (issue 31). The LLaMA-style
block (Touvron et al. 2023; grouped-query heads as in LLaMA 2): pre-norm
RMSNorm, a SwiGLU feed-forward network, no biases, rotary positions and
grouped-query heads (`attnkit train --block llama --kv-heads 2`), against
the classic block (layer norm, a relu network, biases, sinusoidal positions),
and, to tell the block from its positions, the classic block with rotary
positions. A decoder character model on KJV with causal full attention,
section 11's model and budget (4 blocks of width 128, 4 heads, context 256,
600 steps of 16 sequences), 3 seeds; the feed-forward widths make the
parameter counts equal (see PARAMETERS)."""

import plots
import stats
from sections import agglomerative_lm
from sections.agglomerative_controls import FLAT_BPC, flattening
from sections.agglomerative_lm import bpc_problem, collect as collect_runs

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 12

CORPUS = "kjv"

# The same parameters in every configuration. Per block at width d = 128 with
# 4 heads: the classic block has attention 4 d^2 + 4 d, two layer norms 4 d,
# a relu network of width 512, 2 * 512 d + 512 + d: 198,272 in all. The
# llama block has no biases and RMSNorm's weights only (2 d); with 2 of 4
# key/value heads its projections are 3 d^2 (q, out: d^2 each; k, v: d^2 / 2
# each), so SwiGLU's three matrices of width f, 3 f d, must hold
# 198,272 - 3 d^2 - 2 d = 148,864: f = 388 gives 148,992 (128 more per block;
# the final norm has 128 fewer), 0.05% more in all.
PARAMETERS = "equal to 0.05%"

EXPERIMENT = {
    "title": "The modern decoder block (RMSNorm, SwiGLU, no biases, rotary, grouped-query heads) against the "
             "classic one, character language model",
    "paper": {"source": "Touvron et al., LLaMA (2023), section 2.2; Shazeer, GLU Variants Improve Transformer (2020); "
                        "Zhang and Sennrich, Root Mean Square Layer Normalization (2019)",
              "claim": "the pre-norm RMSNorm, SwiGLU, rotary block trains to a lower loss than the original "
                       "transformer's block at the same parameter count"},
    # name -> (attention, flags of the block); causal full attention in every block.
    "configurations": [("classic", "full", ["--positions", "sinusoidal", "--ffn", "512"]),
                       ("classic-rope", "full", ["--positions", "rope", "--ffn", "512"]),
                       ("llama", "full", ["--block", "llama", "--kv-heads", "2", "--ffn", "388"])],
    "model": ["--layers", "4", "--width", "128", "--heads", "4", "--dropout", "0.1"],
    # Section 11's budget: 600 steps of 16 x 256 characters, validation every 60.
    "trainer": ["--context", "256", "--batch", "16", "--steps", "600", "--lr", "2e-3", "--min-lr", "1e-4",
                "--warmup", "100", "--log-every", "25", "--eval-every", "60", "--eval-batches", "8",
                "--checkpoint-every", "60"],
    "smoke_model": ["--layers", "2", "--width", "16", "--heads", "4", "--dropout", "0.1"],
    "smoke_trainer": ["--context", "16", "--batch", "4", "--steps", "6", "--lr", "2e-3", "--min-lr", "1e-4",
                      "--warmup", "2", "--log-every", "2", "--eval-every", "3", "--eval-batches", "2",
                      "--checkpoint-every", "3"],
    "seeds": [1, 2, 3],
}

# Same-seed differences of the test bpc, A minus B (negative: A is better).
PAIRS = [("llama", "classic"), ("llama", "classic-rope"), ("classic-rope", "classic")]


def jobs(exp, out, data, attnkit, seeds, smoke):
    """agglomerative-lm's jobs: seed 1 of every configuration first."""
    return agglomerative_lm.jobs(exp, out, data, attnkit, seeds, smoke)


def collect(exp, jobs, data, command):
    results = collect_runs(exp, jobs, data, command)
    for c in results["configurations"]:
        gains = [flattening(r) for r in c["runs"]]
        c["valid_gain_last_fifth"] = gains
        c["flattened"] = bool(gains) and all(g is not None and g < FLAT_BPC for g in gains)
    results["flat_bpc"] = FLAT_BPC
    results["parameters_note"] = PARAMETERS
    results["paired"] = stats.paired_differences(
        {c["name"]: {"runs": [{"seed": r["seed"], "bpc": r["test_bpc"]} for r in c["runs"]]}
         for c in results["configurations"]}, PAIRS, "bpc")
    return results


def mean_se_text(mean, se, digits=3):
    return f"{mean:.{digits}f}" + (f" ± {se:.{digits + 1}f}" if se is not None else "")


def table(results):
    print("| block | flags | parameters | test bpc (n) | validation gain, last fifth | flattened |")
    print("|---|---|---:|---|---|---|")
    for c in results["configurations"]:
        flags = " ".join(c["positions"])
        if c["n"] == 0:
            print(f"| {c['name']} | `{flags}` | | no finished run | | |")
            continue
        gains = ", ".join("" if g is None else f"{g:.4f}" for g in c["valid_gain_last_fifth"])
        print(f"| {c['name']} | `{flags}` | {c['parameters']} | "
              f"{mean_se_text(c['test_bpc_mean'], c['test_bpc_se'])} ({c['n']}) | {gains} | "
              f"{'yes' if c['flattened'] else 'no'} |")
    if results["paired"]:
        print()
        print("| test bpc, A minus B (same seed) | mean ± s.e. (n) | per seed |")
        print("|---|---|---|")
        for p in results["paired"]:
            per_seed = ", ".join(f"{d:+.4f}" for d in p["differences"])
            print(f"| {p['a']} minus {p['b']} | {mean_se_text(p['mean'], p['se'], 4)} ({len(p['seeds'])}) | "
                  f"{per_seed} |")


COLOURS = {"classic": "#d62728", "classic-rope": "#1f77b4", "llama": "#2ca02c"}


def plot(results, png):
    """Validation bpc against the step, mean over the seeds, one line per block."""
    plt = plots.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for c in (c for c in results["configurations"] if c["runs"]):
        steps, bpc = stats.mean_curve(c["runs"], "valid_bpc")
        ax.plot(steps[1:], bpc[1:], "-o", ms=3, lw=1.3, color=COLOURS.get(c["name"]),
                label=f"{c['name']}: test {c['test_bpc_mean']:.3f} (n={c['n']})")
    ax.set_xlabel("step (batch {batch} x context {context} characters)".format(**results["budget"]))
    ax.set_ylabel("validation bits per character")
    corpus = ", ".join(results["corpus"]["sources"]) or results["corpus"]["dir"]
    ax.set_title(f"Classic and modern decoder blocks, character model on {corpus}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return plots.save(plt, fig, png, dpi=90)


def smoke_check(first):
    problems = [p for p in (bpc_problem(c) for c in first["configurations"]) if p]
    for c in first["configurations"]:
        if c["runs"] and flattening(c["runs"][0]) is None:
            problems.append(f"{c['name']}: fewer than two validation points")
    return problems
