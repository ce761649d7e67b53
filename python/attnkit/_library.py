"""Finds and loads libattnkit.so, which registers torch.ops.attnkit and
torch.classes.attnkit.

The library is found through, in order: the ``ATTNKIT_LIBRARY`` environment
variable (a path to libattnkit.so), the copy a pip install puts inside the
package (``attnkit/lib``), the CMake install layout (``lib/attnkit/python``
beside ``lib/libattnkit.so``), and the source tree's build directory
(``build/libattnkit.so``).
"""
import json
import os
import pathlib

import torch

__all__ = ["library_path", "mechanisms"]


def _candidates():
    env = os.environ.get("ATTNKIT_LIBRARY")
    if env:
        yield pathlib.Path(env)
        return
    here = pathlib.Path(__file__).resolve().parent
    yield here / "lib" / "libattnkit.so"                  # pip install
    yield here.parent.parent.parent / "libattnkit.so"     # <prefix>/lib/attnkit/python/attnkit
    yield here.parent.parent / "build" / "libattnkit.so"  # source tree: python/attnkit


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            torch.ops.load_library(str(path))
            return path
    raise ImportError("attnkit: libattnkit.so not found; tried " + ", ".join(tried) +
                      ". Install the package (pip install .) or set ATTNKIT_LIBRARY to its path.")


library_path = _load()


def mechanisms():
    """The registry of mechanisms (`attnkit mechanisms`): a list of dicts with
    name, summary, options (key, type: integer | real | boolean | choice,
    accepts: e.g. "integer >= 1", default, help, and min, min_exclusive, max
    or choices where they apply), supports (causal,
    key_lengths, cross, value_dim, decoding_state, grouped_heads, alibi, and
    rotary: "kernel", "inputs" or "none"), inputs, approximates_exact,
    always_causal and layer_only (a mechanism that is a whole layer:
    attnkit.nn.AgglomerativeAttention)."""
    return json.loads(torch.ops.attnkit.mechanisms_json())
