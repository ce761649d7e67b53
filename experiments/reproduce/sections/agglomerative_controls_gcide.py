"""agglomerative-controls-gcide: agglomerative-controls on a second corpus,
the GNU Collaborative International Dictionary of English (Debian dict-gcide;
scripts/fetch-corpus gcide), with the same configurations and budget."""

from sections.agglomerative_controls import EXPERIMENT as KJV_EXPERIMENT
from sections.agglomerative_controls import collect, jobs, plot, smoke_check, table  # noqa: F401

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 1

CORPUS = "gcide"

EXPERIMENT = dict(KJV_EXPERIMENT, title=KJV_EXPERIMENT["title"] + " (second corpus)")
