"""A compressed context as a cache: every layer and key/value head keeps its own tokens.

EMLoC (and the pruning baselines) keep, in layer ``l``, ``n_l`` tokens of the context
per key/value head: the same count for every head of a layer, not the same tokens.
``LayerwiseMemory`` holds them, with their original positions (keys keep the rotation of
the position they were computed at), and appends new tokens after them in an ordinary
``lhc.lm.KVCache`` (the *tail*): it follows the cache protocol of ``lhc.lm.cache``, so
``lhc.lm.generate`` answers a query on it. Attention reads the memory through a
``KVView`` whose key positions are per head (``[B, K, S]``), masked like any other, block
by block up to the last held slot (``attention_with_blocked_prefix``).

A memory's arrays may be longer than what it holds (slots at position -1 are empty, so
that a growing memory keeps its shapes, and compiled programs, for a while); ``sizes``
counts what is held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from lhc.lm.cache import CACHE_LAYER_KV_AXES, KVCache, init_cache
from lhc.nn.attention import KVView
from lhc.nn.blocked_prefix import attention_with_blocked_prefix

# Memory slots are allocated in multiples of this, so that a memory growing chunk by
# chunk reuses compiled programs.
SLOT_BUCKET = 64
# Capacities (``capacity_slots``) are multiples of this.
CAPACITY_BUCKET = 512
# Attention reads a memory this many slots at a time, up to its last held slot.
MEMORY_BLOCK = 128


@struct.dataclass
class _MemoryView(KVView):
    """One layer's memory (per-head slots), then the tail (``keys``, ``values``,
    ``positions``: what it held before this call), then this call's keys.

    Attention reads the memory ``MEMORY_BLOCK`` slots at a time up to its last held
    slot (``attention_with_blocked_prefix``): a memory padded for its future growth costs
    what it holds, not its capacity.
    """

    memory_keys: jax.Array | None = None  # [B, K, M, H]
    memory_values: jax.Array | None = None
    memory_positions: jax.Array | None = None  # int32 [B, K, M]

    def segments(self) -> list[tuple[jax.Array, ...]]:
        memory = (
            jnp.swapaxes(self.memory_keys, 1, 2),  # [B, M, K, H]
            jnp.swapaxes(self.memory_values, 1, 2),
            self.memory_positions,
        )
        return [memory, *super().segments()]

    def attend(self, query, query_positions, *, impl, window, dtype, alibi_slopes=None):
        del impl  # plain XLA: per-head positions
        segments = [(k.astype(dtype), v.astype(dtype), *rest) for k, v, *rest in super().segments()]
        memory = (
            self.memory_keys.astype(dtype),
            self.memory_values.astype(dtype),
            self.memory_positions,
        )
        return attention_with_blocked_prefix(
            query,
            memory,
            segments,
            query_positions,
            scale=query.shape[-1] ** -0.5,
            window=window,
            alibi_slopes=alibi_slopes,
            block=MEMORY_BLOCK,
        )


@struct.dataclass
class _MemoryWriter:
    tail: Any  # the tail's writer for this call
    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    positions: tuple[jax.Array, ...]
    segment_ids: jax.Array | None  # int32 [B, T] of this call's tokens, or None

    def read(self, layers, layer, keys, values) -> KVView:
        view = self.tail.read(layers, layer, keys, values)
        return _MemoryView(
            keys=view.keys,
            values=view.values,
            positions=view.positions,
            new_keys=view.new_keys,
            new_values=view.new_values,
            new_positions=view.new_positions,
            new_mask=(
                None
                if self.segment_ids is None
                else self.segment_ids[:, :, None] == self.segment_ids[:, None, :]
            ),
            memory_keys=self.keys[layer],
            memory_values=self.values[layer],
            memory_positions=self.positions[layer],
        )

    def write(self, layers, layer, keys, values, *, after):
        return self.tail.write(layers, layer, keys, values, after=after)


@struct.dataclass
class LayerwiseMemory:
    """Kept context tokens per layer and key/value head, then appended tokens.

    Attributes:
        keys: per layer ``[B, K, M_l, H]``, the kept keys (as computed, rotated).
        values: per layer ``[B, K, M_l, H]``.
        positions: per layer int32 ``[B, K, M_l]``: the position of each kept token,
            -1 for an empty slot.
        start: int32 ``[B]``: the position after the compressed context (positions of
            appended tokens continue from it, whatever was pruned).
        tail: a ``KVCache`` (tuple layout) of the tokens appended since.
        segment_ids: ``None``, or int32 ``[B, T]`` for a call of ``T`` tokens that packs
            several sequences in a row (``packed``): a token sees the memory, the tail
            held before the call, and the call's tokens of its own segment.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    positions: tuple[jax.Array, ...]
    start: jax.Array
    tail: KVCache
    segment_ids: jax.Array | None = None

    # The cache protocol -------------------------------------------------------------

    @property
    def lengths(self) -> jax.Array:
        """int32 ``[B]``: tokens appended after the memory (padding included)."""
        return self.tail.lengths

    @property
    def capacity(self) -> int:
        return self.tail.capacity

    def truncate(self, new_lengths) -> LayerwiseMemory:
        return self.replace(tail=self.tail.truncate(new_lengths))

    def truncate_at_position(self, positions) -> LayerwiseMemory:
        return self.replace(tail=self.tail.truncate_at_position(positions))

    def next_positions(self) -> jax.Array:
        return jnp.maximum(self.tail.next_positions(), self.start)

    def can_append(self, num_tokens: int) -> jax.Array:
        return self.tail.can_append(num_tokens)

    def validate_append(self, batch_size: int, num_tokens: int) -> None:
        self.tail.validate_append(batch_size, num_tokens)

    def logical_axes(self) -> LayerwiseMemory:
        per_layer = lambda: tuple(PartitionSpec(*CACHE_LAYER_KV_AXES) for _ in self.keys)
        return LayerwiseMemory(
            keys=per_layer(),
            values=per_layer(),
            positions=tuple(
                PartitionSpec("cache_batch", "cache_kv_heads", "cache_len") for _ in self.keys
            ),
            start=PartitionSpec("cache_batch"),
            tail=self.tail.logical_axes(),
        )

    def begin_update(self, positions: jax.Array):
        if self.segment_ids is not None and self.segment_ids.shape != positions.shape:
            raise ValueError(
                f"LayerwiseMemory.segment_ids has shape {self.segment_ids.shape}, the call's "
                f"positions {positions.shape}"
            )
        writer, layers = self.tail.begin_update(positions)
        memory = _MemoryWriter(writer, self.keys, self.values, self.positions, self.segment_ids)
        return memory, layers

    def finish_update(self, writer: _MemoryWriter, layers) -> LayerwiseMemory:
        # Packing (segment ids) holds for one call only.
        return self.replace(tail=self.tail.finish_update(writer.tail, layers), segment_ids=None)

    # The memory itself --------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return int(self.start.shape[0])

    def sizes(self) -> np.ndarray:
        """int ``[L]``: tokens held per key/value head in each layer (of sequence 0)."""
        return np.array([int(np.sum(np.asarray(p)[0, 0] >= 0)) for p in self.positions])

    def nbytes(self) -> int:
        """Bytes of the keys and values held (all sequences, heads and layers), as a
        store without empty slots would take them."""
        total = 0
        for keys, positions in zip(self.keys, self.positions):
            held = int(np.sum(np.asarray(positions) >= 0))
            total += 2 * held * keys.shape[-1] * keys.dtype.itemsize
        return total

    def packed(self, segment_ids: jax.Array | np.ndarray | None) -> LayerwiseMemory:
        """This memory for one call of ``T`` tokens that packs several sequences in each
        row: int ``[B, T]``, equal ids for the tokens of one sequence (``None``: the
        call's tokens are one sequence per row). Every packed sequence reads the whole
        memory, as if each had a row of its own."""
        ids = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
        return self.replace(segment_ids=ids)

    def with_tail(self, config, slots: int) -> LayerwiseMemory:
        """This memory with an empty tail of ``slots`` slots per sequence."""
        return self.replace(tail=init_cache(config, self.batch_size, slots))

    def padded(self, slots: int) -> LayerwiseMemory:
        """This memory with ``slots`` slots in every layer (empty ones added at the end),
        so that programs compiled for one capacity serve memories of any sizes below it.

        Raises:
            ValueError: a layer already has more slots.
        """
        most = max(p.shape[-1] for p in self.positions)
        if most > slots:
            raise ValueError(f"padded: a layer has {most} slots, more than slots={slots}")

        def grow(x, fill):
            width = [(0, 0)] * x.ndim
            width[2] = (0, slots - x.shape[2])
            return jnp.pad(x, width, constant_values=fill)

        return self.replace(
            keys=tuple(grow(k, 0) for k in self.keys),
            values=tuple(grow(v, 0) for v in self.values),
            positions=tuple(grow(p, -1) for p in self.positions),
        )

    def broadcast(self, batch_size: int) -> LayerwiseMemory:
        """A memory of one sequence repeated for ``batch_size`` (its tail emptied to the
        same number of slots)."""
        if self.batch_size != 1:
            raise ValueError(f"broadcast needs a memory of one sequence, got {self.batch_size}")
        repeat = lambda x: jnp.repeat(x, batch_size, axis=0)
        return LayerwiseMemory(
            keys=tuple(repeat(k) for k in self.keys),
            values=tuple(repeat(v) for v in self.values),
            positions=tuple(repeat(p) for p in self.positions),
            start=repeat(self.start),
            tail=_empty_like(self.tail, batch_size),
        )


