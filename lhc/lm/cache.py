"""The cache protocol of causal LMs, and two caches of attention layers.

A model called as ``logits, cache = model.apply(variables, tokens, positions, cache)``
appends the call's ``T`` tokens per sequence to ``cache`` and returns the updated cache.
What a cache *is* differs from model to model (keys and values of every token, a ring of
the last ``W`` tokens, a quantized store, a recurrent state, a memory pruned differently
in every layer); what every cache offers, so that decoding, speculative decoding and
evaluation code works with any of them, is this (``Cache`` below):

* ``lengths``: int32 ``[B]``, how many tokens (slots) each sequence has appended,
  padding tokens included. Appending ``T`` tokens adds ``T`` to every length.
* ``capacity``: the most tokens a sequence may append in all, or ``None`` when
  unbounded (a ring buffer, a recurrent state).
* ``truncate(new_lengths)``: forget every token appended after the first
  ``new_lengths[b]`` (speculative rollback, erasing a span before re-appending).
* ``truncate_at_position(positions)``: forget every token at a position
  ``>= positions[b]`` (and any padding after the last token kept). In a left-padded batch
  the slot count and the position of a token differ; this works in positions.
* ``next_positions()``: int32 ``[B]``, one past the largest position held (0 if none).
* ``can_append(num_tokens)``: bool ``[B]``, whether appending ``num_tokens`` more keeps
  every token the model will need. A model gives NaN logits for a sequence where it is
  false (under ``jit`` nothing else can signal an overflow).
* ``validate_append(batch_size, num_tokens)``: with concrete values, raises
  ``ValueError`` for a call that would not fit.
* ``logical_axes()``: the same pytree with ``PartitionSpec`` leaves of logical axis
  names, which ``flax.linen.logical_to_mesh_sharding`` maps to shardings.

Positions of the real tokens of a sequence increase with the order in which they were
appended; padding (position -1) may sit anywhere. Truncation relies on that order.

Caches of attention layers add the per-layer interface the ``Attention`` layer uses
(``lhc.nn.attention``):

* ``begin_update(positions) -> (writer, layers)``: ``writer`` is shared by every layer
  of the call; ``layers`` is the per-layer storage (stacked arrays whose leaves lead
  with ``[L]``, or tuples of per-layer arrays), which the model carries through its
  layers and each layer updates in place.
* ``writer.read(layers, layer, keys, values) -> KVView``: what layer ``layer`` attends
  to, given this call's keys and values ``[B, T, K, H]``: what it holds, with *that
  layer's* key positions (so a cache may keep a different set of tokens in every
  layer), and the call's own keys.
* ``writer.write(layers, layer, keys, values, after=attended) -> layers``: stores them,
  after the attention output ``attended`` is computed (``lhc.nn.attention.ordered_after``):
  read first, then write in place.
* ``finish_update(writer, layers) -> cache``: the cache after the call.

``KVCache`` keeps every token (``capacity`` slots). ``SlidingWindowKVCache`` keeps the
last ``slots`` tokens in a ring for a model whose layers all attend within a window
``W <= slots``: its memory does not grow with the context, and it can be truncated by up
to ``slots - W`` tokens without losing a key that a later query needs.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from lhc.nn.attention import KVView, ordered_after, write_slots

# Keys and values are stored heads-major, [B, K, S, H] per layer: a layer's keys for one
# head are contiguous over slots, the operand layout of the attention matmuls. A model
# that scans over stacked layers keeps one [L, B, K, S, H] array; a model that loops
# over layers keeps a tuple of L arrays, so that attention reads a layer's buffer
# itself (slicing a stacked array copies the layer on CPU).
CACHE_KV_AXES = (None, "cache_batch", "cache_kv_heads", "cache_len", "cache_kv")
CACHE_LAYER_KV_AXES = CACHE_KV_AXES[1:]
CACHE_POSITION_AXES = ("cache_batch", "cache_len")


def is_concrete(*values) -> bool:
    """Whether every value is known outside a trace (so it may be checked in Python)."""
    return not any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(values))


def repeat_rows(cache, repeats: int):
    """The cache with every sequence repeated ``repeats`` times in a row (sequence ``b``
    becomes rows ``b * repeats .. (b + 1) * repeats - 1``), for any cache of the protocol
    of ``lhc.lm.cache``: each leaf is repeated along the axis its ``logical_axes()``
    names ``cache_batch``."""

    def repeat(leaf, spec):
        return jnp.repeat(leaf, repeats, axis=tuple(spec).index("cache_batch"))

    return jax.tree.map(repeat, cache, cache.logical_axes())


@runtime_checkable
class Cache(Protocol):
    """What every model's cache offers (see the module docstring)."""

    lengths: jax.Array

    @property
    def capacity(self) -> int | None: ...

    def truncate(self, new_lengths: jax.Array | int) -> Cache: ...

    def truncate_at_position(self, positions: jax.Array | int) -> Cache: ...

    def next_positions(self) -> jax.Array: ...

    def can_append(self, num_tokens: int) -> jax.Array: ...

    def validate_append(self, batch_size: int, num_tokens: int) -> None: ...

    def logical_axes(self) -> Any: ...


