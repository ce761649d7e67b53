"""Where things are: the repository, and the default directories of a run."""

import os

# experiments/reproduce/paths.py -> the repository's root.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def directory(given, *default):
    """GIVEN (an option's value) as an absolute path, or ROOT/DEFAULT... without it."""
    return os.path.abspath(given or os.path.join(ROOT, *default))


def results_directory(args):
    """Where NAME.json and NAME.png go: --results, default docs/experiments."""
    return directory(args.results, "docs", "experiments")


def runs_directory(args):
    """The run directories: --out, default build/runs/NAME."""
    return directory(args.out, "build", "runs", args.name)


def records_directory(args):
    """The records of the finished runs (records.py): --records, default experiments/records/NAME."""
    return directory(args.records, "experiments", "records", args.name)
