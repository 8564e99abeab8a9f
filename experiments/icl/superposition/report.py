"""The tables of ``experiments/icl/superposition`` from its raw results.

    lhc report experiments/icl/superposition [--write]

Each results file (``results/<model>.jsonl``, written by ``lhc bench icl superposition
--results``) holds one record per sweep (family, tasks) and seed with every prompt's
probability of each task's answer (first token) at each share d of the first task.
Per model and sweep, the seeds' prompts are pooled at each d: the first task's mean
probability, the calibration slope (least squares, over every d and task, of the
probability normalised over the K answers against the task's share: 1 when the model
follows the proportions exactly, 0 when it ignores them) and the spread at d = 0.5
(the share of prompts giving two or more answers at least 0.1), each with a 95%
bootstrap interval over the prompts (resampled within each seed and d).
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 1000
SPREAD_AT = 0.1


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """One block per results file (``lhc report``)."""
    return {name: table(rows) for name, rows in results.items()}


def _slope(shares: np.ndarray, means: np.ndarray) -> float:
    """``shares``, ``means``: ``[D, K]``; the slope of the within-K normalised means."""
    within = means / np.maximum(means.sum(-1, keepdims=True), 1e-300)
    return float(np.polyfit(shares.ravel(), within.ravel(), 1)[0])


def _statistics(shares, per_point):
    """``per_point[d]``: ``[P, K]`` prompts' probabilities at ``shares[d]``."""
    means = np.stack([p.mean(0) for p in per_point])
    half = int(np.argmin(np.abs(shares[:, 0] - 0.5)))
    spread = float(np.mean((per_point[half] >= SPREAD_AT).sum(-1) >= 2))
    return means[:, 0], _slope(shares, means), spread


def table(rows: list[dict]) -> str:
    sweeps: dict[tuple, list[dict]] = {}
    for row in rows:
        sweeps.setdefault((row["model"], row["family"], tuple(row["tasks"])), []).append(row)
    shares_shown = None
    lines = []
    for (model, family, tasks), records in sweeps.items():
        shares = np.array([r["proportions"] for r in records[0]["rows"]])  # [D, K]
        # Pool the seeds: at each d, every seed's prompts (resampled within the seed).
        per_seed = [
            [np.array(point["per_prompt"]["first"]) for point in record["rows"]]
            for record in records
        ]
        pooled = [np.concatenate([seed[d] for seed in per_seed]) for d in range(len(shares))]
        first, slope, spread = _statistics(shares, pooled)
        rng = np.random.default_rng(0)
        draws = []
        for _ in range(RESAMPLES):
            resampled = [
                np.concatenate(
                    [seed[d][rng.integers(len(seed[d]), size=len(seed[d]))] for seed in per_seed]
                )
                for d in range(len(shares))
            ]
            f, s, p = _statistics(shares, resampled)
            draws.append([*f, s, p])
        low, high = np.percentile(np.asarray(draws), [2.5, 97.5], axis=0)
        count = len(pooled[0])
        cells = [f"{m:.2f} ({lo:.2f}-{hi:.2f})" for m, lo, hi in zip(first, low, high)]
        if shares_shown is None:
            shares_shown = shares[:, 0]
            header = " | ".join(f"P(first), d = {d:g}" for d in shares_shown)
            lines += [
                f"| model | family | tasks | seeds | prompts per d | {header} | slope | "
                "spread at d = 0.5 |",
                "|---|---|---|---:|---:|" + "---|" * len(shares_shown) + "---|---|",
            ]
        lines.append(
            f"| {model} | {family} | {', '.join(tasks)} | {len(records)} | {count} | "
            + " | ".join(cells)
            + f" | {slope:.2f} ({low[-2]:.2f} to {high[-2]:.2f}) "
            f"| {spread:.2f} ({low[-1]:.2f}-{high[-1]:.2f}) |"
        )
    return "\n".join(lines) + "\n"
