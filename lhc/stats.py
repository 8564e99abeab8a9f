"""Statistics and result files shared by every experiment and benchmark.

Result files are JSON lines, one record per test, appended as each test finishes, so
an interrupted sweep resumes where it stopped (``read_records`` / ``append_records``);
a path ending in ``.gz`` is a gzip-compressed file of the same lines, for the sweeps whose
answers would make a plain file too large to commit.
Tables of results are markdown (``markdown_table``), an accuracy given with its
``wilson_interval``, two methods scored on the same items compared by the exact paired
test on the items where they disagree (``mcnemar``); samples against a known
distribution by ``chi_square_fit``. Any other statistic gets a
percentile ``bootstrap_interval``, and a difference between two methods on the same items a
``paired_bootstrap`` interval and p-value; both resample whole groups when items are not
independent (one question-needle pair tested at several depths).
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

# Result files --------------------------------------------------------------------------


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a results file (one JSON object per line; gzip-compressed when
    ``path`` ends in ``.gz``). A last line without its newline (a write that an
    interruption cut short) is dropped from the file: that record is made again.

    Raises:
        ValueError: a line that is not JSON, naming the file and line.
    """
    if not os.path.exists(path):
        return []
    text = _read_text(path)
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        _write_text(path, text)
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{os.fspath(path)}:{number}: not a JSON record") from None
    return records


