"""The course of an experiment. A section whose runs are `attnkit train`
then measurements of the trained model (sections 1, 2, 3, 6 and 7 of
docs/EXPERIMENTS.md) goes through run() or smoke() here; a section of
measurements (speed, lookup) has commands() for measurements_main(); a
section whose runs write their own result.json (node-classify, zoo-translate,
cloze-long, node-controls) has run_job(), data() and smoke_data() for
own_result_main(). They share twice() and verdict() of the smoke and
publish() of the results.

Such a section is a module of sections/ with EXPERIMENT (its configuration),
CORPUS (the corpus it trains on: a scripts/fetch-corpus name, True for kjv,
False for none), jobs(), collect(), table(),
plot() and smoke_check()."""

import json
import os
import shlex
import subprocess
import sys
import tempfile

import paths
import records
import runner


def corpus_name(section):
    """The corpus a section trains on (scripts/fetch-corpus's name): CORPUS
    is a name, True for the default (kjv), or False for none."""
    if section.CORPUS is True:
        return "kjv"
    return section.CORPUS or None


def run(section, args, attnkit, seeds, command):
    """Runs (or continues) every job, collects the finished ones into
    RESULTS/NAME.json, prints the table and draws the plot."""
    exp = section.EXPERIMENT
    out = paths.runs_directory(args)
    corpus = corpus_name(section)
    data = paths.directory(args.data, "build", "data", corpus) if corpus else None
    results_dir = paths.results_directory(args)
    if data and not os.path.exists(os.path.join(data, "meta.json")):
        sys.exit(f"reproduce: no corpus at {data} (scripts/fetch-corpus {corpus} --out {data})")
    jobs = section.jobs(exp, out, data, attnkit, seeds, smoke=False)
    chosen = selected(jobs, args.configurations)
    print(f"reproduce {args.name}: {len(chosen)} runs (seeds {seeds}), budget {jobs[0]['steps']} steps each, "
          f"{args.jobs} at a time, runs in {out}", flush=True)
    print("the first run's command:", shlex.join(chosen[0]["train"]), flush=True)
    ok = with_records(args, out, jobs, lambda job: runner.finished(job) is not None,
                      lambda after: True if args.collect_only else runner.run_all(chosen, args.jobs, after=after))
    publish(section.collect(exp, jobs, data, command), results_dir, args.name, section.table, section.plot)
    return 0 if ok else 1


def smoke(section, args, attnkit, seeds, command):
    """Every configuration for a few steps of a tiny model on the shipped text
    in a temporary directory (or an empty --out), twice; then the checks."""
    exp = section.EXPERIMENT
    with tempfile.TemporaryDirectory(prefix="reproduce-smoke-") as tmp:
        data = None
        if section.CORPUS:
            data = os.path.join(tmp, "data")
            text = os.path.join(paths.ROOT, "tests", "data", "genesis-1-2.txt")
            subprocess.run(runner.attnkit_command(attnkit, "data", ["char-lm", "--input", text, "--out", data]),
                           check=True, stdout=subprocess.DEVNULL)
        out = args.out and os.path.abspath(args.out) or os.path.join(tmp, "runs")
        exp["copy_runs"] = os.path.join(out, "copy-clustered")
        if os.path.exists(out) and os.listdir(out):
            sys.exit(f"reproduce --smoke: {out} is not empty (the smoke starts from nothing)")
        jobs = section.jobs(exp, out, data, attnkit, seeds[:1], smoke=True)
        print(f"reproduce {args.name} --smoke: {len(jobs)} runs, budget {jobs[0]['steps']} steps, "
              f"seed {seeds[0]}", flush=True)
        first, problems = twice(lambda: runner.run_all(jobs, args.jobs),
                                lambda: section.collect(exp, jobs, data, command),
                                [(j["label"], os.path.join(j["dir"], "test.json")) for j in jobs],
                                section.smoke_check)
        section.table(first)
        results_dir = args.results and os.path.abspath(args.results)
        if results_dir:
            write_results(first, results_dir, args.name)
        section.plot(first, os.path.join(results_dir or tmp, f"{args.name}.png"))
        return verdict(problems)


# ---------------------------------------------------------------- shared parts

def selected(jobs, configurations):
    """The jobs of the configurations named in CONFIGURATIONS (comma-separated;
    None or empty: every job). The results still collect every configuration's
    finished runs, so a budget can be spent one group at a time. Exits naming
    the known configurations when a name is unknown."""
    if not configurations:
        return jobs
    names = configurations.split(",")
    known = list(dict.fromkeys(j["config"] for j in jobs))
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"reproduce: unknown configuration(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [j for j in jobs if j["config"] in names]


def measurements_main(section, args, attnkit, command):
    """The course of a section of measurements rather than training runs
    (speed, lookup): the section's commands(exp, out, attnkit, smoke) run one
    at a time (one whose JSON is there is skipped), then RESULTS/NAME.json, the
    table and the plot; --smoke: tiny sizes, twice, then its smoke_check."""
    exp, name = section.EXPERIMENT, args.name
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="reproduce-smoke-") as tmp:
            planned = section.commands(exp, tmp, attnkit, smoke=True)
            first, problems = twice(lambda: runner.run_in_turn(planned, tmp),
                                    lambda: section.collect(exp, planned, tmp, command),
                                    [(path, path) for _, _, path in planned], section.smoke_check)
            section.table(first)
            section.plot(first, os.path.join(tmp, f"{name}.png"))
            return verdict(problems)
    out = paths.runs_directory(args)
    results_dir = paths.results_directory(args)
    planned = section.commands(exp, out, attnkit, smoke=False)
    print(f"reproduce {name}: {len(planned)} measurements, one at a time on one thread, in {out}; "
          f"nothing else should run (load now {runner.loadavg()})", flush=True)
    ok = True if args.collect_only else runner.run_in_turn(planned, out)
    publish(section.collect(exp, planned, out, command), results_dir, name, section.table, section.plot)
    return 0 if ok else 1


