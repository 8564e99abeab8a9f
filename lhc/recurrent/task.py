"""Training recurrent LMs from non-zero initial states: the unexplored-states
interventions of Buitrago Ruiz & Gu, as switches of one passkey task.

``RecurrentPasskeyTask`` is the passkey task (``lhc.train.passkey``) whose training
forward pass starts every sequence from the state ``config.initial_state.kind`` says:

* ``"zero"``: the zero state (the usual training). These steps also record, per layer
  and head, running moments of the final states (an exponential moving average with
  decay ``fit_decay``), which Fitted Noise draws from;
* ``"noise"``: i.i.d. Gaussian states with mean 0 and one standard deviation ``std`` for
  every layer and head, fresh for each sequence and step (Random Noise);
* ``"fitted"``: i.i.d. Gaussian states whose mean and standard deviation per layer and
  head are the recorded moments (Fitted Noise): post-train a zero-state run by resuming
  its workdir with this kind;
* ``"passing"``: the final states of the previous batch (unrelated sequences), without
  gradient (State Passing); the first batch starts from zero;
* ``"tbtt"``: truncated backpropagation through time: documents of ``chunks`` x
  ``config.data.length`` tokens served chunk by chunk in consecutive batches
  (``lhc.data.consecutive_chunks``), each chunk starting from the state the previous one
  ended in, without gradient; a new document starts from zero. Only the last chunk holds
  the question and answer.

The carry between steps (``Task.init_carry``) is the same for every kind, so a run may
be resumed with another kind: the final states of the last batch and the moments.
Noise goes into the recurrent states (Mamba-2's SSM state, GLA's state), not into
Mamba-2's convolution state (the paper does not say whether it is included); passing
and TBTT carry every state, the convolution's too. Evaluation always starts from the
zero state, on single sequences of the training length.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc.data.iterators import consecutive_chunks
from lhc.recurrent.cache import RecurrentCache
from lhc.train.passkey import PasskeyTask, passkey_example

KINDS = ("zero", "noise", "fitted", "passing", "tbtt")
NOT_PERTURBED = ("conv",)  # states that noise leaves at zero and moments do not cover


@dataclasses.dataclass(frozen=True)
class InitialState:
    """``config.initial_state``.

    Attributes:
        kind: one of ``KINDS``.
        std: the Random Noise standard deviation.
        fit_decay: decay of the moving average of final-state moments (zero-state steps).
        chunks: TBTT's chunks per document.
    """

    kind: str = "zero"
    std: float = 1.0
    fit_decay: float = 0.99
    chunks: int = 4

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"config.initial_state.kind must be one of {KINDS}, got {self.kind!r}")
        if not self.std >= 0:
            raise ValueError(f"config.initial_state.std must be >= 0, got {self.std}")
        if not 0 <= self.fit_decay < 1:
            raise ValueError(
                f"config.initial_state.fit_decay must lie in [0, 1), got {self.fit_decay}"
            )
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(
                f"config.initial_state.chunks must be a positive int, got {self.chunks!r}"
            )


def noise_states(cache: RecurrentCache, rng: jax.Array, std: float) -> RecurrentCache:
    """``cache`` with its current states (all but the convolution's) replaced by
    ``std``-scaled standard normal draws."""
    states = dict(cache.states)
    for name, draw in _draws(cache, rng).items():
        states[name] = states[name].at[:, :, 0].set((std * draw).astype(states[name].dtype))
    return cache.replace(states=states)


def _draws(cache: RecurrentCache, rng) -> dict:
    """Standard normal ``[L, B, ...]`` draws for each perturbed state of ``cache``."""
    draws = {}
    for i, (name, history) in enumerate(sorted(cache.states.items())):
        if name not in NOT_PERTURBED:
            shape = history[:, :, 0].shape
            draws[name] = jax.random.normal(jax.random.fold_in(rng, i), shape, jnp.float32)
    return draws


def head_moments(states: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean and mean square per layer and head of states ``[L, B, H, ...]``: ``[L, H]``
    each, over the batch and the state's other axes."""
    axes = (1,) + tuple(range(3, states.ndim))
    states = states.astype(jnp.float32)
    return states.mean(axis=axes), jnp.square(states).mean(axis=axes)


def fitted_states(moments: dict, draws: dict) -> dict:
    """``mean + std * draw`` per layer and head from the recorded ``moments`` (name ->
    ``mean``, ``square``: ``[L, H]`` moving averages, and ``weight``, the sum of their
    weights)."""
    out = {}
    for name, draw in draws.items():
        m = moments[name]
        weight = jnp.maximum(moments["weight"], 1e-12)
        mean, square = m["mean"] / weight, m["square"] / weight
        std = jnp.sqrt(jnp.maximum(square - jnp.square(mean), 0.0))
        expand = (slice(None), None, slice(None)) + (None,) * (draw.ndim - 3)
        out[name] = mean[expand] + std[expand] * draw
    return out


def _require_statistics(weight) -> None:
    if not weight > 0:
        raise ValueError(
            "config.initial_state.kind='fitted' draws from the final-state moments that "
            "zero-state steps record, and this run has none: train with kind='zero' first "
            "and resume its workdir with kind='fitted'"
        )


class RecurrentPasskeyTask(PasskeyTask):
    """``config.task = "lhc.recurrent.task:RecurrentPasskeyTask"``; the passkey task's keys
    and ``initial_state`` (the fields of ``InitialState``)."""

    def __init__(self, config, mesh, rules):
        super().__init__(config, mesh, rules)
        self.initial_state = InitialState(**dict(config.get("initial_state") or {}))
        self._tbtt_batch = None
        if self.initial_state.kind == "tbtt":
            self._tbtt_batch = consecutive_chunks(
                self._document,
                chunk_length=int(config.data.length),
                num_chunks=self.initial_state.chunks,
            )

    # Data: TBTT serves documents chunk by chunk; evaluation stays at the training length.

    def _document(self, rng: np.random.Generator, length: int) -> dict:
        example = passkey_example(rng, length=length + 1, **self._generator_kwargs_but_length())
        return {name: example[name] for name in ("tokens", "targets", "weights")}

    def _generator_kwargs_but_length(self) -> dict:
        kwargs = self._generator_kwargs()
        kwargs.pop("length")
        return kwargs

    def batch_spec(self, batch_size):
        if self._tbtt_batch is None:
            return super().batch_spec(batch_size)
        example = self._tbtt_batch(0, 0, range(1))
        return {
            name: jax.ShapeDtypeStruct((batch_size,) + value.shape[1:], value.dtype)
            for name, value in example.items()
        }

    def train_iterator(self, process_index, process_count):
        if self._tbtt_batch is None:
            return super().train_iterator(process_index, process_count)
        return self.indexed_iterator(self._tbtt_batch, process_index, process_count)

    # The carry: the last batch's final states and the moments of zero-state final states.

    def init_carry(self, batch_size):
        cache = self.model.init_cache(batch_size, rollback=0)
        states = {
            name: nn.LogicallyPartitioned(
                history[:, :, 0], ("layers", "cache_batch") + (None,) * (history.ndim - 3)
            )
            for name, history in cache.states.items()
        }
        moments = {"weight": jnp.zeros((), jnp.float32)}
        for name, history in cache.states.items():
            if name not in NOT_PERTURBED:
                shape = (history.shape[0], history.shape[3])  # [L, H]
                moments[name] = {"mean": jnp.zeros(shape), "square": jnp.zeros(shape)}
        return {"states": states, "moments": moments}

    def _initial_states(self, carry, batch, rng) -> dict:
        kind = self.initial_state.kind
        previous = carry["states"]
        if kind == "passing":
            return previous
        if kind == "tbtt":
            reset = batch["reset"]
            return {
                name: jnp.where(reset.reshape((1, -1) + (1,) * (s.ndim - 2)), 0, s)
                for name, s in previous.items()
            }
        zeros = {name: jnp.zeros_like(s) for name, s in previous.items()}
        if kind == "zero":
            return zeros
        cache = self.model.init_cache(batch["tokens"].shape[0], rollback=0)
        draws = _draws(cache, rng)
        if kind == "noise":
            drawn = {name: self.initial_state.std * d for name, d in draws.items()}
        else:  # fitted
            jax.debug.callback(_require_statistics, carry["moments"]["weight"])
            drawn = fitted_states(carry["moments"], draws)
        return {**zeros, **{k: v.astype(zeros[k].dtype) for k, v in drawn.items()}}

    def carried_loss(self, params, batch, rng, carry):
        tokens = batch["tokens"]
        positions = batch.get("positions")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        noise_rng, train_rng = jax.random.split(rng)
        initial = self._initial_states(carry, batch, noise_rng)
        cache = self.model.init_cache(tokens.shape[0], rollback=0)
        cache = cache.replace(states={name: s[:, :, None] for name, s in initial.items()})
        logits, cache = self.model.apply(
            {"params": params}, tokens, positions, cache, rngs={"train": train_rng}
        )
        loss, metrics = self.loss_from_logits(logits, batch)
        final = {name: history[:, :, 0] for name, history in cache.states.items()}
        moments = carry["moments"]
        if self.initial_state.kind == "zero":
            moments = _updated_moments(moments, final, self.initial_state.fit_decay)
        for name, state in final.items():
            if name not in NOT_PERTURBED:
                metrics[f"final_{name}_rms"] = jnp.sqrt(jnp.mean(jnp.square(state)))
        return loss, (metrics, {"states": final, "moments": moments})


def _updated_moments(moments: dict, final: dict, decay: float) -> dict:
    """The moving averages after one more batch of final states (unnormalised: each
    average is divided by ``weight`` when read)."""
    out = {"weight": decay * moments["weight"] + (1 - decay)}
    for name, m in moments.items():
        if name == "weight":
            continue
        mean, square = head_moments(final[name])
        out[name] = {
            "mean": decay * m["mean"] + (1 - decay) * mean,
            "square": decay * m["square"] + (1 - decay) * square,
        }
    return out
