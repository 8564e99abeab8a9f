"""D4RL-style datasets for gym locomotion, made locally with trained SAC policies.

D4RL (Fu et al., 2020) made its gym locomotion datasets from one Soft Actor-Critic run
per environment; ``lhc.dm.datasets.make_d4rl_datasets`` repeats that recipe with
gymnasium's MuJoCo environments (the command is ``python -m lhc.dm.behaviour``):

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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from lhc.dm import resume
from lhc.dm.config import SACConfig
from lhc.dm.data import (
    OfflineDataset,
)
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

# A policy maps one observation ``[S]`` to one action ``[A]`` in the environment's units.
Policy = Callable[[np.ndarray], np.ndarray]


# ---------------------------------------------------------------------------------------
# Environments and policies.


def action_bounds(action_space: gym.Space) -> tuple[np.ndarray, np.ndarray]:
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
    low, high = action_bounds(action_space)
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
    low, high = action_bounds(action_space)
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
    low, high = action_bounds(env.action_space)
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
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 50_000,
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
      checkpoint_dir: where the run is saved (``lhc.dm.resume``) at the first episode
        end after every ``checkpoint_every`` steps and at the end; a run saved there
        with the same settings continues from it and ends as it would have
        uninterrupted (a finished one returns at once). None: nothing is saved.
      checkpoint_every: environment steps between saves.

    Returns:
      ``(state, snapshots, buffer, log)``: the final agent; ``{step: actor_params}`` for
      each checkpoint; the replay buffer (``buffer.transitions()`` in order of
      collection, agent actions in ``[-1, 1]``); the ``TrainLog``.
    """
    _check_training(steps, checkpoints, batch_size, updates_per_step)
    config = config or SACConfig()
    started = time.perf_counter()
    env = _make_env(env_id, env_kwargs)
    low, high = action_bounds(env.action_space)
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
    update_keys, next_update, first_update_step, start, seconds = None, 0, None, 1, 0.0
    settings = resume.settings(
        env_id=env_id, steps=steps, seed=seed, config=dataclasses.asdict(config),
        start_steps=start_steps, batch_size=batch_size, updates_per_step=updates_per_step,
        checkpoints=sorted(checkpoints), buffer_capacity=buffer_capacity,
        env_kwargs=dict(env_kwargs or {}),
    )  # fmt: skip
    saved = (
        resume.load(checkpoint_dir, state, buffer, settings, rng, env) if checkpoint_dir else None
    )
    if saved is not None:
        state, progress, reset = saved
        snapshots, log, start = progress.snapshots, TrainLog(**progress.log), progress.step + 1
        next_update, first_update_step = progress.next_update, progress.first_update_step
        seconds = progress.seconds
        if first_update_step is not None:
            num_updates = (steps - first_update_step + 1) * updates_per_step
            update_keys = np.asarray(jax.random.split(update_key, num_updates))
        observation = observation if reset is None else reset
        if verbose:
            print(f"resumed from {checkpoint_dir} at step {progress.step}", flush=True)

    def save(step: int, env_rng_state: dict | None) -> None:
        progress = resume.Progress(
            step=step, next_update=next_update, first_update_step=first_update_step,
            rng_state=rng.bit_generator.state, env_rng_state=env_rng_state,
            log=dataclasses.asdict(log), snapshots=snapshots, settings=settings,
            seconds=seconds + time.perf_counter() - started,
        )  # fmt: skip
        resume.save(checkpoint_dir, state, buffer, progress)

    next_save = (start // checkpoint_every + 1) * checkpoint_every
    for step in range(start, steps + 1):
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
            save_now = checkpoint_dir and step >= next_save and step < steps
            env_rng_state = env.unwrapped.np_random.bit_generator.state if save_now else None
            observation, _ = env.reset()
            observation = np.asarray(observation, np.float32).reshape(-1)
        else:
            save_now = False

        if step >= start_steps and len(buffer) >= batch_size and updates_per_step > 0:
            if update_keys is None:
                # Drawn once: per-step jax.random.split calls would cost more than the host.
                first_update_step = step
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
        if save_now:
            save(step, env_rng_state)
            next_save = (step // checkpoint_every + 1) * checkpoint_every
    log.wall_seconds = seconds + time.perf_counter() - started
    if checkpoint_dir and start <= steps:
        save(steps, None)
    env.close()
    return state, snapshots, buffer, log
