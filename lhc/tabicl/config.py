"""TabICL's configs: the architecture (``TabICLConfig``, with the constants the reference
fixes) and the synthetic prior's tables (``PriorConfig``)."""

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


PRIOR_TYPES = ("mix_scm", "mlp_scm", "tree_scm")


@dataclasses.dataclass(frozen=True)
class PriorConfig:
    """What a batch of prior tables looks like. Defaults are stage 1 of the curriculum.

    Attributes:
      batch_size: B, tables per batch.
      num_rows: the most rows a table has (the reference's ``max_seq_len``); also the
        padded T unless ``row_multiple`` is set.
      min_rows: None for exactly ``num_rows`` rows; else tables have
        U[min_rows, num_rows) rows (log-uniform with ``log_rows``).
      log_rows: sample the row count log-uniformly.
      rows_per_group: each group draws its own row count and train size (else one per
        batch); the feature cap then shrinks with the row count, as in the reference.
      replay_small: in 5% of draws U[200, 1000) rows, in 25% log-U[1000, 10000) rows
        (capped at ``num_rows``).
      min_features, max_features: the feature count is round(U(min, max)); H = max.
      max_classes: the largest K.
      min_train_fraction, max_train_fraction: train_size = int(T * U(min, max)).
      prior_type: "mix_scm", "mlp_scm" or "tree_scm".
      mix_probs: (MLP, tree) probabilities of "mix_scm".
      tables_per_group: tables sharing meta-sampled hyperparameter distributions.
      tables_per_subgroup: tables sharing prior type, feature count and hyperparameters
        (None: the same as ``tables_per_group``).
      cat_prob: probability that some feature columns of a table are binned.
      row_multiple: None pads every batch to ``num_rows`` rows; an integer pads to the
        batch's longest table rounded up to a multiple of it (fewer padded rows, a few
        distinct shapes).
      train_size_multiple: None keeps the sampled train size; an integer rounds it down
        to a multiple of itself (at least one multiple), so a jitted model that takes the
        train size as a static shape compiles only ``num_rows / train_size_multiple``
        variants.
      max_attempts: redraws of one table before giving up with a RuntimeError.
    """

    batch_size: int = 512
    num_rows: int = 1024
    min_rows: int | None = None
    log_rows: bool = False
    rows_per_group: bool = False
    replay_small: bool = False
    min_features: int = 2
    max_features: int = 100
    max_classes: int = 10
    min_train_fraction: float = 0.1
    max_train_fraction: float = 0.9
    prior_type: str = "mix_scm"
    mix_probs: tuple[float, float] = (0.7, 0.3)
    tables_per_group: int = 4
    tables_per_subgroup: int | None = None
    cat_prob: float = 0.2
    row_multiple: int | None = None
    train_size_multiple: int | None = None
    max_attempts: int = 1000

    def __post_init__(self):
        def check(ok: bool, name: str, expected: str):
            if not ok:
                raise ValueError(
                    f"PriorConfig.{name}: expected {expected}, got {getattr(self, name)!r}"
                )

        check(self.batch_size >= 1, "batch_size", "an integer >= 1")
        check(self.num_rows >= 4, "num_rows", "an integer >= 4")
        check(
            self.min_rows is None or 4 <= self.min_rows < self.num_rows,
            "min_rows",
            f"None or an integer in [4, num_rows={self.num_rows})",
        )
        check(
            1 <= self.min_features <= self.max_features,
            "min_features",
            "1 <= min_features <= max_features",
        )
        check(2 <= self.max_classes, "max_classes", "an integer >= 2")
        check(
            0.0 < self.min_train_fraction < self.max_train_fraction < 1.0,
            "min_train_fraction",
            f"0 < min_train_fraction < max_train_fraction={self.max_train_fraction} < 1",
        )
        check(self.prior_type in PRIOR_TYPES, "prior_type", f"one of {PRIOR_TYPES}")
        check(
            len(self.mix_probs) == 2
            and min(self.mix_probs) >= 0
            and abs(sum(self.mix_probs) - 1) < 1e-6,
            "mix_probs",
            "two probabilities summing to 1",
        )
        check(self.tables_per_group >= 1, "tables_per_group", "an integer >= 1")
        check(
            self.tables_per_subgroup is None or self.tables_per_subgroup >= 1,
            "tables_per_subgroup",
            "None or an integer >= 1",
        )
        check(0.0 <= self.cat_prob <= 1.0, "cat_prob", "a probability")
        check(
            self.row_multiple is None or self.row_multiple >= 1,
            "row_multiple",
            "None or an integer >= 1",
        )
        check(
            self.train_size_multiple is None
            or 1 <= self.train_size_multiple < self.num_rows * self.max_train_fraction,
            "train_size_multiple",
            "None or an integer in [1, num_rows * max_train_fraction)",
        )
        check(self.max_attempts >= 1, "max_attempts", "an integer >= 1")

    def replace(self, **changes) -> PriorConfig:
        """A copy with some fields changed; an unknown field is a ValueError."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"PriorConfig: unknown fields {unknown}")
        return dataclasses.replace(self, **changes)
