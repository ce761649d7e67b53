#!/usr/bin/python3
"""scripts/package-graph on tests/data/packages-fixture.txt.

    python3 tests/scripts/package_graph_test.py

The expectations are counted by hand from the fixture (they are not computed
by a second implementation): which packages form the largest component of the
sound, games and graphics sections, its edges, the labels, the vocabulary and
the features of some descriptions. The fixture is built for it:
  - tonal-mixer has a second, later stanza (section games, Depends chess-master,
    description "Arcade mixer game") that must be ignored;
  - lonely-synth, lonely-synth-data and solitaire-classic form a component of
    3 that must be dropped, and orphan-viewer has no edge at all; only
    packages of other sections (libaurora-core, libimage-codec: libs;
    tray-launcher: x11) and a Suggests of wave-editor would join them;
  - tonal-sounds recommends itself; beatbox-synth, card-table depend on
    packages that are not in the file; photo-lab on a virtual one;
  - relations carry versions, `:any`, `:native`, `[amd64 arm64]`, `<!nocheck>`,
    alternatives whose second branch matters (puzzle-blocks, aurora-player),
    a folded line (card-table) and an edge only through Pre-Depends
    (maze-runner);
  - "free" is in 14 of the 26 component descriptions (more than half: not a
    feature), "open" in 13 (exactly half: a feature).
"""

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "package-graph")
FIXTURE = os.path.join(ROOT, "tests", "data", "packages-fixture.txt")
SECTIONS = "sound,games,graphics"
BASE = ["--sections", SECTIONS, "--train-per-class", "2", "--valid", "5", "--test", "8", "--min-count", "2"]
FILES = ("nodes.tsv", "edges.tsv", "vocabulary.txt", "meta.json")

