"""Configuration of the Grouped Cross Attention LM (the official code's "DRT")."""

from __future__ import annotations

import dataclasses
from typing import Any

from lhc.nn.config import ModelConfig
from lhc.train.optim import adamw_cosine

GCA_IMPLS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class GCAConfig(ModelConfig):
    """Shape and numerics of a ``lhc.gca.GCA`` model.

    The token stream the layers see is the user's text with a landmark token closing
    every ``chunk_size - 1`` text tokens, so each chunk is ``chunk_size`` stream
    positions, the landmark last. Text position ``p`` sits at stream position
    ``p + p // (chunk_size - 1)``.

    Attributes:
        vocab_size: V, including the landmark token.
        embed_dim: D, the residual width.
        num_heads: N, query heads of every attention (sliding-window, encoder, GCA).
        num_kv_heads: K, key/value heads of the sliding-window layers and of the chunk
            memory; divides N.
        head_dim: H (even, for the encoder's RoPE).
        mlp_dim: F, the SwiGLU hidden width.
        lower_layers: sliding-window layers below the first retrieval.
        encoder_layers: bidirectional layers of the chunk encoder.
        upper_layers: layers per retrieval group; each group retrieves once (from its
            own landmark queries) and every layer of the group reads the retrieved
            chunks. ``(6,)`` is the paper's single retrieval, two entries its
            "retrieval x2".
        chunk_size: S, stream positions per chunk including the landmark.
        top_k: chunks retrieved per chunk (fewer while fewer earlier chunks exist).
        window: the sliding-window attention span in stream positions: a position ``p``
            attends to ``(p - window, p]`` (the official ``slide_window=512`` of
            flash-attn's ``window_size=(512, 0)`` is ``window=513`` here).
        max_len: the most text tokens a sequence may hold (bounds the chunk memory).
        landmark_id: the landmark token; defaults to ``vocab_size - 1``. Text tokens
            must not use it.
        rope_theta: RoPE base of the encoder (within-chunk positions).
        norm_eps: RMSNorm epsilon.
        tie_embeddings: the output projection reuses the embedding table.
        gca_impl: ``"xla"`` or ``"pallas"``, the ``kernels_pallas.chunk_retrieval``
            implementation (Pallas runs interpreted on CPU).
        offload_memory: the cache keeps the chunk memory (keys and values) in host
            memory (``lhc.parallel.offload``): each call writes its new chunks there
            and gathers only the retrieved chunks to the device, so context is bounded
            by host memory. The landmark keys and windows stay on the device; a plain
            forward pass (no cache) is unaffected. An inference setting: parameters
            and outputs are the same either way.
        retriever: how chunks are scored for retrieval. ``"learned"`` (the paper): each
            group's query (the hidden state at the landmark) against the chunks'
            landmark keys, both learned end to end through the fusion weights.
            Ablations: ``"no_grad"``, the same scores with their gradient stopped (the
            retriever is not trained by the language-model loss; the rest is);
            ``"mean_pool"``, a retriever that is not learned at all: the cosine
            similarity of chunks' mean-pooled lower-decoder outputs (the chunk that
            closes at the query's landmark against each earlier chunk), its softmax at
            temperature ``MEAN_POOL_TEMPERATURE``, no gradient.
        dtype: compute dtype name.
        param_dtype: storage dtype name.
    """

    vocab_size: int
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    lower_layers: int
    encoder_layers: int
    upper_layers: tuple[int, ...]
    chunk_size: int = 64
    top_k: int = 8
    window: int = 513
    max_len: int = 1 << 20
    landmark_id: int | None = None
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    gca_impl: str = "xla"
    offload_memory: bool = False
    retriever: str = "learned"
    dtype: str = "float32"
    param_dtype: str = "float32"

    POSITIVE = (
        "vocab_size",
        "embed_dim",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
        "encoder_layers",
        "top_k",
        "window",
        "max_len",
    )
    NON_NEGATIVE = ("lower_layers",)
    CHOICES = {"gca_impl": GCA_IMPLS, "retriever": ("learned", "no_grad", "mean_pool")}
    MULTIPLES = (("num_heads", "num_kv_heads"),)
    EVEN = ("head_dim",)  # RoPE rotates pairs
    DTYPES = ("dtype", "param_dtype")

    def __post_init__(self):
        super().__post_init__()
        upper = tuple(self.upper_layers) if not isinstance(self.upper_layers, int) else None
        if not upper or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in upper):
            raise ValueError(
                "GCAConfig.upper_layers must be a non-empty sequence of positive ints (layers "
                f"per retrieval group), got {self.upper_layers!r}"
            )
        object.__setattr__(self, "upper_layers", upper)
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int):
            raise ValueError(f"GCAConfig.chunk_size must be an int >= 2, got {self.chunk_size!r}")
        if self.chunk_size < 2:
            raise ValueError(
                f"GCAConfig.chunk_size must be >= 2 (text tokens and a landmark), got "
                f"{self.chunk_size}"
            )
        landmark = self.vocab_size - 1 if self.landmark_id is None else self.landmark_id
        if (
            isinstance(landmark, bool)
            or not isinstance(landmark, int)
            or not (0 <= landmark < self.vocab_size)
        ):
            raise ValueError(
                f"GCAConfig.landmark_id must be None or an int in [0, vocab_size="
                f"{self.vocab_size}), got {self.landmark_id!r}"
            )
        object.__setattr__(self, "landmark_id", landmark)
        if not isinstance(self.offload_memory, bool):
            raise ValueError(
                f"GCAConfig.offload_memory must be a bool, got {self.offload_memory!r}"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"GCAConfig.rope_theta must be positive, got {self.rope_theta}")
        if not self.norm_eps > 0:
            raise ValueError(f"GCAConfig.norm_eps must be positive, got {self.norm_eps}")
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "norm_eps", float(self.norm_eps))

    # Stream layout ------------------------------------------------------------------

    @property
    def text_per_chunk(self) -> int:
        """Text tokens per chunk (``chunk_size - 1``)."""
        return self.chunk_size - 1

    @property
    def num_window_layers(self) -> int:
        """Sliding-window attention layers: the lower ones and one per upper layer."""
        return self.lower_layers + sum(self.upper_layers)

    @property
    def num_groups(self) -> int:
        return len(self.upper_layers)

    # Presets ------------------------------------------------------------------------

    @classmethod
    def tiny(cls, **overrides: Any) -> GCAConfig:
        """A model small enough for unit tests on a CPU (8-position chunks)."""
        return cls(**{**_preset("tiny"), "max_len": 4096, **overrides})

    @classmethod
    def paper_128m(cls, **overrides: Any) -> GCAConfig:
        """The paper's 128M setting (the official ``config_63``): d=768, 12 heads of 64,
        6 lower layers, a 2-layer encoder, one group of 6 upper layers, 64-position chunks,
        top-8 retrieval, window 512, GPT-2 vocabulary with the landmark as id 50264."""
        return cls(**{**_preset("paper_128m"), "landmark_id": 50_264, **overrides})


# The presets' shapes, one row each (other fields take their defaults).
_PRESET_FIELDS = ("vocab_size", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                  "lower_layers", "encoder_layers", "upper_layers", "chunk_size", "top_k",
                  "window")  # fmt: skip
_PRESETS = {
    #              vocab  embed heads kv head  mlp lower enc upper chunk top_k window
    "tiny":       (64,     32,   4,   2,  8,   64,  1,   1,  (1,),  8,    2,    12),
    "paper_128m": (50_265, 768,  12,  12, 64, 2048, 6,   2,  (6,),  64,   8,    513),
}  # fmt: skip


def _preset(name: str) -> dict[str, Any]:
    return dict(zip(_PRESET_FIELDS, _PRESETS[name], strict=True))


def paper_optimizer() -> dict:
    """The official pre-training optimizer settings for ``lhc.train`` (``config.optimizer``):
    AdamW at 2e-3, 2% warm-up, cosine decay to 4e-4, betas (0.9, 0.95), weight decay 0.001,
    gradient clipping at 1.0."""
    return adamw_cosine(learning_rate=2e-3)
