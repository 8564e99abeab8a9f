"""The TabICL synthetic prior (v1): batches of random classification tables for pretraining.

A batch of ``B`` tables is drawn as in the ``prior/`` package of ``tabicl==0.1.4``:

1. Tables come in groups (``tables_per_group``, 4 in stage 1) that share meta-sampled
   hyperparameter distributions; subgroups share the prior type (MLP-SCM with p=0.7,
   tree-SCM with p=0.3), the feature count and the SCM hyperparameters; each table
   draws its own class count (K=2 with p=1/2, else uniform on 2..max_classes).
2. Each table is a regression table from its SCM (``prior_scm``), turned into a
   classification table (``prior_reg2cls``); constant features are dropped, and the
   table is redrawn unless its train and test parts hold the same >= 2 classes (ten
   random row shuffles are tried first).
3. Tables are padded to fixed shapes, so a jitted model never recompiles.

Everything is a pure function of ``(seed, step)``: a run that resumes at step ``s``
sees the same batches as one that never stopped.

Shapes: ``B`` tables, ``T`` rows (train rows first), ``H`` = ``max_features``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import threadpoolctl
from scipy import special

from lhc.tabicl.config import PriorConfig
from lhc.tabicl.prior_reg2cls import regression_to_classification
from lhc.tabicl.prior_scm import ACTIVATION_CHOICES, CAUSE_SAMPLINGS, SCMHparams, mlp_scm, tree_scm

LABEL_PAD = -1
"""Label of padded rows (rows at and beyond a table's ``seq_len``)."""

# ---------------------------------------------------------------------------------------
# Meta-sampled hyperparameters
# ---------------------------------------------------------------------------------------

SubgroupSampler = Callable[[np.random.Generator], Any]


def _constant(value) -> SubgroupSampler:
    return lambda rng: value


@dataclasses.dataclass(frozen=True)
class MetaTruncNormLogScaled:
    """Per group: ``mu = exp(U(log min_mean, log max_mean))``, ``sigma = mu exp(U(log min_std, log max_std))``.

    Per subgroup: ``lower_bound + [round](x)``, ``x ~ N(mu, sigma^2)`` truncated to [0, 1e6].
    """

    min_mean: float
    max_mean: float
    round: bool
    lower_bound: float
    min_std: float = 0.01
    max_std: float = 1.0

    def meta_sample(self, rng: np.random.Generator) -> SubgroupSampler:
        mu = math.exp(rng.uniform(math.log(self.min_mean), math.log(self.max_mean)))
        sigma = mu * math.exp(rng.uniform(math.log(self.min_std), math.log(self.max_std)))

        def sample(rng: np.random.Generator):
            x = truncated_normal(rng, mu, sigma, 0.0, 1e6)
            return self.lower_bound + int(np.rint(x)) if self.round else self.lower_bound + x

        return sample


@dataclasses.dataclass(frozen=True)
class MetaChoice:
    """Per group: one value with probabilities ``softmax([1, U(lo, hi), ...])``, then fixed."""

    choices: tuple
    weight_low: float = -3.0
    weight_high: float = 5.0

    def probabilities(self, rng: np.random.Generator) -> np.ndarray:
        logits = np.concatenate(
            [[1.0], rng.uniform(self.weight_low, self.weight_high, len(self.choices) - 1)]
        )
        return special.softmax(logits)

    def meta_sample(self, rng: np.random.Generator) -> SubgroupSampler:
        return _constant(self.choices[rng.choice(len(self.choices), p=self.probabilities(rng))])


@dataclasses.dataclass(frozen=True)
class MetaChoiceMixed(MetaChoice):
    """Per group: probabilities ``softmax([1, U(-5, 6), ...])``; each layer draws its own value.

    The sampled hyperparameter is the probability vector itself (a tuple).
    """

    weight_low: float = -5.0
    weight_high: float = 6.0

    def meta_sample(self, rng: np.random.Generator) -> SubgroupSampler:
        return _constant(tuple(float(p) for p in self.probabilities(rng)))


@dataclasses.dataclass(frozen=True)
class MetaBeta:
    """Per group: ``a, b ~ U(min, max)``; per subgroup: ``scale * Beta(a, b)``."""

    scale: float
    min: float
    max: float

    def meta_sample(self, rng: np.random.Generator) -> SubgroupSampler:
        a, b = rng.uniform(self.min, self.max, 2)
        return lambda rng: self.scale * rng.beta(a, b)


_BOOL = (True, False)

SAMPLED_HPARAMS: dict[str, MetaTruncNormLogScaled | MetaChoice | MetaBeta] = {
    "multiclass_type": MetaChoice(("value", "rank")),
    "activation_probs": MetaChoiceMixed(ACTIVATION_CHOICES),
    "block_wise_dropout": MetaChoice(_BOOL),
    "mlp_dropout_prob": MetaBeta(scale=0.9, min=0.1, max=5.0),
    "is_causal": MetaChoice(_BOOL),
    "num_causes": MetaTruncNormLogScaled(1, 12, round=True, lower_bound=1),
    "y_is_effect": MetaChoice(_BOOL),
    "in_clique": MetaChoice(_BOOL),
    "sort_features": MetaChoice(_BOOL),
    "num_layers": MetaTruncNormLogScaled(1, 6, round=True, lower_bound=2),
    "hidden_dim": MetaTruncNormLogScaled(5, 130, round=True, lower_bound=4),
    "init_std": MetaTruncNormLogScaled(0.01, 10.0, round=False, lower_bound=0.0),
    "noise_std": MetaTruncNormLogScaled(0.0001, 0.3, round=False, lower_bound=0.0),
    "sampling": MetaChoice(CAUSE_SAMPLINGS),
    "pre_sample_cause_stats": MetaChoice(_BOOL),
    "pre_sample_noise_std": MetaChoice(_BOOL),
}
"""The prior's sampled hyperparameters and their meta-distributions (the reference's
``DEFAULT_SAMPLED_HP``; ``activation_probs`` is its ``mlp_activations``)."""


def truncated_normal(
    rng: np.random.Generator, mu: float, sigma: float, low: float, high: float
) -> float:
    """One draw of N(mu, sigma^2) truncated to [low, high], by inverting the CDF."""
    cdf_low = special.ndtr((low - mu) / sigma)
    cdf_high = special.ndtr((high - mu) / sigma)
    x = mu + sigma * special.ndtri(cdf_low + rng.random() * (cdf_high - cdf_low))
    return float(np.clip(x, low, high))


def meta_sample_hparams(rng: np.random.Generator) -> dict[str, SubgroupSampler]:
    """Draws a group's hyperparameter distributions: name -> ``sampler(rng)`` for a subgroup."""
    return {name: spec.meta_sample(rng) for name, spec in SAMPLED_HPARAMS.items()}


def sample_hparams(rng: np.random.Generator, group: dict[str, SubgroupSampler]) -> dict[str, Any]:
    """Draws a subgroup's hyperparameter values from its group's distributions."""
    return {name: sampler(rng) for name, sampler in group.items()}


def sample_num_classes(rng: np.random.Generator, max_classes: int) -> int:
    """K = 2 with probability 1/2, else uniform on {2, ..., max_classes}."""
    return int(rng.integers(2, max_classes + 1)) if rng.random() > 0.5 else 2


# ---------------------------------------------------------------------------------------
# Configuration and curriculum
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CurriculumStage:
    """One stage of TabICL pretraining (from the reference ``scripts/train_stage{1,2,3}.sh``).

    Attributes:
      name: "stage1", "stage2" or "stage3".
      num_steps: optimizer steps.
      learning_rate: the peak learning rate (AdamW, weight decay 0).
      schedule: "cosine_warmup" (to 0), "polynomial_decay" (to ``end_learning_rate``
        with ``decay_power``) or "constant".
      warmup_fraction: linear warmup as a fraction of ``num_steps``.
      end_learning_rate: the final learning rate of "polynomial_decay".
      decay_power: the power of "polynomial_decay".
      gradient_clipping: the global gradient-norm clip.
      micro_batch_size: tables per gradient-accumulation micro step in the reference.
      frozen: model stages not trained ("col", "row").
      prior: the batches of this stage.
    """

    name: str
    num_steps: int
    learning_rate: float
    schedule: str
    warmup_fraction: float
    end_learning_rate: float
    decay_power: float
    gradient_clipping: float
    micro_batch_size: int
    frozen: tuple[str, ...]
    prior: PriorConfig


# The reference's ``scripts/train_stage{1,2,3}.sh``, in the order of CurriculumStage's fields.
_STAGES = (
    # name     steps    lr    schedule            warmup end lr power clip micro frozen
    ("stage1", 100_000, 1e-4, "cosine_warmup",    0.02,  0.0,   1.0,  1.0, 4,    ()),
    ("stage2", 2_000,   2e-5, "polynomial_decay", 0.0,   5e-6,  2.0,  1.0, 1,    ()),
    ("stage3", 50,      2e-6, "constant",         0.0,   2e-6,  1.0,  1.0, 1,    ("col", "row")),
)  # fmt: skip
# Their tables: 512 per step, at most 90% training rows. Stages 2 and 3 draw long tables,
# with log-uniform row counts, one per group of tables, and 50% training rows or more.
_LONG_TABLES = dict(log_rows=True, rows_per_group=True, min_train_fraction=0.5)
_STAGE_PRIORS = (
    dict(num_rows=1024, min_train_fraction=0.1, tables_per_group=4),
    dict(num_rows=40_000, min_rows=1_000, **_LONG_TABLES, tables_per_group=2),
    dict(num_rows=60_000, min_rows=40_000, **_LONG_TABLES, replay_small=True, tables_per_group=1),
)
CURRICULUM: tuple[CurriculumStage, ...] = tuple(
    CurriculumStage(*stage, prior=PriorConfig(batch_size=512, max_train_fraction=0.9, **prior))
    for stage, prior in zip(_STAGES, _STAGE_PRIORS, strict=True)
)
"""The three pretraining stages of the paper (AdamW, 512 tables per step)."""


def curriculum_stage(stage: int | str) -> CurriculumStage:
    """A stage of ``CURRICULUM`` by number (1, 2, 3) or name ("stage1", ...)."""
    for index, candidate in enumerate(CURRICULUM, start=1):
        if stage in (index, candidate.name, str(index)):
            return candidate
    raise ValueError(
        f"stage: expected 1, 2, 3 or one of {[s.name for s in CURRICULUM]}, got {stage!r}"
    )


def max_features_for_rows(seq_len: int, max_features: int) -> int:
    """The reference's feature cap for long tables (used when ``rows_per_group``)."""
    for rows, cap in (
        (10_240, 100),
        (20_000, 80),
        (30_000, 60),
        (40_000, 40),
        (50_000, 30),
        (60_000, 20),
        (65_000, 15),
    ):
        if seq_len <= rows:
            return min(cap, max_features)
    return min(10, max_features)


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """Everything one table is drawn from."""

    seq_len: int
    train_size: int
    num_features: int
    num_classes: int
    prior_type: str  # "mlp_scm" or "tree_scm"
    hparams: SCMHparams
    multiclass_type: str
    cat_prob: float = 0.2


def _valid_split(labels: np.ndarray, train_size: int) -> bool:
    if not 0 < train_size < labels.shape[0]:
        return False
    train_classes = np.unique(labels[:train_size])
    return len(train_classes) >= 2 and np.array_equal(train_classes, np.unique(labels[train_size:]))


def generate_table(
    rng: np.random.Generator, spec: TableSpec, max_attempts: int = 1000
) -> tuple[np.ndarray, np.ndarray]:
    """Draws one classification table, redrawing until it is usable.

    A draw is rejected when the SCM gives a non-finite value, when every feature is
    constant, or when no split (as drawn, or after up to 10 random row shuffles) has
    the same >= 2 classes in the train and test parts.

    Args:
      rng: the generator.
      spec: the table's sizes and hyperparameters.
      max_attempts: redraws before raising RuntimeError.

    Returns:
      ``(X float32[T, F'], y int32[T])``: F' <= F non-constant standardized features,
      labels in 0..n-1 with every class in both parts.
    """
    scm = {"mlp_scm": mlp_scm, "tree_scm": tree_scm}[spec.prior_type]
    for _ in range(max_attempts):
        x, y = scm(rng, spec.seq_len, spec.num_features, spec.hparams)
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            continue
        x, labels = regression_to_classification(
            rng, x, y, spec.num_classes, spec.multiclass_type, cat_prob=spec.cat_prob
        )
        x = x.astype(np.float32)
        x = x[:, x.max(axis=0) > x.min(axis=0)]
        if x.shape[1] == 0:
            continue
        for attempt in range(11):
            if attempt:
                order = rng.permutation(spec.seq_len)
                x, labels = x[order], labels[order]
            if _valid_split(labels, spec.train_size):
                return x, labels.astype(np.int32)
    raise RuntimeError(
        f"no usable table after {max_attempts} draws: {spec.prior_type}, seq_len={spec.seq_len}, "
        f"train_size={spec.train_size}, num_features={spec.num_features}, num_classes={spec.num_classes}"
    )


def _hparams_from_sample(values: dict[str, Any]) -> SCMHparams:
    fields = {f.name for f in dataclasses.fields(SCMHparams)}
    return SCMHparams(**{k: v for k, v in values.items() if k in fields})


def _sample_seq_len(rng: np.random.Generator, config: PriorConfig) -> int:
    if config.min_rows is None:
        seq_len = config.num_rows
    elif config.log_rows:
        seq_len = int(np.exp(rng.uniform(np.log(config.min_rows), np.log(config.num_rows))))
    else:
        seq_len = int(rng.integers(config.min_rows, config.num_rows))
    if config.replay_small:
        u = rng.random()
        if u < 0.05:
            seq_len = int(rng.integers(200, 1000))
        elif u < 0.3:
            seq_len = int(np.exp(rng.uniform(np.log(1000), np.log(10000))))
    return min(seq_len, config.num_rows)


def _sample_train_size(rng: np.random.Generator, config: PriorConfig, seq_len: int) -> int:
    train_size = int(seq_len * rng.uniform(config.min_train_fraction, config.max_train_fraction))
    multiple = config.train_size_multiple
    if multiple is not None and multiple < seq_len:
        train_size = max(train_size // multiple, 1) * multiple
    return train_size


def plan_batch(config: PriorConfig, rng: np.random.Generator) -> list[TableSpec]:
    """The specs of a batch's tables, with the reference's group/subgroup sharing."""
    batch_size = config.batch_size
    per_group = min(config.tables_per_group, batch_size)
    per_subgroup = min(config.tables_per_subgroup or config.tables_per_group, per_group)
    max_features = config.max_features
    if not config.rows_per_group:
        seq_len = _sample_seq_len(rng, config)
        train_size = _sample_train_size(rng, config, seq_len)

    specs: list[TableSpec] = []
    for group_start in range(0, batch_size, per_group):
        group_size = min(per_group, batch_size - group_start)
        group = meta_sample_hparams(rng)
        if config.rows_per_group:
            seq_len = _sample_seq_len(rng, config)
            train_size = _sample_train_size(rng, config, seq_len)
            max_features = max_features_for_rows(seq_len, config.max_features)
        for subgroup_start in range(0, group_size, per_subgroup):
            if config.prior_type == "mix_scm":
                prior_type = ("mlp_scm", "tree_scm")[rng.choice(2, p=config.mix_probs)]
            else:
                prior_type = config.prior_type
            num_features = int(
                round(rng.uniform(config.min_features, max(max_features, config.min_features)))
            )
            values = sample_hparams(rng, group)
            hparams = _hparams_from_sample(values)
            for _ in range(min(per_subgroup, group_size - subgroup_start)):
                specs.append(
                    TableSpec(
                        seq_len=seq_len,
                        train_size=train_size,
                        num_features=num_features,
                        num_classes=sample_num_classes(rng, config.max_classes),
                        prior_type=prior_type,
                        hparams=hparams,
                        multiclass_type=values["multiclass_type"],
                        cat_prob=config.cat_prob,
                    )
                )
    return specs


# ---------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------


def _batch_rng(seed_or_rng: int | np.random.Generator, step: int) -> np.random.Generator:
    if isinstance(seed_or_rng, np.random.Generator):
        return seed_or_rng
    if isinstance(seed_or_rng, (int, np.integer)) and not isinstance(seed_or_rng, bool):
        if seed_or_rng < 0 or step < 0:
            raise ValueError(
                f"seed, step: expected non-negative integers, got {seed_or_rng}, {step}"
            )
        return np.random.default_rng([int(seed_or_rng), int(step)])
    raise ValueError(
        f"seed_or_rng: expected an int or np.random.Generator, got {type(seed_or_rng).__name__}"
    )


def sample_batch(
    config: PriorConfig,
    seed_or_rng: int | np.random.Generator,
    step: int = 0,
    *,
    tables: Sequence[int] | None = None,
) -> dict[str, np.ndarray]:
    """Draws one batch of padded prior tables.

    Args:
      config: the prior configuration.
      seed_or_rng: an integer data seed (the batch is a pure function of
        ``(seed, step)``), or a generator (the batch is a pure function of its state;
        ``step`` is then unused), e.g. the one ``lhc.data.iterators.IndexedIterator``
        passes.
      step: the training step.
      tables: indices of the batch's tables to generate (None: all). The whole batch is
        planned either way, so table ``i`` is the same whichever subset asks for it;
        each process of a multi-host run generates only its own tables.

    Returns:
      A dict of numpy arrays (B = the number of tables generated):
        * ``X``: float32[B, T, H]; features of table b are columns ``< num_features[b]``,
          rows ``< seq_len[b]``; the rest is 0.
        * ``y``: int32[B, T]; labels in ``[0, num_classes[b])``, ``LABEL_PAD`` (-1) in
          padded rows.
        * ``train_size``: int32[B]; rows ``< train_size`` are the context (train) part,
          rows in ``[train_size, seq_len)`` the queries (test).
        * ``seq_len``: int32[B], rows of each table.
        * ``num_features``: int32[B], non-constant features of each table.
        * ``num_classes``: int32[B], classes present (each in both parts).
      ``T = config.num_rows`` (or the longest table rounded up to ``row_multiple``) and
      ``H = config.max_features``.
    """
    if not isinstance(config, PriorConfig):
        raise ValueError(f"config: expected a PriorConfig, got {type(config).__name__}")
    rng = _batch_rng(seed_or_rng, step)
    specs = plan_batch(config, rng)
    # Each table gets its own stream, so a table does not depend on how others drew.
    table_seeds = np.random.SeedSequence(rng.integers(0, 2**63, size=4)).spawn(len(specs))
    if tables is not None:
        indices = [int(i) for i in tables]
        if not indices or min(indices) < 0 or max(indices) >= len(specs):
            raise ValueError(
                f"tables: expected indices in [0, {len(specs)}), got {list(tables)[:8]}"
            )
        specs = [specs[i] for i in indices]
        table_seeds = [table_seeds[i] for i in indices]
    # Matrices here are small: multithreaded BLAS only adds synchronisation. Run several
    # generator processes for throughput instead.
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        tables = [
            generate_table(np.random.default_rng(seed), spec, config.max_attempts)
            for seed, spec in zip(table_seeds, specs)
        ]
    return _pad_tables(config, specs, tables)


def _pad_tables(
    config: PriorConfig, specs: Sequence[TableSpec], tables: Sequence[tuple[np.ndarray, np.ndarray]]
) -> dict[str, np.ndarray]:
    longest = max(spec.seq_len for spec in specs)
    if config.row_multiple is None:
        num_rows = config.num_rows
    else:
        num_rows = -(-longest // config.row_multiple) * config.row_multiple
    batch_size = len(specs)
    x_out = np.zeros((batch_size, num_rows, config.max_features), np.float32)
    y_out = np.full((batch_size, num_rows), LABEL_PAD, np.int32)
    for b, (x, y) in enumerate(tables):
        x_out[b, : x.shape[0], : x.shape[1]] = x
        y_out[b, : y.shape[0]] = y
    return {
        "X": x_out,
        "y": y_out,
        "train_size": np.array([s.train_size for s in specs], np.int32),
        "seq_len": np.array([s.seq_len for s in specs], np.int32),
        "num_features": np.array([x.shape[1] for x, _ in tables], np.int32),
        "num_classes": np.array([int(y.max()) + 1 for _, y in tables], np.int32),
    }


def iterate_batches(
    config: PriorConfig, seed: int, start_step: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Yields ``sample_batch(config, seed, step)`` for step = start_step, start_step + 1, ..."""
    step = start_step
    while True:
        yield sample_batch(config, seed, step)
        step += 1
