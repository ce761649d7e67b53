"""attnkit for PyTorch: the library's ops, modules and models.

* ops: ``torch.ops.attnkit.<name>`` (keyword arguments as in docs/API.md), also
  functions of this package::

      import attnkit
      out = attnkit.softmax_attention(q, k, v, causal=True)

* modules: ``attnkit.nn`` (MultiheadAttention with any mechanism, the zoo,
  Linear, the agglomerative and linear layers, DocumentMemory, one class per
  registry mechanism in ``attnkit.nn.mechanisms``);
* models: ``attnkit.models.Transformer`` (the builder, generation, runs of
  ``attnkit train``);
* ``attnkit.mechanisms()`` lists the registry.
"""
import torch

from ._library import library_path, mechanisms

__version__ = torch.ops.attnkit.version()

__all__ = [
    "softmax_attention", "linear_attention", "gated_linear_attention",
    "agglomerative_attention", "clustered_attention", "sparse_attention",
    "edge_pattern", "linear", "library_path", "mechanisms", "nn", "models",
]

softmax_attention = torch.ops.attnkit.softmax_attention
linear_attention = torch.ops.attnkit.linear_attention
gated_linear_attention = torch.ops.attnkit.gated_linear_attention
agglomerative_attention = torch.ops.attnkit.agglomerative_attention
clustered_attention = torch.ops.attnkit.clustered_attention
sparse_attention = torch.ops.attnkit.sparse_attention
edge_pattern = torch.ops.attnkit.edge_pattern
linear = torch.ops.attnkit.linear

from . import nn, models  # noqa: E402  (they need the library loaded above)
