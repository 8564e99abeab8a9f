"""Training recurrent LMs from a non-zero initial state (the unexplored-states
interventions of Buitrago Ruiz & Gu).

``RecurrentPasskeyTask`` is the passkey task (``lhc.train.passkey``) whose training
forward pass starts every sequence from ``config.initial_state``:

* ``kind="zero"``: the zero state (the usual training);
* ``kind="noise"``: i.i.d. Gaussian states with mean 0 and one standard deviation
  ``std`` for every layer and head, fresh for each sequence and step ("Random Noise").

Noise goes into the recurrent states (Mamba-2's SSM state, GLA's state), not into
Mamba-2's convolution state: the paper does not say whether the convolution state is
included. Evaluation always starts from the zero state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lhc.recurrent.cache import RecurrentCache
from lhc.train.passkey import PasskeyTask

KINDS = ("zero", "noise")
NOT_PERTURBED = ("conv",)


def noise_states(cache: RecurrentCache, rng: jax.Array, std: float) -> RecurrentCache:
    """``cache`` with its current states (all but the convolution's) replaced by
    ``std``-scaled standard normal draws."""
    states = {}
    for i, (name, history) in enumerate(sorted(cache.states.items())):
        if name in NOT_PERTURBED:
            states[name] = history
            continue
        draw = jax.random.normal(jax.random.fold_in(rng, i), history[:, :, 0].shape, jnp.float32)
        states[name] = history.at[:, :, 0].set((std * draw).astype(history.dtype))
    return cache.replace(states=states)


class RecurrentPasskeyTask(PasskeyTask):
    """``config.task = "lhc.recurrent.task:RecurrentPasskeyTask"``; the passkey task's keys
    and ``initial_state`` = ``kind`` (``"zero"`` or ``"noise"``) and ``std``."""

    def _initial_state(self) -> tuple[str, float]:
        settings = self.config.get("initial_state")
        kind = "zero" if settings is None else str(settings.get("kind", "zero"))
        std = 0.0 if settings is None else float(settings.get("std", 0.0))
        if kind not in KINDS:
            raise ValueError(f"config.initial_state.kind must be one of {KINDS}, got {kind!r}")
        if std < 0:
            raise ValueError(f"config.initial_state.std must be >= 0, got {std}")
        return kind, std

    def _logits(self, params, batch, rng=None):
        kind, std = self._initial_state()
        if kind == "zero" or rng is None:  # evaluation passes no rng: the zero state
            return super()._logits(params, batch, rng)
        tokens = batch["tokens"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        noise_rng, train_rng = jax.random.split(rng)
        cache = noise_states(self.model.init_cache(tokens.shape[0], rollback=0), noise_rng, std)
        logits, _ = self.model.apply(
            {"params": params}, tokens, positions, cache, rngs={"train": train_rng}
        )
        return logits
