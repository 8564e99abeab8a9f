"""Behaviour policies and locally made D4RL-style datasets for gym locomotion.

Launch: ``python -m lhc.dm.behaviour --env Hopper-v5 --out /tmp/d4rl --sac-steps 100000
--dataset-steps 100000`` (tiny: ``--env Pendulum-v1 --sac-steps 2000 --dataset-steps 1000``).

D4RL (Fu et al., 2020) made its gym locomotion datasets from one Soft Actor-Critic run
per environment; ``make_d4rl_datasets`` repeats that recipe with gymnasium's MuJoCo
environments:

* **random**: uniformly random actions;
* **expert**: the final SAC policy;
* **medium**: a policy stopped early, at about a third of the expert's performance
  (here: the training snapshot closest to that, see ``make_d4rl_datasets``);
* **medium-replay**: the replay buffer of training up to the medium snapshot;
* **medium-expert**: medium followed by expert.

The agent is SAC as in Haarnoja et al. (2018, "Soft Actor-Critic Algorithms and
Applications", the v2 with a learned temperature): twin Q critics with Polyak-averaged
targets, a tanh-squashed Gaussian actor, the temperature ``alpha`` tuned towards the
target entropy ``-A``. The agent works in ``[-1, 1]^A``; ``scale_action`` maps to the
environment's bounds. The replay buffer keeps the agent's actions, datasets keep the
environment's (D4RL's actions are those sent to the environment; for the MuJoCo
locomotion tasks both coincide, their bounds being ``[-1, 1]``).

Bootstrapping: a transition is ``done`` only when the environment *terminated* (the
agent fell); a time-limit truncation still bootstraps from the next observation. The
datasets record the two apart, as D4RL does: ``terminals`` from ``terminated``,
``timeouts`` from ``truncated`` (the ``TimeLimit`` of 1000 steps).

Shape letters: ``B`` batch, ``S`` observation size, ``A`` action size, ``N`` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from lhc.dm.data import REF_SCORES, OfflineDataset, normalized_score, save_d4rl
from lhc.extras import require

gym = require("gymnasium", "dm")

# Bounds of the actor's log standard deviation (the SAC v2 code, rlkit / softlearning).
LOG_STD_MIN = -20.0
LOG_STD_MAX = 2.0

# The datasets make_d4rl_datasets writes, in the order it writes them.
DATASET_NAMES = ("random", "medium", "medium-replay", "expert", "medium-expert")

# A policy maps one observation ``[S]`` to one action ``[A]`` in the environment's units.
Policy = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class SACConfig:
    """SAC hyperparameters (defaults: Haarnoja et al. 2018 v2, table 1).

    Attributes:
      hidden_sizes: widths of the hidden layers of the actor and of each critic.
      actor_learning_rate, critic_learning_rate, alpha_learning_rate: Adam step sizes.
      gamma: discount.
      tau: Polyak weight of the online critic in the target update.
      initial_alpha: the temperature at the start.
      target_entropy: of the policy; None means ``-A``.
    """

    hidden_sizes: tuple[int, ...] = (256, 256)
    actor_learning_rate: float = 3e-4
    critic_learning_rate: float = 3e-4
    alpha_learning_rate: float = 3e-4
    gamma: float = 0.99
    tau: float = 0.005
    initial_alpha: float = 1.0
    target_entropy: float | None = None

    def __post_init__(self):
        if not self.hidden_sizes or any(size < 1 for size in self.hidden_sizes):
            raise ValueError(
                f"hidden_sizes: expected a non-empty tuple of positive widths, "
                f"got {self.hidden_sizes!r}"
            )
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma: expected a value in [0, 1], got {self.gamma}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"tau: expected a value in (0, 1], got {self.tau}")
        if not self.initial_alpha > 0:
            raise ValueError(f"initial_alpha: expected > 0, got {self.initial_alpha}")

    def entropy_target(self, action_dim: int) -> float:
        """The target entropy: ``target_entropy``, or ``-action_dim`` when None."""
        return -float(action_dim) if self.target_entropy is None else self.target_entropy


# ---------------------------------------------------------------------------------------
# Networks.


class MLP(nn.Module):
    """``Dense -> ReLU`` per hidden width, then a linear output layer.

    Attributes:
      hidden_sizes: hidden widths.
      output_size: width of the output.
    """

    hidden_sizes: tuple[int, ...]
    output_size: int

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Maps ``[B, D_in]`` to ``[B, output_size]``."""
        hidden = inputs
        for layer, width in enumerate(self.hidden_sizes):
            hidden = nn.relu(nn.Dense(width, name=f"hidden_{layer}")(hidden))
        return nn.Dense(self.output_size, name="output")(hidden)


