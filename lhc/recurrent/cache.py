"""The cache of recurrent LMs: per-layer states, and the states after each of the latest
call's last tokens, so that speculative rollback within them is exact.

Memory does not depend on the context. Truncating ``k`` tokens back restores the state
recorded ``k`` tokens back when ``k <= last`` (at most ``rollback``, and within the
latest call); further back the state is gone, the cache is marked broken and the model
returns NaN logits for that sequence (``can_append`` is false).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec


@struct.dataclass
class RecurrentCache:
    """The causal-LM cache protocol (``lhc.lm.cache``) over recurrent states.

    Attributes:
        states: name -> ``[L, B, R + 1, ...]``; ``states[name][:, b, k]`` is the state
            ``k`` tokens back (``k = 0``: now), valid for ``k <= last[b]``.
        history_positions: int32 ``[B, R]``, positions of the latest call's last tokens,
            the most recent first (-1 for padding and beyond the call).
        last: int32 ``[B]``, how many tokens back truncation restores exactly.
        lengths: int32 ``[B]``, tokens appended.
        top: int32 ``[B]``, the largest position held (-1 if none).
        top_before: int32 ``[B]``, the largest position before the latest call.
        intact: bool ``[B]``, false after truncating further back than ``last``.
    """

    states: dict
    history_positions: jax.Array
    last: jax.Array
    lengths: jax.Array
    top: jax.Array
    top_before: jax.Array
    intact: jax.Array

    @classmethod
    def create(cls, shapes: Mapping[str, tuple], *, num_layers, batch_size, rollback, dtypes):
        """Zero states of per-token ``shapes[name]`` for ``num_layers`` layers."""
        return cls(
            states={
                name: jnp.zeros((num_layers, batch_size, rollback + 1, *shape), dtypes[name])
                for name, shape in shapes.items()
            },
            history_positions=jnp.full((batch_size, rollback), -1, jnp.int32),
            last=jnp.zeros((batch_size,), jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            top=jnp.full((batch_size,), -1, jnp.int32),
            top_before=jnp.full((batch_size,), -1, jnp.int32),
            intact=jnp.ones((batch_size,), bool),
        )

    @property
    def rollback(self) -> int:
        return self.history_positions.shape[1]

    def now(self, name: str, layer: int) -> jax.Array:
        """The current state ``name`` of ``layer``, ``[B, ...]``."""
        return self.states[name][layer, :, 0]

    def appended(self, states: Mapping[str, jax.Array], positions: jax.Array, tail: int):
        """The cache after a call of ``positions [B, T]`` whose model recorded
        ``states[name]`` ``[L, B, R + 1, ...]`` (see ``layer_history``) for its last
        ``tail`` tokens."""
        batch = positions.shape[0]
        newest_first = jnp.concatenate(
            [positions[:, ::-1], jnp.full((batch, self.rollback), -1, jnp.int32)], axis=1
        )[:, : self.rollback]
        return RecurrentCache(
            states=dict(states),
            history_positions=newest_first,
            last=jnp.full((batch,), tail, jnp.int32),
            lengths=self.lengths + positions.shape[1],
            top=jnp.maximum(self.top, jnp.max(positions, axis=1)),
            top_before=self.top,
            intact=self.intact,
        )

    @property
    def capacity(self) -> None:
        return None

    def truncate(self, new_lengths):
        new_lengths = jnp.broadcast_to(jnp.asarray(new_lengths, jnp.int32), self.lengths.shape)
        back = self.lengths - new_lengths
        pick = jnp.clip(back, 0, self.rollback)

        def restore(history):  # [L, B, R + 1, ...] -> the state `back` tokens ago, now
            index = pick.reshape((1, -1, 1) + (1,) * (history.ndim - 3))
            state = jnp.take_along_axis(history, index, axis=2)
            return jnp.zeros_like(history).at[:, :, :1].set(state)

        kept = jnp.arange(self.rollback)[None, :] >= back[:, None]
        kept_top = jnp.max(jnp.where(kept, self.history_positions, -1), axis=1, initial=-1)
        top = jnp.where(back > 0, jnp.maximum(self.top_before, kept_top), self.top)
        return RecurrentCache(
            states={name: restore(h) for name, h in self.states.items()},
            history_positions=jnp.full_like(self.history_positions, -1),
            last=jnp.zeros_like(self.last),
            lengths=new_lengths,
            top=top,
            top_before=top,
            intact=self.intact & (back >= 0) & (back <= self.last),
        )

    def truncate_at_position(self, positions):
        positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), self.lengths.shape)
        in_last = jnp.arange(self.rollback)[None, :] < self.last[:, None]
        drop = jnp.sum(in_last & (self.history_positions >= positions[:, None]), axis=1)
        return self.truncate(self.lengths - drop)

    def next_positions(self):
        return self.top + 1

    def can_append(self, num_tokens):
        del num_tokens
        return self.intact

    def validate_append(self, batch_size, num_tokens):
        del num_tokens
        if self.lengths.shape != (batch_size,):
            raise ValueError(
                f"the cache holds {self.lengths.shape[0]} sequences, the call has {batch_size}"
            )

    def logical_axes(self):
        batch = PartitionSpec("cache_batch")
        return RecurrentCache(
            states={
                name: PartitionSpec("layers", "cache_batch", *([None] * (h.ndim - 2)))
                for name, h in self.states.items()
            },
            history_positions=PartitionSpec("cache_batch", None),
            last=batch,
            lengths=batch,
            top=batch,
            top_before=batch,
            intact=batch,
        )


def layer_history(old, head_end, tail_states, rollback: int) -> jax.Array:
    """One layer's ``[B, R + 1, ...]`` after a call: the states after each of the call's
    last tokens ``tail_states [B, tail, ...]`` (oldest first; None if none), newest
    first, then the state entering them ``head_end [B, ...]``, then the older ones."""
    parts = [head_end[:, None].astype(old.dtype), old]
    if tail_states is not None:
        parts.insert(0, tail_states[:, ::-1].astype(old.dtype))
    return jnp.concatenate(parts, axis=1)[:, : rollback + 1]