# The largest component of sound, games and graphics, in node (name) order.
NODES = [
    "aurora-player",         # 0  sound
    "aurora-player-data",    # 1  sound
    "beatbox-synth",         # 2  contrib/sound
    "board-sounds",          # 3  sound
    "card-table",            # 4  games
    "card-table-data",       # 5  games
    "cd-ripper",             # 6  sound
    "chess-master",          # 7  games
    "chess-pieces-data",     # 8  games
    "font-render",           # 9  graphics
    "game-engine-common",    # 10 contrib/games
    "icon-forge",            # 11 graphics
    "maze-runner",           # 12 games
    "photo-lab",             # 13 non-free/graphics
    "pixel-viewer",          # 14 graphics
    "pulse-helper",          # 15 sound
    "puzzle-blocks",         # 16 games
    "scan-studio",           # 17 graphics
    "sketch-paint",          # 18 graphics
    "sketch-paint-brushes",  # 19 graphics
    "star-raiders",          # 20 games
    "star-raiders-data",     # 21 games
    "tonal-mixer",           # 22 sound (its first stanza)
    "tonal-sounds",          # 23 sound
    "vector-draw",           # 24 graphics
    "wave-editor",           # 25 sound
]
CLASSES = ["games", "graphics", "sound"]
SECTION_OF = {
    "aurora-player": "sound", "aurora-player-data": "sound", "beatbox-synth": "sound",
    "board-sounds": "sound", "cd-ripper": "sound", "pulse-helper": "sound", "tonal-mixer": "sound",
    "tonal-sounds": "sound", "wave-editor": "sound",
    "card-table": "games", "card-table-data": "games", "chess-master": "games",
    "chess-pieces-data": "games", "game-engine-common": "games", "maze-runner": "games",
    "puzzle-blocks": "games", "star-raiders": "games", "star-raiders-data": "games",
    "font-render": "graphics", "icon-forge": "graphics", "photo-lab": "graphics",
    "pixel-viewer": "graphics", "scan-studio": "graphics", "sketch-paint": "graphics",
    "sketch-paint-brushes": "graphics", "vector-draw": "graphics",
}
# Every relation between two nodes, read off the fixture (the field that makes it).
EDGE_NAMES = [
    ("aurora-player", "aurora-player-data"),     # Depends, first alternative
    ("aurora-player", "tonal-sounds"),           # Depends, second alternative
    ("aurora-player", "tonal-mixer"),            # Recommends tonal-mixer:any
    ("cd-ripper", "aurora-player"),              # Recommends
    ("tonal-mixer", "pulse-helper"),             # both ways: once
    ("beatbox-synth", "tonal-mixer"),            # (>= 0.9) [amd64 arm64]
    ("wave-editor", "aurora-player-data"),       # Recommends
    ("wave-editor", "sketch-paint"),             # Recommends, <!nocheck>
    ("star-raiders", "star-raiders-data"),       # (= 1.4-2)
    ("star-raiders", "tonal-sounds"),            # Recommends
    ("puzzle-blocks", "game-engine-common"),     # game-engine-common:any (>= 2.0~) | ...
    ("puzzle-blocks", "star-raiders-data"),      # ... | star-raiders-data
    ("game-engine-common", "pixel-viewer"),      # pixel-viewer:any
    ("chess-master", "chess-pieces-data"),
    ("chess-master", "game-engine-common"),
    ("chess-master", "board-sounds"),            # Recommends
    ("maze-runner", "game-engine-common"),       # Pre-Depends
    ("card-table", "game-engine-common"),        # folded Depends
    ("card-table", "card-table-data"),           # folded Depends
    ("sketch-paint", "pixel-viewer"),
    ("sketch-paint", "sketch-paint-brushes"),    # Recommends
    ("photo-lab", "pixel-viewer"),               # pixel-viewer (>= 3) | image-tool
    ("vector-draw", "sketch-paint-brushes"),
    ("vector-draw", "font-render"),
    ("scan-studio", "photo-lab"),
    ("icon-forge", "vector-draw"),               # Recommends vector-draw:native
]
# The same, as edges.tsv must hold it.
EDGES = [(0, 1), (0, 6), (0, 22), (0, 23), (1, 25), (2, 22), (3, 7), (4, 5), (4, 10), (7, 8), (7, 10),
         (9, 24), (10, 12), (10, 14), (10, 16), (11, 24), (13, 14), (13, 17), (14, 18), (15, 22), (16, 21),
         (18, 19), (18, 25), (19, 24), (20, 21), (20, 23)]
# Document frequencies in the 26 descriptions: open 13, game 6, files 5, sound 5,
# data 4, tonal 4, engine 3, and 2 for the rest of the list; "free" 14.
VOCABULARY = ["audio", "aurora", "brushes", "card", "chess", "data", "drawing", "editor", "engine", "fast",
              "files", "game", "games", "image", "levels", "master", "mixer", "music", "open", "opengl",
              "paint", "plays", "program", "programs", "raiders", "server", "sketch", "sound", "star",
              "table", "themes", "tonal", "wooden"]
# Feature words of some nodes.
FEATURE_WORDS = {
    # "Audio mixer for the Tonal sound server / Tonal mixes free and open streams."
    "tonal-mixer": {"audio", "mixer", "tonal", "sound", "server", "open"},
    # "wooden" comes after the " ." paragraph break.
    "chess-pieces-data": {"chess", "master", "data", "files", "wooden"},
    # "sdl2mixer" is "sdl" (one description) and "mixer".
    "beatbox-synth": {"programs", "open", "plays", "mixer"},
    # "OpenGL" is "opengl", not "open"; "opens" is a word of its own.
    "pixel-viewer": {"fast", "image", "opengl"},
    # "theremin" is in two more descriptions, both of the dropped component.
    "wave-editor": {"editor", "open"},
    # "arcade" is in one more description: the ignored second tonal-mixer stanza.
    "maze-runner": {"fast", "game", "levels"},
    "tonal-sounds": {"tonal"},
    "icon-forge": {"editor", "themes"},
    "scan-studio": set(),
}


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True)


