"""D4RL's gym locomotion datasets made locally: one SAC run per environment
(``lhc.dm.recipe.train_sac``), then random, medium, medium-replay, expert and
medium-expert datasets in D4RL's layout (``make_d4rl_datasets``; the command is
``python -m lhc.dm.behaviour``). ``lhc.dm.recipe``'s docstring says what each dataset
is and how bootstrapping and the episode flags are recorded."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lhc.dm.config import SACConfig
from lhc.dm.data import (
    REF_SCORES,
    OfflineDataset,
    complete_episode_returns,
    concatenate_datasets,
    normalized_score,
    save_d4rl,
)
from lhc.dm.recipe import (
    Policy,
    action_bounds,
    collect,
    evaluate,
    gym,
    random_policy,
    sac_policy,
    train_sac,
)
from lhc.dm.sac import ReplayBuffer, scale_action

# The datasets make_d4rl_datasets writes, in the order it writes them.
DATASET_NAMES = ("random", "medium", "medium-replay", "expert", "medium-expert")


def buffer_dataset(
    buffer: ReplayBuffer, num_steps: int, action_space: gym.spaces.Box
) -> OfflineDataset:
    """The first ``num_steps`` transitions of ``buffer`` (in order) in the D4RL layout,
    with actions scaled to the environment's bounds."""
    transitions = buffer.transitions()
    if not 1 <= num_steps <= len(transitions["rewards"]):
        raise ValueError(
            f"num_steps: expected 1..{len(transitions['rewards'])} (the buffer's size), "
            f"got {num_steps}"
        )
    low, high = action_bounds(action_space)
    dataset = OfflineDataset(
        observations=transitions["observations"][:num_steps],
        actions=scale_action(transitions["actions"][:num_steps], low, high),
        rewards=transitions["rewards"][:num_steps],
        terminals=transitions["dones"][:num_steps],
        timeouts=transitions["timeouts"][:num_steps],
    )
    dataset.validate()
    return dataset


def _return_summary(env_id: str, returns: np.ndarray) -> dict[str, float]:
    summary = {
        "num_episodes": len(returns),
        "return_mean": float(np.mean(returns)) if len(returns) else float("nan"),
        "return_std": float(np.std(returns)) if len(returns) else float("nan"),
    }
    if env_id.split("-")[0].lower() in REF_SCORES and len(returns):
        scores = normalized_score(env_id, returns)
        summary["normalized_mean"] = float(np.mean(scores))
        summary["normalized_std"] = float(np.std(scores))
    return summary


