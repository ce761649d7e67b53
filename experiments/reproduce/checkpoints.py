"""The files of a run directory, read: the one reader of our checkpoint format
in this package (docs/TRAINING.md, "Checkpoint format"), the measurements'
JSON (test.json, test-NAME.json, approx.json, result.json, a benchmark's
JSON), the JSON-lines logs (metrics.jsonl, sessions.jsonl) and a data
directory's meta.json. Nothing here runs anything or writes a file."""

import glob
import json
import os
import struct
import sys

MAGIC = b"ATNKCKPT"
# magic (8 bytes), format version (4), header bytes H (8), payload bytes P (8); then the header.
PREFIX_BYTES = 28


def checkpoints(run_dir):
    """The run's checkpoint files, oldest first (checkpoint-<step>.ckpt)."""
    return sorted(glob.glob(os.path.join(run_dir, "checkpoint-*.ckpt")))


def checkpoint_header(path):
    """The JSON header of a checkpoint."""
    with open(path, "rb") as f:
        head = f.read(PREFIX_BYTES)
        if len(head) != PREFIX_BYTES or head[:8] != MAGIC:
            raise RuntimeError(f"{path}: not an attnkit checkpoint")
        header_bytes = struct.unpack("<Q", head[12:20])[0]
        return json.loads(f.read(header_bytes).decode())


def latest_header(run_dir):
    """The header of the run's newest checkpoint; in a run restored from its
    record (records.py), which has no checkpoint, the header.json kept from it."""
    files = checkpoints(run_dir)
    if files:
        return checkpoint_header(files[-1])
    kept = read_json(os.path.join(run_dir, "header.json"))
    if kept is None:
        raise RuntimeError(f"{run_dir}: no checkpoint and no header.json")
    return kept


def trainer_options(header):
    """The header's trainer options as a dict (stored as an object or as a JSON string)."""
    trainer = header["trainer"]
    return json.loads(trainer) if isinstance(trainer, str) else trainer


def read_json(path):
    """A JSON file, or None when it does not exist."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_jsonl(path):
    """The records of a JSON-lines file ([] when it does not exist); a malformed line is skipped with a message."""
    records = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"reproduce: skipping a malformed line of {path}: {line[:60]!r}", file=sys.stderr)
    return records


def result_step(result):
    """The training step a result was measured at (eval: step; approx: model.step); None for no result."""
    if result is None:
        return None
    return result.get("step", result.get("model", {}).get("step"))


def data_meta(data):
    """A data directory's meta.json (`attnkit data char-lm`, scripts/package-graph); it must exist."""
    with open(os.path.join(data, "meta.json")) as f:
        return json.load(f)
