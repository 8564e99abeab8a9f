"""QuantSpec's KV cache: a hierarchically quantized store plus a full-precision buffer
of the recent tokens, read at 8 bits by the target and at 4 bits by the draft.

Which tokens a query reads quantized depends only on the query's slot ``s`` (its index
in the sequence, padding included), never on how the tokens were grouped into calls:
the tokens before ``Q(s) = G * max(0, s // G - 1)`` come from the quantized store, the
rest (between G and 2G - 1 tokens: the group ``s`` falls in and the one before it, the
paper's two buffer halves) at full precision. So decoding one token per call and
verifying gamma + 1 tokens in one call give the same logits, and speculative decoding
on this cache reproduces plain decoding on it token for token.

Storage, per layer: keys quantized per channel over groups of ``G`` slots, values per
slot over groups of ``G`` channels (``lhc.quantspec.quantize``: upper and lower nibble
planes, float16 scales and minima); a ring of ``2G + max_call - 1`` full-precision
slots. At the start of a call the groups that its queries will read quantized are
quantized from the ring (the older buffer half flushes, during decoding too); the
call's own keys are then written to the ring. A call appends at most ``max_call <= G``
tokens, so its queries read its own keys at full precision as any grouping into calls
would: prefill in chunks of at most G.

Truncation moves the length back; quantized groups at or past the new length are
dropped and re-quantized later from the ring. Going back by more than ``max_call``
tokens can lose keys the ring no longer holds: the sequence is then marked broken
(``can_append`` false, NaN logits), as for the other caches.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from kernels_pallas.quant_kv_attention import (
    buffer_attention,
    merge_attention,
    quant_kv_attention,
)
from lhc.lm.cache import (
    InOrderSlots,
    check_batch,
    check_room,
    checked_lengths,
    is_concrete,
)
from lhc.nn.attention import ordered_after, write_slots
from lhc.nn.blocked_prefix import attention_with_blocked_prefix
from lhc.quantspec.quantize import quantize

_CODES = ("k_upper", "k_lower", "v_upper", "v_lower")
_STORE_ORDER = ("k_upper", "k_lower", "k_scale", "k_min", "v_upper", "v_lower", "v_scale", "v_min")


def cutoff(slots: jax.Array, group_size: int) -> jax.Array:
    """``Q(s)``: a query at slot ``s`` reads the tokens before it from the quantized store."""
    return group_size * jnp.maximum(slots // group_size - 1, 0)


@struct.dataclass
class _QuantWriter:
    """``QuantSpecCache``'s writer for one call."""

    ring_writes: jax.Array  # int32 [B, T], the ring slots of this call's tokens
    store_positions: jax.Array  # int32 [B, S], slot positions before the call
    ring_slots: jax.Array  # int32 [B, C], the slot each ring entry holds (-1: none)
    ring_positions: jax.Array  # int32 [B, C]
    read_cut: jax.Array  # int32 [B, T], slots below it are read quantized
    start: jax.Array  # int32 [B], the call's first slot
    new_positions: jax.Array  # int32 [B, T]
    key_positions: jax.Array  # int32 [B, S], slot positions after the call
    quantized: jax.Array  # int32 [B], slots quantized after the flush
    group_size: int = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False)

    def read(self, layers, layer, keys, values):
        return _QuantView(self, layers, layer, keys, values)

    def write(self, layers, layer, keys, values, *, after):
        layers = dict(layers)
        rows = jnp.arange(keys.shape[0])[:, None]
        for name, new in (("ring_k", keys), ("ring_v", values)):
            store = layers[name]
            update = ordered_after(new, after).astype(store.dtype)
            layers[name] = store.at[layer, rows, :, self.ring_writes].set(update)
        return layers


