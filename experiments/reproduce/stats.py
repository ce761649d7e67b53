"""Pure numerics over the collected runs: no files, no processes."""

import math


def mean_se(values):
    """(mean, standard error of the mean); (None, None) for no value, (mean, None) for one."""
    n = len(values)
    if n == 0:
        return None, None
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def mean_curve(runs, key):
    """The mean of `key` over the replicas at the steps every replica logged it: (steps, means)."""
    per_run = [{r["step"]: r[key] for r in run["curve"] if key in r} for run in runs]
    if not per_run:
        return [], []
    steps = sorted(set.intersection(*(set(p) for p in per_run)))
    return steps, [sum(p[s] for p in per_run) / len(per_run) for s in steps]


def curve(metrics, keys):
    """metrics.jsonl's records cut to KEYS (each record keeps the ones it has)."""
    return [{k: r[k] for k in keys if k in r} for r in metrics]


def wall_seconds(sessions):
    """From the first session's start to the last one's end; None without a session."""
    if not sessions:
        return None
    return max(s["end"] for s in sessions) - min(s["start"] for s in sessions)


def per_seed(values, scale=100, digits=1):
    """'a / b / c' for several seeds, 'a' for one, '' for none."""
    return " / ".join(f"{scale * v:.{digits}f}" for v in values or [])
