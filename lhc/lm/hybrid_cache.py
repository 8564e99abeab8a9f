"""The cache of a model whose layers attend within different windows (Gemma 3: five local
layers of a 512-token window to one global layer): each global layer keeps every token
(a ``KVCache``), each local layer a ring of the last tokens (a ``SlidingWindowKVCache``),
so a 32K-token cache of Gemma 3 270M holds 3 full layers and 15 rings of 640 slots.

Both parts take every call's tokens, so they hold the same sequences with the same
lengths; the model asks the writer which part serves a layer (``writer.part(layer,
window)``: the part's writer, which storage, the layer's index there), by the layer's
window, which is static, so that each part keeps its own static shapes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from lhc.lm.cache import (
    KVCache,
    SlidingWindowKVCache,
    check_batch,
    empty_slots,
    positions_to_lengths,
)

FULL, RING = 0, 1  # the parts, in the storage tuple and in ``layer_parts``


def _index_in_part(layer_parts: tuple[int, ...], layer):
    """Layer ``layer``'s index among the layers of its part (a traced layer gives a traced
    index)."""
    counts = {FULL: 0, RING: 0}
    indices = []
    for part in layer_parts:
        indices.append(counts[part])
        counts[part] += 1
    if isinstance(layer, int):
        return indices[layer]
    return jnp.asarray(indices, jnp.int32)[layer]


@struct.dataclass
class _HybridWriter:
    """The two parts' writers for one call."""

    full: Any
    ring: Any
    layer_parts: tuple[int, ...] = struct.field(pytree_node=False)

    def part(self, layer, window):
        """``(writer, part, index)`` of ``layer``, whose attention window is ``window``."""
        part = FULL if window is None else RING
        writer = self.full if part == FULL else self.ring
        return writer, part, _index_in_part(self.layer_parts, layer)


@struct.dataclass
class HybridKVCache:
    """Keys and values of the global layers (every token) and of the local ones (a ring).

    Attributes:
        full: a ``KVCache`` of the layers that attend fully, in layer order.
        ring: a ``SlidingWindowKVCache`` of the layers that attend within the window.
        layer_parts: for each layer, ``FULL`` or ``RING`` (static).
    """

    full: KVCache
    ring: SlidingWindowKVCache
    layer_parts: tuple[int, ...] = struct.field(pytree_node=False)

    @property
    def lengths(self) -> jax.Array:
        return self.full.lengths

    @property
    def capacity(self) -> int:
        return self.full.capacity

    @property
    def batch_size(self) -> int:
        return self.full.batch_size

    @property
    def stacked_layers(self) -> bool:
        return self.full.stacked_layers and self.ring.stacked_layers

    @property
    def padding_room(self) -> int:
        """The ring's (``SlidingWindowKVCache.padding_room``)."""
        return self.ring.padding_room

    def truncate(self, new_lengths: jax.Array | int) -> HybridKVCache:
        """Forgets every token appended after the first ``new_lengths[b]`` (the ring no
        further back than it can: see ``SlidingWindowKVCache.truncate``)."""
        return self.replace(
            full=self.full.truncate(new_lengths), ring=self.ring.truncate(new_lengths)
        )

    def truncate_at_position(self, positions: jax.Array | int) -> HybridKVCache:
        """Forgets every token at a position ``>= positions[b]`` (counted in the full part,
        which holds every token)."""
        slots = jnp.arange(self.full.capacity, dtype=jnp.int32)[None, :]
        order = jnp.where(slots < self.lengths[:, None], slots, -1)
        return self.truncate(
            positions_to_lengths(positions, self.full.positions, order, self.lengths)
        )

    def next_positions(self) -> jax.Array:
        return self.full.next_positions()

    def can_append(self, num_tokens: int) -> jax.Array:
        return self.full.can_append(num_tokens) & self.ring.can_append(num_tokens)

    def validate_append(self, batch_size: int, num_tokens: int) -> None:
        check_batch("cache", self.lengths, batch_size)
        self.full.validate_append(batch_size, num_tokens)
        self.ring.validate_append(batch_size, num_tokens)

    def begin_update(self, positions: jax.Array):
        full_writer, full_layers = self.full.begin_update(positions)
        ring_writer, ring_layers = self.ring.begin_update(positions)
        writer = _HybridWriter(full_writer, ring_writer, self.layer_parts)
        return writer, (full_layers, ring_layers)

    def finish_update(self, writer: _HybridWriter, layers) -> HybridKVCache:
        return self.replace(
            full=self.full.finish_update(writer.full, layers[FULL]),
            ring=self.ring.finish_update(writer.ring, layers[RING]),
        )

    def logical_axes(self) -> HybridKVCache:
        return self.replace(full=self.full.logical_axes(), ring=self.ring.logical_axes())


def init_hybrid_cache(config, batch_size: int, max_len: int, ring_slots: int) -> HybridKVCache:
    """An empty ``HybridKVCache`` of ``max_len`` slots in the global layers and
    ``ring_slots >= config.sliding_window`` in the local ones.

    Raises:
        ValueError: non-positive sizes, ``max_len > config.max_len``, a ring smaller than
            the window, or a config whose layers all have one window.
    """
    window = config.sliding_window
    parts = tuple(
        FULL if config.layer_window(i) is None else RING for i in range(config.num_layers)
    )
    if window is None or len(set(parts)) < 2:
        raise ValueError(
            "init_hybrid_cache: the model's layers must mix a sliding window and full "
            f"attention; sliding_window={window}, full_attention_layers="
            f"{config.full_attention_layers}"
        )
    if batch_size <= 0 or not 0 < max_len <= config.max_len or ring_slots < window:
        raise ValueError(
            f"init_hybrid_cache: need batch_size > 0, 0 < max_len <= {config.max_len} and "
            f"ring_slots >= window {window}; got {batch_size=} {max_len=} {ring_slots=}"
        )
    full = KVCache(**empty_slots(config, batch_size, max_len, parts.count(FULL)))
    ring = SlidingWindowKVCache(
        **empty_slots(config, batch_size, ring_slots, parts.count(RING)),
        complete=jnp.ones((batch_size,), bool),
        window=int(window),
    )
    return HybridKVCache(full, ring, parts)


def check_hybrid_cache(cache: HybridKVCache, config) -> None:
    """ValueError unless ``cache`` serves a model of ``config`` (its layers' windows, heads
    and head dimension, and a ring at least as long as the window)."""
    parts = tuple(
        FULL if config.layer_window(i) is None else RING for i in range(config.num_layers)
    )
    expected = (config.num_kv_heads, config.head_dim)
    if (
        cache.layer_parts != parts
        or cache.full.head_shape != expected
        or cache.ring.head_shape != expected
        or cache.ring.window < (config.sliding_window or 0)
    ):
        raise ValueError(
            f"the hybrid cache serves layers {cache.layer_parts} (0: full, 1: windowed) of "
            f"heads {cache.full.head_shape} and a window of {cache.ring.window}; the model "
            f"has {parts}, heads {expected}, window {config.sliding_window}"
        )