def empty_memory(
    config, batch_size: int = 1, tail_slots: int = 1, slots: int = 0
) -> LayerwiseMemory:
    """A memory holding nothing, for a model of ``config`` (``scan_layers=False``), with
    ``slots`` empty slots in every layer (room to grow without changing shapes)."""
    if getattr(config, "scan_layers", False):
        raise ValueError(
            "a LayerwiseMemory keeps a different number of tokens in every layer: it needs "
            "a model that loops over its layers (scan_layers=False)"
        )
    shape = (batch_size, config.num_kv_heads, slots, config.head_dim)
    dtype = jnp.dtype(config.dtype)
    layers = range(config.num_layers)
    return LayerwiseMemory(
        keys=tuple(jnp.zeros(shape, dtype) for _ in layers),
        values=tuple(jnp.zeros(shape, dtype) for _ in layers),
        positions=tuple(jnp.full(shape[:3], -1, jnp.int32) for _ in layers),
        start=jnp.zeros((batch_size,), jnp.int32),
        tail=init_cache(config, batch_size, tail_slots),
    )


def padded_slots(count: int) -> int:
    """``count`` rounded up to a multiple of ``SLOT_BUCKET``."""
    return max(SLOT_BUCKET, SLOT_BUCKET * math.ceil(count / SLOT_BUCKET))


