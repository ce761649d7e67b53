"""Running the attnkit CLI: the one function that builds its command lines,
a session (one command, its log, wall time and machine load), the runs of an
experiment N at a time with their resume and skip rules and Ctrl-C, and
measurements one at a time.

A job is one replica of one configuration, a dict: "dir" (the run
directory), "train" (the `attnkit train --resume` argv, or a section's own
command), "steps" (the budget), "seed", "config", "label", and its
measurements: "eval" (argv writing RUN/test.json) or "evals" ([(argv, the
JSON it writes)], the test metric first).
"""

import concurrent.futures
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from checkpoints import checkpoints, latest_header, read_json, result_step


# ---------------------------------------------------------------- command lines

# The subcommands of attnkit-experiments (experiments/cli), the tool built
# beside attnkit; every other subcommand is the product tool's.
EXPERIMENT_SUBCOMMANDS = frozenset({"approx", "cloze", "figure-agglomerative", "figure-clustered", "node-classify",
                                    "translate"})


def attnkit_command(binary, subcommand, args):
    """The argv of `attnkit SUBCOMMAND ARGS...`, `binary` being the attnkit
    tool; an experiment's subcommand runs attnkit-experiments from the same
    build directory instead. Every command of the package that runs one of the
    two tools is built here."""
    if subcommand in EXPERIMENT_SUBCOMMANDS:
        binary = os.path.join(os.path.dirname(binary), "attnkit-experiments")
    return [binary, subcommand, *args]


def train_command(attnkit, flags, seed, run_dir):
    """`attnkit train FLAGS` of one replica: its seed, one thread, plain
    progress, RUN as the run directory, continued if it holds a checkpoint."""
    return attnkit_command(attnkit, "train", [*flags, "--seed", str(seed), "--threads", "1", "--display", "plain",
                                              "--out", run_dir, "--resume"])


def eval_command(attnkit, run_dir, *args):
    """`attnkit eval` of a trained run on the test split, one thread; ARGS add the JSON path, a swapped mechanism."""
    return attnkit_command(attnkit, "eval", ["--run", run_dir, "--split", "test", "--threads", "1", *args])


def test_evals(attnkit, run_dir, swaps):
    """The measurements of a trained run: its test metric (test.json), then
    the test metric with each (name, spec) of SWAPS swapped in (test-NAME.json)."""
    path = os.path.join(run_dir, "test.json")
    evals = [(eval_command(attnkit, run_dir, "--json", path), path)]
    for name, spec in swaps:
        path = os.path.join(run_dir, f"test-{name}.json")
        evals.append((eval_command(attnkit, run_dir, "--attention", spec, "--json", path), path))
    return evals


def replica(attnkit, run_dir, flags, seed, steps, **fields):
    """The job of `attnkit train FLAGS` for STEPS steps, then its test metric (test.json)."""
    return {"dir": run_dir, "train": train_command(attnkit, flags, seed, run_dir),
            "eval": eval_command(attnkit, run_dir, "--json", os.path.join(run_dir, "test.json")),
            "steps": steps, "seed": seed, **fields}


def flag_value(flags, name):
    """The value after NAME in an argv or a list of flags."""
    return flags[flags.index(name) + 1]


# ---------------------------------------------------------------- the skip rule

def job_evals(job):
    """The measurements of a trained run: (argv, the JSON it writes), the test metric first."""
    return job.get("evals") or [(job["eval"], os.path.join(job["dir"], "test.json"))]


def finished(job):
    """The job's measurement results when every one was taken at the full
    budget (the run is finished and is skipped), else None."""
    results = [read_json(path) for _, path in job_evals(job)]
    if all(result_step(r) == job["steps"] for r in results):
        return results
    return None


# ---------------------------------------------------------------- running

def loadavg():
    with open("/proc/loadavg") as f:
        return f.read().strip()


