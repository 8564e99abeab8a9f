"""Attention functions and the kernel dispatch behind ``lhc.nn.Attention``.

``dot_product_attention`` is the one place that chooses how attention is computed:
``impl="xla"`` (plain einsums, always available) or any implementation registered with
``register_attention_impl`` (Pallas kernels plug in there). Every implementation takes
the same arguments and honours the same mask, which is built from positions:

* a query or key whose position is negative is padding; no query attends to a padding
  key, and a padding query's output is zero;
* otherwise a query at position ``p`` attends to every key at position ``<= p``
  (causality by position, so a cache may hold tokens in any slot order);
* with a sliding ``window`` of ``W`` tokens, only to keys at positions in ``(p - W, p]``.

Position information enters through RoPE on queries and keys (``lhc.nn.Attention``'s
default) or through ALiBi: a bias ``-slope_n * (p - p_key)`` on the scores of head ``n``,
with the slopes of ``alibi_slopes`` (``impl="xla"`` only).

Besides the dispatcher: ``attention_segments`` (one softmax over several key segments,
a cache and this call's keys, without concatenating them), ``segment_weights`` (its
probabilities), ``attention_with_blocked_prefix`` (the same with a first segment read
block by block up to its last held key: a store padded for growth costs what it holds),
``banded_self_attention`` (sliding-window self-attention in ``O(T * (window + block))``)
and ``weighted_values`` (probabilities times values with a float32 accumulator).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


class AttentionImpl(Protocol):
    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        query_positions: jax.Array,
        key_positions: jax.Array,
        *,
        scale: float,
        window: int | None = None,
    ) -> jax.Array: ...


def attention_mask(
    query_positions: jax.Array, key_positions: jax.Array, window: int | None = None
) -> jax.Array:
    """Which keys each query may attend to.

    Args:
        query_positions: int ``[B, T]``; negative marks padding.
        key_positions: int ``[B, S]``; negative marks padding or an empty cache slot.
        window: ``None`` (full causal attention) or ``W >= 1``: a query at position
            ``p`` sees keys at positions in ``(p - W, p]``.

    Returns:
        bool ``[B, T, S]``: key position ``>= 0``, query position ``>= 0``, key position
        ``<=`` query position and, with a window, ``query - key < W``.
    """
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    mask = (k >= 0) & (q >= 0) & (k <= q)
    if window is not None:
        mask &= q - k < window
    return mask


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes ``2 ** (-8 (n + 1) / N)``, float32 ``[N]``.

    For a power-of-two N this is the geometric sequence of the ALiBi paper; the same
    formula for every N is what GCA's official code uses.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    return (2.0 ** (-8.0 * np.arange(1, num_heads + 1) / num_heads)).astype(np.float32)


def _xla_attention(
    query, key, value, query_positions, key_positions, *, scale, window=None, alibi_slopes=None
):
    return attention_segments(
        query,
        [(key, value, key_positions)],
        query_positions,
        scale=scale,
        window=window,
        alibi_slopes=alibi_slopes,
    )


def _segment_mask(query_positions, key_positions, window, extra) -> jax.Array:
    """bool ``[B, K or 1, 1, T, S]``: ``attention_mask`` for key positions ``[B, S]``, or
    per key/value head for ``[B, K, S]``, and-ed with an optional ``[B, T, S]`` mask."""
    if key_positions.ndim == 3:
        per_head = jax.vmap(attention_mask, in_axes=(None, 1, None), out_axes=1)
        mask = per_head(query_positions, key_positions, window)  # [B, K, T, S]
    else:
        mask = attention_mask(query_positions, key_positions, window)[:, None]
    if extra is not None:
        mask &= extra[:, None]
    return mask[:, :, None]


def segment_weights(
    query: jax.Array,
    segments: Sequence[tuple[jax.Array, ...]],
    query_positions: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    alibi_slopes: jax.Array | np.ndarray | None = None,
) -> list[jax.Array]:
    """The attention probabilities of ``query`` over several key segments: float32
    ``[B, K, G, T, S_i]`` per segment (query head ``n = k G + g``), one softmax over all
    segments (``attention_segments`` has the arguments). Rows that see no key are zero."""
    rows = _query_rows(query, segments[0][0].shape[2])
    logits, masks = [], []
    for keys, _, key_positions, *extra in segments:
        x, mask = _masked_logits(
            rows,
            jnp.swapaxes(keys, 1, 2),
            key_positions,
            extra[0] if extra else None,
            query_positions,
            scale=scale,
            window=window,
            alibi_slopes=alibi_slopes,
        )
        logits.append(x)
        masks.append(mask)
    # The softmax is shift-invariant: no gradient flows through the shift.
    top = jax.lax.stop_gradient(
        functools.reduce(jnp.maximum, [jnp.max(x, axis=-1, keepdims=True) for x in logits])
    )
    weights = [jnp.where(m, jnp.exp(x - top), 0.0) for x, m in zip(logits, masks)]
    total = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    return [w * _inverse(total) for w in weights]


def _query_rows(query: jax.Array, num_kv_heads: int) -> jax.Array:
    """``[B, K, G * T, H]``: the queries of each key/value head's group as the rows of
    one matmul (query head ``n = k G + g``)."""
    batch, length, num_heads, head_dim = query.shape
    group = num_heads // num_kv_heads
    rows = jnp.transpose(
        query.reshape(batch, length, num_kv_heads, group, head_dim), (0, 2, 3, 1, 4)
    )
    return rows.reshape(batch, num_kv_heads, group * length, head_dim)


def _query_layout(rows: jax.Array, length: int) -> jax.Array:
    """``[B, T, N, H]`` from rows ``[B, K, G * T, H]`` (the inverse of ``_query_rows``)."""
    batch, num_kv_heads, _, head_dim = rows.shape
    out = jnp.transpose(rows.reshape(batch, num_kv_heads, -1, length, head_dim), (0, 3, 1, 2, 4))
    return out.reshape(batch, length, -1, head_dim)


def _masked_logits(
    rows, keys, key_positions, extra, query_positions, *, scale, window, alibi_slopes
) -> tuple[jax.Array, jax.Array]:
    """float32 scores ``[B, K, G, T, S]`` of ``rows [B, K, G * T, H]`` against heads-major
    ``keys [B, K, S, H]``, masked positions filled with the float32 minimum, and the
    mask (``_segment_mask``)."""
    scores = jnp.einsum("BKQH,BKSH->BKQS", rows, keys, preferred_element_type=jnp.float32)
    return _masked_scores(
        scores,
        key_positions,
        extra,
        query_positions,
        scale=scale,
        window=window,
        alibi_slopes=alibi_slopes,
    )


def _masked_scores(
    scores, key_positions, extra, query_positions, *, scale, window, alibi_slopes
) -> tuple[jax.Array, jax.Array]:
    """``_masked_logits`` from the products ``scores`` float32 ``[B, K, G * T, S]``."""
    batch, num_kv_heads, _, _ = scores.shape
    length = query_positions.shape[1]
    group = scores.shape[2] // length
    scores = scores.reshape(batch, num_kv_heads, group, length, -1) * jnp.float32(scale)
    if alibi_slopes is not None:
        per_head = key_positions if key_positions.ndim == 3 else key_positions[:, None]
        distance = query_positions[:, None, :, None] - per_head[:, :, None, :]
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(num_kv_heads, group)
        scores = scores - slopes[None, :, :, None, None] * distance[:, :, None].astype(jnp.float32)
    mask = _segment_mask(query_positions, key_positions, window, extra)
    # A finite fill keeps fully masked rows (padding queries) free of NaN.
    return jnp.where(mask, scores, jnp.finfo(jnp.float32).min), mask


def _inverse(total: jax.Array) -> jax.Array:
    """``1 / total``, 0 where ``total`` is 0 (rows that see no key)."""
    return jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)


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


def attention_segments(
    query: jax.Array,
    segments: Sequence[tuple[jax.Array, ...]],
    query_positions: jax.Array,
    *,
    scale: float,
    window: int | None = None,
    alibi_slopes: jax.Array | np.ndarray | None = None,
) -> jax.Array:
    """Softmax attention over several key/value segments at once, in plain XLA.

    The scores of every segment share one softmax, as if the segments were
    concatenated, without concatenating them (a cache and this call's own keys).

    Args:
        query: ``[B, T, N, H]``.
        segments: ``(keys [B, S_i, K, H], values [B, S_i, K, H], positions)``, or with
            a fourth element, a bool ``[B, T, S_i]`` mask (or None) that further
            restricts which of the segment's keys each query sees. ``positions`` is
            int ``[B, S_i]``, or ``[B, K, S_i]`` when every key/value head holds keys
            of its own (a cache pruned head by head).
        query_positions: int ``[B, T]``.
        scale: multiplies the scores.
        window: ``None`` or the sliding-window length.
        alibi_slopes: ``None`` or float ``[N]``: adds ``-alibi_slopes[n] * (query
            position - key position)`` to the scores of head ``n``.

    Returns:
        ``[B, T, N, H]`` in the values' dtype.
    """
    # Heads-major throughout ([B, K, ., .]), the operand and result layouts of XLA's
    # batched matmuls, so that no cached key or value is transposed: the query groups
    # and positions of one key/value head form the rows Q = G * T of one matmul.
    batch, length, num_heads, head_dim = query.shape
    num_kv_heads = segments[0][0].shape[2]
    group = num_heads // num_kv_heads
    weights = segment_weights(
        query, segments, query_positions, scale=scale, window=window, alibi_slopes=alibi_slopes
    )
    out = None
    for w, (_, values, *_) in zip(weights, segments):
        w = w.reshape(batch, num_kv_heads, group * length, -1)
        part = weighted_values(w, values)
        out = part if out is None else out + part
    return _query_layout(out, length).astype(segments[0][1].dtype)


def banded_self_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    positions: jax.Array,
    *,
    window: int,
    scale: float | None = None,
    alibi_slopes: jax.Array | np.ndarray | None = None,
    block: int = 64,
) -> jax.Array:
    """Sliding-window self-attention in ``O(T * (window + block))``, in plain XLA.

    For a self-attention call (no cache) whose real tokens sit in slot order with
    contiguous positions (position ``p`` in slot ``p + offset``; padding, position -1,
    anywhere after or between rows' tokens is fine as long as each real token's window
    lies in the slots just before it): the slots are cut into blocks of ``block``, and
    each query block attends only to itself and the ``ceil((window - 1) / block)``
    blocks before it, under the usual position mask (``attention_mask``) and optional
    ALiBi. It equals ``dot_product_attention(..., window=window)`` on such inputs while
    computing ``T x (window + block)`` scores instead of ``T x T``.

    Args:
        query: ``[B, T, N, H]``.
        key, value: ``[B, T, K, H]``.
        positions: int ``[B, T]``.
        window: ``W >= 1``.
        scale: score multiplier, ``H ** -0.5`` by default.
        alibi_slopes: ``None`` or float ``[N]``.
        block: slots per block.

    Returns:
        ``[B, T, N, H]`` in the value dtype.
    """
    _check_attention_inputs(query, key, value, positions, positions)
    batch, length, num_heads, head_dim = query.shape
    num_kv_heads, group = key.shape[2], num_heads // key.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    block = max(1, min(block, length))
    before = -(-(window - 1) // block)  # earlier blocks a query's window may reach
    num_blocks = -(-length // block)
    pad = num_blocks * block - length
    pad_slots = lambda x, value=0: jnp.pad(
        x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=value
    )
    q = pad_slots(query).reshape(batch, num_blocks, block, num_kv_heads, group, head_dim)
    q_pos = pad_slots(positions, -1).reshape(batch, num_blocks, block)

    def with_history(x, value=0):
        # [B, nb, (before + 1) * block, ...]: the blocks i - before .. i for each block i.
        x = jnp.pad(
            pad_slots(x, value),
            ((0, 0), (before * block, 0)) + ((0, 0),) * (x.ndim - 2),
            constant_values=value,
        )
        parts = [
            x[:, j * block : j * block + num_blocks * block].reshape(
                batch, num_blocks, block, *x.shape[2:]
            )
            for j in range(before + 1)
        ]
        return jnp.concatenate(parts, axis=2)

    k, v, k_pos = with_history(key), with_history(value), with_history(positions, -1)
    scores = jnp.einsum("BIQKGH,BISKH->BIKGQS", q, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(scale)
    distance = q_pos[..., :, None] - k_pos[..., None, :]  # [B, nb, Q, S]
    if alibi_slopes is not None:
        slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(num_kv_heads, group)
        scores = scores - slopes[:, :, None, None] * distance[:, :, None, None].astype(jnp.float32)
    mask = (k_pos[..., None, :] >= 0) & (q_pos[..., :, None] >= 0) & (distance >= 0)
    mask = (mask & (distance < window))[:, :, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    probs = jnp.where(mask, probs, 0.0)
    total = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum(
        "BIKGQS,BISKH->BIQKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    out = out.reshape(batch, num_blocks * block, num_heads, head_dim)[:, :length]
    return out.astype(value.dtype)


def weighted_values(probs: jax.Array, value: jax.Array) -> jax.Array:
    """float32 ``[B, K, Q, H]``: ``probs [B, K, Q, S]`` times ``value [B, S, K, H]``.

    The products accumulate in float32 whatever the value dtype. XLA's CPU runtime has
    no bfloat16 x bfloat16 -> float32 matmul, so there both operands are widened (XLA
    CPU widens bfloat16 matmuls to float32 anyway); TPU and GPU multiply in the value
    dtype with a float32 accumulator.
    """
    equation = "BKQS,BKSH->BKQH"
    value = jnp.swapaxes(value, 1, 2)  # [B, K, S, H], the cache's own layout

    def native(probs, value):
        return jnp.einsum(
            equation, probs.astype(value.dtype), value, preferred_element_type=jnp.float32
        )

    def widened(probs, value):
        return jnp.einsum(equation, probs.astype(jnp.float32), value.astype(jnp.float32))

    if value.dtype == jnp.float32:
        return native(probs, value)
    return jax.lax.platform_dependent(probs, value, cpu=widened, default=native)


def _chunked_attention(query, key, value, query_positions, key_positions, *, scale, window=None):
    """Online softmax over key blocks in plain XLA: memory grows with the block, not T x S."""
    from kernels_pallas.flash_attention import flash_attention

    return flash_attention(
        query, key, value, query_positions, key_positions, scale=scale, window=window, impl="xla"
    )


def _flash_attention(query, key, value, query_positions, key_positions, *, scale, window=None):
    """The Pallas flash-attention kernels (Mosaic on TPU, Triton on GPU; interpreted on CPU)."""
    from kernels_pallas.flash_attention import flash_attention

    return flash_attention(
        query,
        key,
        value,
        query_positions,
        key_positions,
        scale=scale,
        window=window,
        impl="pallas",
        interpret=jax.default_backend() == "cpu",
    )


_IMPLEMENTATIONS: dict[str, AttentionImpl] = {
    # Materialises the float32 scores [B, K, G, T, S]: fastest for short sequences.
    "xla": _xla_attention,
    # Bounded memory for long prompts, everywhere (kernels_pallas/flash_attention.py).
    "chunked": _chunked_attention,
    "flash": _flash_attention,
}


def register_attention_impl(name: str, fn: AttentionImpl, *, overwrite: bool = False) -> None:
    """Makes ``fn`` available as ``dot_product_attention(..., impl=name)``.

    ``fn`` receives validated arrays (see ``dot_product_attention``) and must apply the
    position mask described in this module's docstring.
    """
    if name in _IMPLEMENTATIONS and not overwrite:
        raise ValueError(f"attention impl {name!r} is already registered")
    _IMPLEMENTATIONS[name] = fn


def attention_impls() -> tuple[str, ...]:
    """Names accepted by ``dot_product_attention(impl=...)``."""
    return tuple(_IMPLEMENTATIONS)


def _check_attention_inputs(query, key, value, query_positions, key_positions) -> None:
    if query.ndim != 4 or key.ndim != 4 or value.shape != key.shape:
        raise ValueError(
            f"expected query [B, T, N, H] and key/value [B, S, K, H], got {query.shape=} "
            f"{key.shape=} {value.shape=}"
        )
    batch, length, num_heads, head_dim = query.shape
    if key.shape[0] != batch or key.shape[3] != head_dim:
        raise ValueError(f"batch or head_dim differ: {query.shape=} {key.shape=}")
    if num_heads % key.shape[2]:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of key/value heads ({key.shape[2]})"
        )
    if query_positions.shape != (batch, length):
        raise ValueError(f"{query_positions.shape=} must be {(batch, length)}")
    per_head = (key.shape[0], key.shape[2], key.shape[1])
    if key_positions.shape not in (key.shape[:2], per_head):
        raise ValueError(f"{key_positions.shape=} must be {key.shape[:2]} or {per_head}")


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    query_positions: jax.Array,
    key_positions: jax.Array,
    *,
    impl: str = "xla",
    scale: float | None = None,
    window: int | None = None,
    alibi_slopes: jax.Array | np.ndarray | None = None,
) -> jax.Array:
    """Softmax attention with grouped-query heads and a position mask.

    Scores, softmax and the weighted sum of values accumulate in float32.

    Args:
        query: ``[B, T, N, H]``.
        key: ``[B, S, K, H]`` with ``N`` a multiple of ``K`` (query head ``n`` reads
            key head ``n // (N // K)``).
        value: ``[B, S, K, H]``.
        query_positions: int ``[B, T]``.
        key_positions: int ``[B, S]``.
        impl: a name from ``attention_impls()``.
        scale: multiplies the scores; ``H ** -0.5`` by default.
        window: ``None`` or the sliding-window length ``W >= 1`` (see ``attention_mask``).
        alibi_slopes: ``None`` or float ``[N]``, ALiBi's per-head slopes (``impl="xla"``).

    Returns:
        ``[B, T, N, H]`` in the value dtype.
    """
    _check_attention_inputs(query, key, value, query_positions, key_positions)
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"attention impl must be one of {attention_impls()}, got {impl!r}")
    if key_positions.ndim == 3 and impl != "xla":
        raise ValueError(f"key positions per key/value head need impl='xla', got {impl!r}")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    # An implementation without sliding windows may leave out the window argument.
    extra = {} if window is None else {"window": window}
    if alibi_slopes is not None:
        if impl != "xla":
            raise ValueError(f"ALiBi (alibi_slopes) needs impl='xla', got impl={impl!r}")
        if tuple(np.shape(alibi_slopes)) != (query.shape[2],):
            raise ValueError(
                f"alibi_slopes must have shape [N] = ({query.shape[2]},), got "
                f"{tuple(np.shape(alibi_slopes))}"
            )
        extra["alibi_slopes"] = alibi_slopes
    return _IMPLEMENTATIONS[impl](
        query, key, value, query_positions, key_positions, scale=float(scale), **extra
    )
