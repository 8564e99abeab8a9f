"""QuantSpec's hierarchical 4/8-bit quantization: one store, two precisions.

Each group of ``G`` values along ``group_axis`` gets a minimum ``m`` and a scale
``s = (max - m) / 15``. The upper nibble is the plain 4-bit round-to-nearest code
``U = clamp(round((x - m) / s), 0, 15)``, so ``m + s U`` is the best 4-bit value (within
``s / 2``); the lower nibble codes the residual at a sixteenth of the step,
``Lo = clamp(round((x - m - s U) / (s / 16)), -8, 7)``, stored as ``Lo + 8``, so that
``m + s U + (s / 16) Lo`` is an 8-bit value (within ``s / 32``, or ``s / 16`` where the
residual is clipped at +7). The draft reads the upper plane only, the target both.

Codes are packed two per byte along the last axis (element ``2i`` in the low four bits,
``2i + 1`` in the high four), upper and lower in separate planes. ``m`` and ``s`` are
stored in ``scale_dtype`` (float16 by default, as the official code), rounded so that
the stored minimum is at most the group's minimum and ``m + 15 s`` at least its
maximum: the bounds above hold for the stored values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Quantized:
    """A hierarchically quantized array of shape ``shape``.

    Attributes:
        upper: uint8, ``shape`` with the last axis halved: the 4-bit codes ``U``.
        lower: uint8, the same shape: the residual codes ``Lo + 8``.
        scale: ``s`` per group, ``shape`` with ``group_axis`` divided by ``group_size``.
        minimum: ``m`` per group, the same shape.
        group_axis: the (non-negative) axis the groups run along.
        group_size: G.
    """

    upper: jax.Array
    lower: jax.Array
    scale: jax.Array
    minimum: jax.Array
    group_axis: int = struct.field(pytree_node=False)
    group_size: int = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.upper.shape[:-1], 2 * self.upper.shape[-1])


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 codes in [0, 15], last axis even -> two per byte (last axis halved)."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """The inverse of ``pack_nibbles``: uint8 ``[..., n]`` -> codes ``[..., 2n]``."""
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _grouped(x: jax.Array, axis: int, size: int) -> jax.Array:
    """``x`` with ``axis`` split into ``[n, size]`` (the group index at ``axis``)."""
    return x.reshape(*x.shape[:axis], x.shape[axis] // size, size, *x.shape[axis + 1 :])


def _round_down(value: jax.Array, dtype) -> jax.Array:
    """The largest ``dtype`` value <= ``value`` (float32 in, ``dtype`` out)."""
    rounded = value.astype(dtype)
    too_big = rounded.astype(jnp.float32) > value
    return jnp.where(too_big, jnp.nextafter(rounded, jnp.array(-jnp.inf, dtype)), rounded)


def _round_up(value: jax.Array, dtype) -> jax.Array:
    rounded = value.astype(dtype)
    too_small = rounded.astype(jnp.float32) < value
    return jnp.where(too_small, jnp.nextafter(rounded, jnp.array(jnp.inf, dtype)), rounded)


def _normalized_axis(axis: int, ndim: int, name: str) -> int:
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"{name} must be an axis of the {ndim}-d input, got {axis!r}")
    return axis % ndim


def quantize(
    x: jax.Array, *, group_axis: int, group_size: int = 128, scale_dtype=jnp.float16
) -> Quantized:
    """Hierarchical quantization of ``x`` in groups of ``group_size`` along ``group_axis``.

    Keys are quantized per channel over tokens (``group_axis`` the token axis), values
    per token over channels (``group_axis`` the channel axis).

    Args:
        x: a float array whose last axis is even (two codes per byte).
        group_axis: the axis the groups run along.
        group_size: G; must divide ``x.shape[group_axis]``.
        scale_dtype: dtype of the stored scales and minima.

    Returns:
        A ``Quantized``.

    Raises:
        ValueError: an odd last axis, a bad axis, or a group size that does not divide it.
    """
    axis = _normalized_axis(group_axis, x.ndim, "quantize: group_axis")
    if x.shape[-1] % 2:
        raise ValueError(
            f"quantize: the last axis holds two codes per byte and must be even, got shape "
            f"{x.shape}"
        )
    if not isinstance(group_size, int) or group_size < 1 or x.shape[axis] % group_size:
        raise ValueError(
            f"quantize: group_size must be a positive int dividing axis {axis} of shape "
            f"{x.shape} ({x.shape[axis]}), got {group_size!r}"
        )
    grouped = _grouped(x.astype(jnp.float32), axis, group_size)
    low = jnp.min(grouped, axis=axis + 1, keepdims=True)
    high = jnp.max(grouped, axis=axis + 1, keepdims=True)
    minimum = _round_down(low, scale_dtype)
    scale = _round_up((high - minimum.astype(jnp.float32)) / 15.0, scale_dtype)
    m, s = minimum.astype(jnp.float32), scale.astype(jnp.float32)
    safe = jnp.where(s > 0, s, 1.0)
    upper = jnp.clip(jnp.round((grouped - m) / safe), 0, 15)
    residual = grouped - (m + s * upper)
    lower = jnp.clip(jnp.round(residual / (safe / 16.0)), -8, 7) + 8
    codes = [c.reshape(x.shape).astype(jnp.uint8) for c in (upper, lower)]
    return Quantized(
        upper=pack_nibbles(codes[0]),
        lower=pack_nibbles(codes[1]),
        scale=jnp.squeeze(scale, axis + 1),
        minimum=jnp.squeeze(minimum, axis + 1),
        group_axis=axis,
        group_size=group_size,
    )


def dequantize(q: Quantized, bits: int = 8, dtype=jnp.float32) -> jax.Array:
    """``m + s U`` (``bits=4``, the upper plane only) or ``m + s U + (s / 16)(Lo - 8)``
    (``bits=8``), in ``dtype``."""
    if bits not in (4, 8):
        raise ValueError(f"dequantize: bits must be 4 or 8, got {bits!r}")
    axis, size = q.group_axis, q.group_size
    expand = lambda a: jnp.repeat(a.astype(jnp.float32), size, axis=axis)  # noqa: E731
    m, s = expand(q.minimum), expand(q.scale)
    value = m + s * unpack_nibbles(q.upper).astype(jnp.float32)
    if bits == 8:
        value = value + (s / 16.0) * (unpack_nibbles(q.lower).astype(jnp.float32) - 8.0)
    return value.astype(dtype)
