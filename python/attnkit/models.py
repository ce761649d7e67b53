"""attnkit.models.Transformer: the C++ transformer builder as a torch.nn.Module.

It is attnkit::models::Transformer itself (include/attnkit/models/transformer.h)
behind nn.Parameters (attnkit/_bridge.py): the same options, layers, outputs and
errors, and the same checkpoints. A run of ``attnkit train`` loads with
``Transformer.load(run_dir)`` and gives the logits ``attnkit eval`` computes;
``model.save(run_dir, ...)`` writes a run that ``attnkit eval`` and
``attnkit generate`` read.

    model = attnkit.models.Transformer.from_kwargs(
        vocab_size=27, layers=4, width=256, heads=4,
        attention=["full", "full", "improved-clustered:clusters=25", "causal-linear"])
    logits = model(tokens)                                  # (N, L) -> (N, L, 27)
    text = model.generate(prompt, tokens=100, top_k=5)
"""
import json
import warnings
from typing import Optional

from torch import Tensor

from ._bridge import BridgedModule

__all__ = ["Transformer"]

# TransformerOptions' keys (src/models/options.cpp) with their C++ defaults.
_OPTIONS = ("architecture", "vocab_size", "source_vocab_size", "layers", "width", "heads", "kv_heads", "ffn",
            "dropout", "attention_dropout", "attention", "cross_attention", "positions", "max_length", "relative_clip",
            "conv_width", "rotary_fraction", "norm", "normalization", "feed_forward", "bias", "tie_embeddings",
            "shared_weights")

# block="llama": the options it sets unless given (`attnkit train --block llama`).
_LLAMA_BLOCK = {"norm": "pre", "normalization": "rms", "feed_forward": "swiglu", "bias": False, "positions": "rope"}


class Transformer(BridgedModule):
    """A decoder-only language model, an encoder or an encoder-decoder whose
    blocks take their self-attention from the registry by spec string.

    Options (the C++ TransformerOptions, same names and defaults):
    architecture ("decoder" | "encoder" | "encoder-decoder"), vocab_size,
    source_vocab_size, layers (2), width (64), heads (4), kv_heads (0: as many as
    heads; a divisor of heads for grouped-query attention, 1 for multi-query), ffn (256),
    dropout (0.1), attention_dropout (0.0: dropout on the attention weights in
    training, inside the exact kernel), attention (a spec, or one per block; "full"),
    cross_attention ("full"), positions ("sinusoidal" | "learned" | "relative"
    | "conv" | "alibi" | "rope" | "none", or schemes joined by "+" such as "conv+learned"), max_length (2048), relative_clip (16), conv_width (8),
    rotary_fraction (1.0: with "rope", the share of each head's features rotated),
    norm ("pre" | "post"), normalization ("layer" | "rms": layer norm or
    RMSNorm), feed_forward ("relu" | "swiglu": ff2(silu(ff1 h) * ff3 h)), bias
    (True; False: no biases in the blocks' linear layers and layer norms, nor in
    an untied output layer), tie_embeddings (True), shared_weights (False).

    block="llama" (not an option of its own) is the block LLaMA-style decoders
    use: norm "pre", normalization "rms", feed_forward "swiglu", bias False and
    positions "rope", each unless given; kv_heads stays as given.
    """

    # TorchScript compiles forward only: the options are Python's.
    __jit_unused_properties__ = ["options"]

    def __init__(self, vocab_size, block="classic", **options):
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TypeError(f"attnkit.models.Transformer: unknown option(s) {', '.join(unknown)}; "
                            f"known: {', '.join(_OPTIONS)}, block")
        if block not in ("classic", "llama"):
            raise ValueError(f"attnkit.models.Transformer: block must be 'classic' or 'llama', got {block!r}")
        if block == "llama":
            options = {**_LLAMA_BLOCK, **options}
        if isinstance(options.get("attention"), str):
            options["attention"] = [options["attention"]]
        super().__init__("Transformer", dict(options, vocab_size=vocab_size))
        self.run_info = None

    @classmethod
    def from_kwargs(cls, **options):
        """The builder form (fast-transformers' TransformerEncoderBuilder.from_kwargs):
        every option by keyword, vocab_size included."""
        if "vocab_size" not in options:
            raise TypeError("attnkit.models.Transformer.from_kwargs: vocab_size is required")
        return cls(options.pop("vocab_size"), **options)

    @classmethod
    def load(cls, run_dir):
        """The model of the newest checkpoint of a run directory (written by
        ``attnkit train`` or save()), in eval mode. ``run_info`` holds the
        checkpoint's path, step, task and trainer options."""
        self = cls.__new__(cls)
        BridgedModule.__init__(self, "run", {"run_dir": str(run_dir)})
        self.run_info = json.loads(self._bridge.run_info())
        self.eval()
        return self

    @property
    def options(self):
        """The builder's options as a dict (after set_attention, the new specs)."""
        return json.loads(self._bridge.settings())

    def forward(self, tokens: Tensor, source: Optional[Tensor] = None,
                source_lengths: Optional[Tensor] = None) -> Tensor:
        """tokens (N, L) int64 -> logits (N, L, vocab_size); an encoder-decoder
        also takes source (N, S) and its lengths (int64 (N), optional)."""
        return self._forward(tokens, source, source_lengths)[0]

    def generate(self, prompt, tokens=100, temperature=1.0, top_k=0, seed=0, source=None,
                 source_lengths=None):
        """prompt (N, P) -> (N, P + tokens): the prompt and sampled tokens
        (temperature 0: greedy; top_k 0: all), decoded incrementally in eval
        mode without autograd. The seed makes it repeatable."""
        return self._call("generate", prompt, source, source_lengths, tokens=tokens,
                          temperature=temperature, top_k=top_k, seed=seed)[0]

    def set_attention(self, attention):
        """Replaces the self-attention of every block (a spec) or of each block
        (a list) behind the same trained projections."""
        if isinstance(attention, str):
            attention = [attention]
        self._command("set_attention", attention=list(attention))

    def save(self, run_dir, task="char-lm", data_dir="", copy_length=None, step=0, trainer=None, *, length=None):
        """Writes the model (float32) as checkpoint `step` of run directory
        `run_dir` for `task` ("char-lm" or "masked-char" with their `data_dir`,
        or "copy" with its `copy_length`, default 64; ``length`` is its
        deprecated old name), so that ``attnkit eval --run`` and
        ``attnkit generate --run`` read it. `trainer` (a dict of TrainerOptions,
        e.g. {"context": 256, "batch": 16}) is recorded as the run's settings;
        eval reads its context. There is no optimiser state: ``--resume``
        refuses such a run. Returns the checkpoint's path."""
        if length is not None:
            if copy_length is not None:
                raise TypeError("attnkit.models.Transformer.save: give 'copy_length' or its old name 'length', "
                                "not both")
            warnings.warn("attnkit.models.Transformer.save: 'length' is deprecated, use 'copy_length'",
                          DeprecationWarning, stacklevel=2)
            copy_length = length
        self._sync()
        task_json = {"name": task, "data_dir": str(data_dir), "copy_length": 64 if copy_length is None else copy_length}
        return self._bridge.save_run(str(run_dir), json.dumps(task_json),
                                     json.dumps(trainer or {}), step)
