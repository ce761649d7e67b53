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
    or choices where they apply), supports (one key per support field, listed
    below), inputs, approximates_exact, always_causal, layer_only (a mechanism
    that is a whole layer: attnkit.nn.AgglomerativeAttention), exact (exact
    softmax attention), torch_baseline (torch computes the same), layer
    ("multihead" or "class_projections": the layer a transformer block builds
    around it), model_structures (attends over structures the model's edge
    predictor makes: SAC) and adds_nodes (a pattern with nodes of its own)."""
    return json.loads(torch.ops.attnkit.mechanisms_json())


def _support_fields_doc():
    fields = json.loads(torch.ops.attnkit.support_fields_json())
    return "\n\n    supports' keys:\n" + "".join(f"\n    - {f['key']}: {f['help']}" for f in fields)


# The supports keys come from the library's one list of them
# (nn::support_fields()), as `attnkit mechanisms` prints them.
mechanisms.__doc__ += _support_fields_doc()
