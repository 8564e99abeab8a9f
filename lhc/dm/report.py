"""The table of a Decision Transformer / Decision Mixer comparison (``configs/dm_gym.py``
runs, ``experiments/dm/run.sh``).

Reads each workdir's ``config.json`` and the last rollout evaluation in its
``metrics.jsonl`` and prints, per dataset and model, the number of seeds, the mean and
standard deviation over seeds of each run's mean return (and of the D4RL normalised
score where the environment has one), the held-out action MSE, the forward FLOPs per
action and the tokens each routed layer selected per action.

    python -m lhc.dm.report /tmp/dm/hopper-*/*/
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib

import numpy as np

from lhc.train.config import load_run_config

MODEL_ORDER = ("dt", "dm", "dm_noaux", "dm_fixed")


def model_name(model_config) -> str:
    """The ``configs/dm_gym.py`` model name of a run's ``config.model``."""
    if not model_config.get("router", False):
        return "dt"
    if model_config.get("fixed_capacity") is not None:
        return "dm_fixed"
    return "dm" if model_config.get("aux", True) else "dm_noaux"


def read_run(workdir: str) -> dict:
    """``dataset``, ``model``, ``seed`` and the last rollout evaluation of one run."""
    path = pathlib.Path(workdir)
    config = load_run_config(workdir)
    evaluations = [
        record
        for record in map(json.loads, (path / "metrics.jsonl").read_text().splitlines())
        if "eval/return_mean" in record
    ]
    if not evaluations:
        raise ValueError(f"{workdir}: metrics.jsonl holds no rollout evaluation")
    return dict(
        workdir=workdir,
        dataset=pathlib.Path(str(config.data.path)).stem,
        model=model_name(config.model),
        seed=int(config.seed),
        record=evaluations[-1],
    )


def _spread(values: list[float], digits: int) -> str:
    return f"{np.mean(values):.{digits}f} ± {np.std(values):.{digits}f}"


def table(runs: list[dict]) -> str:
    groups = collections.defaultdict(list)
    for run in runs:
        groups[run["dataset"], run["model"]].append(run)
    order = {name: index for index, name in enumerate(MODEL_ORDER)}
    lines = []
    for dataset in sorted({key[0] for key in groups}):
        models = sorted((m for d, m in groups if d == dataset), key=lambda m: order.get(m, 99))
        normalized = any(
            "eval/normalized_mean" in r["record"] for m in models for r in groups[dataset, m]
        )
        lines += [
            f"{dataset} (mean ± std over seeds of each run's mean over episodes):",
            f"{'model':<9} {'seeds':>5} {'step':>6} {'return':>19} "
            + (f"{'normalized':>15} " if normalized else "")
            + f"{'action MSE':>17} {'MFLOPs/action':>13} selected tokens per routed layer",
        ]
        for model in models:
            group = sorted(groups[dataset, model], key=lambda r: r["seed"])
            records = [r["record"] for r in group]
            routed = sorted(k for k in records[0] if k.startswith("eval/selected_tokens_"))
            selected = " ".join(f"{np.mean([r[k] for r in records]):.1f}" for k in routed)
            lines.append(
                f"{model:<9} {len(group):>5} {records[0]['step']:>6} "
                f"{_spread([r['eval/return_mean'] for r in records], 1):>19} "
                + (
                    f"{_spread([r['eval/normalized_mean'] for r in records], 1):>15} "
                    if normalized
                    else ""
                )
                + f"{_spread([r['eval/action_mse'] for r in records], 4):>17} "
                f"{np.mean([r['eval/flops_per_action'] for r in records]) / 1e6:>13.2f} "
                f"{selected or '-'}"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdirs", nargs="+", help="configs/dm_gym.py run directories")
    args = parser.parse_args(argv)
    text = table([read_run(w) for w in args.workdirs])
    print(text)
    return text


if __name__ == "__main__":
    main()
