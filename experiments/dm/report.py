"""The strong-data table of ``experiments/dm`` from its raw results.

    lhc report experiments/dm [--write]

``results/strong.jsonl`` (``experiments/dm/run_strong.sh``: one record per run's rollout
evaluation, every episode's return and D4RL-normalised score) gives, per environment,
dataset and model: the seeds and episodes, the normalised score's mean with a 95%
cluster-bootstrap interval (a resample draws training seeds with all their episodes),
each seed's mean, and the forward FLOPs per action; then the Decision Mixer minus the
Decision Transformer with the interval of the difference (each model's seeds resampled
apart). A run evaluated twice counts once, its last record.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 10_000


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """One block per results file (``lhc report``)."""
    return {name: table(rows) for name, rows in results.items()}


def _runs(rows: list[dict]) -> dict[tuple, dict]:
    """``{(env, dataset, model, seed): record}``, the last record of each run."""
    return {(r["env"], r["dataset"], r["model"], r["seed"]): r for r in rows}


def _scores(record: dict) -> np.ndarray:
    return np.asarray(record["normalized"] or record["returns"], float)


def _cluster_means(clusters: list[np.ndarray], rng, resamples: int) -> np.ndarray:
    """Resampled means of all episodes of ``len(clusters)`` seeds drawn with
    replacement."""
    picks = rng.integers(len(clusters), size=(resamples, len(clusters)))
    sums = np.array([c.sum() for c in clusters])
    counts = np.array([len(c) for c in clusters])
    return sums[picks].sum(1) / counts[picks].sum(1)


def table(rows: list[dict]) -> str:
    runs = _runs(rows)
    groups: dict[tuple, dict[int, dict]] = {}
    for (env, dataset, model, seed), record in runs.items():
        groups.setdefault((env, dataset, model), {})[seed] = record
    lines = [
        "| environment | dataset | model | seeds | episodes | normalised score (95% CI) "
        "| per seed | MFLOPs / action |",
        "|---|---|---|---:|---:|---|---|---:|",
    ]
    rng = np.random.default_rng(0)
    draws = {}
    for key in sorted(groups):
        env, dataset, model = key
        clusters = [_scores(r) for _, r in sorted(groups[key].items())]
        episodes = np.concatenate(clusters)
        draws[key] = _cluster_means(clusters, rng, RESAMPLES)
        low, high = np.percentile(draws[key], [2.5, 97.5])
        flops = np.mean([r["flops_per_action"] for r in groups[key].values()]) / 1e6
        per_seed = ", ".join(f"{c.mean():.1f}" for c in clusters)
        lines.append(
            f"| {env} | {dataset} | {model} | {len(clusters)} | {len(episodes)} "
            f"| {episodes.mean():.1f} ({low:.1f}-{high:.1f}) | {per_seed} | {flops:.3f} |"
        )
    differences = []
    for env, dataset, model in sorted(groups):
        if model != "dm" or (env, dataset, "dt") not in groups:
            continue
        dm, dt = draws[(env, dataset, "dm")], draws[(env, dataset, "dt")]
        point = np.mean(np.concatenate([_scores(r) for r in groups[(env, dataset, "dm")].values()]))
        point -= np.mean(
            np.concatenate([_scores(r) for r in groups[(env, dataset, "dt")].values()])
        )
        low, high = np.percentile(dm - dt, [2.5, 97.5])
        differences.append(f"| {env} | {dataset} | {point:+.1f} ({low:+.1f} to {high:+.1f}) |")
    if differences:
        lines += ["", "| environment | dataset | DM minus DT (95% CI) |", "|---|---|---|"]
        lines += differences
    return "\n".join(lines) + "\n"
