"""The tables of ``experiments/icl/iterative_vectors`` from its raw results.

    lhc report experiments/icl/iterative_vectors [--write]

Each results file (``results/<model>.jsonl``, written by ``lhc bench icl vectors
--results``) holds one record per task and seed with every test episode's class and the
predictions of the plain prompt (``clean``), Task Vectors (``tv``) and Iterative Vectors
(``iv``). Per model and task, the seeds' test episodes are pooled (each test input of a
seed is one item): macro-F1 of each method with a bootstrap interval over the items,
and IV minus each baseline by a paired bootstrap over the same items; the strengths
chosen on validation, and how many sit at the bottom of the grid searched.
"""

from __future__ import annotations

import numpy as np

from lhc import stats
from lhc.icl.iterative import macro_f1

METHODS = ("clean", "tv", "iv")
RESAMPLES = 2000


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """One block per results file (``lhc report``)."""
    return {name: table(rows) for name, rows in results.items()}


def _macro_f1(classes: int):
    """``statistic`` of items coded ``predicted * classes + true``: their macro-F1."""

    def statistic(codes: np.ndarray) -> float:
        predicted, true = np.divmod(np.asarray(codes, int), classes)
        return macro_f1(predicted, true, classes)

    return statistic


def table(rows: list[dict]) -> str:
    lines = [
        "| model | task | seeds | test items | clean F1 | TV F1 | IV F1 | IV - clean | "
        "IV - TV | strengths chosen (lowest searched) |",
        "|---|---|---:|---:|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        cells.setdefault((row["model"], row["task"]), []).append(row)
    for (model, task), cell in cells.items():
        classes = len(cell[0]["labels"])
        statistic = _macro_f1(classes)
        true = np.concatenate([r["test_classes"] for r in cell])
        codes = {
            m: np.concatenate([r["predicted"][m] for r in cell]) * classes + true for m in METHODS
        }
        shown = {}
        for m in METHODS:
            low, high = stats.bootstrap_interval(codes[m], statistic, resamples=RESAMPLES)
            shown[m] = f"{statistic(codes[m]):.3f} ({low:.3f}-{high:.3f})"
        for other in ("clean", "tv"):
            d = stats.paired_bootstrap(codes["iv"], codes[other], statistic, resamples=RESAMPLES)
            shown[f"iv-{other}"] = (
                f"{d['difference']:+.3f} ({d['low']:+.3f} to {d['high']:+.3f}, p {d['p_value']:.3f})"
            )
        lowest = min(min(g["strength"] for g in r["grid"]) for r in cell)
        chosen = ", ".join(f"{r['strength']:g}" for r in sorted(cell, key=lambda r: r["seed"]))
        at_bottom = sum(r["strength"] == lowest for r in cell)
        lines.append(
            f"| {model} | {task} | {len(cell)} | {len(true)} | {shown['clean']} | {shown['tv']} "
            f"| {shown['iv']} | {shown['iv-clean']} | {shown['iv-tv']} "
            f"| {chosen} ({at_bottom} at {lowest:g}) |"
        )
    return "\n".join(lines) + "\n"
