"""sac-copy: section 6 of docs/EXPERIMENTS.md, whether SAC's edge predictor
learns the masked copy task's known structure; the runs and collection of
copy-clustered."""

import statistics

import plots
from sections import copy_clustered
from sections.copy_clustered import collect, jobs

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 6

CORPUS = False

# Section 6 of docs/EXPERIMENTS.md (the SAC issue, part 4.1): does SAC's edge
# predictor learn a structure that is known? On the masked copy task position i
# must see its twin length + 1 away. SAC with one predicted edge per node
# (all-connected, plus the self-edge), trained with the paper's sequence reward
# and with per-edge credit, against a local pattern with more edges per node
# (span 1: 3) and full attention, on the same budget.
EXPERIMENT = {
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


def partner_recall(results):
    """(name, length) -> the SAC runs' partner recall, in seed order."""
    return copy_clustered.values(results, lambda c: (c.get("structure") or {}).get("partner_recall"))


def table(results):
    """The table of docs/EXPERIMENTS.md, section 6: test accuracy (%) per
    mechanism and length, and below it, in the same table, the SAC runs'
    partner recall (whole percents); then the training seconds."""
    copy_clustered.accuracy_table(results)
    sac = [name for name in results["configurations"] if name.startswith("sac")]
    copy_clustered.per_length_rows(results, sac, partner_recall(results), digits=0, suffix=" partner recall")
    print()
    copy_clustered.seconds_table(results)


def plot(results, png):
    plt = plots.pyplot()
    if plt is None:
        return False
    names, lengths = results["configurations"], results["lengths"]
    accuracy = copy_clustered.values(results)
    recall = partner_recall(results)
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
    return plots.save(plt, fig, png)


def smoke_check(first):
    problems = copy_clustered.smoke_check(first)
    for c in first["cells"]:
        # SAC runs report partner hits; fixed patterns their edges per node only.
        has = "partner_recall" in (c.get("structure") or {})
        if has != c["config"].startswith("sac"):
            problems.append(f"{c['config']} at {c['length']}: partner hits {'present' if has else 'missing'}")
        elif has and not 0 <= c["structure"]["partner_recall"] <= 1:
            problems.append(f"{c['config']} at {c['length']}: partner recall outside [0, 1]")
    return problems