def capacity_slots(count: int) -> int:
    """Slots for ``count`` tokens in coarse steps (a multiple of ``CAPACITY_BUCKET``), so
    that one compiled program serves contexts of similar sizes."""
    return CAPACITY_BUCKET * max(1, math.ceil(count / CAPACITY_BUCKET))


def append_kept(
    memory: LayerwiseMemory,
    keys: Sequence[jax.Array],
    values: Sequence[jax.Array],
    positions: jax.Array,
    kept: Sequence[np.ndarray],
    start: int,
) -> LayerwiseMemory:
    """The memory with, in every layer, the kept tokens of a new span appended.

    Args:
        memory: a memory of one sequence.
        keys: per layer ``[1, K, C, H]``, the span's keys.
        values: per layer ``[1, K, C, H]``.
        positions: int ``[C]``, the span's positions.
        kept: per layer int ``[K, n_l]``, indices into ``C`` of the tokens each head
            keeps (the same count ``n_l`` for every head of a layer).
        start: the position after the span.

    Returns:
        A memory whose layer ``l`` holds its old tokens and the ``n_l`` new ones per head,
        in its slots, or, where they do not fit, in slots rounded up to a multiple of
        ``SLOT_BUCKET``; its tail is emptied.
    """
    if memory.batch_size != 1:
        raise ValueError(f"append_kept needs a memory of one sequence, got {memory.batch_size}")
    positions = np.asarray(positions)
    new_keys, new_values, new_positions = [], [], []
    for layer in range(memory.num_layers):
        index = np.sort(np.asarray(kept[layer]), axis=-1)  # [K, n]
        held = np.asarray(memory.positions[layer])[0]  # [K, M]
        count = int(np.sum(held[0] >= 0))
        heads, n = index.shape
        slots = max(held.shape[-1], padded_slots(count + n))
        position_block = np.full((heads, slots), -1, np.int32)
        position_block[:, :count] = held[:, :count]
        position_block[:, count : count + n] = positions[index]
        new_keys.append(_grown(memory.keys[layer], keys[layer], count, index, slots))
        new_values.append(_grown(memory.values[layer], values[layer], count, index, slots))
        new_positions.append(jnp.asarray(position_block)[None])
    return memory.replace(
        keys=tuple(new_keys),
        values=tuple(new_values),
        positions=tuple(new_positions),
        start=jnp.asarray([start], jnp.int32),
        tail=_empty_like(memory.tail, 1),
    )


def _grown(old, new, count: int, index: np.ndarray, slots: int) -> jax.Array:
    """``[1, K, slots, H]``: the ``count`` held entries of ``old``, then the entries
    ``index [K, n]`` of ``new [1, K, C, H]``, then empty slots (built on the host: the
    counts differ from layer to layer and chunk to chunk, and would each compile)."""
    old, new = np.asarray(old)[0], np.asarray(new)[0]
    block = np.zeros((old.shape[0], slots, old.shape[-1]), old.dtype)
    block[:, :count] = old[:, :count]
    taken = np.take_along_axis(new, index[:, :, None], axis=1)
    block[:, count : count + index.shape[1]] = taken.astype(old.dtype)
    return jnp.asarray(block[None])


def _empty_like(tail: KVCache, batch_size: int) -> KVCache:
    """An empty ``KVCache`` of ``tail``'s shapes for ``batch_size`` sequences."""
    zeros = jax.tree_util.tree_map(lambda x: jnp.zeros((batch_size, *x.shape[1:]), x.dtype), tail)
    return zeros.replace(positions=jnp.full((batch_size, tail.capacity), -1, jnp.int32))
