"""D4RL-style datasets for gym locomotion, made locally with trained SAC policies.

D4RL (Fu et al., 2020) made its gym locomotion datasets from one Soft Actor-Critic run
per environment; ``make_d4rl_datasets`` repeats that recipe with gymnasium's MuJoCo
environments (the command is ``python -m lhc.dm.behaviour``):

* **random**: uniformly random actions;
* **expert**: the final SAC policy;
* **medium**: a policy stopped early, at about a third of the expert's performance
  (here: the training snapshot closest to that, see ``make_d4rl_datasets``);
* **medium-replay**: the replay buffer of training up to the medium snapshot;
* **medium-expert**: medium followed by expert.

The agent (``lhc.dm.sac``) works in ``[-1, 1]^A``; ``train_sac`` trains it online in an
environment. The replay buffer keeps the agent's actions, datasets keep the
environment's (D4RL's actions are those sent to the environment; for the MuJoCo
locomotion tasks both coincide, their bounds being ``[-1, 1]``).

Bootstrapping: a transition is ``done`` only when the environment *terminated* (the
agent fell); a time-limit truncation still bootstraps from the next observation. The
datasets record the two apart, as D4RL does: ``terminals`` from ``terminated``,
``timeouts`` from ``truncated`` (the ``TimeLimit`` of 1000 steps).

Shape letters: ``S`` observation size, ``A`` action size, ``N`` steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from lhc.dm.config import SACConfig
from lhc.dm.data import REF_SCORES, OfflineDataset, normalized_score, save_d4rl
from lhc.dm.sac import (
    GaussianActor,
    ReplayBuffer,
    SACState,
    actor_action,
    actor_action_dim,
    create_sac_state,
    sac_update,
    scale_action,
)
from lhc.extras import require

gym = require("gymnasium", "dm")

# The datasets make_d4rl_datasets writes, in the order it writes them.
DATASET_NAMES = ("random", "medium", "medium-replay", "expert", "medium-expert")

# A policy maps one observation ``[S]`` to one action ``[A]`` in the environment's units.
Policy = Callable[[np.ndarray], np.ndarray]


# ---------------------------------------------------------------------------------------
# Environments and policies.


def _action_bounds(action_space: gym.Space) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(action_space, gym.spaces.Box) or len(action_space.shape) != 1:
        raise ValueError(f"action space: expected a 1-D gymnasium Box, got {action_space}")
    low = np.asarray(action_space.low, np.float64)
    high = np.asarray(action_space.high, np.float64)
    if not (np.isfinite(low).all() and np.isfinite(high).all()):
        raise ValueError(f"action space: expected finite bounds, got {action_space}")
    return low, high


def _make_env(env_id: str, env_kwargs: Mapping[str, Any] | None) -> gym.Env:
    return gym.make(env_id, **dict(env_kwargs or {}))


def random_policy(env: gym.Env | gym.spaces.Box | str, *, seed: int = 0) -> Policy:
    """Uniformly random actions within the environment's bounds.

    Args:
      env: a gymnasium environment, its action space, or an environment id.
      seed: of the policy's own numpy generator.
    """
    if isinstance(env, str):
        env = gym.make(env)
    action_space = env if isinstance(env, gym.spaces.Space) else env.action_space
    low, high = _action_bounds(action_space)
    rng = np.random.default_rng(seed)

    def policy(observation: np.ndarray) -> np.ndarray:
        del observation
        return rng.uniform(low, high).astype(np.float32)

    return policy


def sac_policy(
    actor_params: Any,
    config: SACConfig,
    action_space: gym.spaces.Box,
    *,
    deterministic: bool = False,
    seed: int = 0,
) -> Policy:
    """The SAC actor as a policy in the environment's units.

    Args:
      actor_params: of ``GaussianActor`` (e.g. ``state.actor_params`` or a snapshot).
      config: the agent's hyperparameters (for the network sizes).
      action_space: the environment's, to scale ``[-1, 1]`` to its bounds.
      deterministic: True for ``tanh(mean)``; False to sample the squashed Gaussian.
      seed: of the numpy generator that draws the sampling noise.
    """
    low, high = _action_bounds(action_space)
    action_dim = actor_action_dim(actor_params)
    if action_dim != len(low):
        raise ValueError(
            f"actor_params: expected an actor with {len(low)} actions (the action space), "
            f"got one with {action_dim}"
        )
    actor = GaussianActor(action_dim, config.hidden_sizes)
    rng = np.random.default_rng(seed)

    def policy(observation: np.ndarray) -> np.ndarray:
        noise = np.zeros(action_dim, np.float32)
        if not deterministic:
            noise = rng.standard_normal(action_dim).astype(np.float32)
        action = actor_action(actor, actor_params, np.asarray(observation, np.float32), noise)
        return scale_action(np.asarray(action), low, high)

    return policy


# ---------------------------------------------------------------------------------------
# Data collection.


def collect(
    env_id: str,
    policy: Policy,
    *,
    num_steps: int | None = None,
    num_episodes: int | None = None,
    seed: int = 0,
    noise: float = 0.0,
    env_kwargs: Mapping[str, Any] | None = None,
) -> OfflineDataset:
    """Rolls out ``policy`` and logs the steps in the D4RL layout.

    The environment is reset with ``seed`` once, then without a seed after each episode
    (so the run is reproducible). ``terminals`` is set at a step where the environment
    terminated, ``timeouts`` where it was truncated (its ``TimeLimit``) without
    terminating. With ``num_steps``, collection stops after that many steps, and an
    episode cut off there ends without a flag (``OfflineDataset`` counts it as one more
    episode).

    Args:
      env_id: a gymnasium id, e.g. ``"Hopper-v5"``.
      policy: observation ``[S]`` -> action ``[A]`` in the environment's units.
      num_steps: steps to log; give this or ``num_episodes``.
      num_episodes: whole episodes to log.
      seed: of the environment and of the action noise.
      noise: standard deviation of Gaussian noise added to each action, in units of
        half the action range, before clipping to the bounds (0: none).
      env_kwargs: passed to ``gym.make`` (e.g. ``max_episode_steps``).

    Returns:
      The validated dataset; ``actions`` are those sent to the environment.
    """
    if (num_steps is None) == (num_episodes is None):
        raise ValueError(
            f"collect: expected exactly one of num_steps and num_episodes, got "
            f"num_steps={num_steps}, num_episodes={num_episodes}"
        )
    if (num_steps if num_steps is not None else num_episodes) < 1:
        raise ValueError(
            f"collect: expected num_steps or num_episodes >= 1, got num_steps={num_steps}, "
            f"num_episodes={num_episodes}"
        )
    if noise < 0:
        raise ValueError(f"noise: expected >= 0, got {noise}")
    env = _make_env(env_id, env_kwargs)
    low, high = _action_bounds(env.action_space)
    noise_rng = np.random.default_rng(seed)
    observations, actions, rewards, terminals, timeouts = [], [], [], [], []
    observation, _ = env.reset(seed=seed)
    episodes_done = 0
    while True:
        action = np.asarray(policy(observation), np.float64)
        if action.shape != low.shape:
            raise ValueError(f"policy: expected an action of shape {low.shape}, got {action.shape}")
        if noise > 0:
            action = action + noise * 0.5 * (high - low) * noise_rng.standard_normal(len(low))
        action = np.clip(action, low, high).astype(np.float32)
        next_observation, reward, terminated, truncated, _ = env.step(action)
        observations.append(np.asarray(observation, np.float32))
        actions.append(action)
        rewards.append(reward)
        terminals.append(bool(terminated))
        timeouts.append(bool(truncated) and not terminated)
        observation = next_observation
        if terminated or truncated:
            episodes_done += 1
            if num_episodes is not None and episodes_done == num_episodes:
                break
            observation, _ = env.reset()
        if num_steps is not None and len(rewards) == num_steps:
            break
    env.close()
    dataset = OfflineDataset(
        observations=np.stack(observations).astype(np.float32),
        actions=np.stack(actions).astype(np.float32),
        rewards=np.asarray(rewards, np.float32),
        terminals=np.asarray(terminals, bool),
        timeouts=np.asarray(timeouts, bool),
    )
    dataset.validate()
    return dataset


def complete_episode_returns(dataset: OfflineDataset) -> np.ndarray:
    """Returns of the episodes that ended by a terminal or a timeout flag (``float64``);
    a trailing episode cut off by the end of the data is left out."""
    rewards = np.asarray(dataset.rewards, np.float64)
    flags = dataset.terminals | dataset.timeouts
    return np.array(
        [rewards[start:end].sum() for start, end in dataset.episode_bounds() if flags[end - 1]]
    )


def evaluate(
    env_id: str,
    policy: Policy,
    *,
    num_episodes: int,
    seed: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """Undiscounted returns of ``num_episodes`` whole episodes, ``float64[num_episodes]``."""
    dataset = collect(env_id, policy, num_episodes=num_episodes, seed=seed, env_kwargs=env_kwargs)
    return dataset.returns()


# ---------------------------------------------------------------------------------------
# Training.


@dataclasses.dataclass
class TrainLog:
    """What ``train_sac`` saw.

    Attributes:
      episode_end_steps: the environment step (1-based) at which each episode ended.
      episode_returns: undiscounted return of each episode.
      episode_lengths: steps of each episode.
      metrics: ``(step, {name: value})`` every ``log_every`` environment steps once
        updates have started.
      wall_seconds: duration of the run.
    """

    episode_end_steps: list[int] = dataclasses.field(default_factory=list)
    episode_returns: list[float] = dataclasses.field(default_factory=list)
    episode_lengths: list[int] = dataclasses.field(default_factory=list)
    metrics: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
    wall_seconds: float = 0.0


def _check_training(
    steps: int, checkpoints: Sequence[int], batch_size: int, updates_per_step: int
) -> None:
    """Raises ValueError for ``train_sac`` arguments out of range."""
    if steps < 1:
        raise ValueError(f"steps: expected >= 1, got {steps}")
    bad_checkpoints = [step for step in checkpoints if not 1 <= step <= steps]
    if bad_checkpoints:
        raise ValueError(f"checkpoints: expected steps in [1, {steps}], got {bad_checkpoints}")
    if batch_size < 1 or updates_per_step < 0:
        raise ValueError(
            f"batch_size >= 1 and updates_per_step >= 0 expected, got {batch_size} and "
            f"{updates_per_step}"
        )


def train_sac(
    env_id: str,
    steps: int,
    *,
    seed: int = 0,
    config: SACConfig | None = None,
    start_steps: int = 5000,
    batch_size: int = 256,
    updates_per_step: int = 1,
    checkpoints: Sequence[int] = (),
    buffer_capacity: int | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    log_every: int = 1000,
    verbose: bool = False,
) -> tuple[SACState, dict[int, Any], ReplayBuffer, TrainLog]:
    """Trains SAC online: one environment step, then ``updates_per_step`` updates.

    The first ``start_steps`` actions are uniform in ``[-1, 1]^A`` (then scaled to the
    bounds) and no update is made before step ``start_steps`` nor before the buffer
    holds ``batch_size`` transitions; afterwards actions are sampled from the actor.
    Transitions are stored with ``done = terminated``: a truncated episode (its time
    limit) bootstraps from its last next observation.

    Args:
      env_id: a gymnasium id with a 1-D Box action space.
      steps: environment steps.
      seed: of the environment, the network initialisation and all sampling.
      config: hyperparameters (default ``SACConfig()``).
      start_steps: leading steps with random actions.
      batch_size: transitions per update.
      updates_per_step: gradient updates after each environment step.
      checkpoints: environment steps (1..steps) after which to snapshot the actor.
      buffer_capacity: of the replay buffer; None keeps every step (``steps``).
      env_kwargs: passed to ``gym.make``.
      log_every: environment steps between recorded update metrics.
      verbose: print a line per ``log_every`` steps.

    Returns:
      ``(state, snapshots, buffer, log)``: the final agent; ``{step: actor_params}`` for
      each checkpoint; the replay buffer (``buffer.transitions()`` in order of
      collection, agent actions in ``[-1, 1]``); the ``TrainLog``.
    """
    _check_training(steps, checkpoints, batch_size, updates_per_step)
    config = config or SACConfig()
    started = time.perf_counter()
    env = _make_env(env_id, env_kwargs)
    low, high = _action_bounds(env.action_space)
    observation_dim = int(np.prod(env.observation_space.shape))
    action_dim = len(low)

    key = jax.random.PRNGKey(seed)
    init_key, update_key = jax.random.split(key)
    state = create_sac_state(config, observation_dim, action_dim, init_key)
    actor = state.actor
    buffer = ReplayBuffer(buffer_capacity or steps, observation_dim, action_dim)
    rng = np.random.default_rng(seed)
    log = TrainLog()
    snapshots: dict[int, Any] = {}
    checkpoint_steps = set(checkpoints)

    observation, _ = env.reset(seed=seed)
    observation = np.asarray(observation, np.float32).reshape(-1)
    episode_return, episode_length = 0.0, 0
    update_keys = None
    for step in range(1, steps + 1):
        if step <= start_steps:
            action = rng.uniform(-1.0, 1.0, action_dim).astype(np.float32)
        else:
            noise = rng.standard_normal(action_dim).astype(np.float32)
            action = np.asarray(actor_action(actor, state.actor_params, observation, noise))
        next_observation, reward, terminated, truncated, _ = env.step(
            scale_action(action, low, high)
        )
        next_observation = np.asarray(next_observation, np.float32).reshape(-1)
        buffer.add(observation, action, reward, next_observation, terminated, truncated)
        episode_return += float(reward)
        episode_length += 1
        observation = next_observation
        if terminated or truncated:
            log.episode_end_steps.append(step)
            log.episode_returns.append(episode_return)
            log.episode_lengths.append(episode_length)
            episode_return, episode_length = 0.0, 0
            observation, _ = env.reset()
            observation = np.asarray(observation, np.float32).reshape(-1)

        if step >= start_steps and len(buffer) >= batch_size and updates_per_step > 0:
            if update_keys is None:
                # Drawn once: per-step jax.random.split calls would cost more than the host.
                num_updates = (steps - step + 1) * updates_per_step
                update_keys = np.asarray(jax.random.split(update_key, num_updates))
                next_update = 0
            for _ in range(updates_per_step):
                batch = buffer.sample(rng, batch_size)
                state, metrics = sac_update(state, batch, update_keys[next_update])
                next_update += 1
            if step % log_every == 0:
                values = {name: float(value) for name, value in metrics.items()}
                log.metrics.append((step, values))
                if verbose:
                    recent = log.episode_returns[-10:]
                    print(
                        f"step {step}: return(last 10) "
                        f"{np.mean(recent) if recent else float('nan'):.1f} "
                        + " ".join(f"{name} {value:.3g}" for name, value in values.items()),
                        flush=True,
                    )
        if step in checkpoint_steps:
            snapshots[step] = jax.tree.map(np.asarray, state.actor_params)
    env.close()
    log.wall_seconds = time.perf_counter() - started
    return state, snapshots, buffer, log


# ---------------------------------------------------------------------------------------
# D4RL-style datasets.


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
    low, high = _action_bounds(action_space)
    dataset = OfflineDataset(
        observations=transitions["observations"][:num_steps],
        actions=scale_action(transitions["actions"][:num_steps], low, high),
        rewards=transitions["rewards"][:num_steps],
        terminals=transitions["dones"][:num_steps],
        timeouts=transitions["timeouts"][:num_steps],
    )
    dataset.validate()
    return dataset


def concatenate_datasets(datasets: Sequence[OfflineDataset]) -> OfflineDataset:
    """Datasets back to back. A part whose last step has no flag (an episode cut off by
    the end of its data) gets a timeout there, so it does not merge with the next part's
    first episode."""
    if not datasets:
        raise ValueError("datasets: expected at least one OfflineDataset, got none")
    parts = []
    for index, dataset in enumerate(datasets):
        dataset.validate()
        timeouts = dataset.timeouts.copy()
        if index < len(datasets) - 1 and not (dataset.terminals[-1] or timeouts[-1]):
            timeouts[-1] = True
        parts.append(dataclasses.replace(dataset, timeouts=timeouts))
    merged = OfflineDataset(
        **{
            field.name: np.concatenate([getattr(part, field.name) for part in parts])
            for field in dataclasses.fields(OfflineDataset)
        }
    )
    merged.validate()
    return merged


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
