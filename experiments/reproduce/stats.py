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


def paired_differences(by_name, pairs, key):
    """Same-seed differences of a run metric KEY, A minus B, for each (A, B)
    of PAIRS whose configurations (BY_NAME: name -> {"runs": [{"seed", KEY}]})
    have finished runs of a common seed: runs of one seed see the same data in
    the same order, so the difference cancels what the data order adds to each
    run's spread. [{a, b, seeds, differences, mean, se}]."""
    out = []
    for a, b in pairs:
        if a not in by_name or b not in by_name:
            continue
        first = {r["seed"]: r[key] for r in by_name[a]["runs"]}
        second = {r["seed"]: r[key] for r in by_name[b]["runs"]}
        seeds = sorted(set(first) & set(second))
        if not seeds:
            continue
        differences = [first[s] - second[s] for s in seeds]
        mean, se = mean_se(differences)
        out.append({"a": a, "b": b, "seeds": seeds, "differences": differences, "mean": mean, "se": se})
    return out
