"""attnkit for PyTorch: loads libattnkit.so and exposes its ops.

Every op is available as ``torch.ops.attnkit.<name>`` (keyword arguments as in
docs/API.md) and, for convenience, as a function of this module::

    import attnkit
    out = attnkit.softmax_attention(q, k, v, causal=True)

The library is found through, in order: the ``ATTNKIT_LIBRARY`` environment
variable (a path to libattnkit.so), the installed layout (``lib/attnkit/python``
beside ``lib/libattnkit.so``), and the build tree (``build/libattnkit.so``).
"""
import os
import pathlib

import torch

__all__ = [
    "softmax_attention", "linear_attention", "gated_linear_attention",
    "agglomerative_attention", "clustered_attention", "sparse_attention",
    "edge_pattern", "linear", "library_path",
]


def _candidates():
    env = os.environ.get("ATTNKIT_LIBRARY")
    if env:
        yield pathlib.Path(env)
        return
    here = pathlib.Path(__file__).resolve().parent
    yield here.parent.parent.parent / "libattnkit.so"   # <prefix>/lib/attnkit/python/attnkit
    yield here.parent.parent / "build" / "libattnkit.so"  # source tree: python/attnkit


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            torch.ops.load_library(str(path))
            return path
    raise ImportError("attnkit: libattnkit.so not found; tried " + ", ".join(tried) +
                      ". Set ATTNKIT_LIBRARY to its path.")


library_path = _load()

softmax_attention = torch.ops.attnkit.softmax_attention
linear_attention = torch.ops.attnkit.linear_attention
gated_linear_attention = torch.ops.attnkit.gated_linear_attention
agglomerative_attention = torch.ops.attnkit.agglomerative_attention
clustered_attention = torch.ops.attnkit.clustered_attention
sparse_attention = torch.ops.attnkit.sparse_attention
edge_pattern = torch.ops.attnkit.edge_pattern
linear = torch.ops.attnkit.linear
