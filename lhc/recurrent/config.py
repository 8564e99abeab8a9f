"""The configs of the recurrent LMs: the fields every one has (``RecurrentLMConfig``)
and those of Mamba-2 (``Mamba2Config``) and gated linear attention (``GLAConfig``)."""

from __future__ import annotations

import dataclasses

from lhc.nn.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class RecurrentLMConfig(ModelConfig):
    """The fields every recurrent LM's config has; a model's own fields follow these.

    Attributes:
        vocab_size: V.
        num_layers: layers (blocks).
        embed_dim: D, the residual width.
        chunk_size: the chunked scan's chunk length.
        rollback: how many tokens of the latest call truncation can undo exactly.
        max_len: the longest sequence generation code should plan for (the state does
            not grow with it).
        norm_eps: RMSNorm epsilon.
        tie_embeddings: the output projection is the embedding table.
        dtype: compute dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``; the
            recurrence runs in float32).
        param_dtype: storage dtype name of the parameters.
    """

    vocab_size: int
    num_layers: int = 2
    embed_dim: int = 64
    chunk_size: int = 64
    rollback: int = 16
    max_len: int = 1 << 20
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"

    POSITIVE = ("vocab_size", "num_layers", "embed_dim", "chunk_size", "max_len")
    NON_NEGATIVE = ("rollback",)
    DTYPES = ("dtype", "param_dtype")


@dataclasses.dataclass(frozen=True)
class Mamba2Config(RecurrentLMConfig):
    """Shape of a ``Mamba2LM``: the ``RecurrentLMConfig`` fields (``num_layers`` counts
    blocks; the SSD runs in float32) and

    Attributes:
        expand: the inner width is ``expand * D``.
        head_dim: P, channels per SSD head (``expand * D / P`` heads).
        state_dim: N, the SSM state per channel.
        num_groups: G, groups of heads sharing B and C.
        conv_width: K, the causal convolution's width.
    """

    expand: int = 2
    head_dim: int = 16
    state_dim: int = 16
    num_groups: int = 1
    conv_width: int = 4

    POSITIVE = (
        *RecurrentLMConfig.POSITIVE,
        "expand",
        "head_dim",
        "state_dim",
        "num_groups",
        "conv_width",
    )

    def __post_init__(self):
        super().__post_init__()
        if self.inner_dim % self.head_dim:
            raise ValueError(
                f"Mamba2Config: expand * embed_dim = {self.inner_dim} must be a multiple of "
                f"head_dim = {self.head_dim}"
            )
        if self.num_heads % self.num_groups:
            raise ValueError(
                f"Mamba2Config: the {self.num_heads} heads must be a multiple of "
                f"num_groups = {self.num_groups}"
            )

    @property
    def inner_dim(self) -> int:
        return self.expand * self.embed_dim

    @property
    def num_heads(self) -> int:
        return self.inner_dim // self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_dim + 2 * self.num_groups * self.state_dim


@dataclasses.dataclass(frozen=True)
class GLAConfig(RecurrentLMConfig):
    """Shape of a ``GLALM``: the ``RecurrentLMConfig`` fields and

    Attributes:
        num_heads: H.
        key_dim: Dk per head.
        value_dim: Dv per head.
        gate_rank: rank of the forget-gate projection.
        gate_temperature: log-gates are ``log_sigmoid(.) / gate_temperature``.
        mlp_dim: SwiGLU hidden width.
    """

    num_heads: int = 2
    key_dim: int = 16
    value_dim: int = 32
    gate_rank: int = 16
    gate_temperature: float = 16.0
    mlp_dim: int = 128

    POSITIVE = (
        *RecurrentLMConfig.POSITIVE,
        "num_heads",
        "key_dim",
        "value_dim",
        "gate_rank",
        "mlp_dim",
    )

    def __post_init__(self):
        super().__post_init__()
        if not self.gate_temperature > 0:
            raise ValueError(f"GLAConfig.gate_temperature must be > 0, got {self.gate_temperature}")
