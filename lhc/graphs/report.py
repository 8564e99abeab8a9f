"""The table and plot of a depth sweep of ``configs/graphs_range.py`` runs.

Reads each workdir's ``config.json`` and ``metrics.jsonl`` (the evaluations that
``lhc.graphs.task.RangeTask`` logs) and prints, per depth, the held-out MSE and the
model's range at the end of training beside the task's, then the model's normalised
spd range at every evaluation and a text bar chart of the final range against
depth; with ``--plot`` it draws the model's range against the
training step, one line per depth, and the task's range as a dashed line.

    python -m lhc.graphs.report /tmp/range/depth* --plot /tmp/range/range.png
"""

from __future__ import annotations

import argparse
import json
import pathlib

from lhc import plots
from lhc.train.config import load_run_config


def read_run(workdir: str) -> dict:
    """``depth``, the evaluations (a list of metric dicts with their step) of one run."""
    path = pathlib.Path(workdir)
    config = load_run_config(workdir)
    evaluations = []
    for line in (path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/range_spd_norm" in record:
            evaluations.append(record)
    if not evaluations:
        raise ValueError(f"{workdir}: metrics.jsonl holds no range evaluation")
    return dict(workdir=workdir, depth=int(config.model.num_layers), evaluations=evaluations)


def table(runs: list[dict], variant: str = "spd_norm") -> str:
    runs = sorted(runs, key=lambda r: r["depth"])
    last = [r["evaluations"][-1] for r in runs]
    variants = ("spd_norm", "res_norm", "spd_raw", "res_raw")
    lines = [
        "model range at the end of training (task range in brackets):",
        f"{'depth':>5} {'step':>6} {'MSE':>9} " + " ".join(f"{v:>17}" for v in variants),
    ]
    for run, record in zip(runs, last):
        cells = " ".join(
            f"{record[f'eval/range_{v}']:>8.3f} ({record[f'eval/task_range_{v}']:>6.3f})"
            for v in variants
        )
        lines.append(f"{run['depth']:>5} {record['step']:>6} {record['eval/mse']:>9.4f} {cells}")
    steps = [e["step"] for e in runs[0]["evaluations"]]
    lines += [
        "",
        f"model range ({variant}) during training:",
        f"{'depth':>5} " + " ".join(f"{s:>6}" for s in steps),
    ]
    for run in runs:
        values = {e["step"]: e[f"eval/range_{variant}"] for e in run["evaluations"]}
        lines.append(
            f"{run['depth']:>5} "
            + " ".join(f"{values[s]:>6.3f}" if s in values else f"{'':>6}" for s in steps)
        )
    task = last[0][f"eval/task_range_{variant}"]
    lines.append(f"{'task':>5} " + " ".join(f"{task:>6.3f}" for _ in steps))
    lines += ["", f"final model range ({variant}) against depth, | marks the task's:"]
    lines += bar_chart(
        [(f"{r['depth']} layers", e[f"eval/range_{variant}"]) for r, e in zip(runs, last)], task
    )
    return "\n".join(lines)


def bar_chart(rows: list[tuple[str, float]], reference: float, width: int = 50) -> list[str]:
    """One text bar per (label, value), scaled so the largest value or the reference
    fills ``width`` characters; ``|`` marks the reference."""
    top = max([reference] + [v for _, v in rows]) or 1.0
    mark = round(reference / top * width)
    lines = []
    for label, value in rows:
        bar = list(("#" * round(value / top * width)).ljust(width + 1))
        bar[mark] = "|"
        lines.append(f"{label:>10} {''.join(bar)} {value:.3f}")
    return lines


def plot(runs: list[dict], path: str, variant: str = "spd_norm") -> None:
    """Writes each run's range (``variant``) against the training step, and the task's
    range as a dashed line, as a PNG."""
    lines = {}
    for run in sorted(runs, key=lambda r: r["depth"]):
        steps = [e["step"] for e in run["evaluations"]]
        lines[f"{run['depth']} layers"] = (
            steps,
            [e[f"eval/range_{variant}"] for e in run["evaluations"]],
        )
    task = plots.Reference(runs[0]["evaluations"][-1][f"eval/task_range_{variant}"], "task")
    plots.curves(
        path,
        lines,
        xlabel="training step",
        ylabel=f"range ({variant.replace('_', ', ')})",
        references=[task],
        legend_fontsize=7,
        figsize=(6, 4),
    )


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        prog="python -m lhc.graphs.report", description=__doc__.splitlines()[0]
    )
    p.add_argument("workdirs", nargs="+")
    p.add_argument(
        "--variant", default="spd_norm", choices=("spd_norm", "res_norm", "spd_raw", "res_raw")
    )
    p.add_argument("--plot", help="write the plot (PNG) here")
    args = p.parse_args(argv)
    runs = [read_run(w) for w in args.workdirs]
    text = table(runs, args.variant)
    print(text)
    if args.plot:
        plot(runs, args.plot, args.variant)
    return text


if __name__ == "__main__":
    main()
