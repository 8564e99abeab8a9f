"""Behaviour policies and locally made D4RL-style datasets for gym locomotion.

Launch: ``python -m lhc.dm.behaviour --env Hopper-v5 --out /tmp/d4rl --sac-steps 100000
--dataset-steps 100000`` (tiny: ``--env Pendulum-v1 --sac-steps 2000 --dataset-steps 1000``).

The command trains SAC once (``lhc.dm.sac``) and writes the random, medium,
medium-replay, expert and medium-expert datasets of D4RL's recipe with
``lhc.dm.datasets.make_d4rl_datasets``, then prints their sizes and returns.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from lhc.dm import datasets


def format_summary(summary: Mapping[str, Any]) -> str:
    """A table of dataset sizes and returns."""
    lines = [
        f"{'dataset':<15} {'steps':>8} {'episodes':>8} {'return mean':>12} {'std':>9} "
        f"{'normalized':>10}"
    ]
    for name, info in summary["datasets"].items():
        normalized = info.get("normalized_mean")
        lines.append(
            f"{name:<15} {info['num_steps']:>8} {info['num_episodes']:>8} "
            f"{info['return_mean']:>12.1f} {info['return_std']:>9.1f} "
            + (f"{normalized:>10.1f}" if normalized is not None else f"{'-':>10}")
        )
    evaluation = summary["evaluation"]
    lines.append(
        f"medium snapshot: step {evaluation['medium_step']} (target return "
        f"{evaluation['medium_target']:.1f}); expert eval return "
        f"{evaluation['expert']['return_mean']:.1f}"
    )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_argument("--env", required=True, help="gymnasium id, e.g. Hopper-v5")
    flags.add_argument("--out", required=True, help="output directory")
    flags.add_argument("--sac-steps", type=int, required=True)
    flags.add_argument("--dataset-steps", type=int, required=True)
    flags.add_argument("--seed", type=int, default=0)
    flags.add_argument("--start-steps", type=int, default=5000)
    flags.add_argument("--num-snapshots", type=int, default=20)
    flags.add_argument("--eval-episodes", type=int, default=5)
    flags.add_argument("--deterministic", action="store_true", help="collect with tanh(mean)")
    flags.add_argument(
        "--save-every",
        type=int,
        default=50_000,
        help="SAC steps between saves of the training (OUT/<env>-sac; a rerun continues "
        "from it); 0: not saved",
    )
    flags.add_argument("--quiet", action="store_true")
    return flags


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    summary = datasets.make_d4rl_datasets(
        args.env,
        args.out,
        sac_steps=args.sac_steps,
        dataset_steps=args.dataset_steps,
        seed=args.seed,
        start_steps=args.start_steps,
        num_snapshots=args.num_snapshots,
        eval_episodes=args.eval_episodes,
        deterministic=args.deterministic,
        verbose=not args.quiet,
        save_every=args.save_every,
    )
    print(format_summary(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
