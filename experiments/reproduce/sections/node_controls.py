"""node-controls: section 8 of docs/EXPERIMENTS.md again with the controls it
lacked (issue 29): what the features alone reach (each node attends to
itself only: an MLP of the same layers), what one correct extra edge per node
would add (the input graph plus an edge to a node of the same class, drawn
with the labels: a ceiling for SAC's additions), the input graph plus random
edges at SAC's count, and SAC warm-started from the trained GAT of the same
seed, as the SAC paper trains it. Runs, collection, table and plot are
node-classify's."""

from sections import node_classify
from sections.node_classify import collect, data, jobs, plot, run_job, smoke_data, table  # noqa: F401

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 8

EXPERIMENT = dict(
    node_classify.EXPERIMENT,
    title="SAC on the Debian package graph, with a features-only control, an oracle and a warm start",
    configurations=[
        ("input", ["--structure", "input"], []),
        ("self", ["--structure", "self"], []),
        ("input+random-2", ["--structure", "input+random:alpha=2,seed={seed}"], []),
        ("input+oracle", ["--structure", "input+oracle:seed={seed}"], []),
        # The network starts where "input" of the same seed ended (it runs
        # first); the predictor starts fresh.
        ("sac-2-warm", ["--attention", "sac:alpha=2,variant=all-connected", "--init-from", "{out}/input/seed-{seed}"],
         []),
    ],
)


def smoke_check(first):
    problems = node_classify.smoke_check(first)
    by_name = {c["name"]: c for c in first["configurations"]}
    if by_name["self"]["runs"] and by_name["self"]["edges_per_node"] != 1:
        problems.append(f"self: {by_name['self']['edges_per_node']} edges per node, expected 1")
    if by_name["input+oracle"]["runs"] and by_name["input"]["runs"] and \
            by_name["input+oracle"]["same_class"] <= by_name["input"]["same_class"]:
        problems.append("input+oracle's edges join no more same-class pairs than the input graph's")
    return problems
