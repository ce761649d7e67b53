"""A finished run's record: the small files of its directory that the
results are collected from (the measurements' JSON, the JSON-lines logs, and
the newest checkpoint's header as header.json), kept in the repository under
experiments/records/NAME/ with the run directory's path below OUT.

The run directories live in the build tree, which a new machine or a new
checkout does not have; a run finished there would otherwise be run again (or
its results lost) whenever the build directory goes. With its record, a
re-run copies the record into the run directory, the skip rule sees a
finished run, and the collection reads the same numbers. Checkpoints and the
text logs are not kept: they are large, and nothing collected reads them.
An unfinished run has no record; it resumes only from its own checkpoints.
"""

import json
import os
import shutil

from checkpoints import checkpoints, latest_header

HEADER = "header.json"  # the newest checkpoint's header, where a record has no checkpoint


def kept(name):
    """Whether a file of a run directory belongs to its record."""
    return name.endswith(".json") or name.endswith(".jsonl")


def record_dir(records, out, job):
    """Where JOB's record lives: its run directory's path below OUT, under RECORDS."""
    relative = os.path.relpath(job["dir"], out)
    if relative.startswith(os.pardir):
        raise ValueError(f"{job['dir']} is not below {out}")
    return os.path.join(records, relative)


def restore(records, out, jobs):
    """Copies the record of each job whose run directory is missing or empty
    into it; a directory that holds anything (a checkpoint, a result) is the
    newer state and is left alone. Returns the labels of the restored runs."""
    restored = []
    for job in jobs:
        source = record_dir(records, out, job)
        if not os.path.isdir(source) or (os.path.isdir(job["dir"]) and os.listdir(job["dir"])):
            continue
        os.makedirs(job["dir"], exist_ok=True)
        for name in sorted(os.listdir(source)):
            shutil.copy2(os.path.join(source, name), os.path.join(job["dir"], name))
        restored.append(job["label"])
    return restored


def save(records, out, jobs, is_finished):
    """Writes the record of every job for which is_finished(job) holds:
    header.json from its newest checkpoint, then each kept file of its run
    directory (replacing an older record of the run). Returns the labels of
    the runs whose record was written or changed."""
    saved = []
    for job in jobs:
        if not os.path.isdir(job["dir"]) or not is_finished(job):
            continue
        if checkpoints(job["dir"]):
            write_if_changed(os.path.join(job["dir"], HEADER), json.dumps(latest_header(job["dir"]), indent=1) + "\n")
        target = record_dir(records, out, job)
        changed = False
        for name in sorted(os.listdir(job["dir"])):
            path = os.path.join(job["dir"], name)
            if kept(name) and os.path.isfile(path):
                with open(path) as f:
                    changed |= write_if_changed(os.path.join(target, name), f.read())
        if changed:
            saved.append(job["label"])
    return saved


def write_if_changed(path, text):
    """Writes TEXT to PATH (atomically) unless it already holds it; True when written."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return True
