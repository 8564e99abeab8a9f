"""The seeded scaling tables of ``experiments/pencil`` from its raw results.

    lhc report experiments/pencil [--write]

``results/qbf_3_8.jsonl`` (``experiments/pencil/run_seeds.sh``: ``pencil_eval.results``
of each run, one record per held-out instance) gives two blocks:

* ``qbf_3_8``: per problem size and run (format and context limit), the accuracy over
  every seed's instances with a 95% Wilson interval, each seed's accuracy, and the share
  of instances over the limit, finished, and the largest context;
* ``qbf_3_8_gap``: per size, PENCIL at 512 against CoT at 512 and against CoT at 2,048
  on the same instances (runs of one seed draw the same ones): the accuracy difference
  with a paired bootstrap interval over instances and McNemar's exact test; and whether
  the gap grows: the gap at the two largest sizes minus the gap at the two smallest,
  with a bootstrap interval (instances resampled within each size).

An instance evaluated twice (a run whose evaluation was stopped and made again) counts
once, its last record.
"""

from __future__ import annotations

import numpy as np

from lhc import stats

RUNS = (("pencil", 512, "PENCIL"), ("cot", 512, "CoT"), ("cot", 2048, "CoT at 2,048"))


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """Two blocks per results file (``lhc report``)."""
    blocks = {}
    for name, rows in results.items():
        outcomes = _outcomes(rows)
        blocks[name] = accuracy_table(outcomes)
        blocks[name + "_gap"] = gap_table(outcomes)
    return blocks


def _outcomes(rows: list[dict]) -> dict[tuple, dict[tuple, dict]]:
    """``{(format, limit): {(size, seed, instance): record}}``, the last record of each."""
    runs: dict[tuple, dict[tuple, dict]] = {}
    for r in rows:
        key = (r["size"], r["seed"], r["instance"])
        runs.setdefault((r["format"], r["context_limit"]), {})[key] = r
    return runs


def _sizes(outcomes) -> list[int]:
    return sorted({key[0] for run in outcomes.values() for key in run})


def accuracy_table(outcomes) -> str:
    lines = [
        "| n | run | seeds | instances | accuracy (95% CI) | per seed | over the limit "
        "| finished | largest context (mean / max) |",
        "|---:|---|---:|---:|---|---|---:|---:|---|",
    ]
    for size in _sizes(outcomes):
        for fmt, limit, label in RUNS:
            run = {k: r for k, r in outcomes.get((fmt, limit), {}).items() if k[0] == size}
            if not run:
                continue
            seeds = sorted({k[1] for k in run})
            correct = sum(r["correct"] for r in run.values())
            low, high = stats.wilson_interval(correct, len(run))
            per_seed = ", ".join(
                f"{np.mean([r['correct'] for k, r in run.items() if k[1] == s]):.2f}" for s in seeds
            )
            share = lambda field, run=run: np.mean([r[field] for r in run.values()])  # noqa: E731
            contexts = [r["max_context"] for r in run.values()]
            lines.append(
                f"| {size} | {label} | {len(seeds)} | {len(run)} "
                f"| {correct / len(run):.2f} ({low:.2f}-{high:.2f}) | {per_seed} "
                f"| {share('over_limit'):.2f} | {share('finished'):.2f} "
                f"| {np.mean(contexts):.0f} / {max(contexts):,} |"
            )
    return "\n".join(lines) + "\n"


def _paired(outcomes, size, other) -> tuple[np.ndarray, np.ndarray]:
    """PENCIL's and ``other`` run's correctness on the instances of ``size`` both have."""
    pencil = outcomes.get(("pencil", 512), {})
    versus = outcomes.get(other, {})
    common = sorted(k for k in set(pencil) & set(versus) if k[0] == size)
    first = np.array([pencil[k]["correct"] for k in common], bool)
    second = np.array([versus[k]["correct"] for k in common], bool)
    return first, second


def _growth(outcomes, other, sizes, resamples=10_000, seed=0) -> tuple[float, float, float]:
    """The gap (PENCIL minus ``other``) at the two largest ``sizes`` minus the gap at
    the two smallest, and its 95% bootstrap interval (paired instances resampled within
    each size)."""
    rng = np.random.default_rng(seed)
    small, large = sizes[:2], sizes[-2:]
    point, draws = 0.0, np.zeros(resamples)
    for size in small + large:
        first, second = _paired(outcomes, size, other)
        sign = 1.0 if size in large else -1.0
        difference = first.astype(float) - second.astype(float)
        point += sign * difference.mean() / 2
        picks = rng.integers(len(difference), size=(resamples, len(difference)))
        draws += sign * difference[picks].mean(axis=1) / 2
    low, high = np.percentile(draws, [2.5, 97.5])
    return point, float(low), float(high)


def gap_table(outcomes) -> str:
    lines = [
        "| n | PENCIL against | instances | difference (95% CI) | PENCIL alone / other alone "
        "(McNemar p) |",
        "|---:|---|---:|---|---|",
    ]
    sizes = _sizes(outcomes)
    others = [(fmt, limit, label) for fmt, limit, label in RUNS[1:] if (fmt, limit) in outcomes]
    for size in sizes:
        for fmt, limit, label in others:
            first, second = _paired(outcomes, size, (fmt, limit))
            if not len(first):
                continue
            boot = stats.paired_bootstrap(first, second)
            test = stats.mcnemar(first, second)
            lines.append(
                f"| {size} | {label} | {len(first)} | {boot['difference']:+.2f} "
                f"({boot['low']:+.2f} to {boot['high']:+.2f}) "
                f"| {test['only_first']} / {test['only_second']} ({test['p_value']:.3g}) |"
            )
    for fmt, limit, label in others:
        usable = [s for s in sizes if len(_paired(outcomes, s, (fmt, limit))[0])]
        if len(usable) >= 4:
            point, low, high = _growth(outcomes, (fmt, limit), usable)
            lines.append(
                f"| {usable[-2]}-{usable[-1]} vs {usable[0]}-{usable[1]} | {label}: growth of "
                f"the gap | - | {point:+.2f} ({low:+.2f} to {high:+.2f}) | - |"
            )
    return "\n".join(lines) + "\n"
