"""Scoring: "contains", the base score, effective length and normalized scores; plots.

The paper's definitions (NoLiMa §4.3):

* a response is correct when it contains a gold answer (case-sensitive);
* a pair's score at length L is its accuracy averaged over haystacks and depths; the
  score at L is the mean over pairs;
* the base score: per pair, the best of its scores at the short lengths (250, 500, 1K),
  averaged over pairs;
* the effective length: the longest length whose score is at least 85% of the base.
  Here it is the longest length before the first that falls below (lengths in order),
  so a model that recovers at a longer length after failing is not credited with it;
  None when even the shortest length falls below, or the base score is 0;
* the normalized score at L: score / base.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from lhc import plots
from lhc.stats import markdown_table, wilson_interval

BASE_LENGTHS = (250, 500, 1000)


def contains(response: str, answers: Sequence[str]) -> bool:
    """Whether ``response`` contains any of ``answers`` (case-sensitive)."""
    return any(answer in response for answer in answers)


def pair_scores(records: Iterable[Mapping]) -> dict[str, dict[int, float]]:
    """``{pair: {length: accuracy}}`` (averaged over haystacks and depths)."""
    sums: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in records:
        sums[r["pair"], int(r["length"])].append(float(r["correct"]))
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for (pair, length), values in sums.items():
        out[pair][length] = float(np.mean(values))
    return dict(out)


def length_scores(pairs: Mapping[str, Mapping[int, float]]) -> dict[int, float]:
    """``{length: mean over pairs}`` (only pairs measured at that length)."""
    by_length: dict[int, list[float]] = defaultdict(list)
    for scores in pairs.values():
        for length, value in scores.items():
            by_length[length].append(value)
    return {length: float(np.mean(v)) for length, v in sorted(by_length.items())}


def base_score(
    pairs: Mapping[str, Mapping[int, float]], base_lengths: Sequence[int] = BASE_LENGTHS
) -> float:
    """Per pair the best score at ``base_lengths``, averaged over pairs.

    Raises:
        ValueError: a pair measured at none of ``base_lengths``.
    """
    best = []
    for pair, scores in pairs.items():
        short = [scores[n] for n in base_lengths if n in scores]
        if not short:
            raise ValueError(f"pair {pair!r} has no score at the base lengths {list(base_lengths)}")
        best.append(max(short))
    if not best:
        raise ValueError("base_score needs at least one pair")
    return float(np.mean(best))


def effective_length(
    scores: Mapping[int, float], base: float, threshold: float = 0.85
) -> int | None:
    """The longest length before the first whose score is below ``threshold * base``."""
    effective = None
    if base <= 0:
        return None
    for length in sorted(scores):
        if scores[length] < threshold * base:
            break
        effective = length
    return effective


def summary(
    records: Sequence[Mapping],
    *,
    base_lengths: Sequence[int] = BASE_LENGTHS,
    threshold: float = 0.85,
) -> dict:
    """Scores by length, base score, effective length, normalized scores; the same per
    question type; accuracy by (length, depth)."""

    def block(rows):
        pairs = pair_scores(rows)
        by_length = length_scores(pairs)
        out = {
            "tests": len(rows),
            "pairs": len(pairs),
            "by_length": by_length,
            "intervals": _intervals(rows),
        }
        if any(n in by_length for n in base_lengths):
            base = base_score(pairs, base_lengths)
            out.update(
                base=base,
                effective_length=effective_length(by_length, base, threshold),
                normalized={
                    n: (s / base if base > 0 else float("nan")) for n, s in by_length.items()
                },
            )
        return out

    result = block(records)
    kinds = sorted({r["question_type"] for r in records})
    result["by_question_type"] = {
        k: block([r for r in records if r["question_type"] == k]) for k in kinds
    }
    literal = [r for r in records if r["question_type"] in LITERAL]
    latent = [r for r in records if r["question_type"] not in LITERAL]
    if literal and latent:
        result["literal_latent"] = {"literal": block(literal), "latent": block(latent)}
    grid: dict[tuple[int, float], list[float]] = defaultdict(list)
    for r in records:
        grid[int(r["length"]), float(r["depth"])].append(float(r["correct"]))
    result["by_length_depth"] = {
        f"{n}/{d:g}": float(np.mean(v)) for (n, d), v in sorted(grid.items())
    }
    return result


# Question types whose question names the needle's own words (the rest need a latent hop).
LITERAL = ("direct",)


def _intervals(rows: Sequence[Mapping]) -> dict[int, dict[str, float]]:
    """Per length: tests, accuracy over them and its 95% Wilson interval (tests taken as
    independent draws, which tests of one pair at several depths are not quite)."""
    by_length: dict[int, list[bool]] = defaultdict(list)
    for r in rows:
        by_length[int(r["length"])].append(bool(r["correct"]))
    out = {}
    for length, values in sorted(by_length.items()):
        low, high = wilson_interval(sum(values), len(values))
        out[length] = {
            "tests": len(values),
            "accuracy": sum(values) / len(values),
            "low": low,
            "high": high,
        }
    return out


def interval_table(result: Mapping) -> str:
    """A markdown table: accuracy over tests per length with its 95% interval and the
    number of tests, literal against latent questions, then per question type."""
    blocks = list((result.get("literal_latent") or {}).items())
    blocks += list(result["by_question_type"].items())
    lengths = sorted({n for _, b in blocks for n in b["intervals"]})
    cell = lambda c: f"{c['accuracy']:.2f} [{c['low']:.2f}, {c['high']:.2f}] ({c['tests']})"  # noqa: E731
    rows = [
        dict(questions=name, **{str(n): cell(b["intervals"][n]) for n in b["intervals"]})
        for name, b in blocks
    ]
    columns = [("questions", "questions")] + [(str(n), str(n)) for n in lengths]
    return markdown_table(columns, rows, right=[str(n) for n in lengths])


def table(result: Mapping) -> str:
    """A markdown table: score per length for all pairs and each question type, with the
    base score and effective length."""
    lengths = sorted(result["by_length"])
    rows = []
    for name, b in [("all", result), *result["by_question_type"].items()]:
        effective = b.get("effective_length")
        if effective is None and "base" in b:
            effective = f"<{lengths[0]}"  # below the base already at the shortest
        rows.append({"questions": name, "base": b.get("base"), "effective": effective})
        rows[-1].update(b["by_length"])
    columns = [("questions", "questions"), ("base", "base", ".2f")]
    columns += [(str(n), n, ".2f") for n in lengths]
    columns.append(("effective length", "effective"))
    return markdown_table(columns, rows, right=["effective"])


def grid(records: Sequence[Mapping], question_type: str | None = None):
    """``(lengths, depths, accuracy [len(lengths), len(depths)])`` (NaN where unmeasured)."""
    rows = [r for r in records if question_type is None or r["question_type"] == question_type]
    lengths = sorted({int(r["length"]) for r in rows})
    depths = sorted({float(r["depth"]) for r in rows})
    values: dict[tuple[int, float], list[float]] = defaultdict(list)
    for r in rows:
        values[int(r["length"]), float(r["depth"])].append(float(r["correct"]))
    accuracy = np.full((len(lengths), len(depths)), np.nan)
    for (n, d), v in values.items():
        accuracy[lengths.index(n), depths.index(d)] = np.mean(v)
    return lengths, depths, accuracy


def plot(records: Sequence[Mapping], directory: str, title: str = "NoLiMa") -> list[str]:
    """Writes ``heatmap_<type>.png`` (accuracy by depth and length, per question type),
    ``depths.png`` (accuracy against depth per question type, averaged over lengths)
    and ``curves.png`` (score against length per question type, with 85% of each base)
    into ``directory``; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    result = summary(records)
    for kind in result["by_question_type"]:
        lengths, depths, accuracy = grid(records, kind)
        path = os.path.join(directory, f"heatmap_{kind}.png")
        plots.length_depth_heatmap(path, accuracy, lengths, depths, f"{title}: {kind}")
        paths.append(path)
    lines, references = {}, []
    for index, (kind, block) in enumerate(result["by_question_type"].items()):
        lengths = sorted(block["by_length"])
        lines[kind] = (lengths, [block["by_length"][n] for n in lengths])
        if "base" in block:
            reference = plots.Reference(0.85 * block["base"], color=f"C{index}", linestyle=":")
            references.append(reference)
    depth_lines = {}
    for kind in result["by_question_type"]:
        lengths, depths, accuracy = grid(records, kind)
        depth_lines[kind] = (depths, np.nanmean(accuracy, axis=0).tolist())
    accuracy_axes = dict(y_limits=(-0.02, 1.02), marker="o", figsize=(5.5, 3.5))
    for name, curve_lines, axes in (
        (
            "depths.png",
            depth_lines,
            dict(
                xlabel="needle depth",
                ylabel="accuracy (mean over lengths)",
                title=f"{title}: by depth",
            ),
        ),
        (
            "curves.png",
            lines,
            dict(
                xlabel="context length (tokens)",
                ylabel="accuracy",
                title=f"{title} (dotted: 85% of base)",
                references=references,
                log_x_base=2,
            ),
        ),
    ):
        path = os.path.join(directory, name)
        plots.curves(path, curve_lines, **axes, **accuracy_axes)
        paths.append(path)
    return paths
