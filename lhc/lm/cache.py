"""Key/value cache of the decoder LM.

Layout (L layers, B sequences, S slots, K key/value heads, H head dim):

* ``keys``, ``values``: ``[L, B, S, K, H]`` in the compute dtype;
* ``positions``: int32 ``[B, S]``, the position of the token held in each slot, shared by
  all layers; ``-1`` marks an empty slot or a padding token;
* ``lengths``: int32 ``[B]``, how many slots each sequence has used.

Appending ``T`` tokens writes sequence ``b`` into slots ``lengths[b] : lengths[b] + T``
and adds ``T`` to ``lengths[b]``, whatever the tokens' positions are, so padding tokens
(position ``< 0``) take slots but are never attended to. Attention is causal by position
(a query at position ``p`` sees cached keys at positions ``0 <= q <= p``), not by slot.
Truncating to shorter lengths empties the slots beyond them (speculative rollback,
erasing a span before re-appending).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from lhc.lm.config import LMConfig

CACHE_KV_AXES = (None, "cache_batch", "cache_len", "cache_kv_heads", "cache_kv")


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


@struct.dataclass
class KVCache:
    """Per-layer keys and values with per-sequence slot positions and lengths.

    See the module docstring for the layout.
    """

    keys: jax.Array
    values: jax.Array
    positions: jax.Array
    lengths: jax.Array

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        """S, the number of slots per sequence."""
        return self.keys.shape[2]

    def truncate(self, new_lengths: jax.Array | int) -> KVCache:
        """Drops every slot at or beyond ``new_lengths``.

        Args:
            new_lengths: int ``[B]`` (or a scalar for all sequences), each at most the
                current length. Lengths are in slots, padding slots included.

        Returns:
            A cache whose slots ``>= new_lengths[b]`` are empty (position -1). Keys and
            values there are left in place; they are masked and overwritten later.

        Raises:
            ValueError: with concrete values, when a new length is negative or exceeds
                the current one. Under ``jit`` the new lengths are clipped to
                ``[0, lengths]`` instead.
        """
        new_lengths = jnp.broadcast_to(jnp.asarray(new_lengths, jnp.int32), self.lengths.shape)
        if _is_concrete(new_lengths) and _is_concrete(self.lengths):
            new_np, old_np = np.asarray(new_lengths), np.asarray(self.lengths)
            if (new_np < 0).any() or (new_np > old_np).any():
                raise ValueError(
                    f"truncate: new_lengths must lie in [0, lengths]; got new_lengths="
                    f"{new_np.tolist()} for lengths={old_np.tolist()}"
                )
        new_lengths = jnp.clip(new_lengths, 0, self.lengths)
        slots = jnp.arange(self.capacity, dtype=jnp.int32)
        positions = jnp.where(slots[None, :] < new_lengths[:, None], self.positions, -1)
        return self.replace(positions=positions, lengths=new_lengths)

    def next_positions(self) -> jax.Array:
        """int32 ``[B]``: one past the largest position stored per sequence (0 if empty)."""
        return jnp.max(self.positions, axis=1) + 1

    @staticmethod
    def logical_axes() -> KVCache:
        """The cache's logical axis names, as ``PartitionSpec`` leaves.

        Map them to shardings with
        ``flax.linen.logical_to_mesh_sharding(KVCache.logical_axes(), mesh, rules)``.
        """
        kv = PartitionSpec(*CACHE_KV_AXES)
        return KVCache(
            keys=kv,
            values=kv,
            positions=PartitionSpec("cache_batch", "cache_len"),
            lengths=PartitionSpec("cache_batch"),
        )


def init_cache(config: LMConfig, batch_size: int, max_len: int) -> KVCache:
    """An empty cache with ``max_len`` slots per sequence.

    Args:
        config: the model's config (layers, heads, compute dtype).
        batch_size: B.
        max_len: S, at most ``config.max_len``.

    Raises:
        ValueError: non-positive sizes or ``max_len > config.max_len``.
    """
    if batch_size <= 0:
        raise ValueError(f"init_cache: batch_size must be positive, got {batch_size}")
    if not 0 < max_len <= config.max_len:
        raise ValueError(
            f"init_cache: max_len must be in [1, config.max_len={config.max_len}], got {max_len}"
        )
    shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
    dtype = jnp.dtype(config.dtype)
    return KVCache(
        keys=jnp.zeros(shape, dtype),
        values=jnp.zeros(shape, dtype),
        positions=jnp.full((batch_size, max_len), -1, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )
