#!/usr/bin/python3
"""Checks that the result tables of docs/EXPERIMENTS.md show their JSON's numbers.

    python3 experiments/reproduce/check_tables.py [DOC]     (default docs/EXPERIMENTS.md)

Every table of the doc has a marker, an HTML comment on the line right
before it. A result table names its JSON:

    <!-- table: docs/experiments/NAME.json -->
    <!-- table: docs/experiments/NAME.json #2 rows: full, sparse-local, clustered-15 -->

and a table whose numbers no JSON holds says so, with the reason:

    <!-- table: no JSON, measured by hand with attnkit bench-lookup -->

NAME.json is what `python3 experiments/reproduce NAME` writes (cloze.json:
experiments/plot-cloze), and its tables are what that command prints: the
writer's table(results) run on the JSON. `#N` picks the Nth table printed
(default the first). `rows:` names the printed rows the doc shows, in the
doc's order, by their first cell; the doc may then leave rows out, reorder
and relabel them. Without it the doc shows every printed row, in order,
under the same labels.

The rule, cell by cell (the header row too: its numbers pin the columns,
"L = 64", "1,024"): the numbers of a doc cell, in order, are the printed
cell's, digit for digit, so with the same rounding. Thousands separators,
emphasis and the words around the numbers are free ("24.9%" shows "24.9",
"**1.785**" shows "1.785", "134,720" shows "134720"), and so is the first
cell of a row under `rows:`; otherwise the first cell is compared as text.

Exit status 0 when every marked table agrees with its JSON; 1 with one line
per problem: a mismatch names the section, row, column, the doc's value and
the JSON's; a marker whose JSON is missing, an unknown writer, a missing
table or row, and a table without a marker are problems too.
"""

import contextlib
import importlib.machinery
import importlib.util
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field

sys.dont_write_bytecode = True  # run from the source tree: no __pycache__ beside the modules
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paths  # noqa: E402
from sections import SECTIONS  # noqa: E402

