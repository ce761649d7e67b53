#!/usr/bin/python3
"""The pure parts of experiments/reproduce: stats.py's numerics, and
checkpoints.py's reader of our checkpoint format with runner.py's skip rule
on a run that `attnkit train` and `attnkit eval` write in a temporary
directory (a copy task of a few steps: no data needed).

    ATTNKIT_CLI=build/attnkit python3 experiments/tests/reproduce_test.py

The expected numbers are worked out by hand (stats), or are the flags the
run was made with (checkpoints), not computed by a second implementation.
"""

import math
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "experiments", "reproduce"))
sys.dont_write_bytecode = True  # nothing written into the source tree

import checkpoints  # noqa: E402
import runner  # noqa: E402
import stats  # noqa: E402

CLI = os.environ.get("ATTNKIT_CLI", os.path.join(ROOT, "build", "attnkit"))


def run(argv):
    """Runs argv quietly; its output is shown when it fails."""
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise AssertionError(f"{argv} exited {done.returncode}:\n{done.stdout}")


class Stats(unittest.TestCase):
    def test_mean_se(self):
        self.assertEqual(stats.mean_se([]), (None, None))
        self.assertEqual(stats.mean_se([2.5]), (2.5, None))
        # 1, 2, 3, 4: mean 2.5, sample variance (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3, s.e. sqrt(5/3 / 4).
        mean, se = stats.mean_se([1.0, 2.0, 3.0, 4.0])
        self.assertEqual(mean, 2.5)
        self.assertAlmostEqual(se, math.sqrt(5 / 12), places=12)
        self.assertAlmostEqual(stats.mean_se([3.0, 3.0])[1], 0.0)

    def test_mean_curve_uses_the_steps_every_replica_logged(self):
        runs = [{"curve": [{"step": 1, "bpc": 4.0}, {"step": 2, "bpc": 3.0, "valid_bpc": 3.5}, {"step": 3, "bpc": 2.0}]},
                {"curve": [{"step": 2, "bpc": 2.0}, {"step": 3, "bpc": 1.0, "valid_bpc": 1.5}]}]
        self.assertEqual(stats.mean_curve(runs, "bpc"), ([2, 3], [2.5, 1.5]))
        self.assertEqual(stats.mean_curve(runs, "valid_bpc"), ([], []))  # no step both logged
        self.assertEqual(stats.mean_curve([], "bpc"), ([], []))

    def test_curve_wall_seconds_per_seed(self):
        metrics = [{"step": 2, "bpc": 3.0, "lr": 1e-3}, {"step": 4, "valid_bpc": 2.0}]
        self.assertEqual(stats.curve(metrics, ("step", "bpc", "valid_bpc")),
                         [{"step": 2, "bpc": 3.0}, {"step": 4, "valid_bpc": 2.0}])
        self.assertIsNone(stats.wall_seconds([]))
        self.assertEqual(stats.wall_seconds([{"start": 10.0, "end": 12.0}, {"start": 11.0, "end": 17.5}]), 7.5)
        self.assertEqual(stats.per_seed([0.5, 0.25]), "50.0 / 25.0")
        self.assertEqual(stats.per_seed([12.4], 1, 0), "12")
        self.assertEqual(stats.per_seed(None), "")


class Sections(unittest.TestCase):
    def test_list_names_every_experiment_with_its_section(self):
        """`reproduce --list` (through scripts/reproduce) prints one line per
        NAME: the name, its section of docs/EXPERIMENTS.md, its title."""
        from sections import SECTIONS
        with open(os.path.join(ROOT, "docs", "EXPERIMENTS.md")) as f:
            doc_sections = {int(line.split(".")[0][3:]) for line in f if line.startswith("## ") and line[3].isdigit()}
        out = subprocess.run([os.path.join(ROOT, "scripts", "reproduce"), "--list"], check=True,
                             capture_output=True, text=True).stdout.splitlines()
        self.assertEqual(len(out), len(SECTIONS))
        for name, section in SECTIONS.items():
            line = next((l for l in out if l.split()[0] == name), None)
            self.assertIsNotNone(line, name)
            self.assertIn(f"section {section.DOC_SECTION:2d}: {section.EXPERIMENT['title']}", line)
            self.assertIn(section.DOC_SECTION, doc_sections, f"{name}: no section {section.DOC_SECTION} in the doc")


