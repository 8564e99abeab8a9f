"""Regression table -> classification table, as the TabICL prior does it (``Reg2Cls``).

Features: with probability ``cat_prob`` some columns become categorical (rank binning),
then every column is clipped at 4 robust standard deviations, standardized (clipped at
+-100), and the columns are permuted. Target: standardized, cut at ``K - 1`` boundaries
("rank": values of the target itself; "value": N(0, 1) draws), then the labels are
re-encoded as 0..n-1 and randomly permuted.

Shapes: ``T`` rows, ``F`` features. Arrays are float64 here; NaN is ignored in
statistics like the reference's ``nanmean``/``nanstd``.
"""

from __future__ import annotations

import warnings

import numpy as np


def _nan_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column nanmean and nanstd (ddof=1 when T > 1), ignoring empty-slice warnings."""
    ddof = 1 if x.shape[0] > 1 else 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=RuntimeWarning)
        return np.nanmean(x, axis=0), np.nanstd(x, axis=0, ddof=ddof)


def _float_columns(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x`` as float64 ``[T, F]``, with its per-column nanmean and nanstd."""
    x = np.asarray(x, np.float64)
    return (x, *_nan_stats(x))


def standard_scaling(x: np.ndarray, clip_value: float = 100.0) -> np.ndarray:
    """``clip((x - mean) / max(std, 1e-6), +-clip_value)`` per column (ddof=1).

    Args:
      x: float[T, F].

    Returns:
      float64[T, F].
    """
    x, mean, std = _float_columns(x)
    return np.clip((x - mean) / np.maximum(std, 1e-6), -clip_value, clip_value)


def outlier_removing(x: np.ndarray, threshold: float = 4.0) -> np.ndarray:
    """Clamps each column to ``mean +- threshold * std`` of its non-outlying values.

    The first pass finds values within ``threshold`` standard deviations; the mean and
    std of those alone set the final bounds (a robust two-pass estimate).

    Args:
      x: float[T, F].

    Returns:
      float64[T, F].
    """
    x, mean, std = _float_columns(x)
    std = np.maximum(std, 1e-6)
    lower, upper = mean - threshold * std, mean + threshold * std
    with np.errstate(invalid="ignore"):
        inside = (lower <= x) & (x <= upper) & ~np.isnan(x)
    robust_mean, robust_std = _nan_stats(np.where(inside, x, np.nan))
    robust_std = np.maximum(robust_std, 1e-6)  # NaN stays NaN, as torch.clip does
    robust_mean = np.where(np.isnan(robust_mean), mean, robust_mean)
    robust_std = np.where(np.isnan(robust_std), 0.0, robust_std)
    lower = np.nan_to_num(robust_mean - threshold * robust_std, nan=-np.inf)
    upper = np.nan_to_num(robust_mean + threshold * robust_std, nan=np.inf)
    return np.clip(x, lower, upper)


def permute_classes(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
    """Re-encodes labels as 0..n-1 (by sorted value) and applies a random permutation.

    Args:
      labels: int[T] (or float, any values).

    Returns:
      int64[T] with values in [0, n), or ``labels`` unchanged when n <= 1.
    """
    unique, inverse = np.unique(labels, return_inverse=True)
    if len(unique) <= 1:
        return labels
    return rng.permutation(len(unique))[inverse.reshape(-1)]


def assign_classes(
    rng: np.random.Generator,
    values: np.ndarray,
    num_classes: int,
    mode: str = "rank",
    ordered_prob: float = 0.2,
) -> np.ndarray:
    """Cuts a continuous column into classes at ``num_classes - 1`` random boundaries.

    ``mode="rank"`` takes the boundaries from the values at random rows; ``"value"``
    draws them from N(0, 1) (the input is standardized). With probability
    ``1 - ordered_prob`` the classes are re-encoded and permuted; with probability 1/2
    they are reversed (``num_classes - 1 - c``). Some classes may be empty.

    Args:
      values: float[T].

    Returns:
      int64[T].
    """
    if num_classes < 2:
        raise ValueError(f"num_classes: expected >= 2, got {num_classes}")
    if mode == "rank":
        boundaries = values[rng.integers(0, values.shape[0], num_classes - 1)]
    elif mode == "value":
        boundaries = rng.standard_normal(num_classes - 1)
    else:
        raise ValueError(f"mode: expected 'rank' or 'value', got {mode!r}")
    classes = (values[:, None] > boundaries[None, :]).sum(axis=1)
    if rng.random() > ordered_prob:
        classes = permute_classes(rng, classes)
    if rng.random() > 0.5:
        classes = num_classes - 1 - classes
    return classes


def numerical_to_categorical(
    rng: np.random.Generator, x: np.ndarray, cat_prob: float = 0.2, max_categories: float = np.inf
) -> np.ndarray:
    """With probability ``cat_prob``, bins each column with probability ``q ~ U(0, 1)``.

    A binned column gets ``min(max(round(Exp(mean 10)), 2), max_categories)`` categories
    by rank boundaries (``assign_classes(..., "rank", ordered_prob=0.3)``).

    Args:
      x: float[T, F].

    Returns:
      float64[T, F], a new array.
    """
    x = np.array(x, np.float64)
    if rng.random() < cat_prob:
        column_prob = rng.random()
        for col in range(x.shape[1]):
            if rng.random() < column_prob:
                num_categories = int(min(max(round(rng.gamma(1.0, 10.0)), 2), max_categories))
                x[:, col] = assign_classes(rng, x[:, col], num_categories, "rank", ordered_prob=0.3)
    return x


def regression_to_classification(
    rng: np.random.Generator,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    multiclass_type: str,
    cat_prob: float = 0.2,
    multiclass_ordered_prob: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Turns a regression table into a classification table (the reference's ``Reg2Cls``).

    Args:
      rng: the generator.
      x: float[T, F] features.
      y: float[T] target.
      num_classes: K, the number of boundaries plus one (some classes may end up empty).
      multiclass_type: "rank" or "value".
      cat_prob: probability that some feature columns are binned.
      multiclass_ordered_prob: probability of not permuting the classes before the final
        permutation (0 in the reference prior).

    Returns:
      ``(X float64[T, F], labels int64[T])``: X clipped at 4 robust sigma, standardized
      and column-permuted (not padded); labels in 0..n-1.
    """
    x = numerical_to_categorical(rng, x, cat_prob)
    x = standard_scaling(outlier_removing(x, threshold=4.0))
    x = x[:, rng.permutation(x.shape[1])]

    y = standard_scaling(np.asarray(y, np.float64)[:, None])[:, 0]
    labels = assign_classes(rng, y, num_classes, multiclass_type, multiclass_ordered_prob)
    return x, permute_classes(rng, labels)
