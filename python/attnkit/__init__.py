"""attnkit for PyTorch: the library's ops, modules and models.

* ops: ``torch.ops.attnkit.<name>`` (keyword arguments as in docs/API.md), also
  functions of this package::

      import attnkit
      out = attnkit.softmax_attention(q, k, v, causal=True)
      out = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True)  # torch 2's API

* modules: ``attnkit.nn`` (MultiheadAttention with any mechanism, the zoo,
  Linear, the agglomerative and linear layers, DocumentMemory, one class per
  registry mechanism in ``attnkit.nn.registry``);
* block masks: ``attnkit.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)``,
  ``BlockMask``, ``and_masks``, ``or_masks``, ``noop_mask`` (torch 2's
  FlexAttention API) and the named mask_mods of ``attnkit.masks``;
* models: ``attnkit.models.Transformer`` (the builder, generation, runs of
  ``attnkit train``);
* ``attnkit.mechanisms()`` lists the registry (as data; its classes are
  ``attnkit.nn.registry``);
* ``attnkit.isa()`` names the instruction-set level the kernels run at
  (``baseline``, ``avx2``, ``avx512``, ``avx512_bf16`` or ``amx``: the best the
  CPU has, capped by the environment variable ``ATTNKIT_MAX_ISA`` or by
  ``attnkit.set_max_isa`` before the first kernel call), ``attnkit.isa_description()``
  says how it was chosen.
"""
import torch

from ._library import library_path, mechanisms

__version__ = torch.ops.attnkit.version()

isa = torch.ops.attnkit.isa
isa_description = torch.ops.attnkit.isa_description
machine_isa = torch.ops.attnkit.machine_isa
set_max_isa = torch.ops.attnkit.set_max_isa

if machine_isa() == "below baseline":
    # The kernels need x86-64-v2; say so at import rather than at the first op.
    raise ImportError("attnkit: this CPU lacks the baseline level attnkit's kernels are built for "
                      "(x86-64-v2: SSE4.2, SSSE3, POPCNT, CMPXCHG16B)")

__all__ = [
    "scaled_dot_product_attention", "softmax_attention", "softmax_attention_with_lse", "merge_attention",
    "linear_attention", "gated_linear_attention",
    "varlen_attention", "varlen_linear_attention",
    "agglomerative_attention", "clustered_attention", "sparse_attention",
    "edge_pattern", "linear", "alibi_slopes", "rotary_embedding", "attention_dropout_mask", "library_path", "mechanisms", "nn", "models",
    "isa", "isa_description", "machine_isa", "set_max_isa",
    "BlockMask", "create_block_mask", "and_masks", "or_masks", "noop_mask", "masks",
    "flex_attention", "flex_attention_dispatch", "score_mods",
]

softmax_attention = torch.ops.attnkit.softmax_attention
# (out, lse): softmax_attention and each row's log-sum-exp, both
# differentiable; merge_attention(outputs, lses) -> (out, lse) combines
# attention over disjoint key sets exactly. docs/API.md.
softmax_attention_with_lse = torch.ops.attnkit.softmax_attention_with_lse
merge_attention = torch.ops.attnkit.merge_attention
linear_attention = torch.ops.attnkit.linear_attention
# Packed variable-length batches (q (Tq, H, E), k and v (Tk, Hkv, .), int64
# offsets cu_seqlens_q and cu_seqlens_k of B + 1 entries): docs/API.md.
varlen_attention = torch.ops.attnkit.varlen_attention
varlen_linear_attention = torch.ops.attnkit.varlen_linear_attention
gated_linear_attention = torch.ops.attnkit.gated_linear_attention
agglomerative_attention = torch.ops.attnkit.agglomerative_attention
clustered_attention = torch.ops.attnkit.clustered_attention
sparse_attention = torch.ops.attnkit.sparse_attention
edge_pattern = torch.ops.attnkit.edge_pattern
linear = torch.ops.attnkit.linear
alibi_slopes = torch.ops.attnkit.alibi_slopes
rotary_embedding = torch.ops.attnkit.rotary_embedding
# Attention dropout's keep mask (N, H, L, S) for a seed: what
# softmax_attention(dropout_p=, dropout_seed=) keeps. docs/API.md.
attention_dropout_mask = torch.ops.attnkit.attention_dropout_mask


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """torch 2's ``torch.nn.functional.scaled_dot_product_attention`` (as
    documented for torch 2.5) over attnkit's exact kernel, for torch 1.13:
    ``softmax(query key^T * scale + mask) value`` over ``(..., L, E)`` queries
    and ``(..., S, E)`` keys, batch dimensions broadcast.

    * ``attn_mask``: boolean (True: takes part) or of the query's dtype
      (added to the scores), broadcastable to ``(..., L, S)``;
    * ``is_causal``: query i sees key j iff j <= i (top-left aligned, unlike
      ``softmax_attention(causal=True)`` when L != S); not with ``attn_mask``;
    * ``scale``: default ``1 / sqrt(E)``;
    * ``enable_gqa``: query head h reads key and value head ``h // (Hq // Hk)``;
    * ``dropout_p``: attention dropout inside the exact kernel, applied
      whenever positive (as torch's: pass 0.0 when not training); its seed
      comes from torch's default generator (``torch.manual_seed`` repeats it).

    A query row with no visible key gives zeros and zero gradients (torch's
    math backend gives NaN there). docs/API.md says what each argument costs.
    """
    return torch.ops.attnkit.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                          scale=scale, enable_gqa=enable_gqa)


from . import nn, models  # noqa: E402  (they need the library loaded above)
# Block masks with torch 2's FlexAttention API; named mask_mods in attnkit.masks.
from . import masks  # noqa: E402
from .block_mask import BlockMask, and_masks, create_block_mask, noop_mask, or_masks  # noqa: E402
from .flex import flex_attention, flex_attention_dispatch  # noqa: E402
from . import score_mods  # noqa: E402  (score_mod functions traced into the kernel)
