"""The seed tables of ``experiments/recurrent`` from its raw results.

    lhc report experiments/recurrent [--write]

Each ``results/<model>.jsonl`` (``run_seeds.sh``: ``curves.py --results``) holds one
record per run, named ``<model>_s<seed>_<init>``: the baseline (``base``), the control
post-trained from zero states (``zero``) and each intervention. Per intervention:
the mean over seeds of its log-perplexity minus the control's in the last position
bucket, and of its passkey accuracy minus the control's at each length, each with a
paired bootstrap interval over the seeds (the same seed's control), and in how many
seeds the intervention is better.
"""

from __future__ import annotations

import numpy as np

from lhc import stats

INITS = ("noise", "fitted", "passing", "tbtt")


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    """One block per results file (``lhc report``)."""
    return {name: table(rows) for name, rows in results.items()}


def _by_run(rows):
    runs = {}
    for row in rows:  # the last record of a run wins (a rerun of its evaluation)
        *_, seed, init = row["run"].rsplit("_", 2)
        runs[(int(seed[1:]), init)] = row
    return runs


def _cell(values_a, values_b, better_is_lower: bool) -> str:
    d = stats.paired_bootstrap(values_a, values_b, resamples=5000)
    better = np.sum(values_a < values_b) if better_is_lower else np.sum(values_a > values_b)
    return (
        f"{d['difference']:+.3f} ({d['low']:+.3f} to {d['high']:+.3f}); "
        f"better in {better}/{len(values_a)}"
    )


def table(rows: list[dict]) -> str:
    runs = _by_run(rows)
    seeds = sorted({seed for seed, init in runs if init == "zero"})
    lengths = rows[0]["passkey_lengths"]
    buckets = rows[0]["buckets"]
    last = f"{buckets[-2]}-{buckets[-1]}"
    lines = [
        f"| intervention | seeds | log-perplexity at {last} minus control | "
        + " | ".join(f"passkey at {n:,} minus control" for n in lengths)
        + " |",
        "|---|---:|---|" + "---|" * len(lengths),
    ]

    def passkey(row, i):
        return float(np.mean(row["passkey_hits"][i])) if row["passkey_hits"] else float("nan")

    for init in INITS:
        paired = [s for s in seeds if (s, init) in runs]
        if not paired:
            continue
        ours = [runs[(s, init)] for s in paired]
        control = [runs[(s, "zero")] for s in paired]
        log_ppl = [
            np.log(np.array([r["perplexity"][-1] for r in group])) for group in (ours, control)
        ]
        cells = [_cell(*log_ppl, better_is_lower=True)]
        for i in range(len(lengths)):
            acc = [np.array([passkey(r, i) for r in group]) for group in (ours, control)]
            cells.append(_cell(*acc, better_is_lower=False))
        lines.append(f"| {init} | {len(paired)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
