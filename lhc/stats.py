"""Statistics and result files shared by every experiment and benchmark.

Result files are JSON lines, one record per test, appended as each test finishes, so
an interrupted sweep resumes where it stopped (``read_records`` / ``append_records``).
Tables of results are markdown (``markdown_table``), an accuracy given with its
``wilson_interval``, two methods scored on the same items compared by the exact paired
test on the items where they disagree (``mcnemar``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

# Result files --------------------------------------------------------------------------


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a results file (one JSON object per line). A last line without its
    newline (a write that an interruption cut short) is dropped from the file: that record
    is made again.

    Raises:
        ValueError: a line that is not JSON, naming the file and line.
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
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
    line, flushed to the disk before returning (its folder is made if missing)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    if not lines:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


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
