"""lookup: the lookup table of section 4 of docs/EXPERIMENTS.md, the cheap
linear attention paper's second claim: once a document of n states is read
into C = H^T H (k x k), a lookup costs O(k^2) instead of softmax's O(n k).
`attnkit bench-lookup` times m lookups into one document at each n, one
command at a time on one thread (the machine must be otherwise idle: the load
average is recorded), each writing its JSON; this collects their speed-ups."""

import os

import checkpoints
import plots
import runner

# The section of docs/EXPERIMENTS.md this reproduces (`reproduce --list`).
DOC_SECTION = 4

EXPERIMENT = {
    "title": "Lookups: DocumentMemory against softmax over the stored states",
    "lengths": [100, 1000, 10000, 100000],
    "k": 100,
    "queries": [1, 64, 1024],
    "flags": ["--threads", "1", "--clock", "cpu", "--repeats", "11"],
    "smoke_lengths": [20, 60],
    "smoke_k": 8,
    "smoke_queries": [1, 4],
    "smoke_flags": ["--threads", "1", "--clock", "cpu", "--repeats", "1"],
}


def commands(exp, out, attnkit, smoke):
    """(name, argv, json path) of every measurement, in the order they run."""
    key = (lambda k: "smoke_" + k) if smoke else (lambda k: k)
    planned = []
    for n in exp[key("lengths")]:
        path = os.path.join(out, f"lookup-n{n}.json")
        planned.append((f"lookups, n = {n}", runner.attnkit_command(attnkit, "bench-lookup", [
            "--n", str(n), "--k", str(exp[key("k")]), "--queries", ",".join(map(str, exp[key("queries")])),
            *exp[key("flags")], "--json", path]), path))
    return planned


def collect(exp, planned, out, command):
    rows = []
    for _, _, path in planned:
        doc = checkpoints.read_json(path)
        if doc is None:
            continue
        rows.append({"n": doc["n"], "k": doc["k"], "sgemm_gflops": doc["machine"]["sgemm_gflops"],
                     "load_average": doc["load_average"], "encode_ms": doc["encode_ms"],
                     "results": doc["results"]})
    return {"experiment": exp["title"], "command": command, "measurements": rows}


def table(results):
    """The speed-up of the memory's lookup over softmax's, per n and m (median CPU times)."""
    queries = sorted({r["m"] for row in results["measurements"] for r in row["results"]})
    print("| n (document length) | n / k | " + " | ".join(f"m = {m}" for m in queries) + " |")
    print("|---:|---:|" + "---:|" * len(queries))
    for row in results["measurements"]:
        speedup = {r["m"]: r["speedup"] for r in row["results"]}
        cells = " | ".join(f"{speedup[m]:,.1f}x" if m in speedup else "" for m in queries)
        print(f"| {row['n']:,} | {row['n'] / row['k']:,.0f} | {cells} |")


def plot(results, png):
    plt = plots.pyplot()
    if plt is None or not results["measurements"]:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    queries = sorted({r["m"] for row in results["measurements"] for r in row["results"]})
    for m in queries:
        points = [(row["n"] / row["k"], r["speedup"]) for row in results["measurements"] for r in row["results"]
                  if r["m"] == m]
        ax.loglog([p[0] for p in points], [p[1] for p in points], "-o", ms=3, label=f"m = {m} lookups")
    ax.set_xlabel("n / k (document length over the memory's size)")
    ax.set_ylabel("speed-up of the memory's lookup")
    ax.set_title("DocumentMemory against softmax over the stored states", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return plots.save(plt, fig, png, dpi=90)


def smoke_check(first):
    problems = []
    if len(first["measurements"]) != len(EXPERIMENT["smoke_lengths"]):
        problems.append(f"{len(first['measurements'])} measurements")
    for row in first["measurements"]:
        for r in row["results"]:
            if not r["speedup"] > 0:
                problems.append(f"n = {row['n']}, m = {r['m']}: speed-up {r['speedup']}")
    return problems

