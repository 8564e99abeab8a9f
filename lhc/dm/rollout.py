"""Conditioned rollouts of a Decision Transformer or Decision Mixer in a gymnasium env.

At every step the model sees the last ``K`` steps (left-padded as in training) of
normalised states, actions, returns-to-go and timesteps, and its action at the newest
state token is taken. The return-to-go starts at ``target_return`` and after each
reward becomes ``rtg - reward`` (both divided by ``rtg_scale`` for the model), as in
the official DT evaluation. The action of the newest step is not yet known when the
model reads it: it is 0 and, having no influence on the newest state token (causal
attention), does not matter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lhc.extras import require

gym = require("gymnasium", "dm")


@dataclasses.dataclass
class History:
    """One episode so far: raw states ``[t+1, S]``, actions ``[t, A]``, the
    returns-to-go fed at each step ``[t+1]`` (unscaled)."""

    states: list[np.ndarray]
    actions: list[np.ndarray]
    returns_to_go: list[float]

    @classmethod
    def start(cls, state: np.ndarray, target_return: float) -> History:
        return cls([np.asarray(state, np.float32)], [], [float(target_return)])

    def step(self, action: np.ndarray, reward: float, next_state: np.ndarray) -> None:
        self.actions.append(np.asarray(action, np.float32))
        self.states.append(np.asarray(next_state, np.float32))
        self.returns_to_go.append(self.returns_to_go[-1] - float(reward))


def window(
    history: History,
    context: int,
    *,
    state_mean,
    state_std,
    rtg_scale: float,
    max_ep_len: int,
    action_dim: int,
) -> dict[str, np.ndarray]:
    """The model's inputs for the newest step: a batch of one left-padded window."""
    steps = len(history.states)
    start = max(0, steps - context)
    states = (np.stack(history.states[start:]) - state_mean) / state_std
    actions = np.zeros((steps - start, action_dim), np.float32)
    known = history.actions[start:]
    if known:
        actions[: len(known)] = np.stack(known)
    rtg = np.asarray(history.returns_to_go[start:], np.float32)[:, None] / rtg_scale
    timesteps = np.minimum(np.arange(start, steps), max_ep_len - 1)
    pad = context - (steps - start)

    def left(x, dtype):
        x = np.asarray(x, dtype)
        return np.concatenate([np.zeros((pad,) + x.shape[1:], dtype), x])[None]

    return dict(
        states=left(states, np.float32),
        actions=left(actions, np.float32),
        returns_to_go=left(rtg, np.float32),
        timesteps=left(timesteps, np.int32),
        mask=left(np.ones(steps - start), bool),
    )


def make_policy(model, params, selection: str) -> Callable[[dict], tuple[np.ndarray, list]]:
    """A jitted ``inputs -> (action of the newest step [A], selected tokens per routed
    layer)``."""

    @jax.jit
    def act(inputs):
        actions, aux = model.apply({"params": params}, **inputs, selection=selection)
        return actions[0, -1], [info["selected"].sum() for info in aux["routers"]]

    def policy(inputs):
        action, counts = act({k: jnp.asarray(v) for k, v in inputs.items()})
        return np.asarray(action), [int(c) for c in counts]

    return policy


def rollout(
    env: gym.Env,
    policy,
    *,
    target_return: float,
    context: int,
    state_mean,
    state_std,
    rtg_scale: float,
    max_ep_len: int,
    seed: int,
    action_scale=1.0,
) -> dict:
    """One episode; returns its ``return``, ``length``, the per-step mean number of
    selected tokens per routed layer (``selected``) and the ``history``. The model acts
    in ``[-1, 1]``; the environment gets ``action * action_scale``."""
    state, _ = env.reset(seed=seed)
    history = History.start(state, target_return)
    total, counts = 0.0, []
    action_dim = int(np.prod(env.action_space.shape))
    for _ in range(max_ep_len):
        inputs = window(
            history,
            context,
            state_mean=state_mean,
            state_std=state_std,
            rtg_scale=rtg_scale,
            max_ep_len=max_ep_len,
            action_dim=action_dim,
        )
        action, selected = policy(inputs)
        counts.append(selected)
        state, reward, terminated, truncated, _ = env.step(action * action_scale)
        history.step(action, reward, state)
        total += float(reward)
        if terminated or truncated:
            break
    selected = (
        np.mean(np.asarray(counts, np.float64), axis=0).tolist() if counts and counts[0] else []
    )
    return dict(
        episode_return=total, length=len(history.actions), selected=selected, history=history
    )
