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
probabilities), ``banded_self_attention`` (sliding-window self-attention in ``O(T * (window + block))``)
and ``weighted_values`` (probabilities times values with a float32 accumulator).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np


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


def _ring_attention(query, key, value, query_positions, key_positions, *, scale, window=None):
    """The sequence split over the mesh, keys and values passed around a ring."""
    from lhc.nn.ring_attention import sequence_parallel_attention

    return sequence_parallel_attention(
        query, key, value, query_positions, key_positions, scale=scale, window=window
    )


def _allgather_attention(query, key, value, query_positions, key_positions, *, scale, window=None):
    """The sequence split over the mesh, every device gathering all keys and values."""
    from lhc.nn.ring_attention import sequence_parallel_attention

    return sequence_parallel_attention(
        query, key, value, query_positions, key_positions,
        scale=scale, window=window, variant="allgather",
    )  # fmt: skip


_IMPLEMENTATIONS: dict[str, AttentionImpl] = {
    # Materialises the float32 scores [B, K, G, T, S]: fastest for short sequences.
    "xla": _xla_attention,
    # Bounded memory for long prompts, everywhere (kernels_pallas/flash_attention.py).
    "chunked": _chunked_attention,
    "flash": _flash_attention,
    # The sequence split over the mesh's act_len axes (lhc/nn/ring_attention.py).
    "ring": _ring_attention,
    "allgather": _allgather_attention,
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
