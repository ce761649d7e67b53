"""sac-copy-entropy: section 6 of docs/EXPERIMENTS.md, SAC's entropy bonus on
the masked copy task. The bonus was first tried by hand at L = 64 (issue 29:
those numbers had no file); here it is a step of its own: sac-copy's
edge-credit SAC with `entropy=0.01`, the same model and budget, at L = 64
where no plain run found the twins, 2 seeds. Runs and collection are
copy-clustered's, the table and plot sac-copy's."""

from sections import sac_copy
from sections.copy_clustered import collect, jobs  # noqa: F401  (this section's, with its EXPERIMENT)
from sections.sac_copy import plot, smoke_check, table  # noqa: F401

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 6

CORPUS = False

EXPERIMENT = dict(
    sac_copy.EXPERIMENT,
    title="SAC on the masked copy task with an entropy bonus on the predictor",
    lengths=[64],
    baselines=[("sac-edge-entropy-0.01",
                "sac:alpha=1,variant=all-connected,max_distance={n},reward=edge,entropy=0.01")],
    smoke_lengths=[4],
    seeds=[1, 2],
)

