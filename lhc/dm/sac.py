"""Soft Actor-Critic: the networks, losses and update, and a replay buffer.

The agent is SAC as in Haarnoja et al. (2018, "Soft Actor-Critic Algorithms and
Applications", the v2 with a learned temperature): twin Q critics with Polyak-averaged
targets, a tanh-squashed Gaussian actor, the temperature ``alpha`` tuned towards the
target entropy ``-A``. The agent works in ``[-1, 1]^A``; ``scale_action`` maps to the
environment's bounds. Training it in an environment is ``lhc.dm.recipe.train_sac``;
the datasets made with it are in ``lhc.dm.datasets``.

Bootstrapping: a transition is ``done`` only when the environment *terminated* (the
agent fell); a time-limit truncation still bootstraps from the next observation, and the
replay buffer records it apart (``timeouts``).

Shape letters: ``B`` batch, ``S`` observation size, ``A`` action size, ``N`` steps.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from lhc.dm.config import SACConfig
from lhc.nn.linear import dense

# Bounds of the actor's log standard deviation (the SAC v2 code, rlkit / softlearning).
LOG_STD_MIN = -20.0
LOG_STD_MAX = 2.0


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
            in_axis = "embed" if layer else None
            hidden = nn.relu(dense(width, (in_axis, "mlp"), f"hidden_{layer}")(hidden))
        return dense(self.output_size, ("mlp", None), "output")(hidden)


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
    # Unboxed: the agent trains on one device (the axis names serve a sharded caller).
    actor = GaussianActor(action_dim, config.hidden_sizes)
    actor_params = nn.meta.unbox(actor.init(actor_key, observations))
    critic_params = nn.meta.unbox(
        TwinCritic(config.hidden_sizes).init(critic_key, observations, actions)
    )
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


_STORED = ("observations", "actions", "rewards", "next_observations", "dones", "timeouts")


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

    def state_dict(self) -> dict[str, np.ndarray]:
        """The filled rows as stored (not reordered) and ``next_index``: what
        ``load_state_dict`` needs to continue exactly where this buffer is."""
        rows = {name: getattr(self, name)[: self._size] for name in _STORED}
        return {**rows, "next_index": np.asarray(self._next_index)}

    def load_state_dict(self, saved: dict[str, np.ndarray]) -> None:
        """Restores a ``state_dict`` of a buffer with this capacity and sizes."""
        size = len(saved["rewards"])
        if size > self.capacity:
            raise ValueError(f"load_state_dict: expected at most {self.capacity} rows, got {size}")
        for name in _STORED:
            getattr(self, name)[:size] = saved[name]
        self._size, self._next_index = size, int(saved["next_index"])

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
# Actions.


def scale_action(action: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Maps an agent action in ``[-1, 1]^A`` to ``[low, high]`` (float32 ``[A]``)."""
    return (low + (np.asarray(action) + 1.0) * 0.5 * (high - low)).astype(np.float32)


def unscale_action(env_action: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """The inverse of ``scale_action``."""
    return (2.0 * (np.asarray(env_action) - low) / (high - low) - 1.0).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("actor",))
def actor_action(
    actor: GaussianActor, actor_params: Any, observation: jax.Array, noise: jax.Array
) -> jax.Array:
    """``tanh(mean + std * noise)`` for one observation ``[S]`` -> ``[A]``."""
    mean, log_std = actor.apply(actor_params, observation[None])
    return jnp.tanh(mean + jnp.exp(log_std) * noise[None])[0]


def actor_action_dim(actor_params: Any) -> int:
    """A, read from the parameters of a ``GaussianActor``."""
    return int(actor_params["params"]["mlp"]["output"]["bias"].shape[0]) // 2