def tool_environment(binary):
    """The environment a tool runs in. A copy of the tools made for long runs
    (e.g. /work/bin-runs, frozen while the build tree changes) keeps its
    libattnkit.so beside the binaries, but the binaries' RUNPATH names the
    build tree: without LD_LIBRARY_PATH they would load the build tree's
    library, which may no longer match them (a changed struct crashed runs
    that way). So a libattnkit.so.0 beside the binary goes first."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(binary))
    if os.path.exists(os.path.join(here, "libattnkit.so.0")):
        env["LD_LIBRARY_PATH"] = here + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def session(directory, what, argv, log_name):
    """Runs argv with its output appended to DIRECTORY/log_name; records the
    session's wall time and the machine load at its start and end in
    DIRECTORY/sessions.jsonl. Returns the exit code."""
    start, load_start = time.time(), loadavg()
    with open(os.path.join(directory, log_name), "a") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, env=tool_environment(argv[0]))
    record = {"what": what, "start": start, "end": time.time(), "loadavg_start": load_start,
              "loadavg_end": loadavg(), "returncode": rc}
    with open(os.path.join(directory, "sessions.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    return rc


class Runner:
    def __init__(self, log_lock, stop):
        self.lock = log_lock
        self.stop = stop  # set by Ctrl-C: no new run starts

    def say(self, text):
        with self.lock:
            print(time.strftime("%H:%M:%S"), text, flush=True)

    def run(self, job):
        """One replica of one configuration: train (or resume) to the budget,
        then every measurement of the trained run that has no result yet."""
        run_dir, argv, steps, label = job["dir"], job["train"], job["steps"], job["label"]
        done = finished(job)
        if done is not None:
            result = done[0]
            self.say(f"{label}: finished (test {result['metric']} {result['value']:.4f}), skipped")
            return True
        if self.stop.is_set():
            return False
        os.makedirs(run_dir, exist_ok=True)
        resumed = bool(checkpoints(run_dir))
        self.say(f"{label}: {'resuming' if resumed else 'starting'} (seed {job['seed']}, budget {steps} steps)")
        rc = session(run_dir, "train", argv, "train.log")
        if rc != 0:
            self.say(f"{label}: attnkit train exited {rc}; see {os.path.join(run_dir, 'train.log')}")
            return False
        header = latest_header(run_dir)
        if header["step"] != steps:  # interrupted (Ctrl-C): the checkpoint is there to resume
            self.say(f"{label}: stopped at step {header['step']} of {steps}; re-run to continue")
            return False
        evals = job_evals(job)
        for eval_argv, path in evals:
            if result_step(read_json(path)) == steps:
                continue
            if self.stop.is_set():
                return False
            rc = session(run_dir, "eval", eval_argv, "eval.log")
            if rc != 0:
                self.say(f"{label}: {shlex.join(eval_argv[1:3])} exited {rc}; see {os.path.join(run_dir, 'eval.log')}")
                return False
        result = read_json(evals[0][1])
        self.say(f"{label}: test {result['metric']} {result['value']:.4f}")
        return True


def own_result_run(done, summary):
    """run(runner, job) for a job whose command writes RUN/result.json itself
    (attnkit-experiments cloze, node-classify, translate): skipped when
    done(result, job) holds, resumed (--resume) when the directory holds a
    checkpoint; summary(result) says what the run measured. Its attribute
    is_finished(job) is that skip rule."""
    def is_finished(job):
        result = read_json(os.path.join(job["dir"], "result.json"))
        return result is not None and done(result, job)

    def run(job_runner, job):
        run_dir, label = job["dir"], job["label"]
        result_path = os.path.join(run_dir, "result.json")
        result = read_json(result_path)
        if is_finished(job):
            job_runner.say(f"{label}: finished ({summary(result)}), skipped")
            return True
        if job_runner.stop.is_set():
            return False
        os.makedirs(run_dir, exist_ok=True)
        resumed = bool(checkpoints(run_dir))
        budget = f" (budget {job['steps']} steps)" if "steps" in job else ""
        job_runner.say(f"{label}: {'resuming' if resumed else 'starting'}{budget}")
        rc = session(run_dir, "train", job["train"] + (["--resume"] if resumed else []), "train.log")
        result = read_json(result_path)
        if rc != 0 or result is None or not done(result, job):
            tool = f"{os.path.basename(job['train'][0])} {job['train'][1]}"
            job_runner.say(f"{label}: {tool} exited {rc} without a finished result; see "
                           f"{os.path.join(run_dir, 'train.log')} (re-run to continue)")
            return False
        job_runner.say(f"{label}: {summary(result)}")
        return True
    run.is_finished = is_finished  # the records' test (records.save)
    return run


def run_all(jobs, n_jobs, run=Runner.run, after=None):
    """Runs the jobs n_jobs at a time, each with run(runner, job) (default:
    train, then measure), then after(job) when given (the job's record).
    Ctrl-C reaches the trainers too (one process group): they checkpoint and
    exit, and no further run starts."""
    stop = threading.Event()

    def on_sigint(signum, frame):
        if not stop.is_set():
            print("reproduce: stopping; the trainers checkpoint, re-run to continue", flush=True)
        stop.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        runner = Runner(threading.Lock(), stop)
        with concurrent.futures.ThreadPoolExecutor(max_workers=n_jobs) as pool:
            def one(job):
                ok = run(runner, job)
                if after is not None:
                    after(job)
                return ok
            ok = all(list(pool.map(one, jobs)))
    finally:
        signal.signal(signal.SIGINT, previous)
    if stop.is_set():
        sys.exit("reproduce: stopped by Ctrl-C; the same command continues")
    return ok


def run_in_turn(commands, directory):
    """Runs the (name, argv, JSON path) commands one at a time, their output
    in DIRECTORY/bench.log; one whose JSON is already there is skipped."""
    os.makedirs(directory, exist_ok=True)
    for name, argv, path in commands:
        if os.path.exists(path):
            print(time.strftime("%H:%M:%S"), f"{name}: done, skipped", flush=True)
            continue
        print(time.strftime("%H:%M:%S"), f"{name}: running (load {loadavg()})", flush=True)
        rc = session(directory, name, argv, "bench.log")
        if rc != 0:
            print(f"reproduce: {name} exited {rc}; see {os.path.join(directory, 'bench.log')}", file=sys.stderr)
            return False
    return True