# The members every cache has: the protocol's attributes and methods.
PROTOCOL_MEMBERS = tuple(
    sorted(set(Cache.__annotations__) | {n for n in vars(Cache) if not n.startswith("_")})
)


def check_cache(cache: Any, what: str = "cache") -> None:
    """A one-line ``ValueError`` naming ``what`` unless ``cache`` has every member of the
    ``Cache`` protocol (``PROTOCOL_MEMBERS``)."""
    missing = [name for name in PROTOCOL_MEMBERS if not hasattr(cache, name)]
    if missing:
        raise ValueError(
            f"{what}: expected a cache of the lhc.lm.cache protocol, got a "
            f"{type(cache).__name__} without {', '.join(missing)}"
        )


def checked_lengths(new_lengths, lengths: jax.Array) -> jax.Array:
    """``new_lengths`` broadcast to ``[B]``, checked when concrete, clipped under jit."""
    new_lengths = jnp.broadcast_to(jnp.asarray(new_lengths, jnp.int32), lengths.shape)
    if is_concrete(new_lengths, lengths):
        new_np, old_np = np.asarray(new_lengths), np.asarray(lengths)
        if (new_np < 0).any() or (new_np > old_np).any():
            raise ValueError(
                f"truncate: new_lengths must lie in [0, lengths]; got new_lengths="
                f"{new_np.tolist()} for lengths={old_np.tolist()}"
            )
    return jnp.clip(new_lengths, 0, lengths)


def check_batch(name: str, lengths: jax.Array, batch_size: int) -> None:
    if lengths.shape != (batch_size,):
        raise ValueError(
            f"{name}: the cache holds {lengths.shape[0]} sequences, the call has {batch_size}"
        )


def check_room(lengths: jax.Array, num_tokens: int, capacity: int) -> None:
    """Raises ValueError when appending ``num_tokens`` would pass ``capacity`` (the
    lengths checked only when concrete)."""
    if num_tokens > capacity:
        raise ValueError(f"appending {num_tokens} tokens exceeds the cache capacity {capacity}")
    if is_concrete(lengths):
        lengths = np.asarray(lengths)
        if (lengths + num_tokens > capacity).any():
            raise ValueError(
                f"appending {num_tokens} tokens to cache lengths {lengths.tolist()} exceeds "
                f"the cache capacity {capacity}"
            )