class Checkpoints(unittest.TestCase):
    STEPS, BATCH = 4, 3

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="reproduce-test-")
        cls.run_dir = os.path.join(cls.tmp.name, "run")
        train = runner.train_command(CLI, ["--task", "copy", "--copy-length", "4", "--layers", "1", "--width", "16",
                                           "--heads", "2", "--ffn", "32", "--steps", str(cls.STEPS),
                                           "--batch", str(cls.BATCH), "--checkpoint-every", "2", "--warmup", "1",
                                           "--log-every", "2", "--eval-batches", "1"], 7, cls.run_dir)
        run(train)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_listing_oldest_first(self):
        names = [os.path.basename(p) for p in checkpoints.checkpoints(self.run_dir)]
        self.assertEqual(names, ["checkpoint-00000002.ckpt", "checkpoint-00000004.ckpt"])

    def test_header(self):
        first, last = checkpoints.checkpoints(self.run_dir)
        self.assertEqual(checkpoints.checkpoint_header(first)["step"], 2)
        header = checkpoints.latest_header(self.run_dir)
        self.assertEqual(header["step"], self.STEPS)
        self.assertEqual(header["task"]["name"], "copy")
        self.assertEqual(header["task"]["copy_length"], 4)
        trainer = checkpoints.trainer_options(header)
        self.assertEqual((trainer["batch"], trainer["seed"]), (self.BATCH, 7))
        # The parameter count is the size of the tensors of kind parameter the header lists.
        sizes = [math.prod(t["shape"]) for t in header["tensors"] if t["kind"] == "parameter"]
        self.assertGreater(len(sizes), 4)
        self.assertEqual(header["parameters"], sum(sizes))

    def test_trainer_options_as_a_json_string(self):
        self.assertEqual(checkpoints.trainer_options({"trainer": '{"batch": 5}'}), {"batch": 5})

    def test_record_round_trip(self):
        """A finished run's record (records.py) brings it back into an empty
        run directory: skipped as finished, the same measurements, metric
        logs and header, no checkpoint; an unfinished run has no record, and
        a directory that holds anything is not overwritten."""
        import shutil
        import records
        with tempfile.TemporaryDirectory() as tmp:
            out, kept = os.path.join(tmp, "out"), os.path.join(tmp, "records")
            done = runner.replica(CLI, os.path.join(out, "a", "seed-7"), [], 7, self.STEPS, label="a")
            undone = runner.replica(CLI, os.path.join(out, "b", "seed-7"), [], 7, self.STEPS, label="b")
            shutil.copytree(self.run_dir, done["dir"])
            shutil.copytree(self.run_dir, undone["dir"])  # trained, never measured
            run(done["eval"])
            is_finished = lambda job: runner.finished(job) is not None  # noqa: E731
            self.assertEqual(records.save(kept, out, [done, undone], is_finished), ["a"])
            self.assertEqual(records.save(kept, out, [done, undone], is_finished), [])  # nothing new
            self.assertEqual(sorted(os.listdir(os.path.join(kept, "a", "seed-7"))),
                             ["header.json", "metrics.jsonl", "test.json"])
            self.assertFalse(os.path.exists(os.path.join(kept, "b")))

            again = os.path.join(tmp, "again")
            moved = [dict(j, dir=os.path.join(again, os.path.relpath(j["dir"], out))) for j in (done, undone)]
            self.assertEqual(records.restore(kept, again, moved), ["a"])
            self.assertEqual(runner.finished(moved[0]), runner.finished(done))
            self.assertEqual(checkpoints.latest_header(moved[0]["dir"]), checkpoints.latest_header(done["dir"]))
            self.assertEqual(checkpoints.read_jsonl(os.path.join(moved[0]["dir"], "metrics.jsonl")),
                             checkpoints.read_jsonl(os.path.join(done["dir"], "metrics.jsonl")))
            self.assertEqual(checkpoints.checkpoints(moved[0]["dir"]), [])
            self.assertFalse(os.path.exists(moved[1]["dir"]))

            os.remove(os.path.join(moved[0]["dir"], "test.json"))  # a directory with anything in it stays
            self.assertEqual(records.restore(kept, again, moved), [])
            self.assertIsNone(runner.finished(moved[0]))
            with self.assertRaisesRegex(RuntimeError, "no checkpoint and no header.json"):
                checkpoints.latest_header(tmp)
            with self.assertRaisesRegex(ValueError, "not below"):
                records.record_dir(kept, out, {"dir": tmp})

    def test_refuses_other_files(self):
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in (("short.ckpt", b"ATNKCKPT\x01"), ("other.ckpt", b"NOTACKPT" + bytes(40))):
                path = os.path.join(tmp, name)
                with open(path, "wb") as f:
                    f.write(data)
                with self.assertRaisesRegex(RuntimeError, "not an attnkit checkpoint"):
                    checkpoints.checkpoint_header(path)

    def test_skip_rule(self):
        job = runner.replica(CLI, self.run_dir, [], 7, self.STEPS, label="test")
        self.assertIsNone(runner.finished(job))  # trained, but no test.json yet
        run(job["eval"])
        results = runner.finished(job)
        self.assertEqual(len(results), 1)
        self.assertEqual((results[0]["step"], results[0]["metric"]), (self.STEPS, "accuracy"))
        self.assertIsNone(runner.finished(dict(job, steps=self.STEPS + 1)))  # a larger budget: not finished
        self.assertEqual(checkpoints.result_step({"model": {"step": 9}}), 9)  # approx.json
        self.assertIsNone(checkpoints.result_step(None))


if __name__ == "__main__":
    unittest.main()
