"""Grouped-query attention with a pluggable kernel.

``dot_product_attention`` is the one place that chooses how attention is computed:
``impl="xla"`` (plain einsums, always available) or any implementation registered with
``register_attention_impl`` (Pallas kernels plug in there). Every implementation takes
the same arguments and honours the same mask, which is built from positions:

* a query or key whose position is negative is padding; no query attends to a padding
  key, and a padding query's output is zero;
* otherwise a query at position ``p`` attends to every key at position ``<= p``
  (causality by position, so a cache may hold tokens in any slot order);
* with a sliding ``window`` of ``W`` tokens, only to keys at positions in ``(p - W, p]``.

Position information enters through RoPE on queries and keys (``Attention``'s default) or
through ALiBi: a bias ``-slope_n * (p - p_key)`` on the scores of head ``n``, with the
slopes of ``alibi_slopes`` (``impl="xla"`` only).

The ``Attention`` layer reads and writes a cache through ``LayerCache``: a handle on one
layer of a model's cache (``lhc.lm.cache`` describes the protocol). The handle's writer
receives this call's keys, values and positions and returns a ``KVView``, what the layer
attends to (keys, values and their positions, which may differ from layer to layer); a
view may also compute the attention itself (a quantized store reads its own codes).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from lhc.nn import remat
from lhc.nn.linear import Einsum
from lhc.nn.rope import apply_rope, rope_frequencies


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
    batch, length, num_heads, head_dim = query.shape
    num_kv_heads = segments[0][0].shape[2]
    group = num_heads // num_kv_heads
    rows = jnp.transpose(
        query.reshape(batch, length, num_kv_heads, group, head_dim), (0, 2, 3, 1, 4)
    )
    rows = rows.reshape(batch, num_kv_heads, group * length, head_dim)  # [B, K, Q, H]
    logits, masks = [], []
    for keys, _, key_positions, *extra in segments:
        keys = jnp.swapaxes(keys, 1, 2)  # [B, K, S, H]
        scores = jnp.einsum("BKQH,BKSH->BKQS", rows, keys, preferred_element_type=jnp.float32)
        scores = scores.reshape(batch, num_kv_heads, group, length, -1) * jnp.float32(scale)
        if alibi_slopes is not None:
            per_head = key_positions if key_positions.ndim == 3 else key_positions[:, None]
            distance = query_positions[:, None, :, None] - per_head[:, :, None, :]
            slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(num_kv_heads, group)
            scores = scores - slopes[None, :, :, None, None] * distance[:, :, None].astype(
                jnp.float32
            )
        mask = _segment_mask(query_positions, key_positions, window, extra[0] if extra else None)
        # A finite fill keeps fully masked rows (padding queries) free of NaN.
        logits.append(jnp.where(mask, scores, jnp.finfo(jnp.float32).min))
        masks.append(mask)
    # The softmax is shift-invariant: no gradient flows through the shift.
    top = jax.lax.stop_gradient(
        functools.reduce(jnp.maximum, [jnp.max(x, axis=-1, keepdims=True) for x in logits])
    )
    weights = [jnp.where(m, jnp.exp(x - top), 0.0) for x, m in zip(logits, masks)]
    total = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    inverse = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    return [w * inverse for w in weights]


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
    out = jnp.transpose(out.reshape(batch, num_kv_heads, group, length, head_dim), (0, 3, 1, 2, 4))
    return out.reshape(batch, length, num_heads, head_dim).astype(segments[0][1].dtype)


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


def write_slots(buffer: jax.Array, update: jax.Array, start: jax.Array) -> jax.Array:
    """Writes each sequence's update into its own slots.

    Args:
        buffer: ``[B, S, ...]``.
        update: ``[B, T, ...]`` (same trailing shape as ``buffer``).
        start: int ``[B]``; sequence ``b`` is written to slots ``start[b] : start[b] + T``.

    Returns:
        ``buffer`` with the slots replaced. Slots past ``S`` are dropped, never clamped
        onto the last slots (a caller that overflows detects it from the lengths).
    """
    batch, length = update.shape[:2]
    slots = start[:, None] + jnp.arange(length, dtype=start.dtype)[None, :]
    rows = jnp.arange(batch)[:, None]
    return buffer.at[rows, slots].set(update.astype(buffer.dtype), mode="drop")


@struct.dataclass
class KVView:
    """What one attention layer attends to: what its cache holds, and this call's keys.

    Attributes:
        keys: ``[B, S, K, H]``, held before this call.
        values: ``[B, S, K, H]``.
        positions: int32 ``[B, S]``, the position of each key (negative: empty or
            padding); or ``[B, K, S]`` when each key/value head holds keys of its own
            (slot ``s`` of head ``k`` is ``keys[:, s, k]``; attention then runs in XLA).
        new_keys: ``[B, T, K, H]``, this call's keys (``None`` when ``keys`` has them).
        new_values: ``[B, T, K, H]``.
        new_positions: int32 ``[B, T]``.
    """

    keys: jax.Array
    values: jax.Array
    positions: jax.Array
    new_keys: jax.Array | None = None
    new_values: jax.Array | None = None
    new_positions: jax.Array | None = None

    def attend(
        self,
        query: jax.Array,
        query_positions: jax.Array,
        *,
        impl: str,
        window: int | None,
        dtype: DTypeLike,
        alibi_slopes: jax.Array | np.ndarray | None = None,
    ) -> jax.Array:
        """``[B, T, N, H]`` attention of ``query`` over this view (see ``dot_product_attention``).

        The XLA implementation reads the cache and the new keys as two segments of one
        softmax; the others receive them concatenated. Caches that store something other
        than plain keys and values (quantized codes) return a view that overrides this.
        """
        segments = [(k.astype(dtype), v.astype(dtype), p) for k, v, p in self.segments()]
        if (impl == "xla" and len(segments) > 1) or self.positions.ndim == 3:
            for keys, values, positions in segments:
                _check_attention_inputs(query, keys, values, query_positions, positions)
            return attention_segments(
                query,
                segments,
                query_positions,
                scale=query.shape[-1] ** -0.5,
                window=window,
                alibi_slopes=alibi_slopes,
            )
        keys, values, positions = (jnp.concatenate(parts, axis=1) for parts in zip(*segments))
        return dot_product_attention(
            query,
            keys,
            values,
            query_positions,
            positions,
            impl=impl,
            window=window,
            alibi_slopes=alibi_slopes,
        )

    def segments(self) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
        """``(keys, values, positions)`` of what is held, then of this call's keys."""
        segments = [(self.keys, self.values, self.positions)]
        if self.new_keys is not None:
            segments.append((self.new_keys, self.new_values, self.new_positions))
        return segments

    def probabilities(
        self,
        query: jax.Array,
        query_positions: jax.Array,
        probe: jax.Array,
        *,
        window: int | None,
        alibi_slopes: jax.Array | np.ndarray | None = None,
    ) -> jax.Array:
        """The attention probabilities of the queries ``probe`` picks, in float32.

        Args:
            query: ``[B, T, N, H]``, as passed to ``attend``.
            query_positions: int ``[B, T]``.
            probe: int ``[B, Q]``, indices into ``T``.
            window: as for ``attend``.
            alibi_slopes: as for ``attend``.

        Returns:
            float32 ``[B, N, Q, S + T']``: over the held keys then this call's keys
            (``T'`` = 0 when ``new_keys`` is ``None``), as ``attend`` weighs them.
        """
        picked = jnp.take_along_axis(query, probe[:, :, None, None], axis=1)
        picked_positions = jnp.take_along_axis(query_positions, probe, axis=1)
        weights = segment_weights(
            picked,
            self.segments(),
            picked_positions,
            scale=query.shape[-1] ** -0.5,
            window=window,
            alibi_slopes=alibi_slopes,
        )
        probs = jnp.concatenate(weights, axis=-1)  # [B, K, G, Q, S + T']
        batch, num_kv_heads, group, length, keys = probs.shape
        return probs.reshape(batch, num_kv_heads * group, length, keys)