def positions_to_lengths(positions, slot_positions, slot_order, lengths) -> jax.Array:
    """Lengths that keep exactly the tokens at positions ``< positions[b]``.

    Args:
        positions: int ``[B]`` (or a scalar).
        slot_positions: int ``[B, S]``, the position in each slot (-1: none).
        slot_order: int ``[B, S]``, the index (0-based append order) of the token in each
            slot, -1 where the slot holds none.
        lengths: int ``[B]``.
    """
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), lengths.shape)
    present = slot_order >= 0
    keep = present & (slot_positions >= 0) & (slot_positions < positions[:, None])
    last_kept = jnp.max(jnp.where(keep, slot_order, -1), axis=1)
    # Nothing kept: forget back to the oldest token still held (everything, for a cache
    # that holds all its tokens).
    oldest = jnp.min(jnp.where(present, slot_order, lengths[:, None]), axis=1)
    return jnp.where(last_kept >= 0, last_kept + 1, jnp.minimum(oldest, lengths))


# The cache of every token ----------------------------------------------------------------


class SlotWriter:
    """A writer whose attention reads the stored keys as they were before the call
    (``positions``) and the call's own (``new_positions``), then writes the call's last
    ``T'`` keys at ``slots`` (int32 ``[B, T']``; a slot past the end is dropped).

    A subclass is a ``struct.dataclass`` with those three fields (and what else it needs).
    """

    def read(self, layers, layer, keys, values) -> KVView:
        stored_keys, stored_values = layers
        return KVView(
            keys=_layer_view(stored_keys, layer),
            values=_layer_view(stored_values, layer),
            positions=self.positions,
            new_keys=keys,
            new_values=values,
            new_positions=self.new_positions,
        )

    def write(self, layers, layer, keys, values, *, after):
        kept = self.slots.shape[1]
        return tuple(
            put_slots(store, layer, self.slots, ordered_after(new[:, -kept:], after))
            for store, new in zip(layers, (keys, values))
        )


@struct.dataclass
class _KVWriter(SlotWriter):
    """``KVCache``'s writer for one call: where each sequence writes, what it then holds."""

    slots: jax.Array  # int32 [B, T], the slot of each of this call's tokens
    positions: jax.Array  # int32 [B, S], slot positions before this call
    new_positions: jax.Array  # int32 [B, T], this call's positions
    key_positions: jax.Array  # int32 [B, S], slot positions after this call


def put_slots(store, layer, slots: jax.Array, update: jax.Array):
    """Writes ``update`` ``[B, T, K, H]`` into layer ``layer`` of ``store`` at
    ``[b, :, slots[b, t], :]``, in place. Slots past the end are dropped (the model then
    gives NaN logits for that sequence, see ``Cache.can_append``)."""
    rows = jnp.arange(update.shape[0])[:, None]
    if isinstance(store, tuple):
        layer_store = store[layer]
        written = layer_store.at[rows, :, slots].set(update.astype(layer_store.dtype), mode="drop")
        return store[:layer] + (written,) + store[layer + 1 :]
    return store.at[layer, rows, :, slots].set(update.astype(store.dtype), mode="drop")


def _layer_view(store, layer) -> jax.Array:
    """Layer ``layer`` of ``store`` as ``[B, S, K, H]``."""
    return jnp.swapaxes(store[layer], 1, 2)


def _store_shape(store) -> tuple[int, int, int, int, int]:
    """``(L, B, K, S, H)`` of a stacked array or a tuple of per-layer arrays."""
    if isinstance(store, tuple):
        return (len(store), *store[0].shape)
    return tuple(store.shape)


def _new_store(config, batch_size: int, slots: int, num_layers: int):
    shape = (batch_size, config.num_kv_heads, slots, config.head_dim)
    dtype = jnp.dtype(config.dtype)
    if getattr(config, "scan_layers", False) or getattr(config, "switch_layers", False):
        return jnp.zeros((num_layers, *shape), dtype)
    return tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))


def empty_slots(config, batch_size: int, slots: int, num_layers: int | None = None):
    """Zero key and value stores of ``slots`` slots for ``num_layers`` layers (default
    the config's), every slot empty (position -1): the fields of a ``KVCache``."""
    num_layers = config.num_layers if num_layers is None else num_layers
    return {
        "keys": _new_store(config, batch_size, slots, num_layers),
        "values": _new_store(config, batch_size, slots, num_layers),
        "positions": jnp.full((batch_size, slots), -1, jnp.int32),
        "lengths": jnp.zeros((batch_size,), jnp.int32),
    }


