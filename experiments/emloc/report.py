"""The tables of ``experiments/emloc`` from its raw results.

    lhc report experiments/emloc [--write]

Each results file (``results/<model>.jsonl``, written by ``lhc bench emloc --results``)
holds every method's row of each episode. Per model, task, shots and delta: each
method's accuracy, the mean over episodes with a bootstrap interval over episodes, and
EMLoC minus each method at the same budget by a paired bootstrap over the same
episodes; the kept fraction and the compression time (compilation taken out).
"""

from __future__ import annotations

import numpy as np

from lhc import stats

RESAMPLES = 2000
BASELINES = ("uniform", "SnapKV-style", "fewer shots", "full context")


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """One block per results file (``lhc report``)."""
    return {name: table(rows) for name, rows in results.items()}


def table(rows: list[dict]) -> str:
    lines = [
        "| model | task | shots | delta | episodes | EMLoC | uniform | SnapKV-style | "
        "fewer shots | full context | EMLoC kept | EMLoC - uniform | EMLoC - SnapKV-style | "
        "EMLoC - fewer shots | compression (s) |",
        "|---|---|---:|---:|---:|---|---|---|---|---|---:|---|---|---|---:|",
    ]
    cells: dict[tuple, dict[str, dict[int, dict]]] = {}
    for row in rows:
        shots = row["setting"]["shots"]
        # The full context has no delta: it is the same row for every delta.
        deltas = row["setting"]["deltas"] if row["delta"] is None else [row["delta"]]
        for delta in deltas:
            key = (row["model"], row["task"], shots, delta)
            cells.setdefault(key, {}).setdefault(row["method"], {})[row["episode"]] = row
    for (model, task, shots, delta), methods in sorted(cells.items()):
        episodes = sorted(methods["EMLoC"])
        accuracy = {m: np.array([methods[m][e]["accuracy"] for e in episodes]) for m in methods}
        shown = {}
        for method, values in accuracy.items():
            low, high = stats.bootstrap_interval(values, resamples=RESAMPLES)
            shown[method] = f"{values.mean():.3f} ({low:.3f}-{high:.3f})"
        for method in BASELINES[:3]:
            d = stats.paired_bootstrap(accuracy["EMLoC"], accuracy[method], resamples=RESAMPLES)
            shown[f"d {method}"] = (
                f"{d['difference']:+.3f} ({d['low']:+.3f} to {d['high']:+.3f}, "
                f"p {d['p_value']:.3f})"
            )
        kept = np.mean([methods["EMLoC"][e]["kept"] for e in episodes])
        seconds = np.mean([methods["EMLoC"][e]["seconds"] for e in episodes])
        lines.append(
            f"| {model} | {task} | {shots} | {delta:g} | {len(episodes)} | {shown['EMLoC']} | "
            + " | ".join(shown[m] for m in BASELINES)
            + f" | {kept:.3f} | "
            + " | ".join(shown[f"d {m}"] for m in BASELINES[:3])
            + f" | {seconds:.1f} |"
        )
    return "\n".join(lines) + "\n"
