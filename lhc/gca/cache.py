"""The GCA cache: sliding-window rings, the chunk memory and the current retrievals.

A GCA model appends text tokens; its layers see the *stream*, the text with a landmark
closing every ``S - 1`` text tokens (``S = chunk_size``), text position ``p`` at stream
position ``p + p // (S - 1)``. The real stream entries of a sequence have contiguous
stream positions, so every ring here is indexed by stream position (slot ``q % R``):
padding tokens never take a slot. The cache holds:

* ``window_keys``, ``window_values``: per sliding-window layer ``[B, K, R, H]``, the
  keys and values of the last ``R = window + 2 S`` stream positions, with
  ``window_positions`` ``[B, R]`` (shared by the layers; -1 marks an empty slot).
* ``hidden`` ``[B, 2S, D]`` with ``hidden_positions``: the lower decoder's outputs of
  the last two chunks, from which the chunk encoder runs when a chunk completes (and
  which a truncation back into the last completed chunk restores).
* ``memory_keys``, ``memory_values`` ``[B, N, S, K, H]`` and ``landmark_keys``
  ``[B, N, D]``: the encoded chunks (chunk ``j`` at index ``j``), ``N`` =
  the chunks of the cache's ``max_len`` text tokens. With ``config.offload_memory``
  the memory keys and values live in host memory.
* ``retrieval_indices``, ``retrieval_weights`` ``[B, G, 2, top_k]`` and
  ``retrieval_chunks`` ``[B, 2]``: per retrieval group, the retrievals made at the
  landmarks of the last two completed chunks (slot ``j % 2``); chunk ``j``'s retrieval
  serves the tokens of chunk ``j + 1``.
* ``recent_positions`` ``[B, A]``: the text positions of the last ``A`` appended tokens
  (slot = append index ``% A``, -1 for padding), which map lengths to positions.
* ``stream_lengths`` ``[B]`` (real stream entries, i.e. one past the last stream
  position), ``lengths`` ``[B]`` (text tokens appended, padding included, the protocol's
  count) and ``complete`` ``[B]``.

Truncation is exact back to the start of the last completed chunk (at most ``2 S``
stream positions and ``A`` appended tokens); further back, the sequence is marked
incomplete (``can_append`` is false: NaN logits, or an error with concrete values).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from lhc.gca.config import GCAConfig
from lhc.lm.cache import (
    SlotWriter,
    checked_lengths,
    is_concrete,
    positions_to_lengths,
)
from lhc.parallel.offload import to_host


def stream_position(text_positions: jax.Array, text_per_chunk: int) -> jax.Array:
    """Stream position of text position ``p``: ``p + p // (S - 1)`` (negative stays -1)."""
    return jnp.where(text_positions >= 0, text_positions + text_positions // text_per_chunk, -1)


def text_length(stream_lengths: jax.Array, chunk_size: int) -> jax.Array:
    """Text tokens in the first ``stream_lengths`` stream positions (landmarks excluded)."""
    return stream_lengths - stream_lengths // chunk_size


class StreamLayout(NamedTuple):
    """Where one call's entries go in its stream buffer of ``T'`` entries, and the ``M``
    chunks the call completes (chunk ``first_chunk + m``, closed by its landmark)."""

    tokens: jax.Array  # int32 [B, T']: the text with the landmarks inserted
    positions: jax.Array  # int32 [B, T']: stream positions (-1: padding)
    text_index: jax.Array  # int32 [B, T]: the entry of each text token (T' for padding)
    start: jax.Array  # int32 [B]: stream position of entry 0
    end: jax.Array  # int32 [B]: one past the last real stream position
    num_landmarks: jax.Array  # int32 [B]: chunks completed by the call
    first_chunk: jax.Array  # int32 [B]: the chunk entry 0 belongs to
    chunk_ids: jax.Array  # int32 [B, M]
    chunk_valid: jax.Array  # bool [B, M]
    landmark_entry: jax.Array  # int32 [B, M]: the entry of each chunk's landmark


def stream_layout(cfg: GCAConfig, tokens, positions, cache: GCACache | None) -> StreamLayout:
    """The stream of one call of ``lhc.gca.GCA`` on text ``tokens``, ``positions`` ``[B, T]``:
    entry ``i`` of a row is stream position ``start + i``, where ``start`` continues the
    cache (0 without one)."""
    size, per_chunk = cfg.chunk_size, cfg.text_per_chunk
    batch, length = tokens.shape
    rows = jnp.arange(batch)[:, None]
    real = positions >= 0
    start_text = jnp.zeros((batch,), jnp.int32) if cache is None else cache.text_lengths()
    start = stream_position(start_text, per_chunk)
    buffer_len = length + length // per_chunk + 1
    text_stream = stream_position(positions, per_chunk)
    text_index = jnp.where(real, text_stream - start[:, None], buffer_len)
    closes = real & (jnp.mod(positions, per_chunk) == per_chunk - 1)
    landmark_index = jnp.where(closes, text_index + 1, buffer_len)
    buffer_tokens = (
        jnp.zeros((batch, buffer_len), jnp.int32)
        .at[rows, text_index]
        .set(tokens.astype(jnp.int32), mode="drop")
        .at[rows, landmark_index]
        .set(cfg.landmark_id, mode="drop")
    )
    buffer_positions = (
        jnp.full((batch, buffer_len), -1, jnp.int32)
        .at[rows, text_index]
        .set(text_stream, mode="drop")
        .at[rows, landmark_index]
        .set(text_stream + 1, mode="drop")
    )
    num_landmarks = jnp.sum(closes, axis=1)
    end = start + jnp.sum(real, axis=1) + num_landmarks

    # The chunks this call completes, in order: chunk first_chunk + m.
    max_landmarks = length // per_chunk + 1
    first_chunk = start // size
    chunk_ids = first_chunk[:, None] + jnp.arange(max_landmarks, dtype=jnp.int32)
    chunk_valid = jnp.arange(max_landmarks)[None, :] < num_landmarks[:, None]
    landmark_entry = jnp.clip((chunk_ids + 1) * size - 1 - start[:, None], 0, buffer_len - 1)
    return StreamLayout(
        tokens=buffer_tokens,
        positions=buffer_positions,
        text_index=text_index,
        start=start,
        end=end,
        num_landmarks=num_landmarks,
        first_chunk=first_chunk,
        chunk_ids=chunk_ids,
        chunk_valid=chunk_valid,
        landmark_entry=landmark_entry,
    )


@struct.dataclass
class StreamWriter(SlotWriter):
    """The window rings' writer for one call (``lhc.nn.attention.LayerWriter``).

    Attention reads the ring as it was plus the call's own keys; the call's entries then
    go to slot ``position % R``, only those among the last ``R`` stream positions (an
    entry the ring cannot hold, or a padding entry, is dropped).
    """

    slots: jax.Array  # int32 [B, T'], ring slot of each entry; R (dropped) if not kept
    positions: jax.Array  # int32 [B, R], ring positions before the call
    new_positions: jax.Array  # int32 [B, T'], stream positions of the call (-1: padding)


def ring_slots(stream_positions: jax.Array, stream_end: jax.Array, size: int) -> jax.Array:
    """Slot ``q % size`` of each entry among the last ``size`` before ``stream_end``, else
    ``size`` (out of range: a write there is dropped)."""
    keep = (stream_positions >= 0) & (stream_positions >= stream_end[:, None] - size)
    return jnp.where(keep, jnp.mod(stream_positions, size), size)


def ring_positions(
    positions: jax.Array, stream_positions: jax.Array, stream_end: jax.Array
) -> jax.Array:
    """A ring's slot positions ``[B, R]`` after writing the call's entries."""
    size = positions.shape[1]
    slots = ring_slots(stream_positions, stream_end, size)
    rows = jnp.arange(positions.shape[0])[:, None]
    return positions.at[rows, slots].set(stream_positions, mode="drop")


@struct.dataclass
class GCACache:
    """See the module docstring for the fields."""

    window_keys: tuple[jax.Array, ...]
    window_values: tuple[jax.Array, ...]
    window_positions: jax.Array
    hidden: jax.Array
    hidden_positions: jax.Array
    memory_keys: jax.Array
    memory_values: jax.Array
    landmark_keys: jax.Array
    retrieval_indices: jax.Array
    retrieval_weights: jax.Array
    retrieval_chunks: jax.Array
    recent_positions: jax.Array
    stream_lengths: jax.Array
    lengths: jax.Array
    complete: jax.Array
    chunk_size: int = struct.field(pytree_node=False)
    window: int = struct.field(pytree_node=False)
    max_len: int = struct.field(pytree_node=False)

    @property
    def capacity(self) -> None:
        """``None``: padding takes no room; ``can_append`` bounds the text length."""
        return None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def ring_size(self) -> int:
        return self.window_positions.shape[1]

    def text_lengths(self) -> jax.Array:
        """int32 ``[B]``: real text tokens held (the next text position)."""
        return text_length(self.stream_lengths, self.chunk_size)

    def next_positions(self) -> jax.Array:
        return self.text_lengths()

    def num_chunks(self) -> jax.Array:
        """int32 ``[B]``: completed (encoded) chunks."""
        return self.stream_lengths // self.chunk_size

    def can_append(self, num_tokens: int) -> jax.Array:
        return self.complete & (self.text_lengths() + num_tokens <= self.max_len)

    def validate_append(self, batch_size: int, num_tokens: int) -> None:
        if self.lengths.shape != (batch_size,):
            raise ValueError(
                f"cache: the cache holds {self.lengths.shape[0]} sequences, the call has "
                f"{batch_size}"
            )
        if is_concrete(self.complete) and not np.asarray(self.complete).all():
            raise ValueError(
                "the GCA cache was truncated back further than the start of its last "
                f"completed chunk for sequences {np.flatnonzero(~np.asarray(self.complete)).tolist()}:"
                " the states the next token needs are gone"
            )
        if is_concrete(self.stream_lengths):
            held = np.asarray(self.text_lengths())
            if (held + num_tokens > self.max_len).any():
                raise ValueError(
                    f"appending {num_tokens} tokens to sequences holding {held.tolist()} text "
                    f"tokens exceeds the model's max_len {self.max_len}"
                )

    # Truncation ---------------------------------------------------------------------

    def _recent_order(self) -> jax.Array:
        """int32 ``[B, A]``: the append index of the token in each recent slot (-1: none)."""
        size = self.recent_positions.shape[1]
        slots = jnp.arange(size, dtype=jnp.int32)[None, :]
        last = self.lengths[:, None] - 1
        order = last - jnp.mod(last - slots, size)
        return jnp.where(order >= 0, order, -1)

    def truncate_at_position(self, positions: jax.Array | int) -> GCACache:
        """Forgets every text token at a position ``>= positions[b]`` (and the padding
        appended after the last token kept)."""
        positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), self.lengths.shape)
        order = jnp.where(self.recent_positions >= 0, self._recent_order(), -1)
        new_lengths = positions_to_lengths(positions, self.recent_positions, order, self.lengths)
        return self._cut(jnp.clip(positions, 0, self.text_lengths()), new_lengths)

    def truncate(self, new_lengths: jax.Array | int) -> GCACache:
        """Forgets every token appended after the first ``new_lengths[b]``.

        Raises:
            ValueError: with concrete values, new lengths outside ``[0, lengths]``.
        """
        new_lengths = checked_lengths(new_lengths, self.lengths)
        order = self._recent_order()
        dropped = (order >= new_lengths[:, None]) & (self.recent_positions >= 0)
        # Positions are contiguous: the first dropped real token's position is the new end.
        first_dropped = jnp.min(jnp.where(dropped, self.recent_positions, self.max_len), axis=1)
        new_text = jnp.minimum(first_dropped, self.text_lengths())
        in_ring = self.lengths - new_lengths <= self.recent_positions.shape[1]
        cut = self._cut(new_text, new_lengths)
        return cut.replace(complete=cut.complete & in_ring)

    def _cut(self, new_text: jax.Array, new_lengths: jax.Array) -> GCACache:
        """Keeps the text positions ``< new_text`` and sets ``lengths = new_lengths``."""
        per_chunk = self.chunk_size - 1
        new_stream = new_text + new_text // per_chunk
        old_stream = self.stream_lengths
        chunk = new_stream // self.chunk_size  # the chunk the next entry belongs to
        forget = lambda positions: jnp.where(positions < new_stream[:, None], positions, -1)
        rows = jnp.arange(self.batch_size)
        held = self.retrieval_chunks[rows, jnp.mod(chunk - 1, 2)] == chunk - 1
        complete = (
            self.complete
            # The window ring still holds the last `window` positions before new_stream.
            & (old_stream - new_stream <= self.ring_size - self.window)
            # The hidden ring still holds the current chunk's entries.
            & (chunk * self.chunk_size >= old_stream - self.hidden.shape[1])
            # The retrieval that serves the current chunk is still held.
            & ((chunk == 0) | held)
        )
        recent = jnp.where(self.recent_positions < new_text[:, None], self.recent_positions, -1)
        order = self._recent_order()
        recent = jnp.where(order < new_lengths[:, None], recent, -1)
        return self.replace(
            window_positions=forget(self.window_positions),
            hidden_positions=forget(self.hidden_positions),
            recent_positions=recent,
            stream_lengths=new_stream,
            lengths=new_lengths,
            complete=complete,
        )

    def logical_axes(self) -> GCACache:
        batch = PartitionSpec("cache_batch")
        window = PartitionSpec("cache_batch", "cache_kv_heads", "cache_len", "cache_kv")
        memory = PartitionSpec("cache_batch", None, None, "cache_kv_heads", "cache_kv")
        return self.replace(
            window_keys=tuple(window for _ in self.window_keys),
            window_values=tuple(window for _ in self.window_values),
            window_positions=PartitionSpec("cache_batch", "cache_len"),
            hidden=PartitionSpec("cache_batch", None, None),
            hidden_positions=PartitionSpec("cache_batch", None),
            memory_keys=memory,
            memory_values=memory,
            landmark_keys=PartitionSpec("cache_batch", None, None),
            retrieval_indices=PartitionSpec("cache_batch", None, None, None),
            retrieval_weights=PartitionSpec("cache_batch", None, None, None),
            retrieval_chunks=PartitionSpec("cache_batch", None),
            recent_positions=PartitionSpec("cache_batch", None),
            stream_lengths=batch,
            lengths=batch,
            complete=batch,
        )