def store_axes(store):
    if isinstance(store, tuple):
        return tuple(PartitionSpec(*CACHE_LAYER_KV_AXES) for _ in store)
    return PartitionSpec(*CACHE_KV_AXES)


def _append_slots(start: jax.Array, num_tokens: int) -> jax.Array:
    return start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]


class StoredKeys:
    """Shape of a cache whose ``keys`` are stacked ``[L, B, K, S, H]`` or a tuple of
    ``[B, K, S, H]`` per layer."""

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(L, B, K, S, H)``, whichever way the layers are stored."""
        return _store_shape(self.keys)

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def stacked_layers(self) -> bool:
        """The layers' keys are one stacked array, which a traced layer index can address."""
        return not isinstance(self.keys, tuple)

    @property
    def head_shape(self) -> tuple[int, int]:
        """``(K, H)``: key/value heads and head dim."""
        return self.shape[2], self.shape[4]


class InOrderSlots:
    """For a cache whose slot ``i`` holds a sequence's ``i``-th appended token
    (``positions [B, S]``, ``lengths [B]``, ``capacity`` and ``truncate``): truncation at
    a position and the next positions."""

    def truncate_at_position(self, positions: jax.Array | int):
        """Forgets every token at a position ``>= positions[b]`` (see the module docstring)."""
        slots = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
        order = jnp.where(slots < self.lengths[:, None], slots, -1)
        return self.truncate(positions_to_lengths(positions, self.positions, order, self.lengths))

    def next_positions(self) -> jax.Array:
        """int32 ``[B]``: one past the largest position stored per sequence (0 if empty)."""
        return jnp.maximum(jnp.max(self.positions, axis=1) + 1, 0)


@struct.dataclass
class KVCache(InOrderSlots, StoredKeys):
    """Keys and values of every appended token, per layer.

    Layout (L layers, B sequences, S slots, K key/value heads, H head dim):

    * ``keys``, ``values``: ``[L, B, K, S, H]`` in the compute dtype, or (for models
      that loop over layers) a tuple of L arrays ``[B, K, S, H]``;
    * ``positions``: int32 ``[B, S]``, the position of the token in each slot, shared by
      all layers; -1 marks an empty slot or a padding token;
    * ``lengths``: int32 ``[B]``, how many slots each sequence has used.

    Appending ``T`` tokens writes sequence ``b`` into slots ``lengths[b] : lengths[b] + T``,
    whatever their positions, so padding tokens take slots but are never attended to.
    """

    keys: Any
    values: Any
    positions: jax.Array
    lengths: jax.Array

    @property
    def batch_size(self) -> int:
        return self.shape[1]

    @property
    def capacity(self) -> int:
        """S, the number of slots per sequence."""
        return self.shape[3]

    def truncate(self, new_lengths: jax.Array | int) -> KVCache:
        """Forgets every slot at or beyond ``new_lengths``.

        Args:
            new_lengths: int ``[B]`` (or a scalar for all sequences), each at most the
                current length. Lengths are in slots, padding slots included.

        Returns:
            A cache whose slots ``>= new_lengths[b]`` are empty (position -1). Keys and
            values there stay in place; they are masked and overwritten later.

        Raises:
            ValueError: with concrete values, a new length that is negative or exceeds
                the current one. Under ``jit`` the new lengths are clipped to
                ``[0, lengths]`` instead.
        """
        new_lengths = checked_lengths(new_lengths, self.lengths)
        slots = jnp.arange(self.capacity, dtype=jnp.int32)
        positions = jnp.where(slots[None, :] < new_lengths[:, None], self.positions, -1)
        return self.replace(positions=positions, lengths=new_lengths)

    def can_append(self, num_tokens: int) -> jax.Array:
        return self.lengths + num_tokens <= self.capacity

    def validate_append(self, batch_size: int, num_tokens: int) -> None:
        check_batch("cache", self.lengths, batch_size)
        check_room(self.lengths, num_tokens, self.capacity)

    def begin_update(self, positions: jax.Array) -> tuple[_KVWriter, tuple[Any, Any]]:
        writer = _KVWriter(
            slots=_append_slots(self.lengths, positions.shape[1]),
            positions=self.positions,
            new_positions=positions,
            key_positions=write_slots(self.positions, positions, self.lengths),
        )
        return writer, (self.keys, self.values)

    def finish_update(self, writer: _KVWriter, layers) -> KVCache:
        keys, values = layers
        return KVCache(
            keys=keys,
            values=values,
            positions=writer.key_positions,
            lengths=self.lengths + writer.slots.shape[1],
        )

    def logical_axes(self) -> KVCache:
        """The cache's logical axis names, as ``PartitionSpec`` leaves."""
        return KVCache(
            keys=store_axes(self.keys),
            values=store_axes(self.values),
            positions=PartitionSpec(*CACHE_POSITION_AXES),
            lengths=PartitionSpec("cache_batch"),
        )


