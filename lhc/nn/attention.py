"""The grouped-query attention layer and the cache interface it reads and writes.

``Attention`` projects queries, keys and values, applies RoPE (or ALiBi), and attends
through ``lhc.nn.attention_ops.dot_product_attention`` (whose docstring describes the
position mask and the kernel choice).

The layer reads and writes a cache through ``LayerCache``: a handle on one layer of a
model's cache (``lhc.lm.cache`` describes the protocol). The handle's writer receives
this call's keys, values and positions and returns a ``KVView``, what the layer attends
to (keys, values and their positions, which may differ from layer to layer); a view may
also compute the attention itself (a quantized store reads its own codes). Caches store
with ``write_slots`` and order their in-place writes after the reads with
``ordered_after``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from lhc.nn import remat
from lhc.nn.attention_ops import (
    _check_attention_inputs,
    alibi_slopes,
    attention_segments,
    banded_self_attention,
    dot_product_attention,
    segment_weights,
)
from lhc.nn.blocked_prefix import attention_with_blocked_prefix
from lhc.nn.linear import Einsum
from lhc.nn.norms import RMSNorm
from lhc.nn.rope import apply_rope, rope_attention_factor, rope_frequencies


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


# Held keys read per step of the XLA path's loop (``attention_with_blocked_prefix``): a
# call of several tokens (a prompt's chunk) reads a held segment longer than this block
# by block between its first and last visible key. A one-token step reads it densely
# (a cache sized to its use has few empty slots; no gain measured on a CPU).
HELD_BLOCK = 512


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
        new_mask: ``None`` or bool ``[B, T, T]``: which of this call's keys each of its
            queries may see besides the position mask (packed sequences: each sees its
            own); the held keys are visible to all. Attention then runs in XLA.
    """

    keys: jax.Array
    values: jax.Array
    positions: jax.Array
    new_keys: jax.Array | None = None
    new_values: jax.Array | None = None
    new_positions: jax.Array | None = None
    new_mask: jax.Array | None = None

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
        softmax; for several tokens, a cache longer than ``HELD_BLOCK`` slots block by
        block between its first and last visible key (``attention_with_blocked_prefix``:
        a chunk of a long prompt reads what the cache holds so far, a windowed layer its
        window). The others receive them concatenated. Caches that store something other
        than plain keys and values (quantized codes) return a view that overrides this.
        """
        segments = [(k.astype(dtype), v.astype(dtype), *rest) for k, v, *rest in self.segments()]
        held, length = segments[0][0].shape[1], query.shape[1]
        if impl == "xla" and len(segments) > 1 and held > HELD_BLOCK and length > 1:
            keys, values, positions = segments[0]
            return attention_with_blocked_prefix(
                query,
                (jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2), positions),
                segments[1:],
                query_positions,
                scale=query.shape[-1] ** -0.5,
                window=window,
                alibi_slopes=alibi_slopes,
                block=HELD_BLOCK,
            )
        if (
            (impl == "xla" and len(segments) > 1)
            or self.positions.ndim == 3
            or len(segments[-1]) > 3
        ):
            for keys, values, positions, *_ in segments:
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

    def segments(self) -> list[tuple[jax.Array, ...]]:
        """``(keys, values, positions)`` of what is held, then of this call's keys (with
        ``new_mask`` as a fourth element when there is one)."""
        segments = [(self.keys, self.values, self.positions)]
        if self.new_keys is not None:
            own = (self.new_keys, self.new_values, self.new_positions)
            segments.append(own if self.new_mask is None else (*own, self.new_mask))
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
        segments = [
            (*segment[:3], jnp.take_along_axis(segment[3], probe[:, :, None], axis=1))
            if len(segment) > 3
            else segment
            for segment in self.segments()
        ]
        weights = segment_weights(
            picked,
            segments,
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


def ordered_after(update: jax.Array, result: jax.Array) -> jax.Array:
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
        qk_norm: RMS-normalise each head's query and key (a learned ``[H]`` scale each,
            ``query_norm`` / ``key_norm``) before the rotation (Gemma 3).
        norm_eps, norm_scale_offset: those norms' epsilon and scale offset (``RMSNorm``).
        query_scale: the scores' scale, ``H ** -0.5`` when ``None`` (Gemma 3:
            ``query_pre_attn_scalar ** -0.5``).
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
    qk_norm: bool = False
    norm_eps: float = 1e-6
    norm_scale_offset: float = 0.0
    query_scale: float | None = None

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
        if self.qk_norm:
            norm = functools.partial(
                RMSNorm,
                epsilon=self.norm_eps,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                scale_offset=self.norm_scale_offset,
            )
            query, key = norm(name="query_norm")(query), norm(name="key_norm")(key)
        if self.query_scale is not None and self.query_scale != head_dim**-0.5:
            # Every attention path scales the scores by H ** -0.5.
            query = query * jnp.asarray(self.query_scale * head_dim**0.5, query.dtype)

        settings = dict(impl=self.attention_impl, window=self.window, dtype=self.dtype)
        if self.position_encoding == "rope":
            inv_frequencies = rope_frequencies(head_dim, self.rope_theta, self.rope_scaling)
            # YaRN's temperature scales cos and sin, as transformers does (logits by its square).
            scale = rope_attention_factor(self.rope_scaling)
            query = apply_rope(query, positions, inv_frequencies, scale)
            key = apply_rope(key, positions, inv_frequencies, scale)
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