def append_records(path: str | os.PathLike, records: Sequence[dict | str]) -> None:
    """Appends ``records`` (dicts, or lines of JSON) to the file at ``path``, one per
    line, flushed to the disk before returning (its folder is made if missing). A ``.gz``
    file is written again whole, to a temporary file renamed over it, so an interruption
    leaves either the old records or the new ones (and two processes appending to one
    ``.gz`` file at once would lose records: give each run its own file)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    if not lines:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if _compressed(path):
        text = _read_text(path) if os.path.exists(path) else ""
        _write_text(path, text + "\n".join(lines) + "\n")
        return
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _compressed(path: str | os.PathLike) -> bool:
    return os.fspath(path).endswith(".gz")


def _read_text(path: str | os.PathLike) -> str:
    if _compressed(path):
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return handle.read()
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _write_text(path: str | os.PathLike, text: str) -> None:
    """``text`` into ``path`` through a temporary file in the same folder; a ``.gz`` file
    is compressed with no time stamp, so the same records give the same bytes."""
    temporary = f"{os.fspath(path)}.partial"
    with open(temporary, "wb") as handle:
        data = text.encode("utf-8")
        if _compressed(path):
            data = gzip.compress(data, compresslevel=9, mtime=0)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


# Intervals -----------------------------------------------------------------------------


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% at ``z=1.96``); (0, 1)
    without trials."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = (
        z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    )
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def mcnemar(first: Sequence[bool], second: Sequence[bool]) -> dict[str, float]:
    """The exact McNemar test of two methods scored right or wrong on the same items.

    Only the items where they disagree count: under the null hypothesis (the methods are
    equally good) each is the first method's with probability 1/2, so the two-sided
    p-value is that of a binomial test of ``only_first`` in ``only_first + only_second``.

    Returns:
        ``items``, ``only_first`` (right by the first method alone), ``only_second`` and
        ``p_value`` (1 when they never disagree).

    Raises:
        ValueError: sequences of different lengths.
    """
    if len(first) != len(second):
        raise ValueError(
            f"mcnemar: expected the same items for both methods, got {len(first)} and "
            f"{len(second)} scores"
        )
    only_first = sum(bool(a) and not bool(b) for a, b in zip(first, second))
    only_second = sum(bool(b) and not bool(a) for a, b in zip(first, second))
    disagree = only_first + only_second
    tail = sum(math.comb(disagree, k) for k in range(min(only_first, only_second) + 1))
    p_value = min(1.0, 2 * tail / 2**disagree) if disagree else 1.0
    return {
        "items": len(first),
        "only_first": only_first,
        "only_second": only_second,
        "p_value": p_value,
    }


def chi_square_fit(observed: ArrayLike, expected: ArrayLike, *, min_expected: float = 5.0) -> dict:
    """Pearson's chi-square test that ``observed`` counts were drawn from the
    distribution ``expected`` (counts or probabilities; scaled to the observed total).
    Cells expected fewer than ``min_expected`` times are pooled into one (dropped if
    the pool is still below it), the usual condition for the chi-square approximation.

    Returns:
        ``statistic``, ``dof`` (cells kept less one), ``p_value`` (the chi-square
        distribution's upper tail) and ``cells``.

    Raises:
        ValueError: different shapes, negative values, or fewer than two cells left.
    """
    observed = np.asarray(observed, np.float64).reshape(-1)
    expected = np.asarray(expected, np.float64).reshape(-1)
    if observed.shape != expected.shape or (observed < 0).any() or (expected < 0).any():
        raise ValueError(
            f"chi_square_fit: expected two non-negative arrays of one shape, got "
            f"{observed.shape} and {expected.shape}"
        )
    expected = expected * observed.sum() / expected.sum()
    big = expected >= min_expected
    observed_cells, expected_cells = list(observed[big]), list(expected[big])
    if (~big).any() and expected[~big].sum() >= max(min_expected, 1e-12):
        observed_cells.append(observed[~big].sum())
        expected_cells.append(expected[~big].sum())
    if len(observed_cells) < 2:
        raise ValueError(
            f"chi_square_fit: fewer than two cells expected >= {min_expected} times "
            f"({observed.sum():g} observations)"
        )
    o, e = np.array(observed_cells), np.array(expected_cells)
    e = e * o.sum() / e.sum()  # the kept cells' totals agree
    statistic = float(((o - e) ** 2 / e).sum())
    dof = len(o) - 1
    return {
        "statistic": statistic,
        "dof": dof,
        "p_value": _chi_square_upper_tail(statistic, dof),
        "cells": len(o),
    }


def _chi_square_upper_tail(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with ``dof`` degrees of freedom: the regularized upper
    incomplete gamma function Q(dof / 2, x / 2), by its series (x < a + 1) or its
    continued fraction (Numerical Recipes' gser / gcf)."""
    a, x = dof / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return float(max(0.0, 1.0 - total * math.exp(log_prefix)))
    tiny = 1e-300
    b, c, d = x + 1 - a, 1 / tiny, 1 / (x + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        step = d * c
        h *= step
        if abs(step - 1) < 1e-15:
            break
    return float(math.exp(log_prefix) * h)


# Bootstrap -----------------------------------------------------------------------------

# Group draws made at once: bounds the memory of a block of resamples (~32 MiB of indices).
_DRAWS_PER_BLOCK = 1 << 22


def bootstrap_interval(
    values: ArrayLike,
    statistic: Callable[[np.ndarray], float] = np.mean,
    *,
    groups: Sequence[Hashable] | None = None,
    resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """The percentile bootstrap interval of ``statistic`` over the items ``values``.

    Args:
        values: [N] numbers or booleans, one per item.
        statistic: of a 1-D array of items; ``np.mean`` takes a fast path.
        groups: [N] the group of each item (a pair id, say), or None for independent
            items. A resample draws whole groups with all their items (cluster bootstrap),
            as items of one group are not independent.
        resamples: the number of bootstrap resamples.
        confidence: the coverage of the interval, in (0, 1).
        seed: of the resampling.

    Returns:
        ``(low, high)``, the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2``
        quantiles of the resampled statistic.

    Raises:
        ValueError: no values, not one group per item, ``confidence`` outside (0, 1) or
            fewer than one resample.
    """
    columns = _bootstrap_columns(
        "bootstrap_interval", {"values": values}, groups, resamples, confidence
    )
    draws = _bootstrap(columns, statistic, groups, resamples, seed)[:, 0]
    return _percentile_interval(draws, confidence)


def paired_bootstrap(
    first: ArrayLike,
    second: ArrayLike,
    statistic: Callable[[np.ndarray], float] = np.mean,
    *,
    groups: Sequence[Hashable] | None = None,
    resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """The bootstrap of ``statistic(first) - statistic(second)``, two methods scored on
    the same items: each resample draws the same items (or whole groups, as in
    ``bootstrap_interval``) for both methods.

    Args:
        first: [N] the first method's scores (numbers or booleans), one per item.
        second: [N] the second method's scores on the same items.
        statistic, groups, resamples, confidence, seed: as in ``bootstrap_interval``.

    Returns:
        ``items``; ``difference``, of the statistic on all items; ``low`` and ``high``,
        its percentile interval; and ``p_value``, two-sided: twice the smaller share of
        resampled differences on either side of zero (each counting zero), at most 1.

    Raises:
        ValueError: sequences of different lengths, or as ``bootstrap_interval``.
    """
    if len(first) != len(second):
        raise ValueError(
            f"paired_bootstrap: expected the same items for both methods, got {len(first)} "
            f"and {len(second)} scores"
        )
    columns = _bootstrap_columns(
        "paired_bootstrap", {"first": first, "second": second}, groups, resamples, confidence
    )
    draws = _bootstrap(columns, statistic, groups, resamples, seed)
    differences = draws[:, 0] - draws[:, 1]
    low, high = _percentile_interval(differences, confidence)
    p_value = 2 * min(np.mean(differences <= 0), np.mean(differences >= 0))
    return {
        "items": len(columns[0]),
        "difference": float(statistic(columns[0]) - statistic(columns[1])),
        "low": low,
        "high": high,
        "p_value": float(min(1.0, p_value)),
    }


def _bootstrap_columns(
    caller: str,
    columns: Mapping[str, ArrayLike],
    groups: Sequence[Hashable] | None,
    resamples: int,
    confidence: float,
) -> list[np.ndarray]:
    """The named columns as float arrays, once the arguments are checked."""
    arrays = []
    for name, column in columns.items():
        array = np.asarray(column, dtype=float)
        if array.ndim != 1:
            raise ValueError(f"{caller}: {name} must be one-dimensional, got {array.shape=}")
        if not array.size:
            raise ValueError(f"{caller}: {name} is empty")
        arrays.append(array)
    if groups is not None and len(groups) != len(arrays[0]):
        raise ValueError(
            f"{caller}: groups must name the group of each item, got {len(groups)} groups "
            f"for {len(arrays[0])} items"
        )
    if not 0 < confidence < 1:
        raise ValueError(f"{caller}: confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"{caller}: resamples must be at least 1, got {resamples}")
    return arrays


def _bootstrap(
    columns: Sequence[np.ndarray],
    statistic: Callable[[np.ndarray], float],
    groups: Sequence[Hashable] | None,
    resamples: int,
    seed: int,
) -> np.ndarray:
    """[resamples, C] ``statistic`` of each of the C columns ([N] each) on the same
    resampled items."""
    if groups is None:
        group_of = np.arange(len(columns[0]))
    else:  # numbered in order of first appearance, so unique ids number as the items do
        numbers: dict[Hashable, int] = {}
        group_of = np.array([numbers.setdefault(g, len(numbers)) for g in groups])
    sizes = np.bincount(group_of)
    blocks = _group_draws(np.random.default_rng(seed), len(sizes), resamples)
    if statistic is np.mean:
        # The mean of the drawn groups' items is their summed sums over their summed sizes.
        sums = np.stack([np.bincount(group_of, weights=c) for c in columns], axis=1)
        return np.concatenate(
            [sums[draws].sum(axis=1) / sizes[draws].sum(axis=1, keepdims=True) for draws in blocks]
        )
    by_group = np.argsort(group_of, kind="stable")  # each group's items, contiguous
    starts = np.cumsum(sizes) - sizes
    results = []
    for draws in blocks:
        for draw in draws:
            # The items of the drawn groups, one run of each group's items after another.
            lengths = sizes[draw]
            ends = np.cumsum(lengths)
            items = by_group[
                np.repeat(starts[draw] - ends + lengths, lengths) + np.arange(ends[-1])
            ]
            results.append([statistic(column[items]) for column in columns])
    return np.asarray(results, dtype=float)


def _group_draws(rng: np.random.Generator, num_groups: int, resamples: int) -> Iterator[np.ndarray]:
    """Blocks of [resamples_in_block, num_groups] group indices drawn with replacement."""
    block = max(1, _DRAWS_PER_BLOCK // num_groups)
    for start in range(0, resamples, block):
        yield rng.integers(num_groups, size=(min(block, resamples - start), num_groups))


def _percentile_interval(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    low, high = np.percentile(draws, [50 * (1 - confidence), 50 * (1 + confidence)])
    return float(low), float(high)


# Tables --------------------------------------------------------------------------------


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return ""
    if callable(spec):
        return spec(value)
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)) and spec:
        if spec.endswith("x"):
            return f"{value:{spec[:-1] or '.2f'}}x"
        if spec == "%":
            return f"{100 * value:.0f}%"
        return format(value, spec)
    return str(value)


def markdown_table(
    columns: Sequence[tuple], rows: Sequence[Mapping[str, Any]], *, right: Sequence = ()
) -> str:
    """A markdown table. ``columns``: ``(header, key)`` or ``(header, key, format)``;
    a format is a ``format()`` spec (``".3f"``, ``","``), ``"%"`` (a fraction as a
    percentage), a spec ending in ``"x"`` (a ratio: ``".2fx"``), or a function of the
    value. Text columns are left-aligned, numeric ones and those whose keys are in
    ``right`` right-aligned; a missing value is an empty cell."""
    columns = [(c[0], c[1], c[2] if len(c) > 2 else "") for c in columns]
    numeric = [
        key in right
        or any(
            isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)
            for row in rows
        )
        for _, key, _ in columns
    ]
    lines = [
        "| " + " | ".join(header for header, _, _ in columns) + " |",
        "|" + "".join("---:|" if n else "---|" for n in numeric),
    ]
    for row in rows:
        lines.append(
            "| " + " | ".join(_cell(row.get(key), spec) for _, key, spec in columns) + " |"
        )
    return "\n".join(lines)
