#!/usr/bin/python3
"""experiments/reproduce/check_tables.py, the check that docs/EXPERIMENTS.md's
result tables show their JSON's numbers: on small documents and a writer of
its own, then on docs/EXPERIMENTS.md itself with one number altered.

    python3 experiments/tests/check_tables_test.py
"""

import json
import os
import shutil
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "experiments", "reproduce"))
sys.dont_write_bytecode = True  # nothing written into the source tree

import check_tables  # noqa: E402


def writer(results):
    """A writer's table: one row per mechanism, accuracy per length (%), then a
    second table of seconds."""
    print("| mechanism | L = 16 | L = 32 |")
    print("|---|---:|---:|")
    for name, accuracy in results["accuracy"].items():
        print(f"| {name} | " + " | ".join(f"{100 * a:.1f}" for a in accuracy) + " |")
    print()
    print("| mechanism | seconds |")
    print("|---|---:|")
    for name, seconds in results["seconds"].items():
        print(f"| {name} | {seconds:,} |")


RESULTS = {"accuracy": {"full": [1.0, 0.9876], "sparse-local": [0.0962, 0.1]},
           "seconds": {"full": 1234, "sparse-local": 56}}

# The doc as a writer of it would have it: the first table as printed, the
# second relabelled, reordered and with thousands separators.
DOC = """# Experiments

## 1. One

<!-- table: results/copy.json -->
| mechanism | L = 16 | L = 32 |
|---|---:|---:|
| full | 100.0 | 98.8 |
| sparse-local | 9.6 | 10.0 |

Text.

```sh
| not a table | in a code block |
|---|---|
```

## 2. Two

<!-- table: results/copy.json #2 rows: sparse-local, full -->
| mechanism | training seconds |
|---|---:|
| local window (span 1) | **56** |
| full attention | 1,234 |

<!-- table: no JSON, measured by hand -->
| n | speed-up |
|---:|---:|
| 100 | 3.8x |
"""