MARKER = re.compile(r"^<!-- table: (?P<body>.*?) -->\s*$")
RESULT_MARKER = re.compile(r"^(?P<json>\S+\.json)(?:\s+#(?P<index>\d+))?(?:\s+rows:\s*(?P<rows>.+?))?\s*$")
NO_JSON_MARKER = re.compile(r"^no JSON, (?P<reason>\S.*)$")
SEPARATOR = re.compile(r"^\|(?:\s*:?-+:?\s*\|)+\s*$")
SECTION = re.compile(r"^## (?P<number>\d+)\.")
# A number as a table prints it: optionally signed ("+0.0068", "-0.1"; a
# hyphen between two numbers, "0.65-0.69", is a range, not a sign), with or
# without thousands separators ("134,720"). Digits after a letter are part of a name ("L1", "x11").
NUMBER = re.compile(r"(?<![\w.])[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


@dataclass
class Table:
    """A Markdown table: its header's and rows' cells, and the line number (1-based) of each."""
    line: int
    header: list
    rows: list = field(default_factory=list)  # (line, cells)


@dataclass
class Marker:
    """A table's marker: its JSON (None: a table without one, for REASON), which printed table
    (1-based) and which printed rows (None: all of them, in order)."""
    line: int
    section: str
    json: str = None
    index: int = 1
    rows: list = None
    reason: str = None


# ---------------------------------------------------------------- reading Markdown

def cells(line):
    """The cells of a table row: '| a | b |' -> ['a', 'b']."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def numbers(text):
    """The numbers of a cell as printed, thousands separators removed: '1,024 (±0.5)' -> ['1024', '0.5']."""
    return [n.replace(",", "") for n in NUMBER.findall(text)]


def label(text):
    """A row's first cell as compared: without emphasis or surrounding space."""
    return text.replace("*", "").strip()


def code_lines(lines):
    """The indices of the lines of fenced code blocks, fences included: no table or marker there."""
    inside, fenced = set(), False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
            inside.add(i)
        elif fenced:
            inside.add(i)
    return inside


def tables(lines):
    """The Markdown tables in LINES, in order: a row followed by a separator row
    starts one, and the rows after the separator belong to it."""
    found, current, code = [], None, code_lines(lines)
    for i, line in enumerate(lines):
        if i in code or not line.startswith("|"):
            current = None
        elif i + 1 < len(lines) and i + 1 not in code and SEPARATOR.match(lines[i + 1]):
            current = Table(i + 1, cells(line))
            found.append(current)
        elif current and not SEPARATOR.match(line):
            current.rows.append((i + 1, cells(line)))
    return found


def parse_marker(body, line, section):
    """A marker's comment body -> Marker, or a message saying why it is not one."""
    no_json = NO_JSON_MARKER.match(body)
    if no_json:
        return Marker(line, section, reason=no_json["reason"])
    result = RESULT_MARKER.match(body)
    if not result:
        return (f"line {line}: {section}: '<!-- table: {body} -->' is neither "
                "'<!-- table: PATH.json [#N] [rows: A, B, ...] -->' nor '<!-- table: no JSON, REASON -->'")
    rows = [r.strip() for r in result["rows"].split(",")] if result["rows"] else None
    return Marker(line, section, json=result["json"], index=int(result["index"] or 1), rows=rows)


def marked_tables(lines):
    """(marker, table) of every marked table of the doc, in order, and the problems:
    a table without a marker, a marker without a table, a marker that does not parse."""
    found, problems, section = [], [], "before section 1"
    by_line = {table.line: table for table in tables(lines)}
    code = code_lines(lines)
    for i, line in enumerate(lines):
        if i in code:
            continue
        heading, match = SECTION.match(line), MARKER.match(line)
        if heading:
            section = f"section {heading['number']}"
        if match:
            marker = parse_marker(match["body"].strip(), i + 1, section)
            if isinstance(marker, str):
                problems.append(marker)
            elif i + 2 not in by_line:
                problems.append(f"line {i + 1}: {section}: no table on the line after the marker")
            else:
                found.append((marker, by_line[i + 2]))
        if i + 1 in by_line and not (i > 0 and MARKER.match(lines[i - 1])):
            problems.append(f"line {i + 1}: {section}: a table without a marker on the line before it "
                            "(check_tables.py's help says how to mark one)")
    return found, problems


# ---------------------------------------------------------------- the writers' tables

def load_script(path, name):
    """A Python script without the .py suffix (experiments/plot-cloze), imported as module NAME."""
    loader = importlib.machinery.SourceFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def writers():
    """JSON name (NAME of NAME.json) -> the function that prints its tables from the results:
    every reproduce section's table(), and plot-cloze's for cloze.json."""
    found = {name: section.table for name, section in SECTIONS.items()}
    found["cloze"] = load_script(os.path.join(paths.ROOT, "experiments", "plot-cloze"), "plot_cloze").table
    return found


def printed(table_function, results):
    """What table_function(results) prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        table_function(results)
    return out.getvalue()


# ---------------------------------------------------------------- the comparison

def compare_cells(where, doc_cells, json_cells, columns, compare_label):
    """The mismatches between a doc row and the printed row it shows: WHERE names the
    row, COLUMNS the columns (the doc's header); the first cells are compared as text
    only with COMPARE_LABEL."""
    if len(doc_cells) != len(json_cells):
        return [f"{where}: the doc has {len(doc_cells)} columns, the JSON's table {len(json_cells)}"]
    problems = []
    if compare_label and label(doc_cells[0]) != label(json_cells[0]):
        problems.append(f"{where}: the doc's label is '{doc_cells[0]}', the JSON's row '{json_cells[0]}'")
    for column, doc_cell, json_cell in list(zip(columns, doc_cells, json_cells))[1:]:
        if numbers(doc_cell) != numbers(json_cell):
            problems.append(f"{where}, column '{column}': the doc has '{doc_cell}', the JSON gives '{json_cell}'")
    return problems


def compare(marker, doc, json_table):
    """The mismatches between the doc's table and the printed one, each naming the section,
    the row, the column, the doc's value and the JSON's."""
    name = os.path.basename(marker.json)
    where = f"line {doc.line}: {marker.section}, {name}"
    problems = compare_cells(f"{where}, header", doc.header, json_table.header, doc.header, compare_label=False)
    if problems:
        return problems  # other columns: every row would say so again
    labels = [label(row[0]) for _, row in json_table.rows]
    if marker.rows is None:
        if len(doc.rows) != len(json_table.rows):
            return [f"{where}: the doc shows {len(doc.rows)} rows, the JSON's table has {len(json_table.rows)} "
                    "(to show some of them, name them with 'rows:')"]
        shown = [row for _, row in json_table.rows]
    else:
        if len(doc.rows) != len(marker.rows):
            return [f"{where}: the marker names {len(marker.rows)} rows, the doc's table has {len(doc.rows)}"]
        unclear = [r for r in marker.rows if labels.count(r) != 1]
        if unclear:
            return [f"{where}: the JSON's table has not exactly one row {', '.join(repr(r) for r in unclear)} "
                    f"(its rows: {', '.join(labels)})"]
        shown = [json_table.rows[labels.index(r)][1] for r in marker.rows]
    for (line, doc_row), json_row in zip(doc.rows, shown):
        row_where = f"line {line}: {marker.section}, {name}, row '{doc_row[0]}'"
        problems += compare_cells(row_where, doc_row, json_row, doc.header, compare_label=marker.rows is None)
    return problems


def check_table(marker, doc, root, table_functions):
    """The problems of one result table: its JSON missing or unreadable, no writer for it,
    no such printed table, or the mismatches."""
    path = os.path.join(root, marker.json)
    where = f"line {marker.line}: {marker.section}"
    if not os.path.isfile(path):
        return [f"{where}: the marker's JSON {marker.json} does not exist"]
    name = os.path.basename(marker.json)[:-len(".json")]
    if name not in table_functions:
        return [f"{where}: no writer prints {marker.json}'s tables (known: {', '.join(sorted(table_functions))})"]
    with open(path) as f:
        try:
            results = json.load(f)
        except json.JSONDecodeError as e:
            return [f"{where}: {marker.json} is not JSON: {e}"]
    found = tables(printed(table_functions[name], results).splitlines())
    if not 1 <= marker.index <= len(found):
        return [f"{where}: the marker asks for table #{marker.index}; {name}'s writer prints {len(found)}"]
    return compare(marker, doc, found[marker.index - 1])


def check(doc_path, root=paths.ROOT, table_functions=None):
    """Every problem of the doc's tables, and the markers of the tables without JSON."""
    with open(doc_path) as f:
        lines = f.read().splitlines()
    table_functions = writers() if table_functions is None else table_functions
    found, problems = marked_tables(lines)
    for marker, doc in found:
        if marker.json is not None:
            problems += check_table(marker, doc, root, table_functions)
    return problems, [marker for marker, _ in found if marker.json is None]


def main(argv):
    doc_path = argv[1] if len(argv) > 1 else os.path.join(paths.ROOT, "docs", "EXPERIMENTS.md")
    problems, without_json = check(doc_path)
    shown = os.path.relpath(os.path.abspath(doc_path), paths.ROOT)
    for problem in problems:
        print(f"{shown}: {problem}")
    for marker in without_json:
        print(f"{shown}: line {marker.line}: {marker.section}: a table without JSON ({marker.reason})")
    if problems:
        print(f"check_tables: {len(problems)} problem(s)")
        return 1
    print(f"check_tables: every result table of {shown} shows its JSON's numbers")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