def init_cache(config, batch_size: int, max_len: int) -> KVCache:
    """An empty ``KVCache`` with ``max_len`` slots per sequence for a model of ``config``.

    Args:
        config: the model's config (``num_layers``, ``num_kv_heads``, ``head_dim``,
            ``dtype``, ``max_len``).
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
    return KVCache(**empty_slots(config, batch_size, max_len))


# The ring of the last tokens -------------------------------------------------------------


@struct.dataclass
class _RingWriter(SlotWriter):
    """``SlidingWindowKVCache``'s writer for one call.

    Attention reads the ring as it was and the call's own keys; the last ``slots`` of
    the call's tokens then overwrite the oldest slots. Whatever they overwrite is
    outside the window of every later query.
    """

    slots: jax.Array  # int32 [B, T'], ring slots of the last T' = min(T, S) tokens
    positions: jax.Array  # int32 [B, S], slot positions before this call
    new_positions: jax.Array  # int32 [B, T]
    ring_positions: jax.Array  # int32 [B, S], slot positions after this call


@struct.dataclass
class SlidingWindowKVCache(StoredKeys):
    """Keys and values of the last ``slots`` tokens, for layers that attend within a window.

    Layout as ``KVCache`` with ``S = slots``; token ``i`` of a sequence (0-based, in
    append order, padding included) sits in slot ``i % S`` until token ``i + S``
    overwrites it. ``lengths`` counts every token ever appended, so it may exceed ``S``.

    A query at position ``p`` needs the keys at positions in ``(p - W, p]``; the ring
    holds them as long as the real tokens of a sequence are appended without padding in
    between (left padding before the first token is fine). ``truncate`` may go back by up
    to ``S - W + 1`` tokens; going further forgets keys that the next query needs, and the
    sequence is then marked incomplete (``can_append`` is false, the model gives NaN
    logits, and with concrete values the model raises).

    Attributes:
        keys, values: ``[L, B, K, S, H]``, or a tuple of L arrays ``[B, K, S, H]``.
        positions: int32 ``[B, S]``, the position in each slot (-1: empty or padding).
        lengths: int32 ``[B]``, tokens appended so far.
        complete: bool ``[B]``, whether the ring holds every key the next query needs.
        window: W, the attention window it serves (static).
    """

    keys: Any
    values: Any
    positions: jax.Array
    lengths: jax.Array
    complete: jax.Array
    window: int = struct.field(pytree_node=False)

    @property
    def slots(self) -> int:
        """S, the ring size."""
        return self.shape[3]

    @property
    def capacity(self) -> None:
        """``None``: a ring takes any number of tokens."""
        return None

    @property
    def padding_room(self) -> int:
        """``S - W``: the most padding tokens that may come between two real tokens of a
        sequence (a continued prompt's left padding) without pushing out keys the window
        needs."""
        return self.slots - self.window

    def _slot_order(self, lengths: jax.Array) -> jax.Array:
        """int32 ``[B, S]``: the append index of the token in each slot (-1: none yet)."""
        slots = jnp.arange(self.slots, dtype=jnp.int32)[None, :]
        last = lengths[:, None] - 1
        order = last - jnp.mod(last - slots, self.slots)
        return jnp.where(order >= 0, order, -1)

    def truncate(self, new_lengths: jax.Array | int) -> SlidingWindowKVCache:
        """Forgets every token appended after the first ``new_lengths[b]``.

        Raises:
            ValueError: with concrete values, new lengths outside ``[0, lengths]``.
        """
        new_lengths = checked_lengths(new_lengths, self.lengths)
        order = self._slot_order(self.lengths)
        positions = jnp.where(order < new_lengths[:, None], self.positions, -1)
        # The next query (token new_lengths) needs tokens from new_lengths - W + 1 on;
        # the ring still holds tokens from lengths - S on.
        still_held = (self.lengths <= self.slots) | (
            self.lengths - new_lengths <= self.slots - self.window + 1
        )
        return self.replace(
            positions=positions, lengths=new_lengths, complete=self.complete & still_held
        )

    def truncate_at_position(self, positions: jax.Array | int) -> SlidingWindowKVCache:
        """Forgets every token at a position ``>= positions[b]``."""
        order = jnp.where(self.positions >= 0, self._slot_order(self.lengths), -1)
        return self.truncate(positions_to_lengths(positions, self.positions, order, self.lengths))

    def next_positions(self) -> jax.Array:
        return jnp.maximum(jnp.max(self.positions, axis=1) + 1, 0)

    def can_append(self, num_tokens: int) -> jax.Array:
        del num_tokens  # a ring takes any number
        return self.complete

    def validate_append(self, batch_size: int, num_tokens: int) -> None:
        check_batch("cache", self.lengths, batch_size)
        if is_concrete(self.complete) and not np.asarray(self.complete).all():
            raise ValueError(
                f"the sliding-window cache was truncated back by more than slots - window + 1 "
                f"= {self.slots - self.window + 1} tokens for sequences "
                f"{np.flatnonzero(~np.asarray(self.complete)).tolist()}: keys the next query "
                "needs are gone"
            )

    def begin_update(self, positions: jax.Array) -> tuple[_RingWriter, tuple[Any, Any]]:
        length = positions.shape[1]
        kept = min(length, self.slots)
        slots = jnp.mod(_append_slots(self.lengths + length - kept, kept), self.slots)
        rows = jnp.arange(positions.shape[0])[:, None]
        writer = _RingWriter(
            slots=slots,
            positions=self.positions,
            new_positions=positions,
            ring_positions=self.positions.at[rows, slots].set(positions[:, length - kept :]),
        )
        return writer, (self.keys, self.values)

    def finish_update(self, writer: _RingWriter, layers) -> SlidingWindowKVCache:
        keys, values = layers
        return self.replace(
            keys=keys,
            values=values,
            positions=writer.ring_positions,
            lengths=self.lengths + writer.new_positions.shape[1],
        )

    def logical_axes(self) -> SlidingWindowKVCache:
        return self.replace(
            keys=store_axes(self.keys),
            values=store_axes(self.values),
            positions=PartitionSpec(*CACHE_POSITION_AXES),
            lengths=PartitionSpec("cache_batch"),
            complete=PartitionSpec("cache_batch"),
        )


def init_sliding_window_cache(
    config, batch_size: int, window: int, slots: int
) -> SlidingWindowKVCache:
    """An empty ring of ``slots >= window`` tokens per sequence for a model of ``config``.

    Raises:
        ValueError: non-positive sizes or ``slots < window``.
    """
    if batch_size <= 0:
        raise ValueError(
            f"init_sliding_window_cache: batch_size must be positive, got {batch_size}"
        )
    if not 0 < window <= slots:
        raise ValueError(
            f"init_sliding_window_cache: need 0 < window <= slots, got {window=} {slots=}"
        )
    return SlidingWindowKVCache(
        **empty_slots(config, batch_size, slots),
        complete=jnp.ones((batch_size,), bool),
        window=int(window),
    )
