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

The ``Attention`` layer reads and writes a cache through ``LayerCache``: a handle on one
layer of a model's cache (``lhc.lm.cache`` describes the protocol). The handle's writer
receives this call's keys, values and positions and returns a ``KVView``, what the layer
attends to (keys, values and their positions, which may differ from layer to layer); a
view may also compute the attention itself (a quantized store reads its own codes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
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


def _xla_attention(query, key, value, query_positions, key_positions, *, scale, window=None):
    # Heads-major throughout ([B, K, ., .]), the operand and result layouts of XLA's
    # batched matmuls, so that no cached key or value is transposed: the query groups
    # and positions of one key/value head form the rows Q = G * T of one matmul.
    batch, length, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    group = num_heads // num_kv_heads
    rows = jnp.transpose(
        query.reshape(batch, length, num_kv_heads, group, head_dim), (0, 2, 3, 1, 4)
    )
    rows = rows.reshape(batch, num_kv_heads, group * length, head_dim)  # [B, K, Q, H]
    keys = jnp.swapaxes(key, 1, 2)  # [B, K, S, H]
    logits = jnp.einsum("BKQH,BKSH->BKQS", rows, keys, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, num_kv_heads, group, length, -1) * jnp.float32(scale)
    mask = attention_mask(query_positions, key_positions, window)[:, None, None]  # [B,1,1,T,S]
    # A finite fill keeps fully masked rows (padding queries) free of NaN; their
    # probabilities are zeroed below.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask.any(axis=-1, keepdims=True), probs, 0.0)
    out = weighted_values(probs.reshape(batch, num_kv_heads, group * length, -1), value)
    out = jnp.transpose(out.reshape(batch, num_kv_heads, group, length, head_dim), (0, 3, 1, 2, 4))
    return out.reshape(batch, length, num_heads, head_dim).astype(value.dtype)


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
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    if scale is None:
        scale = head_dim**-0.5
    # An implementation without sliding windows may leave out the window argument.
    extra = {} if window is None else {"window": window}
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
    """What one attention layer attends to after a cache took this call's keys and values.

    Attributes:
        keys: ``[B, S, K, H]``.
        values: ``[B, S, K, H]``.
        positions: int32 ``[B, S]``, the position of each key (negative: empty or padding).
    """

    keys: jax.Array
    values: jax.Array
    positions: jax.Array

    def attend(
        self,
        query: jax.Array,
        query_positions: jax.Array,
        *,
        impl: str,
        window: int | None,
        dtype: DTypeLike,
    ) -> jax.Array:
        """``[B, T, N, H]`` attention of ``query`` over this view (see ``dot_product_attention``).

        Caches that store something other than plain keys and values (quantized codes)
        return a view that overrides this method.
        """
        return dot_product_attention(
            query,
            self.keys.astype(dtype),
            self.values.astype(dtype),
            query_positions,
            self.positions,
            impl=impl,
            window=window,
        )


class LayerWriter(Protocol):
    """How a cache takes one layer's keys and values (``lhc.lm.cache`` has the protocol)."""

    def write(
        self, layers: Any, layer: int | jax.Array, keys: jax.Array, values: jax.Array
    ) -> tuple[KVView, Any]: ...


@struct.dataclass
class LayerCache:
    """One layer's handle on a model cache during one call.

    Attributes:
        writer: the cache's ``LayerWriter`` for this call (shared by every layer).
        layers: the cache's per-layer storage, stacked over layers (a pytree whose leaves
            lead with ``[L]``); passed whole so that a layer updates its slice in place.
        layer: this layer's index into ``layers`` (an int, or a traced scalar under
            ``nn.scan``).
    """

    writer: Any
    layers: Any
    layer: Any

    def update(self, keys: jax.Array, values: jax.Array) -> tuple[KVView, LayerCache]:
        """Stores this call's ``keys`` / ``values`` ``[B, T, K, H]``; returns the view and
        the handle on the updated storage."""
        view, layers = self.writer.write(self.layers, self.layer, keys, values)
        return view, self.replace(layers=layers)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE and an optional cache.

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

    @nn.compact
    def __call__(
        self, x: jax.Array, positions: jax.Array, cache: LayerCache | None = None
    ) -> tuple[jax.Array, LayerCache | None]:
        """Attends the tokens of ``x`` to themselves, or to the cache they are appended to.

        Args:
            x: ``[B, T, D]``.
            positions: int ``[B, T]`` positions of the tokens of ``x`` (negative: padding).
            cache: ``None`` for a plain forward pass, or this layer's ``LayerCache``.

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

        inv_frequencies = rope_frequencies(head_dim, self.rope_theta, self.rope_scaling)
        query = apply_rope(query, positions, inv_frequencies)
        key = apply_rope(key, positions, inv_frequencies)
        query = nn.with_logical_constraint(query, ("act_batch", "act_len", "act_heads", "act_kv"))
        kv_axes = ("act_batch", "act_len", "act_kv_heads", "act_kv")
        key = nn.with_logical_constraint(key, kv_axes)
        value = nn.with_logical_constraint(value, kv_axes)

        if cache is None:
            view = KVView(keys=key, values=value, positions=positions)
        else:
            view, cache = cache.update(key, value)
        attended = view.attend(
            query, positions, impl=self.attention_impl, window=self.window, dtype=self.dtype
        )
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