def init_gca_cache(config: GCAConfig, batch_size: int, max_len: int | None = None) -> GCACache:
    """An empty cache for sequences of up to ``max_len`` text tokens.

    Args:
        config: the model's config.
        batch_size: B.
        max_len: the most text tokens per sequence (sizes the chunk memory); at most
            ``config.max_len``, which is the default.

    Raises:
        ValueError: non-positive sizes or ``max_len > config.max_len``.
    """
    max_len = config.max_len if max_len is None else max_len
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"init_cache: batch_size must be a positive int, got {batch_size!r}")
    if (
        isinstance(max_len, bool)
        or not isinstance(max_len, int)
        or not (0 < max_len <= config.max_len)
    ):
        raise ValueError(
            f"init_cache: max_len must be an int in [1, config.max_len={config.max_len}], "
            f"got {max_len!r}"
        )
    dtype = jnp.dtype(config.dtype)
    size = config.chunk_size
    ring = config.window + 2 * size
    num_chunks = -(-max_len // config.text_per_chunk)
    window_shape = (batch_size, config.num_kv_heads, ring, config.head_dim)
    memory_shape = (batch_size, num_chunks, size, config.num_kv_heads, config.head_dim)
    retrieval_shape = (batch_size, config.num_groups, 2, config.top_k)
    memory_keys = jnp.zeros(memory_shape, dtype)
    memory_values = jnp.zeros(memory_shape, dtype)
    if config.offload_memory:
        memory_keys, memory_values = to_host(memory_keys), to_host(memory_values)
    return GCACache(
        window_keys=tuple(jnp.zeros(window_shape, dtype) for _ in range(config.num_window_layers)),
        window_values=tuple(
            jnp.zeros(window_shape, dtype) for _ in range(config.num_window_layers)
        ),
        window_positions=jnp.full((batch_size, ring), -1, jnp.int32),
        hidden=jnp.zeros((batch_size, 2 * size, config.embed_dim), dtype),
        hidden_positions=jnp.full((batch_size, 2 * size), -1, jnp.int32),
        memory_keys=memory_keys,
        memory_values=memory_values,
        landmark_keys=jnp.zeros((batch_size, num_chunks, config.embed_dim), dtype),
        retrieval_indices=jnp.full(retrieval_shape, -1, jnp.int32),
        retrieval_weights=jnp.zeros(retrieval_shape, jnp.float32),
        retrieval_chunks=jnp.full((batch_size, 2), -1, jnp.int32),
        recent_positions=jnp.full((batch_size, 2 * size), -1, jnp.int32),
        stream_lengths=jnp.zeros((batch_size,), jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        complete=jnp.ones((batch_size,), bool),
        chunk_size=size,
        window=config.window,
        max_len=max_len,
    )


def cache_after_call(
    cache: GCACache,
    stream: StreamLayout,
    layers,
    lower_out,
    positions,
    memory,
    memory_landmarks,
    fresh,
) -> GCACache:
    """The cache after a call of ``lhc.gca.GCA`` that appended ``positions`` ``[B, T]``.

    Args:
        cache: the cache before the call.
        stream: the call's ``stream_layout``.
        layers: ``(window_keys, window_values)`` as the window layers wrote them.
        lower_out: ``[B, T', D]``, the lower decoder's outputs of the call's stream.
        positions: int32 ``[B, T]``, the text positions appended.
        memory: ``(keys, values)``, the chunk memory with the call's chunks stored.
        memory_landmarks: ``[B, N, D]``, the landmark keys likewise.
        fresh: per retrieval group, the call's ``(indices, weights)`` ``[B, M, top_k]``.
    """
    batch, length = positions.shape
    rows = jnp.arange(batch)[:, None]
    buffer_positions, end, chunk_ids = stream.positions, stream.end, stream.chunk_ids
    window_keys, window_values = layers
    hidden_size = cache.hidden.shape[1]
    hidden = cache.hidden.at[rows, ring_slots(buffer_positions, end, hidden_size)].set(
        lower_out.astype(cache.hidden.dtype), mode="drop"
    )
    # Retrievals of the last two chunks completed, at slot chunk % 2.
    m = jnp.arange(chunk_ids.shape[1])[None, :]
    keep = stream.chunk_valid & (m >= stream.num_landmarks[:, None] - 2)
    slot = jnp.where(keep, jnp.mod(chunk_ids, 2), 2)
    retrieval_indices, retrieval_weights = cache.retrieval_indices, cache.retrieval_weights
    for group, (indices, weights) in enumerate(fresh):
        retrieval_indices = retrieval_indices.at[rows, group, slot].set(indices, mode="drop")
        retrieval_weights = retrieval_weights.at[rows, group, slot].set(weights, mode="drop")
    retrieval_chunks = cache.retrieval_chunks.at[rows, slot].set(chunk_ids, mode="drop")
    # Text positions of the last appended tokens, at slot append index % A.
    recent = cache.recent_positions.shape[1]
    order = cache.lengths[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
    recent_slots = jnp.where(
        order >= cache.lengths[:, None] + length - recent, order % recent, recent
    )
    recent_positions = cache.recent_positions.at[rows, recent_slots].set(positions, mode="drop")
    return cache.replace(
        window_keys=window_keys,
        window_values=window_values,
        window_positions=ring_positions(cache.window_positions, buffer_positions, end),
        hidden=hidden,
        hidden_positions=ring_positions(cache.hidden_positions, buffer_positions, end),
        memory_keys=memory[0],
        memory_values=memory[1],
        landmark_keys=memory_landmarks,
        retrieval_indices=retrieval_indices,
        retrieval_weights=retrieval_weights,
        retrieval_chunks=retrieval_chunks,
        recent_positions=recent_positions,
        stream_lengths=end,
        lengths=cache.lengths + length,
    )