@struct.dataclass
class _QuantView:
    """What one layer attends to: the quantized store below each query's cut, the ring
    from the cut on, and the call's own keys."""

    writer: _QuantWriter
    layers: Any
    layer: Any
    new_keys: jax.Array
    new_values: jax.Array

    def attend(self, query, query_positions, *, impl, window, dtype, alibi_slopes=None):
        if impl == "pallas":
            return self._attend_pallas(query, query_positions, window, dtype, alibi_slopes)
        w = self.writer
        block = min(STORE_BLOCK // w.group_size * w.group_size, w.store_positions.shape[1])
        return attention_with_blocked_prefix(
            query.astype(dtype),
            _StoreBlocks.of(self, dtype),
            self._buffer_segments(dtype),
            query_positions,
            scale=query.shape[-1] ** -0.5,
            window=window,
            alibi_slopes=alibi_slopes,
            block=max(block, w.group_size),
        )

    def _buffer_segments(self, dtype):
        w = self.writer
        ring = w.ring_slots[:, None, :]
        ring_mask = (ring >= w.read_cut[:, :, None]) & (ring >= 0) & (ring < w.start[:, None, None])
        swap = lambda x: jnp.swapaxes(x[self.layer], 1, 2).astype(dtype)  # noqa: E731
        return [
            (swap(self.layers["ring_k"]), swap(self.layers["ring_v"]), w.ring_positions, ring_mask),
            (self.new_keys.astype(dtype), self.new_values.astype(dtype), w.new_positions, None),
        ]

    def _attend_pallas(self, query, query_positions, window, dtype, alibi_slopes):
        """The quantized store through ``kernels_pallas.quant_kv_attention`` (dequantized
        in the kernel), the buffer and the call's keys through its ``buffer_attention``
        (the causal tail), merged by log-sum-exp."""
        if window is not None or alibi_slopes is not None:
            raise ValueError("the QuantSpec Pallas path serves full attention without ALiBi")
        w = self.writer
        part = lambda name: self.layers[name][self.layer]  # noqa: E731
        stored = quant_kv_attention(
            query,
            *(part(name) for name in _STORE_ORDER),
            w.store_positions,
            w.read_cut,
            bits=w.bits,
        )
        swap = lambda x: jnp.swapaxes(x[self.layer], 1, 2)  # noqa: E731
        new_slots = w.start[:, None] + jnp.arange(query.shape[1], dtype=jnp.int32)[None]
        recent = buffer_attention(
            query,
            jnp.concatenate([swap(self.layers["ring_k"]), self.new_keys.astype(dtype)], axis=1),
            jnp.concatenate([swap(self.layers["ring_v"]), self.new_values.astype(dtype)], axis=1),
            jnp.concatenate([w.ring_slots, new_slots], axis=1),
            jnp.concatenate([w.ring_positions, w.new_positions], axis=1),
            query_positions,
            w.read_cut,
        )
        return merge_attention([stored, recent]).astype(dtype)


# Slots of the quantized store read per step of the XLA path's loop (rounded down to a
# multiple of G): one block's codes are widened to float32 at a time, never the whole
# store. On a 2-core CPU, 30 layers of SmolLM2's shape at 8K in a loop of blocks cost
# about 1.5x in blocks of 512 what they cost in blocks of 4,096 (each step of the loop
# has its cost); one block of all 8K was not faster.
STORE_BLOCK = 4096


def _code(upper: jax.Array, lower: jax.Array, bits: int) -> jax.Array:
    """float32 ``U`` (``bits=4``) or ``U + (Lo - 8) / 16`` (``bits=8``) from 4-bit codes:
    a value is then ``m + s * code`` (``lhc.quantspec.quantize``)."""
    code = upper.astype(jnp.float32)
    if bits == 8:
        code = code + lower.astype(jnp.float32) * (1 / 16) - 0.5
    return code


@struct.dataclass
class _StoreBlocks:
    """One layer's quantized store as ``BlockedKeys``: a block's codes widened to
    float32 (``m + s * code``) while in cache, the even and the odd channels (the low
    and the high nibbles) apart, never interleaved: the queries are split the same way
    and the weighted values put back together, both a few rows. Slices read the stacked
    store at ``(layer, block)``: a scanned layer copies out no whole layer."""

    store: dict
    layer: Any
    positions: jax.Array  # int32 [B, S], -1 from the last slot any query reads quantized
    read_cut: jax.Array  # int32 [B, T]
    num_kv_heads: int = struct.field(pytree_node=False)
    group_size: int = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False)
    dtype: Any = struct.field(pytree_node=False)

    @classmethod
    def of(cls, view: _QuantView, dtype) -> _StoreBlocks:
        w = view.writer
        slots = jnp.arange(w.store_positions.shape[1], dtype=jnp.int32)[None, :]
        read = slots < jnp.max(w.read_cut, axis=1, keepdims=True)
        return cls(
            store=view.layers,
            layer=view.layer,
            positions=jnp.where(read, w.store_positions, -1),
            read_cut=w.read_cut,
            num_kv_heads=view.layers["ring_k"].shape[2],
            group_size=w.group_size,
            bits=w.bits,
            dtype=jnp.dtype(dtype),
        )

    def _slice(self, name: str, start, size: int) -> jax.Array:
        """``store[name][layer][:, :, start : start + size]``, read in place."""
        x = self.store[name]
        corner = (self.layer, 0, 0, start, 0)
        return jax.lax.dynamic_slice(x, corner, (1, *x.shape[1:3], size, x.shape[4]))[0]

    def _block(self, prefix: str, start, size: int) -> tuple[jax.Array, jax.Array]:
        """float32 ``[B, K, size, H / 2]``: the even and the odd channels of slots
        ``start ..`` (the low and the high nibbles, never interleaved)."""
        g = self.group_size
        upper = self._slice(f"{prefix}_upper", start, size)
        lower = self._slice(f"{prefix}_lower", start, size)
        batch, heads, _, half = upper.shape
        if prefix == "k":  # a scale per channel and group of G slots: [B, K, size / G, H]
            first, count = start // g, size // g
            shape = (batch, heads, size // g, g, half)
        else:  # a scale per slot and group of G channels: [B, K, size, H / G]
            first, count = start, size
            shape = (batch, heads, size, half // (g // 2), g // 2)
        scale, minimum = (
            self._slice(f"{prefix}_{name}", first, count).astype(jnp.float32)
            for name in ("scale", "min")
        )

        def of_parity(x, parity):  # a key's channel 2i + parity; a value's group
            return x[:, :, :, None, parity::2] if prefix == "k" else x[..., None]

        halves = []
        planes = ((upper & 0xF, lower & 0xF), (upper >> 4, lower >> 4))
        for parity, (u, lo) in enumerate(planes):
            code = _code(u, lo, self.bits).reshape(shape)
            value = of_parity(minimum, parity) + of_parity(scale, parity) * code
            halves.append(value.reshape(batch, heads, size, half))
        return halves[0], halves[1]

    def scores(self, rows, start, size):
        even, odd = self._block("k", start, size)
        rows = rows.astype(jnp.float32)
        out = jnp.einsum("bkqh,bksh->bkqs", rows[..., 0::2], even)
        return out + jnp.einsum("bkqh,bksh->bkqs", rows[..., 1::2], odd)

    def weighted(self, weights, start, size):
        even, odd = self._block("v", start, size)
        parts = [jnp.einsum("bkqs,bksh->bkqh", weights, x) for x in (even, odd)]
        return jnp.stack(parts, axis=-1).reshape(*weights.shape[:3], -1)

    def mask(self, start, size):
        slots = start + jnp.arange(size, dtype=jnp.int32)
        return slots[None, None, :] < self.read_cut[:, :, None]


def _ring_slots(lengths: jax.Array, ring: int) -> jax.Array:
    """int32 ``[B, C]``: the slot held by each ring entry (-1: none yet)."""
    entry = jnp.arange(ring, dtype=jnp.int32)[None, :]
    last = lengths[:, None] - 1
    slot = last - jnp.mod(last - entry, ring)
    return jnp.where(slot >= 0, slot, -1)


@struct.dataclass
class QuantSpecCache(InOrderSlots):
    """The cache protocol over a quantized store and a full-precision ring.

    Attributes:
        store: name -> ``[L, B, ...]``: ``k_upper``, ``k_lower``, ``v_upper``,
            ``v_lower`` (uint8 ``[L, B, K, S, H / 2]``), ``k_scale``, ``k_min``
            (``[L, B, K, S / G, H]``), ``v_scale``, ``v_min`` (``[L, B, K, S, H / G]``),
            ``ring_k``, ``ring_v`` (``[L, B, K, C, H]``, the compute dtype).
        positions: int32 ``[B, S]``, the position of the token in each slot (-1: none).
        lengths: int32 ``[B]``, slots appended.
        quantized: int32 ``[B]``, slots held in the quantized store (a multiple of G).
        intact: bool ``[B]``, false after a truncation lost keys.
        group_size: G.
        max_call: the most tokens one call may append.
        bits: 8 (the target's view) or 4 (the draft's); ``draft()`` and ``target()``
            switch it, the store is shared.
    """

    store: dict
    positions: jax.Array
    lengths: jax.Array
    quantized: jax.Array
    intact: jax.Array
    group_size: int = struct.field(pytree_node=False)
    max_call: int = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False, default=8)

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    @property
    def ring_size(self) -> int:
        return self.store["ring_k"].shape[3]

    @property
    def num_layers(self) -> int:
        return self.store["ring_k"].shape[0]

    # Every store array has a leading layer axis.
    stacked_layers = True

    def draft(self) -> QuantSpecCache:
        return self.replace(bits=4)

    def target(self) -> QuantSpecCache:
        return self.replace(bits=8)

    # The cache protocol.

    def truncate(self, new_lengths) -> QuantSpecCache:
        new_lengths = checked_lengths(new_lengths, self.lengths)
        g = self.group_size
        quantized = jnp.minimum(self.quantized, g * (new_lengths // g))
        oldest_held = self.lengths - self.ring_size
        held = (oldest_held <= quantized) & (oldest_held <= cutoff(new_lengths, g))
        slots = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
        return self.replace(
            positions=jnp.where(slots < new_lengths[:, None], self.positions, -1),
            lengths=new_lengths,
            quantized=quantized,
            intact=self.intact & held,
        )

    def can_append(self, num_tokens: int) -> jax.Array:
        return self.intact & (self.lengths + num_tokens <= self.capacity)

    def validate_append(self, batch_size: int, num_tokens: int) -> None:
        check_batch("cache", self.lengths, batch_size)
        if num_tokens > self.max_call:
            raise ValueError(
                f"a QuantSpecCache takes at most max_call={self.max_call} tokens per call, "
                f"got {num_tokens}: prefill in chunks of at most {self.max_call}"
            )
        check_room(self.lengths, num_tokens, self.capacity)
        if is_concrete(self.intact):
            if not np.asarray(self.intact).all():
                raise ValueError(
                    f"the QuantSpecCache was truncated back by more than max_call="
                    f"{self.max_call} tokens for sequences "
                    f"{np.flatnonzero(~np.asarray(self.intact)).tolist()}: keys are lost"
                )

    def logical_axes(self) -> QuantSpecCache:
        spec = PartitionSpec(None, "cache_batch", "cache_kv_heads", None, None)
        return self.replace(
            store={name: spec for name in self.store},
            positions=PartitionSpec("cache_batch", "cache_len"),
            lengths=PartitionSpec("cache_batch"),
            quantized=PartitionSpec("cache_batch"),
            intact=PartitionSpec("cache_batch"),
        )

    # The per-layer interface.

    def _flush(self, limit: jax.Array) -> tuple[dict, jax.Array]:
        """Quantizes, group by group, the slots from ``quantized`` up to ``limit``; a
        group's work runs only when some sequence has a group due (``lax.cond``: most
        decoding steps have none)."""
        store, quantized = dict(self.store), self.quantized
        for _ in range(2):  # calls of at most G tokens: at most two groups are due
            due = quantized < limit  # [B]
            store = jax.lax.cond(
                jnp.any(due), self._flush_group, lambda store, *_: store, store, quantized, due
            )
            quantized = quantized + self.group_size * due
        return store, quantized

    def _flush_group(self, store: dict, quantized: jax.Array, due: jax.Array) -> dict:
        """``store`` with the group at slot ``quantized`` quantized where ``due``."""
        g, ring = self.group_size, self.ring_size
        store = dict(store)
        rows = jnp.arange(quantized.shape[0])[:, None]
        slots = quantized[:, None] + jnp.arange(g, dtype=jnp.int32)[None, :]  # [B, G]
        entries = jnp.mod(slots, ring)
        # [L, B, K, G, H] from the ring, in f32
        keys = store["ring_k"][:, rows, :, entries].astype(jnp.float32)
        values = store["ring_v"][:, rows, :, entries].astype(jnp.float32)
        # The gather puts the [B, G] index dims first: [B, G, L, K, H] -> [L, B, K, G, H]
        keys, values = (jnp.transpose(x, (2, 0, 3, 1, 4)) for x in (keys, values))
        qk = quantize(keys, group_axis=3, group_size=g)
        qv = quantize(values, group_axis=4, group_size=g)
        out = jnp.where(due[:, None], slots, self.capacity)  # dropped where not due
        group = jnp.where(due, quantized // g, self.capacity // g)[:, None]
        for name, x, at in (
            ("k_upper", qk.upper, out),
            ("k_lower", qk.lower, out),
            ("v_upper", qv.upper, out),
            ("v_lower", qv.lower, out),
            ("k_scale", qk.scale, group),
            ("k_min", qk.minimum, group),
            ("v_scale", qv.scale, out),
            ("v_min", qv.minimum, out),
        ):
            update = jnp.transpose(x, (1, 3, 0, 2, 4)).astype(store[name].dtype)
            store[name] = store[name].at[:, rows, :, at].set(update, mode="drop")
        return store

    def begin_update(self, positions: jax.Array) -> tuple[_QuantWriter, dict]:
        g, length = self.group_size, positions.shape[1]
        start = self.lengths
        query_slots = start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
        # Groups whose every slot is stored and that a query of this call reads quantized.
        limit = jnp.minimum(cutoff(start + length - 1, g), g * (start // g))
        store, quantized = self._flush(limit)
        ring_slots = _ring_slots(start, self.ring_size)
        ring_positions = jnp.where(
            ring_slots >= 0,
            jnp.take_along_axis(self.positions, jnp.maximum(ring_slots, 0), axis=1),
            -1,
        )
        writer = _QuantWriter(
            ring_writes=jnp.mod(query_slots, self.ring_size),
            store_positions=self.positions,
            ring_slots=ring_slots,
            ring_positions=ring_positions,
            read_cut=jnp.minimum(cutoff(query_slots, g), quantized[:, None]),
            start=start,
            new_positions=positions,
            key_positions=write_slots(self.positions, positions, start),
            quantized=quantized,
            group_size=g,
            bits=self.bits,
        )
        return writer, store

    def finish_update(self, writer: _QuantWriter, layers) -> QuantSpecCache:
        return self.replace(
            store=layers,
            positions=writer.key_positions,
            lengths=self.lengths + writer.new_positions.shape[1],
            quantized=writer.quantized,
        )


def init_cache(
    config, batch_size: int, max_len: int, *, group_size: int = 128, max_call: int | None = None
) -> QuantSpecCache:
    """An empty ``QuantSpecCache`` for an ``lhc.lm`` model of ``config``.

    Args:
        config: the model's ``LMConfig`` (``num_layers``, ``num_kv_heads``,
            ``head_dim``, ``dtype``).
        batch_size: B.
        max_len: slots per sequence (rounded up to a multiple of ``group_size``).
        group_size: G, the token group of the keys and the channel group of the values;
            must divide ``head_dim``.
        max_call: the most tokens a call may append (prefill chunks, gamma + 1 for
            verification), at most G (the default). The ring holds ``2G + max_call - 1``
            slots.

    Raises:
        ValueError: a group size that does not divide the head, ``max_call`` outside
            ``[1, G]``, or bad sizes.
    """
    g = group_size
    if not isinstance(g, int) or g < 2 or config.head_dim % g:
        raise ValueError(
            f"group_size must be an int >= 2 dividing head_dim={config.head_dim} (values are "
            f"quantized in groups of G channels), got {group_size!r}"
        )
    max_call = g if max_call is None else max_call
    if not isinstance(max_call, int) or not 1 <= max_call <= g:
        raise ValueError(
            f"max_call (tokens per call: prefill chunks, gamma + 1 when verifying) must be "
            f"an int in [1, group_size={g}], got {max_call!r}"
        )
    if batch_size < 1 or max_len < 1:
        raise ValueError(f"batch_size and max_len must be positive, got {batch_size}, {max_len}")
    slots = g * math.ceil(max_len / g)
    layers, kv, h = config.num_layers, config.num_kv_heads, config.head_dim
    ring = 2 * g + max_call - 1
    lead = (layers, batch_size, kv)
    codes = jnp.zeros((*lead, slots, h // 2), jnp.uint8)
    dtype = jnp.dtype(config.dtype)
    store = {name: codes for name in _CODES}
    store.update(
        k_scale=jnp.zeros((*lead, slots // g, h), jnp.float16),
        k_min=jnp.zeros((*lead, slots // g, h), jnp.float16),
        v_scale=jnp.zeros((*lead, slots, h // g), jnp.float16),
        v_min=jnp.zeros((*lead, slots, h // g), jnp.float16),
        ring_k=jnp.zeros((*lead, ring, h), dtype),
        ring_v=jnp.zeros((*lead, ring, h), dtype),
    )
    return QuantSpecCache(
        store=store,
        positions=jnp.full((batch_size, slots), -1, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        quantized=jnp.zeros((batch_size,), jnp.int32),
        intact=jnp.ones((batch_size,), bool),
        group_size=g,
        max_call=max_call,
    )


def kv_bytes_per_token(cache: QuantSpecCache) -> dict[str, float]:
    """Bytes per token of the quantized store that each view reads (codes, scales and
    minima; the bounded ring not counted), and of a bfloat16 cache of the same shape."""
    slots = cache.capacity
    per = lambda names: sum(cache.store[n].nbytes for n in names) / slots  # noqa: E731
    scales = ("k_scale", "k_min", "v_scale", "v_min")
    layers, batch, kv, _, h = cache.store["ring_k"].shape
    return {
        "bits8": per(_CODES + scales) / batch,
        "bits4": per(("k_upper", "v_upper") + scales) / batch,
        "bf16": 2 * layers * kv * h * 2,
    }