class GaussianActor(nn.Module):
    """The mean and log standard deviation of the pre-tanh Gaussian.

    Attributes:
      action_dim: A.
      hidden_sizes: hidden widths.
    """

    action_dim: int
    hidden_sizes: tuple[int, ...]

    @nn.compact
    def __call__(self, observations: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Maps ``observations [B, S]`` to ``(mean [B, A], log_std [B, A])``."""
        outputs = MLP(self.hidden_sizes, 2 * self.action_dim, name="mlp")(observations)
        mean, log_std = jnp.split(outputs, 2, axis=-1)
        return mean, jnp.clip(log_std, LOG_STD_MIN, LOG_STD_MAX)


class TwinCritic(nn.Module):
    """Two independent Q networks on ``concat(observation, action)``.

    Attributes:
      hidden_sizes: hidden widths of each Q network.
    """

    hidden_sizes: tuple[int, ...]

    @nn.compact
    def __call__(self, observations: jax.Array, actions: jax.Array) -> jax.Array:
        """Maps ``observations [B, S]``, ``actions [B, A]`` to ``q_values [2, B]``."""
        inputs = jnp.concatenate([observations, actions], axis=-1)
        q_values = [MLP(self.hidden_sizes, 1, name=f"q{index}")(inputs)[:, 0] for index in (1, 2)]
        return jnp.stack(q_values)


def squashed_gaussian_sample(
    mean: jax.Array, log_std: jax.Array, noise: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """A tanh-squashed Gaussian action and its log-probability.

    ``u = mean + exp(log_std) * noise``, ``action = tanh(u)``, and
    ``log pi(action) = sum_A [log N(u; mean, std) - log(1 - tanh(u)^2)]`` (the change of
    variables of SAC's appendix C). ``log(1 - tanh(u)^2)`` is computed as
    ``2 (log 2 - u - softplus(-2 u))``, which stays finite where ``tanh(u)`` rounds to 1.

    Args:
      mean: ``[..., A]``.
      log_std: ``[..., A]``.
      noise: ``[..., A]`` standard normal draws.

    Returns:
      ``(action [..., A] in (-1, 1), log_prob [...])``.
    """
    pre_tanh = mean + jnp.exp(log_std) * noise
    gaussian_log_density = -0.5 * jnp.square(noise) - log_std - 0.5 * jnp.log(2.0 * jnp.pi)
    log_tanh_jacobian = 2.0 * (jnp.log(2.0) - pre_tanh - jax.nn.softplus(-2.0 * pre_tanh))
    log_prob = jnp.sum(gaussian_log_density - log_tanh_jacobian, axis=-1)
    return jnp.tanh(pre_tanh), log_prob


# ---------------------------------------------------------------------------------------
# Agent state and update.


def _optimizers(config: SACConfig):
    return (
        optax.adam(config.actor_learning_rate),
        optax.adam(config.critic_learning_rate),
        optax.adam(config.alpha_learning_rate),
    )


@struct.dataclass
class SACState:
    """Parameters and optimizer states of the agent (a pytree; ``config`` is static).

    Attributes:
      actor_params: of ``GaussianActor``.
      critic_params: of ``TwinCritic``.
      target_critic_params: Polyak average of ``critic_params``.
      log_alpha: ``float32[]``, log of the temperature.
      actor_opt_state, critic_opt_state, alpha_opt_state: Adam states.
      step: ``int32[]``, updates done.
      config: the hyperparameters.
      action_dim: A.
    """

    actor_params: Any
    critic_params: Any
    target_critic_params: Any
    log_alpha: jax.Array
    actor_opt_state: Any
    critic_opt_state: Any
    alpha_opt_state: Any
    step: jax.Array
    config: SACConfig = struct.field(pytree_node=False)
    action_dim: int = struct.field(pytree_node=False)

    @property
    def actor(self) -> GaussianActor:
        return GaussianActor(self.action_dim, self.config.hidden_sizes)

    @property
    def critic(self) -> TwinCritic:
        return TwinCritic(self.config.hidden_sizes)


def create_sac_state(
    config: SACConfig, observation_dim: int, action_dim: int, key: jax.Array
) -> SACState:
    """Initial parameters (flax default initialisers), targets equal to the critics.

    Args:
      config: hyperparameters.
      observation_dim: S.
      action_dim: A.
      key: PRNG key.
    """
    if observation_dim < 1 or action_dim < 1:
        raise ValueError(
            f"observation_dim and action_dim: expected >= 1, got {observation_dim} and {action_dim}"
        )
    actor_key, critic_key = jax.random.split(key)
    observations = jnp.zeros((1, observation_dim), jnp.float32)
    actions = jnp.zeros((1, action_dim), jnp.float32)
    actor_params = GaussianActor(action_dim, config.hidden_sizes).init(actor_key, observations)
    critic_params = TwinCritic(config.hidden_sizes).init(critic_key, observations, actions)
    log_alpha = jnp.asarray(np.log(config.initial_alpha), jnp.float32)
    actor_optimizer, critic_optimizer, alpha_optimizer = _optimizers(config)
    return SACState(
        actor_params=actor_params,
        critic_params=critic_params,
        target_critic_params=jax.tree.map(jnp.copy, critic_params),
        log_alpha=log_alpha,
        actor_opt_state=actor_optimizer.init(actor_params),
        critic_opt_state=critic_optimizer.init(critic_params),
        alpha_opt_state=alpha_optimizer.init(log_alpha),
        step=jnp.zeros((), jnp.int32),
        config=config,
        action_dim=action_dim,
    )


def polyak_update(target_params: Any, online_params: Any, tau: float) -> Any:
    """``tau * online + (1 - tau) * target`` for every leaf."""
    return jax.tree.map(
        lambda target, online: tau * online + (1.0 - tau) * target, target_params, online_params
    )


def critic_target(
    state: SACState,
    rewards: jax.Array,
    next_observations: jax.Array,
    dones: jax.Array,
    next_noise: jax.Array,
) -> jax.Array:
    """The soft Bellman target of both critics, without gradient.

    ``y = r + gamma (1 - done) (min_i Q_target_i(s', a') - alpha log pi(a' | s'))`` with
    ``a' = tanh(mean(s') + std(s') * next_noise)`` drawn from the current actor.

    Args:
      state: the agent (actor, target critics and alpha are read).
      rewards: ``[B]``.
      next_observations: ``[B, S]``.
      dones: ``[B]``, 1 where the episode terminated (not where it was truncated).
      next_noise: ``[B, A]`` standard normal draws.

    Returns:
      ``float32[B]``.
    """
    mean, log_std = state.actor.apply(state.actor_params, next_observations)
    next_actions, next_log_prob = squashed_gaussian_sample(mean, log_std, next_noise)
    next_q = state.critic.apply(state.target_critic_params, next_observations, next_actions)
    soft_value = jnp.min(next_q, axis=0) - jnp.exp(state.log_alpha) * next_log_prob
    target = rewards + state.config.gamma * (1.0 - dones) * soft_value
    return jax.lax.stop_gradient(target)


BATCH_KEYS = ("observations", "actions", "rewards", "next_observations", "dones")


@jax.jit
def sac_update(
    state: SACState, batch: Mapping[str, jax.Array], key: jax.Array
) -> tuple[SACState, dict[str, jax.Array]]:
    """One gradient step of the critics, the actor and the temperature, then the targets.

    The critics regress on ``critic_target``; the actor minimises
    ``E[alpha log pi(a|s) - min_i Q_i(s, a)]`` against the just-updated critics; the
    temperature minimises ``E[-log_alpha (log pi(a|s) + target_entropy)]``; the targets
    move by ``polyak_update`` with ``tau``.

    Args:
      state: the agent.
      batch: ``observations [B, S]``, ``actions [B, A]`` (in ``[-1, 1]``),
        ``rewards [B]``, ``next_observations [B, S]``, ``dones [B]`` (1 on terminated).
      key: PRNG key for the actions sampled from the actor.

    Returns:
      The new state and scalar metrics (``critic_loss``, ``actor_loss``,
      ``alpha_loss``, ``alpha``, ``entropy``, ``q_mean``).
    """
    config = state.config
    actor_optimizer, critic_optimizer, alpha_optimizer = _optimizers(config)
    observations = batch["observations"]
    batch_size = observations.shape[0]
    next_key, actor_key = jax.random.split(key)
    alpha = jnp.exp(state.log_alpha)

    next_noise = jax.random.normal(next_key, (batch_size, state.action_dim))
    targets = critic_target(
        state, batch["rewards"], batch["next_observations"], batch["dones"], next_noise
    )

    def critic_loss_fn(critic_params):
        q_values = state.critic.apply(critic_params, observations, batch["actions"])  # [2, B]
        # The sum of both critics' mean squared errors (each critic gets its own gradient).
        return jnp.sum(jnp.mean(jnp.square(q_values - targets[None]), axis=1)), q_values

    (critic_loss, q_values), critic_grads = jax.value_and_grad(critic_loss_fn, has_aux=True)(
        state.critic_params
    )
    critic_updates, critic_opt_state = critic_optimizer.update(
        critic_grads, state.critic_opt_state, state.critic_params
    )
    critic_params = optax.apply_updates(state.critic_params, critic_updates)

    noise = jax.random.normal(actor_key, (batch_size, state.action_dim))

    def actor_loss_fn(actor_params):
        mean, log_std = state.actor.apply(actor_params, observations)
        actions, log_prob = squashed_gaussian_sample(mean, log_std, noise)
        q_new = jnp.min(state.critic.apply(critic_params, observations, actions), axis=0)
        return jnp.mean(alpha * log_prob - q_new), log_prob

    (actor_loss, log_prob), actor_grads = jax.value_and_grad(actor_loss_fn, has_aux=True)(
        state.actor_params
    )
    actor_updates, actor_opt_state = actor_optimizer.update(
        actor_grads, state.actor_opt_state, state.actor_params
    )
    actor_params = optax.apply_updates(state.actor_params, actor_updates)

    entropy_gap = jax.lax.stop_gradient(log_prob + config.entropy_target(state.action_dim))

    def alpha_loss_fn(log_alpha):
        return -jnp.mean(log_alpha * entropy_gap)

    alpha_loss, alpha_grad = jax.value_and_grad(alpha_loss_fn)(state.log_alpha)
    alpha_update, alpha_opt_state = alpha_optimizer.update(
        alpha_grad, state.alpha_opt_state, state.log_alpha
    )
    log_alpha = optax.apply_updates(state.log_alpha, alpha_update)

    new_state = state.replace(
        actor_params=actor_params,
        critic_params=critic_params,
        target_critic_params=polyak_update(state.target_critic_params, critic_params, config.tau),
        log_alpha=log_alpha,
        actor_opt_state=actor_opt_state,
        critic_opt_state=critic_opt_state,
        alpha_opt_state=alpha_opt_state,
        step=state.step + 1,
    )
    metrics = {
        "critic_loss": critic_loss,
        "actor_loss": actor_loss,
        "alpha_loss": alpha_loss,
        "alpha": alpha,
        "entropy": -jnp.mean(log_prob),
        "q_mean": jnp.mean(q_values),
    }
    return new_state, metrics


# ---------------------------------------------------------------------------------------
# Replay buffer.


class ReplayBuffer:
    """A fixed-capacity circular buffer of transitions (numpy, on the host).

    Args:
      capacity: transitions kept; the oldest are overwritten first.
      observation_dim: S.
      action_dim: A.
    """

    def __init__(self, capacity: int, observation_dim: int, action_dim: int):
        if capacity < 1:
            raise ValueError(f"capacity: expected >= 1, got {capacity}")
        self.capacity = capacity
        self.observations = np.zeros((capacity, observation_dim), np.float32)
        self.actions = np.zeros((capacity, action_dim), np.float32)
        self.rewards = np.zeros(capacity, np.float32)
        self.next_observations = np.zeros((capacity, observation_dim), np.float32)
        self.dones = np.zeros(capacity, bool)  # terminated
        self.timeouts = np.zeros(capacity, bool)  # truncated and not terminated
        self._next_index = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(
        self,
        observation: np.ndarray,
        action: np.ndarray,
        reward: float,
        next_observation: np.ndarray,
        terminated: bool,
        truncated: bool,
    ) -> None:
        """Stores one transition; ``terminated`` wins where both flags are set."""
        index = self._next_index
        self.observations[index] = observation
        self.actions[index] = action
        self.rewards[index] = reward
        self.next_observations[index] = next_observation
        self.dones[index] = terminated
        self.timeouts[index] = truncated and not terminated
        self._next_index = (index + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def sample(self, rng: np.random.Generator, batch_size: int) -> dict[str, np.ndarray]:
        """``batch_size`` transitions drawn uniformly with replacement.

        Returns:
          The ``BATCH_KEYS`` arrays, ``float32`` (``dones`` as 0/1).
        """
        if self._size == 0:
            raise ValueError("sample: the buffer is empty, expected at least one transition")
        indices = rng.integers(0, self._size, size=batch_size)
        return {
            "observations": self.observations[indices],
            "actions": self.actions[indices],
            "rewards": self.rewards[indices],
            "next_observations": self.next_observations[indices],
            "dones": self.dones[indices].astype(np.float32),
        }

    def transitions(self) -> dict[str, np.ndarray]:
        """All stored transitions, oldest first (copies).

        Returns:
          ``observations [N, S]``, ``actions [N, A]``, ``rewards [N]``,
          ``next_observations [N, S]``, ``dones bool[N]``, ``timeouts bool[N]``.
        """
        if self._size < self.capacity:
            order = np.arange(self._size)
        else:
            order = (np.arange(self.capacity) + self._next_index) % self.capacity
        return {name: getattr(self, name)[order] for name in (*BATCH_KEYS[:4], "dones", "timeouts")}


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


def scale_action(action: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Maps an agent action in ``[-1, 1]^A`` to ``[low, high]`` (float32 ``[A]``)."""
    return (low + (np.asarray(action) + 1.0) * 0.5 * (high - low)).astype(np.float32)


def unscale_action(env_action: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """The inverse of ``scale_action``."""
    return (2.0 * (np.asarray(env_action) - low) / (high - low) - 1.0).astype(np.float32)


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


@functools.partial(jax.jit, static_argnames=("actor",))
def _actor_action(
    actor: GaussianActor, actor_params: Any, observation: jax.Array, noise: jax.Array
) -> jax.Array:
    """``tanh(mean + std * noise)`` for one observation ``[S]`` -> ``[A]``."""
    mean, log_std = actor.apply(actor_params, observation[None])
    return jnp.tanh(mean + jnp.exp(log_std) * noise[None])[0]


def _actor_action_dim(actor_params: Any) -> int:
    return int(actor_params["params"]["mlp"]["output"]["bias"].shape[0]) // 2


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
    action_dim = _actor_action_dim(actor_params)
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
        action = _actor_action(actor, actor_params, np.asarray(observation, np.float32), noise)
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
            action = np.asarray(_actor_action(actor, state.actor_params, observation, noise))
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
    # The step of train_sac's first update.
    first_update_step = max(start_steps, batch_size)

    checkpoints = sorted(
        {max(1, round(sac_steps * (i + 1) / num_snapshots)) for i in range(num_snapshots)}
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
    # Snapshots taken before any update hold the initial actor: not a trained policy.
    trained_steps = [step for step in checkpoints if step > first_update_step]
    candidate_steps = set(trained_steps or checkpoints[:-1]) - {sac_steps}

    def policy_of(actor_params, policy_seed):
        return sac_policy(
            actor_params, config, action_space, deterministic=deterministic, seed=policy_seed
        )

    eval_seed = seed + 1000
    random_returns = evaluate(
        env_id,
        random_policy(action_space, seed=eval_seed),
        num_episodes=eval_episodes,
        seed=eval_seed,
    )
    expert_returns = evaluate(
        env_id, policy_of(state.actor_params, eval_seed), num_episodes=eval_episodes, seed=eval_seed
    )
    snapshot_returns = {
        step: float(
            np.mean(
                evaluate(
                    env_id, policy_of(params, eval_seed), num_episodes=eval_episodes, seed=eval_seed
                )
            )
        )
        for step, params in snapshots.items()
        if step in candidate_steps
    }
    random_mean, expert_mean = float(np.mean(random_returns)), float(np.mean(expert_returns))
    medium_target = random_mean + (expert_mean - random_mean) / 3.0
    medium_step = min(
        snapshot_returns, key=lambda step: (abs(snapshot_returns[step] - medium_target), step)
    )

    datasets = {
        "random": collect(
            env_id,
            random_policy(action_space, seed=seed + 1),
            num_steps=dataset_steps,
            seed=seed + 1,
        ),
        "medium": collect(
            env_id,
            policy_of(snapshots[medium_step], seed + 2),
            num_steps=dataset_steps,
            seed=seed + 2,
        ),
        "medium-replay": buffer_dataset(buffer, medium_step, action_space),
        "expert": collect(
            env_id, policy_of(state.actor_params, seed + 3), num_steps=dataset_steps, seed=seed + 3
        ),
    }
    datasets["medium-expert"] = concatenate_datasets([datasets["medium"], datasets["expert"]])
    episode_returns = {name: complete_episode_returns(data) for name, data in datasets.items()}
    # The medium part's cut-off tail is flagged when concatenated; keep it out as before.
    episode_returns["medium-expert"] = np.concatenate(
        [episode_returns["medium"], episode_returns["expert"]]
    )

    summary: dict[str, Any] = {
        "env": env_id,
        "seed": seed,
        "sac_steps": sac_steps,
        "dataset_steps": dataset_steps,
        "config": dataclasses.asdict(config),
        "training_wall_seconds": log.wall_seconds,
        "evaluation": {
            "episodes": eval_episodes,
            "random": _return_summary(env_id, random_returns),
            "expert": _return_summary(env_id, expert_returns),
            "snapshots": {str(step): value for step, value in sorted(snapshot_returns.items())},
            "medium_target": medium_target,
            "medium_step": medium_step,
        },
        "datasets": {},
    }
    for name in DATASET_NAMES:
        path = os.path.join(os.fspath(out_dir), f"{family}-{name}.hdf5")
        save_d4rl(path, datasets[name])
        summary["datasets"][name] = {
            "file": path,
            "num_steps": len(datasets[name].rewards),
            **_return_summary(env_id, episode_returns[name]),
        }
    with open(os.path.join(os.fspath(out_dir), f"{family}-returns.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    return summary


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
    flags.add_argument("--quiet", action="store_true")
    return flags


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    summary = make_d4rl_datasets(
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
    )
    print(format_summary(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