def read(directory, name):
    with open(os.path.join(directory, name), "rb") as f:
        return f.read()


def nodes_of(directory):
    """[(name, label, split, [feature indices])] from nodes.tsv."""
    rows = []
    for line in read(directory, "nodes.tsv").decode().split("\n")[:-1]:
        name, label, split, features = line.split("\t")
        rows.append((name, int(label), split, [int(f) for f in features.split(" ")] if features else []))
    return rows


class PackageGraphTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.temporary = tempfile.TemporaryDirectory(prefix="package-graph-test.")
        cls.out = os.path.join(cls.temporary.name, "graph")
        cls.result = run("--input", FIXTURE, "--out", cls.out, *BASE)

    @classmethod
    def tearDownClass(cls):
        cls.temporary.cleanup()

    def dir(self, name):
        return os.path.join(self.temporary.name, name)

    def test_runs(self):
        self.assertEqual(self.result.returncode, 0, self.result.stderr)
        self.assertEqual(self.result.stderr, "")
        for name in FILES:
            self.assertTrue(os.path.isfile(os.path.join(self.out, name)), name)
        self.assertEqual(sorted(os.listdir(self.out)), sorted(FILES))  # no temporary file left
        self.assertIn("26", self.result.stdout)
        self.assertIn(self.out, self.result.stdout)

    def test_nodes_are_the_largest_component(self):
        names = [row[0] for row in nodes_of(self.out)]
        self.assertEqual(names, NODES)
        for dropped in ("lonely-synth", "lonely-synth-data", "solitaire-classic", "orphan-viewer",
                        "libc6", "libaurora-core", "libimage-codec", "tray-launcher", "cdtools", "dpkg",
                        "sketch-paint-doc", "image-tool", "libmissing-synth"):
            self.assertNotIn(dropped, names)

    def test_edges(self):
        text = read(self.out, "edges.tsv").decode()
        self.assertEqual(text, "".join(f"{i}\t{j}\n" for i, j in EDGES))
        index = {name: i for i, name in enumerate(NODES)}
        by_name = sorted(tuple(sorted((index[a], index[b]))) for a, b in EDGE_NAMES)
        self.assertEqual(by_name, EDGES)

    def test_labels(self):
        rows = nodes_of(self.out)
        self.assertEqual({name: CLASSES[label] for name, label, _, _ in rows}, SECTION_OF)

    def test_vocabulary_and_features(self):
        vocabulary = read(self.out, "vocabulary.txt").decode().split("\n")
        self.assertEqual(vocabulary[-1], "")
        self.assertEqual(vocabulary[:-1], VOCABULARY)
        for word in ("free", "the", "package", "provides", "arcade", "theremin", "sdl", "classic", "library",
                     "opens", "player"):
            self.assertNotIn(word, VOCABULARY)
        rows = {row[0]: row for row in nodes_of(self.out)}
        for name, words in FEATURE_WORDS.items():
            features = rows[name][3]
            self.assertEqual(features, sorted(features), name)
            self.assertEqual({VOCABULARY[f] for f in features}, words, name)
            self.assertEqual(len(features), len(words), name)
        # A node without features: the line ends with the tab.
        lines = read(self.out, "nodes.tsv").decode().split("\n")
        self.assertIn(f"scan-studio\t{CLASSES.index('graphics')}\t", lines[NODES.index("scan-studio")])
        self.assertTrue(lines[NODES.index("scan-studio")].endswith("\t"))

    def test_feature_limit_keeps_the_most_frequent(self):
        # open 13, game 6, then files and sound tie at 5: files (alphabetical).
        out = self.dir("features-3")
        result = run("--input", FIXTURE, "--out", out, *BASE, "--features", "3")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(read(out, "vocabulary.txt").decode(), "files\ngame\nopen\n")
        # The default --min-count 3: only the words of 3 to 13 descriptions.
        out = self.dir("min-count-3")
        result = run("--input", FIXTURE, "--out", out, "--sections", SECTIONS)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(read(out, "vocabulary.txt").decode().split(),
                         ["data", "engine", "files", "game", "open", "sound", "tonal"])

    def test_split(self):
        rows = nodes_of(self.out)
        counts = {s: sum(1 for row in rows if row[2] == s) for s in ("train", "valid", "test", "none")}
        self.assertEqual(counts, {"train": 6, "valid": 5, "test": 8, "none": 7})
        for label in range(len(CLASSES)):
            self.assertEqual(sum(1 for row in rows if row[1] == label and row[2] == "train"), 2, CLASSES[label])

    def test_split_small_classes_and_scaling(self):
        # 9 games, 8 graphics, 9 sound: fewer than 2 * 5 each, so half of each
        # (4, 4, 4); 14 nodes remain for 15 + 10: scaled to 14 * 15 // 25 = 8 and 6.
        out = self.dir("small-classes")
        result = run("--input", FIXTURE, "--out", out, "--sections", SECTIONS, "--train-per-class", "5",
                     "--valid", "15", "--test", "10")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("note", result.stderr)
        rows = nodes_of(out)
        for label in range(len(CLASSES)):
            self.assertEqual(sum(1 for row in rows if row[1] == label and row[2] == "train"), 4, CLASSES[label])
        meta = json.loads(read(out, "meta.json"))
        self.assertEqual(meta["split_counts"], {"train": 12, "valid": 8, "test": 6, "none": 0})

    def test_meta(self):
        meta = json.loads(read(self.out, "meta.json"))
        with open(FIXTURE, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        self.assertEqual(meta["format"], "attnkit-node-graph")
        self.assertEqual(meta["version"], 1)
        self.assertEqual(meta["nodes"], 26)
        self.assertEqual(meta["edges"], 26)
        self.assertEqual(meta["features"], len(VOCABULARY))
        self.assertEqual(meta["classes"], CLASSES)
        self.assertEqual(meta["class_counts"], [9, 8, 9])
        self.assertEqual(meta["split_counts"], {"train": 6, "valid": 5, "test": 8, "none": 7})
        self.assertEqual(meta["sections"], ["sound", "games", "graphics"])
        self.assertEqual(meta["source"], {"input": FIXTURE, "stanzas": 38, "sha256": digest})
        self.assertEqual(meta["options"], {"sections": ["sound", "games", "graphics"], "features": 1000,
                                           "min_count": 2, "train_per_class": 2, "valid": 5, "test": 8,
                                           "split_seed": 0})
        self.assertTrue(read(self.out, "meta.json").startswith(b'{\n  "format"'))

    def test_default_sections(self):
        # x11 brings tray-launcher, which joins aurora-player, pixel-viewer and
        # lonely-synth: the component of 3 joins the large one (30 nodes, 31 edges).
        out = self.dir("default-sections")
        result = run("--input", FIXTURE, "--out", out, "--train-per-class", "1", "--valid", "2", "--test", "2")
        self.assertEqual(result.returncode, 0, result.stderr)
        meta = json.loads(read(out, "meta.json"))
        self.assertEqual((meta["nodes"], meta["edges"]), (30, 31))
        self.assertEqual(meta["classes"], ["games", "graphics", "sound", "x11"])
        self.assertEqual(meta["class_counts"], [10, 8, 11, 1])
        names = [row[0] for row in nodes_of(out)]
        self.assertEqual(sorted(set(names) - set(NODES)),
                         ["lonely-synth", "lonely-synth-data", "solitaire-classic", "tray-launcher"])
        # A class of 1 still gets 1 training node.
        rows = nodes_of(out)
        self.assertEqual([row[2] for row in rows if row[0] == "tray-launcher"], ["train"])

    def test_component_tie(self):
        # Two components of 2: the one holding the smallest name (apple) wins,
        # though banana - cherry has the smaller largest name.
        index = os.path.join(self.temporary.name, "tie.txt")
        with open(index, "w") as f:
            f.write("Package: banana\nDepends: cherry\nDescription: Yellow fruit\nSection: games\n\n"
                    "Package: cherry\nDescription: Red fruit\nSection: games\n\n"
                    "Package: zebra\nDescription: Striped animal\nSection: games\n\n"
                    "Package: apple\nDepends: zebra (>= 1)\nDescription: Green fruit\nSection: games\n")
        out = self.dir("tie")
        result = run("--input", index, "--out", out, "--sections", "games", "--min-count", "1")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual([(row[0], row[1], row[3]) for row in nodes_of(out)],
                         [("apple", 0, [1, 2]), ("zebra", 0, [0, 3])])
        self.assertEqual(read(out, "edges.tsv"), b"0\t1\n")
        # "Green fruit" and "Striped animal": each word in 1 of the 2
        # descriptions (banana's "fruit" is not counted).
        self.assertEqual(read(out, "vocabulary.txt"), b"animal\nfruit\ngreen\nstriped\n")
        # A class of 2 gives 1 to train; the other node is all that remains
        # for 500 valid + 1000 test: 500 * 1 // 1500 = 0 valid, 1 test.
        self.assertEqual(sorted(row[2] for row in nodes_of(out)), ["test", "train"])
        self.assertIn("note", result.stderr)

    def test_deterministic(self):
        out = self.dir("again")
        result = run("--input", FIXTURE, "--out", out, *BASE)
        self.assertEqual(result.returncode, 0, result.stderr)
        for name in FILES:
            self.assertEqual(read(out, name), read(self.out, name), name)
        # Another seed: the same graph, another split.
        out = self.dir("seed-1")
        result = run("--input", FIXTURE, "--out", out, *BASE, "--split-seed", "1")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(read(out, "edges.tsv"), read(self.out, "edges.tsv"))
        self.assertEqual([r[:2] + r[3:] for r in nodes_of(out)], [r[:2] + r[3:] for r in nodes_of(self.out)])
        self.assertNotEqual([r[2] for r in nodes_of(out)], [r[2] for r in nodes_of(self.out)])

    def test_refuses_to_overwrite(self):
        out = self.dir("overwrite")
        self.assertEqual(run("--input", FIXTURE, "--out", out, *BASE).returncode, 0)
        before = {name: read(out, name) for name in FILES}
        result = run("--input", FIXTURE, "--out", out, *BASE, "--features", "3")
        self.assertEqual(result.returncode, 1)
        self.assertIn("--force", result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        self.assertEqual({name: read(out, name) for name in FILES}, before)
        result = run("--input", FIXTURE, "--out", out, *BASE, "--features", "3", "--force")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(read(out, "vocabulary.txt"), b"files\ngame\nopen\n")
        self.assertEqual(sorted(os.listdir(out)), sorted(FILES))

    def test_errors(self):
        cases = [
            ("no package", ["--input", FIXTURE, "--sections", "hamradio"]),
            ("no dependency edge", ["--input", FIXTURE, "--sections", "admin"]),  # dpkg alone
            ("cannot read", ["--input", os.path.join(self.temporary.name, "missing.txt")]),
        ]
        for i, (message, args) in enumerate(cases):
            out = self.dir(f"error-{i}")
            result = run(*args, "--out", out)
            self.assertEqual(result.returncode, 1, message)
            self.assertIn(message, result.stderr)
            self.assertTrue(result.stderr.startswith("package-graph: "), result.stderr)
            self.assertNotIn("Traceback", result.stderr)
            self.assertFalse(os.path.exists(os.path.join(out, "meta.json")), message)

    def test_help(self):
        result = run("--help")
        self.assertEqual(result.returncode, 0)
        for word in ("apt-cache dumpavail", "nodes.tsv", "edges.tsv", "vocabulary.txt", "meta.json",
                     "--train-per-class", "--force"):
            self.assertIn(word, result.stdout)


if __name__ == "__main__":
    unittest.main()
