"""Grouped-query attention with a pluggable kernel.

``dot_product_attention`` is the one place that chooses how attention is computed:
``impl="xla"`` (plain einsums, always available) or any implementation registered with
``register_attention_impl`` (Pallas kernels plug in there). Every implementation takes
the same arguments and honours the same mask, which is built from positions:

* a query or key whose position is negative is padding; no query attends to a padding
  key, and a padding query's output is zero;
* otherwise a query at position ``p`` attends to every key at position ``<= p``
  (causality by position, so a cache may hold tokens in any slot order).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
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
    ) -> jax.Array: ...


def attention_mask(query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """Which keys each query may attend to.

    Args:
        query_positions: int ``[B, T]``; negative marks padding.
        key_positions: int ``[B, S]``; negative marks padding or an empty cache slot.

    Returns:
        bool ``[B, T, S]``: key position ``>= 0``, query position ``>= 0`` and
        key position ``<=`` query position.
    """
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    return (k >= 0) & (q >= 0) & (k <= q)


def _xla_attention(query, key, value, query_positions, key_positions, *, scale):
    batch, length, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    grouped_query = query.reshape(batch, length, num_kv_heads, group, head_dim)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", grouped_query, key, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(scale)
    mask = attention_mask(query_positions, key_positions)[:, None, None]  # [B, 1, 1, T, S]
    # A finite fill keeps fully masked rows (padding queries) free of NaN; their
    # probabilities are zeroed below.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask.any(axis=-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(value.dtype), value)
    return out.reshape(batch, length, num_heads, head_dim)


_IMPLEMENTATIONS: dict[str, AttentionImpl] = {"xla": _xla_attention}


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


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    query_positions: jax.Array,
    key_positions: jax.Array,
    *,
    impl: str = "xla",
    scale: float | None = None,
) -> jax.Array:
    """Softmax attention with grouped-query heads and a position mask.

    Scores and softmax are float32; the weighted sum of values runs in the value dtype.

    Args:
        query: ``[B, T, N, H]``.
        key: ``[B, S, K, H]`` with ``N`` a multiple of ``K`` (query head ``n`` reads
            key head ``n // (N // K)``).
        value: ``[B, S, K, H]``.
        query_positions: int ``[B, T]``.
        key_positions: int ``[B, S]``.
        impl: a name from ``attention_impls()``.
        scale: multiplies the scores; ``H ** -0.5`` by default.

    Returns:
        ``[B, T, N, H]`` in the value dtype.
    """
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
    if key_positions.shape != key.shape[:2]:
        raise ValueError(f"{key_positions.shape=} must be {key.shape[:2]}")
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"attention impl must be one of {attention_impls()}, got {impl!r}")
    if scale is None:
        scale = head_dim**-0.5
    return _IMPLEMENTATIONS[impl](
        query, key, value, query_positions, key_positions, scale=float(scale)
    )


def write_slots(buffer: jax.Array, update: jax.Array, start: jax.Array) -> jax.Array:
    """Writes each sequence's update into its own slots.

    Args:
        buffer: ``[B, S, ...]``.
        update: ``[B, T, ...]`` (same trailing shape and dtype as ``buffer``).
        start: int ``[B]``; sequence ``b`` is written to slots ``start[b] : start[b] + T``.
            The caller guarantees ``start + T <= S`` (XLA would clamp the start).

    Returns:
        ``buffer`` with the slots replaced.
    """
    return jax.vmap(lambda buf, upd, at: jax.lax.dynamic_update_slice_in_dim(buf, upd, at, 0))(
        buffer, update.astype(buffer.dtype), start
    )


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE and an optional key/value cache.

    Attributes:
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads (divides N).
        head_dim: H.
        rope_theta: RoPE base.
        rope_scaling: see ``lhc.nn.rope.validate_rope_scaling``.
        qkv_bias: biases on the query, key and value projections (Qwen2).
        attention_impl: name passed to ``dot_product_attention``.
        dtype: compute dtype.
        param_dtype: storage dtype.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: Mapping[str, Any] | None = None
    qkv_bias: bool = False
    attention_impl: str = "xla"
    dtype: DTypeLike = jnp.float32
    param_dtype: DTypeLike = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        key_positions: jax.Array | None = None,
        kv_cache: tuple[jax.Array, jax.Array] | None = None,
        write_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Attends the tokens of ``x`` to themselves, or to the cache they are appended to.

        Args:
            x: ``[B, T, D]``.
            positions: int ``[B, T]`` positions of the tokens of ``x`` (negative: padding).
            key_positions: int ``[B, S]`` positions of the cache slots after this call's
                tokens are written (negative: padding or empty); required with a cache.
            kv_cache: ``(keys, values)``, each ``[B, S, K, H]``, or ``None`` for a plain
                forward pass.
            write_index: int ``[B]``, the first slot each sequence writes to.

        Returns:
            ``(y, kv_cache)`` with ``y`` ``[B, T, D]`` and the updated cache (``None``
            without one).
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
                name=name,
            )

        query = projection(num_heads, "heads", "query")("BTD,DNH->BTNH", x)
        key = projection(num_kv_heads, "kv_heads", "key")("BTD,DKH->BTKH", x)
        value = projection(num_kv_heads, "kv_heads", "value")("BTD,DKH->BTKH", x)
        query = checkpoint_name(query, remat.QUERY_PROJ)
        key = checkpoint_name(key, remat.KEY_PROJ)
        value = checkpoint_name(value, remat.VALUE_PROJ)

        inv_frequencies = rope_frequencies(head_dim, self.rope_theta, self.rope_scaling)
        query = apply_rope(query, positions, inv_frequencies)
        key = apply_rope(key, positions, inv_frequencies)
        query = nn.with_logical_constraint(query, ("act_batch", "act_len", "act_heads", "act_kv"))
        kv_axes = ("act_batch", "act_len", "act_kv_heads", "act_kv")
        key = nn.with_logical_constraint(key, kv_axes)
        value = nn.with_logical_constraint(value, kv_axes)

        if kv_cache is None:
            keys, values = key, value
            key_positions = positions if key_positions is None else key_positions
            new_cache = None
        else:
            if key_positions is None or write_index is None:
                raise ValueError("a kv_cache needs key_positions and write_index")
            cache_axes = ("cache_batch", "cache_len", "cache_kv_heads", "cache_kv")
            keys = nn.with_logical_constraint(
                write_slots(kv_cache[0], key, write_index), cache_axes
            )
            values = nn.with_logical_constraint(
                write_slots(kv_cache[1], value, write_index), cache_axes
            )
            new_cache = (keys, values)

        attended = dot_product_attention(
            query,
            keys.astype(self.dtype),
            values.astype(self.dtype),
            positions,
            key_positions,
            impl=self.attention_impl,
        )
        out = Einsum(
            shape=(num_heads, head_dim, embed_dim),
            logical_axes=("heads", "kv", "embed"),
            in_dims=2,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="out",
        )("BTNH,NHD->BTD", attended)
        return checkpoint_name(out, remat.ATTENTION_OUT), new_cache
