"""TabICL's architecture: ``TabICLConfig`` and the constants the reference fixes."""

from __future__ import annotations

import dataclasses

import numpy as np

from lhc.nn.config import ModelConfig

SKIP_VALUE = -100.0
LAYER_NORM_EPS = 1e-5
ACTIVATIONS = ("gelu", "relu")


@dataclasses.dataclass(frozen=True)
class TabICLConfig(ModelConfig):
    """Architecture of a TabICL model: the 15 constructor arguments of ``tabicl.TabICL``.

    ``to_dict`` is those arguments as the reference takes them (and as its checkpoints
    store them); ``from_dict`` reads a checkpoint's ``config``.

    Attributes:
        max_classes: classes the decoder predicts natively; more use the class hierarchy.
        embed_dim: E, width of the column and row stages. The ICL width is
            ``embed_dim * row_num_cls``.
        col_num_blocks: induced self-attention blocks of the column set transformer.
        col_nhead: attention heads of the column stage.
        col_num_inds: I, inducing points per ISAB block.
        row_num_blocks: transformer blocks of the row stage.
        row_nhead: attention heads of the row stage.
        row_num_cls: C, CLS tokens per row.
        row_rope_base: rotary-embedding base of the row stage.
        icl_num_blocks: transformer blocks of the ICL stage.
        icl_nhead: attention heads of the ICL stage.
        ff_factor: feed-forward width as a multiple of the block width.
        dropout: dropout rate (attention probabilities, residual branches, feed-forward).
        activation: feed-forward activation of all blocks, "gelu" (exact) or "relu".
            The decoder always uses GELU.
        norm_first: pre-norm blocks (True) or post-norm blocks (False).
    """

    max_classes: int = 10
    embed_dim: int = 128
    col_num_blocks: int = 3
    col_nhead: int = 4
    col_num_inds: int = 128
    row_num_blocks: int = 3
    row_nhead: int = 8
    row_num_cls: int = 4
    row_rope_base: float = 100000
    icl_num_blocks: int = 12
    icl_nhead: int = 4
    ff_factor: int = 2
    dropout: float = 0.0
    activation: str = "gelu"
    norm_first: bool = True

    POSITIVE = ("max_classes", "embed_dim", "col_num_blocks", "col_nhead", "col_num_inds",
                "row_num_blocks", "row_nhead", "row_num_cls", "icl_num_blocks", "icl_nhead",
                "ff_factor")  # fmt: skip
    CHOICES = {"activation": ACTIVATIONS}
    KEYS_NAME = "TabICL config"

    def __post_init__(self):
        for name in self.POSITIVE:  # numpy ints are accepted, and stored as ints
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))
        super().__post_init__()
        if self.max_classes < 2:
            raise ValueError(f"TabICLConfig.max_classes must be >= 2, got {self.max_classes}")
        for name, heads, width in (
            ("col_nhead", self.col_nhead, self.embed_dim),
            ("row_nhead", self.row_nhead, self.embed_dim),
            ("icl_nhead", self.icl_nhead, self.icl_dim),
        ):
            if width % heads:
                raise ValueError(f"TabICLConfig.{name}={heads} must divide the block width {width}")
        if (self.embed_dim // self.row_nhead) % 2:
            raise ValueError(
                "rotary embeddings rotate pairs: embed_dim // row_nhead must be even, got "
                f"{self.embed_dim} // {self.row_nhead} = {self.embed_dim // self.row_nhead}"
            )
        if not (isinstance(self.row_rope_base, (int, float)) and self.row_rope_base > 0):
            raise ValueError(f"TabICLConfig.row_rope_base must be > 0, got {self.row_rope_base!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"TabICLConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.norm_first, bool):
            raise ValueError(f"TabICLConfig.norm_first must be a bool, got {self.norm_first!r}")

    @property
    def icl_dim(self) -> int:
        """D, the ICL width: the C CLS outputs of width E concatenated."""
        return self.embed_dim * self.row_num_cls
