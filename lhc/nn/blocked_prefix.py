"""Attention over a segment read block by block: ``attention_with_blocked_prefix``
(a store padded for growth costs what it holds; a windowed layer reads its window) and
``BlockedKeys``, the protocol of a segment that computes each block's products itself
(QuantSpec's quantized store)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lhc.nn.attention_ops import (
    _inverse,
    _masked_logits,
    _masked_scores,
    _query_layout,
    _query_rows,
    attention_segments,
    weighted_values,
)


class BlockedKeys(Protocol):
    """A key/value segment that ``attention_with_blocked_prefix`` reads block by block
    through its own arithmetic: keys and values held in another form than plain arrays
    (QuantSpec's quantized store), turned into products one block at a time so that the
    whole segment is never expanded at once. Forward only (the loop's bounds are traced).

    Attributes:
        positions: int ``[B, M]`` or ``[B, K, M]``, the position of each slot (-1: empty).
        num_kv_heads: K.
        dtype: the dtype of the attention output.
    """

    positions: jax.Array
    num_kv_heads: int
    dtype: Any

    def scores(self, rows: jax.Array, start: jax.Array, size: int) -> jax.Array:
        """float32 ``[B, K, Q, size]``: ``rows [B, K, Q, H]`` times the keys of slots
        ``start .. start + size - 1`` (unscaled)."""
        ...

    def weighted(self, weights: jax.Array, start: jax.Array, size: int) -> jax.Array:
        """float32 ``[B, K, Q, H]``: ``weights [B, K, Q, size]`` times those slots' values."""
        ...

    def mask(self, start: jax.Array, size: int) -> jax.Array | None:
        """``None`` or bool ``[B, T, size]``: which of those slots each query may see
        besides the position mask."""
        ...


@struct.dataclass
class _PlainKeys:
    """``BlockedKeys`` over heads-major arrays ``[B, K, M, H]``."""

    keys: jax.Array
    values: jax.Array
    positions: jax.Array

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def dtype(self):
        return self.values.dtype

    def scores(self, rows, start, size):
        keys = jax.lax.dynamic_slice_in_dim(self.keys, start, size, axis=-2)
        return jnp.einsum("BKQH,BKSH->BKQS", rows, keys, preferred_element_type=jnp.float32)

    def weighted(self, weights, start, size):
        values = jax.lax.dynamic_slice_in_dim(self.values, start, size, axis=-2)
        return weighted_values(weights, jnp.swapaxes(values, 1, 2))

    def mask(self, start, size):
        return None


def attention_with_blocked_prefix(
    query: jax.Array,
    prefix: tuple[jax.Array, jax.Array, jax.Array] | BlockedKeys,
    segments: Sequence[tuple[jax.Array, ...]],
    query_positions: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    alibi_slopes: jax.Array | np.ndarray | None = None,
    block: int = 128,
) -> jax.Array:
    """``attention_segments`` over a prefix segment and ``segments``, reading of the
    prefix only the blocks that hold a key some query may see.

    A store whose arrays are longer than what it holds (empty slots, position -1, so
    that its shapes and compiled programs last while it grows) costs, read densely, as
    much as if it were full; a cache read by a chunk of a long prompt holds fewer keys at
    each chunk; with a sliding window only the last ``W`` positions matter. Here the
    prefix is read ``block`` slots at a time in a loop over the blocks between the first
    and the last slot holding a visible key (a key of any sequence or head at a position
    ``>= 0`` and, with a window, ``> min(query positions) - W``): run-time bounds, so one
    program serves every fill. The softmax is online, shared with the other segments
    (read densely). Equal to ``attention_segments(query, [prefix, *segments], ...)``,
    which its gradient differentiates for a plain prefix (the loop's bounds are traced;
    the backward pass reads the prefix densely).

    Args:
        query: ``[B, T, N, H]``.
        prefix: ``(keys [B, K, M, H], values [B, K, M, H], positions)``, heads-major (a
            cache's own layout), positions int ``[B, K, M]`` or ``[B, M]``; or a
            ``BlockedKeys`` (not differentiable).
        segments: as for ``attention_segments`` (token-major keys and values).
        query_positions: int ``[B, T]``.
        scale, window, alibi_slopes: as for ``attention_segments``.
        block: prefix slots per step of the loop (the last block starts early where the
            prefix is not a whole number of blocks; a ``BlockedKeys`` gets block starts
            that are multiples of ``M - block`` or of ``block``).

    Returns:
        ``[B, T, N, H]`` in the prefix values' dtype.
    """
    # Static settings, hashable: the slopes as a tuple of floats.
    slopes = None if alibi_slopes is None else tuple(np.asarray(alibi_slopes, float).tolist())
    static = (float(scale), window, slopes, int(block))
    if not isinstance(prefix, tuple):
        return _blocked_prefix_forward(query, prefix, tuple(segments), query_positions, static)
    return _blocked_prefix(query, prefix, tuple(segments), query_positions, static)


def _slopes(slopes):
    return None if slopes is None else np.asarray(slopes, np.float32)


def _dense_prefix(query, prefix, segments, query_positions, static):
    scale, window, slopes, _ = static
    settings = dict(scale=scale, window=window, alibi_slopes=_slopes(slopes))
    keys, values, positions = prefix
    first = (jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2), positions)
    out = attention_segments(query, [first, *segments], query_positions, **settings)
    return out.astype(values.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked_prefix(query, prefix, segments, query_positions, static):
    return _blocked_prefix_forward(query, _PlainKeys(*prefix), segments, query_positions, static)


def _blocked_prefix_fwd(query, prefix, segments, query_positions, static):
    out = _blocked_prefix_forward(query, _PlainKeys(*prefix), segments, query_positions, static)
    return out, (query, prefix, segments, query_positions)


def _blocked_prefix_bwd(static, residuals, cotangent):
    query, prefix, segments, query_positions = residuals
    _, pullback = jax.vjp(
        lambda q, p, s: _dense_prefix(q, p, s, query_positions, static), query, prefix, segments
    )
    return (*pullback(cotangent), None)


_blocked_prefix.defvjp(_blocked_prefix_fwd, _blocked_prefix_bwd)


def _blocked_prefix_forward(query, prefix: BlockedKeys, segments, query_positions, static):
    scale, window, slopes, block = static
    alibi_slopes = _slopes(slopes)
    positions = prefix.positions
    batch, length, num_heads, head_dim = query.shape
    num_kv_heads, slots = prefix.num_kv_heads, positions.shape[-1]
    block = min(block, slots)
    rows = _query_rows(query, num_kv_heads)
    settings = dict(scale=scale, window=window, alibi_slopes=alibi_slopes)
    flat = lambda x: x.reshape(batch, num_kv_heads, -1, x.shape[-1])  # [B, K, G*T, S]

    # The dense segments start the softmax's running state: (max, total, weighted sum).
    top = jnp.full(
        (batch, num_kv_heads, rows.shape[2] // length, length, 1), jnp.finfo(jnp.float32).min
    )
    parts = []
    for seg_keys, seg_values, seg_positions, *extra in segments:
        logits, mask = _masked_logits(
            rows,
            jnp.swapaxes(seg_keys, 1, 2),
            seg_positions,
            extra[0] if extra else None,
            query_positions,
            **settings,
        )
        top = jnp.maximum(top, jnp.max(logits, axis=-1, keepdims=True))
        parts.append((logits, mask, seg_values))
    total = jnp.zeros(top.shape, jnp.float32)
    acc = jnp.zeros((batch, num_kv_heads, rows.shape[2], head_dim), jnp.float32)
    # Masked scores hold the float32 minimum, so exp(score - top) is 0 wherever a row
    # has seen a key; rows that have seen none (top still the minimum) collect
    # weights of 1, rescaled to 0 once they see a key and dropped at the end.
    for logits, _, seg_values in parts:
        weights = jnp.exp(logits - top)
        total = total + jnp.sum(weights, axis=-1, keepdims=True)
        acc = acc + weighted_values(flat(weights), seg_values)

    first, last = _visible_blocks(positions, query_positions, window, block)
    # The last block of a store that is not a whole number of blocks starts early (a
    # slice is clamped into the array; padding it would copy the store): its slots
    # before i * block, read by the block before, are masked as empty.
    start = lambda i: jnp.minimum(i * block, slots - block)

    def step(i, state):
        top, total, acc = state
        block_positions = jax.lax.dynamic_slice_in_dim(positions, start(i), block, axis=-1)
        fresh = start(i) + jnp.arange(block) >= i * block
        block_positions = jnp.where(fresh, block_positions, -1)
        logits, _ = _masked_scores(
            prefix.scores(rows, start(i), block),
            block_positions,
            prefix.mask(start(i), block),
            query_positions,
            **settings,
        )
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1, keepdims=True))
        rescale = jnp.exp(top - new_top)
        weights = jnp.exp(logits - new_top)
        total = total * rescale + jnp.sum(weights, axis=-1, keepdims=True)
        part = prefix.weighted(flat(weights), start(i), block)
        return new_top, total, acc * flat(rescale) + part

    top, total, acc = jax.lax.fori_loop(first, last, step, (top, total, acc))
    seen = top > jnp.finfo(jnp.float32).min
    out = acc * flat(jnp.where(seen, _inverse(total), 0.0))
    return _query_layout(out, length).astype(prefix.dtype)


def _visible_blocks(positions, query_positions, window, block) -> tuple[jax.Array, jax.Array]:
    """int32 ``(first, last)``: blocks ``first .. last - 1`` of ``block`` slots hold every
    key of ``positions`` (``[..., M]``) that a query at ``query_positions`` may see."""
    visible = positions >= 0
    if window is not None:
        real = jnp.where(query_positions >= 0, query_positions, jnp.iinfo(jnp.int32).max)
        visible &= positions > jnp.min(real) - window
    visible = jnp.any(visible.reshape(-1, positions.shape[-1]), axis=0)
    slot = jnp.arange(positions.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where(visible, slot, positions.shape[-1])) // block
    last = (jnp.max(jnp.where(visible, slot + 1, 0)) + block - 1) // block
    return first, jnp.maximum(first, last)