def make_d4rl_datasets(
    env_id: str,
    out_dir: str | os.PathLike,
    *,
    sac_steps: int,
    dataset_steps: int,
    seed: int = 0,
    config: SACConfig | None = None,
    start_steps: int = 5000,
    batch_size: int = 256,
    num_snapshots: int = 20,
    eval_episodes: int = 5,
    deterministic: bool = False,
    verbose: bool = False,
    save_every: int = 50_000,
) -> dict[str, Any]:
    """Trains SAC once and writes the five D4RL datasets of ``env_id``.

    Files: ``{out_dir}/{env}-{name}.hdf5`` for each of ``DATASET_NAMES`` (``env`` is the
    lower-cased family, e.g. ``hopper-medium.hdf5``) and ``{env}-returns.json``.

    The rule for **medium**: the actor is snapshotted every ``sac_steps / num_snapshots``
    steps. The random policy, the final policy and the candidate snapshots (those before
    the last and after the first update; all before the last if there is no such one)
    are evaluated, ``eval_episodes`` episodes each of the same policy that collects the
    data. The chosen snapshot is the one whose mean return is closest to
    ``R_random + (R_expert - R_random) / 3``, ties to the earlier one: a third of the
    way from the random policy's return to the expert's. With D4RL's reference random
    return that is a third of the expert's normalised score (for hopper, about a third
    of its return); it stays meaningful where returns are negative (Pendulum). D4RL's
    medium policy was SAC stopped early at about a third of the expert's performance.

    **medium-replay** is the replay buffer's transitions up to the medium snapshot's
    step; **medium-expert** is medium then expert (``concatenate_datasets``). Medium and
    expert data are collected with actions sampled from the stochastic SAC actor
    (``deterministic=True``: ``tanh(mean)``).

    Args:
      env_id: a gymnasium id, e.g. ``"Hopper-v5"``.
      out_dir: created if missing.
      sac_steps: environment steps of SAC training.
      dataset_steps: steps of each collected dataset (random, medium, expert).
      seed: of training; collection uses ``seed + 1``, ``+ 2``, ... per dataset.
      config: SAC hyperparameters.
      start_steps: random-action steps at the start of training.
      batch_size: transitions per SAC update.
      num_snapshots: evenly spaced actor snapshots (the last is the final policy).
      eval_episodes: episodes per policy evaluation.
      deterministic: collect medium and expert with ``tanh(mean)`` actions instead.
      verbose: print training progress.
      save_every: SAC training is saved in ``{out_dir}/{env}-sac`` after about every
        this many steps (``train_sac``'s ``checkpoint_every``) and continued from
        there when run again with the same settings; 0: not saved.

    Returns:
      The summary also written to the JSON file: per dataset its file, size and return
      statistics (of episodes that ended by a flag), and the policy evaluations.
    """
    if sac_steps < 2 or num_snapshots < 2:
        raise ValueError(
            f"sac_steps and num_snapshots: expected >= 2 each, got {sac_steps} and {num_snapshots}"
        )
    if dataset_steps < 1:
        raise ValueError(f"dataset_steps: expected >= 1, got {dataset_steps}")
    config = config or SACConfig()
    family = env_id.split("-")[0].lower()
    os.makedirs(out_dir, exist_ok=True)
    checkpoints, candidate_steps = _snapshot_steps(
        sac_steps, num_snapshots, first_update_step=max(start_steps, batch_size)
    )
    state, snapshots, buffer, log = train_sac(
        env_id,
        sac_steps,
        seed=seed,
        config=config,
        start_steps=start_steps,
        batch_size=batch_size,
        checkpoints=checkpoints,
        verbose=verbose,
        checkpoint_dir=os.path.join(os.fspath(out_dir), f"{family}-sac") if save_every else None,
        checkpoint_every=save_every or 1,
    )
    action_space = gym.make(env_id).action_space

    def policy_of(actor_params, policy_seed):
        return sac_policy(
            actor_params, config, action_space, deterministic=deterministic, seed=policy_seed
        )

    evaluation = _evaluate_policies(
        env_id,
        action_space,
        policy_of,
        state.actor_params,
        {step: params for step, params in snapshots.items() if step in candidate_steps},
        eval_episodes=eval_episodes,
        eval_seed=seed + 1000,
    )
    medium_step = evaluation["medium_step"]
    datasets = _collect_datasets(
        env_id,
        random_policy(action_space, seed=seed + 1),
        policy_of(snapshots[medium_step], seed + 2),
        policy_of(state.actor_params, seed + 3),
        buffer_dataset(buffer, medium_step, action_space),
        dataset_steps=dataset_steps,
        seed=seed,
    )
    summary: dict[str, Any] = {
        "env": env_id,
        "seed": seed,
        "sac_steps": sac_steps,
        "dataset_steps": dataset_steps,
        "config": dataclasses.asdict(config),
        "training_wall_seconds": log.wall_seconds,
        "evaluation": evaluation,
        "datasets": _save_datasets(env_id, out_dir, datasets),
    }
    with open(os.path.join(os.fspath(out_dir), f"{family}-returns.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    return summary


def _snapshot_steps(
    sac_steps: int, num_snapshots: int, *, first_update_step: int
) -> tuple[list[int], set[int]]:
    """The steps at which ``make_d4rl_datasets`` snapshots the actor, and those of the
    snapshots that may become medium (after the first update, ``first_update_step``,
    and before the last step)."""
    checkpoints = sorted(
        {max(1, round(sac_steps * (i + 1) / num_snapshots)) for i in range(num_snapshots)}
    )
    # Snapshots taken before any update hold the initial actor: not a trained policy.
    trained_steps = [step for step in checkpoints if step > first_update_step]
    return checkpoints, set(trained_steps or checkpoints[:-1]) - {sac_steps}


def _collect_datasets(
    env_id: str,
    random: Policy,
    medium: Policy,
    expert: Policy,
    medium_replay: OfflineDataset,
    *,
    dataset_steps: int,
    seed: int,
) -> dict[str, OfflineDataset]:
    """The five datasets: random, medium and expert collected with the seeds ``seed + 1``,
    ``+ 2`` and ``+ 3`` (those of their policies), medium-expert their concatenation."""
    datasets = {
        "random": collect(env_id, random, num_steps=dataset_steps, seed=seed + 1),
        "medium": collect(env_id, medium, num_steps=dataset_steps, seed=seed + 2),
        "medium-replay": medium_replay,
        "expert": collect(env_id, expert, num_steps=dataset_steps, seed=seed + 3),
    }
    datasets["medium-expert"] = concatenate_datasets([datasets["medium"], datasets["expert"]])
    return datasets


def _evaluate_policies(
    env_id: str,
    action_space: gym.spaces.Box,
    policy_of: Callable[[Any, int], Policy],
    expert_params: Any,
    candidates: Mapping[int, Any],
    *,
    eval_episodes: int,
    eval_seed: int,
) -> dict[str, Any]:
    """Evaluates the random policy, the expert and the ``{step: actor_params}``
    candidates, and chooses the medium snapshot (the rule of ``make_d4rl_datasets``).

    Returns:
      The summary's ``evaluation``: return statistics of random and expert, each
      candidate's mean return, ``medium_target`` and ``medium_step``.
    """
    random_returns = evaluate(
        env_id,
        random_policy(action_space, seed=eval_seed),
        num_episodes=eval_episodes,
        seed=eval_seed,
    )
    expert_returns = evaluate(
        env_id, policy_of(expert_params, eval_seed), num_episodes=eval_episodes, seed=eval_seed
    )
    snapshot_returns = {
        step: float(
            np.mean(
                evaluate(
                    env_id, policy_of(params, eval_seed), num_episodes=eval_episodes, seed=eval_seed
                )
            )
        )
        for step, params in candidates.items()
    }
    random_mean, expert_mean = float(np.mean(random_returns)), float(np.mean(expert_returns))
    medium_target = random_mean + (expert_mean - random_mean) / 3.0
    medium_step = min(
        snapshot_returns, key=lambda step: (abs(snapshot_returns[step] - medium_target), step)
    )
    return {
        "episodes": eval_episodes,
        "random": _return_summary(env_id, random_returns),
        "expert": _return_summary(env_id, expert_returns),
        "snapshots": {str(step): value for step, value in sorted(snapshot_returns.items())},
        "medium_target": medium_target,
        "medium_step": medium_step,
    }


def _save_datasets(
    env_id: str, out_dir: str | os.PathLike, datasets: Mapping[str, OfflineDataset]
) -> dict[str, Any]:
    """Writes ``{out_dir}/{env}-{name}.hdf5`` for each of ``DATASET_NAMES``.

    Returns:
      The summary's ``datasets``: per name its file, size and return statistics (of the
      episodes that ended by a flag).
    """
    family = env_id.split("-")[0].lower()
    episode_returns = {name: complete_episode_returns(data) for name, data in datasets.items()}
    # The medium part's cut-off tail is flagged when concatenated; keep it out as before.
    episode_returns["medium-expert"] = np.concatenate(
        [episode_returns["medium"], episode_returns["expert"]]
    )
    saved = {}
    for name in DATASET_NAMES:
        path = os.path.join(os.fspath(out_dir), f"{family}-{name}.hdf5")
        save_d4rl(path, datasets[name])
        saved[name] = {
            "file": path,
            "num_steps": len(datasets[name].rewards),
            **_return_summary(env_id, episode_returns[name]),
        }
    return saved