def own_result_main(section, args, attnkit, seeds, command):
    """The course of a section whose runs write their own RUN/result.json
    (node-classify, zoo-translate, cloze-long): every run with the section's
    run_job (runner.own_result_run), then RESULTS/NAME.json, the table and the
    plot. The section's data(args) prepares or checks the data and returns its
    directory; --smoke: its smoke_data(tmp, attnkit) gives the fixture's, tiny runs go
    twice in a temporary directory, then its smoke_check."""
    exp, name = section.EXPERIMENT, args.name
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="reproduce-smoke-") as tmp:
            fixture = section.smoke_data(tmp, attnkit)
            planned = section.jobs(exp, os.path.join(tmp, "runs"), fixture, attnkit, seeds[:1], smoke=True)
            first, problems = twice(lambda: runner.run_all(planned, args.jobs, section.run_job),
                                    lambda: section.collect(exp, planned, fixture, command),
                                    [(j["label"], os.path.join(j["dir"], "result.json")) for j in planned],
                                    section.smoke_check)
            section.table(first)
            section.plot(first, os.path.join(tmp, f"{name}.png"))
            return verdict(problems)
    out = paths.runs_directory(args)
    results_dir = paths.results_directory(args)
    directory = section.data(args)
    planned = section.jobs(exp, out, directory, attnkit, seeds, smoke=False)
    budget = f", budget {planned[0]['steps']} steps each" if "steps" in planned[0] else ""
    print(f"reproduce {name}: {len(planned)} runs (seeds {seeds}){budget}, {args.jobs} at a time, runs in {out}",
          flush=True)
    print("the first run's command:", shlex.join(planned[0]["train"]), flush=True)
    chosen = selected(planned, args.configurations)
    ok = with_records(args, out, planned, section.run_job.is_finished,
                      lambda after: True if args.collect_only else runner.run_all(chosen, args.jobs, section.run_job,
                                                                                  after=after))
    publish(section.collect(exp, planned, directory, command), results_dir, name, section.table, section.plot)
    return 0 if ok else 1


def with_records(args, out, jobs, is_finished, execute):
    """execute(after) between the records' steps (records.py): first every
    job's record that its run directory lacks is restored; execute calls
    after(job) as each run ends, which writes its record when it finished, so
    that a session killed later keeps it; at the end every finished run's
    record is written again (unchanged files are left alone), also after a
    failure or Ctrl-C. RECORDS: --records, default experiments/records/NAME.
    Only the runs below OUT have records here: another experiment's runs
    (approx-trained's copy models, copy-clustered's) are that one's.
    Returns execute()'s result."""
    kept = paths.records_directory(args)
    jobs = [j for j in jobs if not os.path.relpath(j["dir"], out).startswith(os.pardir)]
    restored = records.restore(kept, out, jobs)
    if restored:
        print(f"restored from {kept}: {', '.join(restored)}", flush=True)

    def after(job):
        if records.save(kept, out, [job], is_finished):
            print(f"{job['label']}: recorded in {kept}", flush=True)
    try:
        return execute(after)
    finally:
        saved = records.save(kept, out, jobs, is_finished)
        if saved:
            print(f"recorded in {kept}: {', '.join(saved)}", flush=True)


def twice(execute, collect, watched, check):
    """The smoke's two passes. execute() runs everything (False: a run
    failed); the second pass must skip every finished run: none of the
    WATCHED (label, path) files may change, nor the collect()ed results.
    Returns the first results and the problems: check(first)'s, then the
    second pass's."""
    if not execute():
        sys.exit("reproduce --smoke: a run failed")
    first = collect()
    mtimes = {path: os.path.getmtime(path) for _, path in watched}
    if not execute():
        sys.exit("reproduce --smoke: the second pass failed")
    second = collect()
    problems = check(first)
    problems += [f"{label}: re-run although finished" for label, path in watched
                 if os.path.getmtime(path) != mtimes[path]]
    if json.dumps(first, sort_keys=True) != json.dumps(second, sort_keys=True):
        problems.append("the results changed on the second pass")
    return first, problems


def verdict(problems):
    """The smoke's end: exits naming the problems, or says ok (exit code 0)."""
    if problems:
        sys.exit("reproduce --smoke: " + "; ".join(problems))
    print("reproduce --smoke: ok")
    return 0


def write_results(results, results_dir, name):
    """RESULTS/NAME.json, written atomically; returns its path."""
    os.makedirs(results_dir, exist_ok=True)
    json_path = os.path.join(results_dir, f"{name}.json")
    with open(json_path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    os.replace(json_path + ".tmp", json_path)
    return json_path


def publish(results, results_dir, name, table, plot):
    """RESULTS/NAME.json, the table on stdout, the plot RESULTS/NAME.png."""
    json_path = write_results(results, results_dir, name)
    table(results)
    print("wrote", json_path)
    png = os.path.join(results_dir, f"{name}.png")
    if plot(results, png):
        print("wrote", png)