class LayerWriter(Protocol):
    """How a cache serves one layer (``lhc.lm.cache`` has the protocol)."""

    def read(
        self, layers: Any, layer: int | jax.Array, keys: jax.Array, values: jax.Array
    ) -> KVView: ...

    def write(
        self,
        layers: Any,
        layer: int | jax.Array,
        keys: jax.Array,
        values: jax.Array,
        *,
        after: jax.Array,
    ) -> Any: ...


@struct.dataclass
class LayerCache:
    """One layer's handle on a model cache during one call.

    Attributes:
        writer: the cache's ``LayerWriter`` for this call (shared by every layer).
        layers: the cache's per-layer storage (stacked arrays whose leaves lead with
            ``[L]``, or tuples of per-layer arrays); passed whole so that a layer updates
            its part in place.
        layer: this layer's index into ``layers`` (an int, or a traced scalar under
            ``nn.scan``).
    """

    writer: Any
    layers: Any
    layer: Any

    def view(self, keys: jax.Array, values: jax.Array) -> KVView:
        """What this layer attends to with this call's ``keys`` / ``values``."""
        return self.writer.read(self.layers, self.layer, keys, values)

    def attend(
        self,
        query: jax.Array,
        query_positions: jax.Array,
        keys: jax.Array,
        values: jax.Array,
        *,
        impl: str,
        window: int | None,
        dtype: DTypeLike,
        alibi_slopes: jax.Array | np.ndarray | None = None,
    ) -> tuple[jax.Array, LayerCache]:
        """Attends ``query`` to the cache and this call's ``keys`` / ``values``
        ``[B, T, K, H]``, then stores them; returns the output and the updated handle.

        The cache is read before it is written, and the write is made to depend on the
        attention output, so XLA updates the stored arrays in place: a reader of the
        updated array (or one unordered with the update) makes it copy the layer.
        """
        view = self.view(keys, values)
        attended = view.attend(
            query, query_positions, impl=impl, window=window, dtype=dtype, alibi_slopes=alibi_slopes
        )
        layers = self.writer.write(self.layers, self.layer, keys, values, after=attended)
        return attended, self.replace(layers=layers)