class Checked(unittest.TestCase):
    """check() on a small doc in a temporary directory, with the writer above for copy.json."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="check-tables-test-")
        os.makedirs(os.path.join(self.tmp.name, "results"))
        with open(os.path.join(self.tmp.name, "results", "copy.json"), "w") as f:
            json.dump(RESULTS, f)

    def tearDown(self):
        self.tmp.cleanup()

    def problems(self, doc, writers=None):
        """check()'s problems for the doc text DOC."""
        path = os.path.join(self.tmp.name, "EXPERIMENTS.md")
        with open(path, "w") as f:
            f.write(doc)
        problems, _ = check_tables.check(path, self.tmp.name, writers or {"copy": writer})
        return problems

    def test_the_doc_as_printed_passes_and_lists_its_tables_without_json(self):
        path = os.path.join(self.tmp.name, "EXPERIMENTS.md")
        with open(path, "w") as f:
            f.write(DOC)
        problems, without_json = check_tables.check(path, self.tmp.name, {"copy": writer})
        self.assertEqual(problems, [])
        self.assertEqual([(m.line, m.section, m.reason) for m in without_json],
                         [(26, "section 2", "measured by hand")])

    def test_an_altered_number_names_section_row_column_and_both_values(self):
        problems = self.problems(DOC.replace("| full | 100.0 | 98.8 |", "| full | 100.0 | 98.7 |"))
        self.assertEqual(problems, ["line 8: section 1, copy.json, row 'full', column 'L = 32': "
                                    "the doc has '98.7', the JSON gives '98.8'"])

    def test_another_rounding_is_a_mismatch(self):
        problems = self.problems(DOC.replace("| 98.8 |", "| 98.76 |"))
        self.assertEqual(len(problems), 1)
        self.assertIn("the doc has '98.76', the JSON gives '98.8'", problems[0])

    def test_a_relabelled_row_is_checked_through_rows(self):
        problems = self.problems(DOC.replace("| full attention | 1,234 |", "| full attention | 1,243 |"))
        self.assertEqual(problems, ["line 24: section 2, copy.json, row 'full attention', column 'training seconds': "
                                    "the doc has '1,243', the JSON gives '1,234'"])

    def test_rows_out_of_order_without_rows_are_a_mismatch(self):
        doc = DOC.replace("| full | 100.0 | 98.8 |\n| sparse-local | 9.6 | 10.0 |",
                          "| sparse-local | 9.6 | 10.0 |\n| full | 100.0 | 98.8 |")
        problems = self.problems(doc)
        self.assertEqual(len(problems), 6, problems)  # per row: the label and both lengths
        self.assertIn("row 'sparse-local': the doc's label is 'sparse-local', the JSON's row 'full'", problems[0])
        self.assertIn("column 'L = 16': the doc has '9.6', the JSON gives '100.0'", problems[1])

    def test_a_missing_json_fails(self):
        problems = self.problems(DOC.replace("results/copy.json #2", "results/gone.json #2"))
        self.assertEqual(problems, ["line 20: section 2: the marker's JSON results/gone.json does not exist"])

    def test_a_json_without_a_writer_fails(self):
        shutil.copy(os.path.join(self.tmp.name, "results", "copy.json"), os.path.join(self.tmp.name, "other.json"))
        problems = self.problems(DOC.replace("results/copy.json #2", "other.json #2"))
        self.assertEqual(problems, ["line 20: section 2: no writer prints other.json's tables (known: copy)"])

    def test_marker_problems(self):
        cases = {"#3 rows: sparse-local, full": "the marker asks for table #3; copy's writer prints 2",
                 "#2 rows: sparse-local, none": "the JSON's table has not exactly one row 'none' "
                                                "(its rows: full, sparse-local)",
                 "#2 rows: full": "the marker names 1 rows, the doc's table has 2"}
        for body, expected in cases.items():
            with self.subTest(body=body):
                problems = self.problems(DOC.replace("results/copy.json #2 rows: sparse-local, full",
                                                     "results/copy.json " + body))
                self.assertEqual(len(problems), 1, problems)
                self.assertIn(expected, problems[0])

    def test_without_rows_the_labels_are_compared(self):
        problems = self.problems(DOC.replace("#2 rows: sparse-local, full", "#2"))
        self.assertEqual(len(problems), 4, problems)  # per row: the label and the seconds
        self.assertIn("row 'local window (span 1)': the doc's label is 'local window (span 1)', "
                      "the JSON's row 'full'", problems[0])

    def test_a_different_header_is_one_mismatch(self):
        problems = self.problems(DOC.replace("| mechanism | L = 16 | L = 32 |\n|---|---:|---:|\n| full",
                                             "| mechanism | L = 16 | L = 64 |\n|---|---:|---:|\n| full"))
        self.assertEqual(problems, ["line 6: section 1, copy.json, header, column 'L = 64': "
                                    "the doc has 'L = 64', the JSON gives 'L = 32'"])

    def test_unmarked_tables_and_stray_markers_fail(self):
        problems = self.problems(DOC.replace("<!-- table: results/copy.json -->\n", "")
                                 .replace("Text.", "<!-- table: results/copy.json -->")
                                 .replace("no JSON, measured", "measured"))
        self.assertEqual(len(problems), 3, problems)
        self.assertIn("line 5: section 1: a table without a marker", problems[0])
        self.assertIn("line 10: section 1: no table on the line after the marker", problems[1])
        self.assertIn("'<!-- table: measured by hand -->' is neither", problems[2])


class Numbers(unittest.TestCase):
    def test_numbers_as_printed(self):
        cases = {"1,024": ["1024"], "0.65-0.69": ["0.65", "0.69"], "+0.0068": ["+0.0068"], "-0.1": ["-0.1"],
                 "**1.785**": ["1.785"], "24.9%": ["24.9"], "2.617 ± 0.0155 (3)": ["2.617", "0.0155", "3"],
                 "73.7, 73.7": ["73.7", "73.7"], "row L1 layer 0": ["0"], "clustered-15": ["15"], "all": []}
        for text, expected in cases.items():
            self.assertEqual(check_tables.numbers(text), expected, text)


class TheDoc(unittest.TestCase):
    """docs/EXPERIMENTS.md with the committed JSONs and the real writers."""

    def test_an_altered_number_in_the_doc_is_found(self):
        with open(os.path.join(ROOT, "docs", "EXPERIMENTS.md")) as f:
            doc = f.read()
        row = "| improved-clustered, 15 | 100.0 | 99.7 | 92.0 | 11.3 |"
        self.assertEqual(doc.count(row), 1, "section 2's row moved: update this test")
        with tempfile.TemporaryDirectory(prefix="check-tables-test-") as tmp:
            path = os.path.join(tmp, "EXPERIMENTS.md")
            with open(path, "w") as f:
                f.write(doc.replace(row, row.replace("92.0", "92.1")))
            problems, _ = check_tables.check(path)
        self.assertEqual(len(problems), 1, problems)
        self.assertRegex(problems[0], r"^line \d+: section 2, copy-clustered.json, row 'improved-clustered, 15', "
                                      r"column 'L = 256': the doc has '92.1', the JSON gives '92.0'$")


if __name__ == "__main__":
    unittest.main()