def after(update: jax.Array, result: jax.Array) -> jax.Array:
    """``update`` made to depend on ``result`` (its value unchanged, for finite results).

    An in-place update of a buffer must come after every read of it; a data dependency
    is what orders them in XLA (``0 * x`` is not folded away for floats).
    """
    dependency = jnp.zeros((), jnp.float32) * result.reshape(-1)[0].astype(jnp.float32)
    return update + dependency.astype(update.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE (or ALiBi) and an optional cache.

    Attributes:
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads (divides N).
        head_dim: H.
        rope_theta: RoPE base.
        rope_scaling: see ``lhc.nn.rope.validate_rope_scaling``.
        qkv_bias: biases on the query, key and value projections (Qwen2).
        attention_impl: name passed to ``dot_product_attention``.
        window: ``None``, or the sliding-window length ``W``: a query at position ``p``
            sees keys at positions in ``(p - W, p]``.
        dtype: compute dtype.
        param_dtype: storage dtype.
        kernel_layout: ``"in_out"`` or ``"out_in"`` (see ``lhc.nn.Einsum``).
        position_encoding: ``"rope"`` (rotary embeddings on queries and keys) or
            ``"alibi"`` (no rotation; ALiBi biases with ``alibi_slopes(num_heads)``, which
            needs ``attention_impl="xla"``).
        banded: without a cache, compute the windowed attention block-banded
            (``banded_self_attention``); needs a ``window`` and inputs whose real tokens
            have contiguous positions in slot order.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: Mapping[str, Any] | None = None
    qkv_bias: bool = False
    attention_impl: str = "xla"
    window: int | None = None
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32
    kernel_layout: str = "in_out"
    position_encoding: str = "rope"
    banded: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: LayerCache | None = None,
        probe: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """Attends the tokens of ``x`` to themselves, or to the cache they are appended to.

        Args:
            x: ``[B, T, D]``.
            positions: int ``[B, T]`` positions of the tokens of ``x`` (negative: padding).
            cache: ``None`` for a plain forward pass, or this layer's ``LayerCache``.
            probe: ``None``, or int ``[B, Q]`` indices into ``T``: the attention
                probabilities of those queries are sown as ``intermediates`` /
                ``attention_probs``, float32 ``[B, N, Q, S]`` over the keys of
                ``KVView.probabilities`` (the cache's, then this call's).

        Returns:
            ``(y, cache)``: ``y`` ``[B, T, D]`` and the updated handle (``None`` without
            a cache).
        """
        embed_dim = x.shape[-1]
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim

        def projection(heads, heads_axis, name):
            return Einsum(
                shape=(embed_dim, heads, head_dim),
                logical_axes=("embed", heads_axis, "kv"),
                use_bias=self.qkv_bias,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_layout=self.kernel_layout,
                name=name,
            )

        query = projection(num_heads, "heads", "query")("BTD,DNH->BTNH", x)
        key = projection(num_kv_heads, "kv_heads", "key")("BTD,DKH->BTKH", x)
        value = projection(num_kv_heads, "kv_heads", "value")("BTD,DKH->BTKH", x)
        query = checkpoint_name(query, remat.QUERY_PROJ)
        key = checkpoint_name(key, remat.KEY_PROJ)
        value = checkpoint_name(value, remat.VALUE_PROJ)

        settings = dict(impl=self.attention_impl, window=self.window, dtype=self.dtype)
        if self.position_encoding == "rope":
            inv_frequencies = rope_frequencies(head_dim, self.rope_theta, self.rope_scaling)
            query = apply_rope(query, positions, inv_frequencies)
            key = apply_rope(key, positions, inv_frequencies)
        elif self.position_encoding == "alibi":
            settings["alibi_slopes"] = alibi_slopes(num_heads)
        else:
            raise ValueError(
                f"position_encoding must be 'rope' or 'alibi', got {self.position_encoding!r}"
            )
        query = nn.with_logical_constraint(query, ("act_batch", "act_len", "act_heads", "act_kv"))
        kv_axes = ("act_batch", "act_len", "act_kv_heads", "act_kv")
        key = nn.with_logical_constraint(key, kv_axes)
        value = nn.with_logical_constraint(value, kv_axes)

        if probe is not None:
            view = KVView(key, value, positions) if cache is None else cache.view(key, value)
            probs = view.probabilities(
                query.astype(self.dtype),
                positions,
                probe,
                window=self.window,
                alibi_slopes=settings.get("alibi_slopes"),
            )
            self.sow("intermediates", "attention_probs", probs)
        if cache is None and self.banded:
            if self.window is None:
                raise ValueError("banded attention needs a window")
            attended = banded_self_attention(
                query.astype(self.dtype),
                key.astype(self.dtype),
                value.astype(self.dtype),
                positions,
                window=self.window,
                alibi_slopes=settings.get("alibi_slopes"),
            )
        elif cache is None:
            attended = KVView(keys=key, values=value, positions=positions).attend(
                query, positions, **settings
            )
        else:
            attended, cache = cache.attend(query, positions, key, value, **settings)
        batch, length = attended.shape[:2]
        out = Einsum(
            shape=(num_heads, head_dim, embed_dim),
            logical_axes=("heads", "kv", "embed"),
            in_dims=2,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            equation_shape=(num_heads * head_dim, embed_dim),
            kernel_layout=self.kernel_layout,
            name="out",
        )("BTX,XD->BTD", attended.reshape(batch, length, num_heads * head_dim))
        return checkpoint_name(out, remat.ATTENTION_OUT), cache
