"""Rotary position embeddings (RoPE) with linear and Llama-3 frequency scaling.

Rotation follows the "rotate half" layout used by Llama and Qwen2 checkpoints: feature
``i`` of the first half of a head is paired with feature ``i + H/2``, not with its
neighbour.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3")

_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Keys that Hugging Face configs carry beside the scaling parameters and that change
# nothing here.
_IGNORED_KEYS = ("rope_type", "type", "rope_theta")


def validate_rope_scaling(rope_scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Checks a RoPE scaling description and returns it in canonical form.

    Args:
        rope_scaling: ``None`` (no scaling) or a mapping with ``rope_type`` (or the older
            ``type``) in ``ROPE_TYPES`` and that type's parameters:
            ``linear``: ``factor``; ``llama3``: ``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``.

    Returns:
        ``None`` for no scaling (also for ``rope_type="default"``), else a plain dict
        with ``rope_type`` and float/int parameters.

    Raises:
        ValueError: unknown type, missing or unknown keys, or non-positive values.
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling must be None or a mapping, got {rope_scaling!r}")
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling rope_type must be one of {ROPE_TYPES}, got {rope_type!r} "
            f"(in {dict(rope_scaling)!r})"
        )
    if rope_type == "default":
        return None
    required = _REQUIRED_KEYS[rope_type]
    missing = [key for key in required if key not in rope_scaling]
    if missing:
        raise ValueError(
            f"rope_scaling of type {rope_type!r} needs keys {required}, missing {missing} "
            f"(got {dict(rope_scaling)!r})"
        )
    unknown = [k for k in rope_scaling if k not in required and k not in _IGNORED_KEYS]
    if unknown:
        raise ValueError(
            f"rope_scaling of type {rope_type!r} takes keys {required}, got unknown keys {unknown}"
        )
    canonical: dict[str, Any] = {"rope_type": rope_type}
    for key in required:
        value = rope_scaling[key]
        if key == "original_max_position_embeddings":
            value = int(value)
        else:
            value = float(value)
        if not value > 0:
            raise ValueError(f"rope_scaling[{key!r}] must be positive, got {value}")
        canonical[key] = value
    if rope_type == "llama3" and canonical["high_freq_factor"] <= canonical["low_freq_factor"]:
        raise ValueError(
            "rope_scaling high_freq_factor must exceed low_freq_factor, got "
            f"{canonical['high_freq_factor']} <= {canonical['low_freq_factor']}"
        )
    return canonical


def rope_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, one per feature pair.

    Computed in float32 as the reference checkpoints' code does, so that angles at long
    positions agree bit for bit as far as possible.

    Args:
        head_dim: H, the per-head feature count (even).
        rope_theta: base of the geometric frequency ladder.
        rope_scaling: see ``validate_rope_scaling``.

    Returns:
        float32 ``[H/2]``.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    scaling = validate_rope_scaling(rope_scaling)
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(rope_theta), exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    factor = np.float32(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    # Llama 3: wavelengths longer than the original context are stretched by `factor`,
    # shorter than original/high_freq_factor are kept, and the band between is blended
    # linearly in 1/wavelength so the spectrum stays continuous.
    low_freq_factor = np.float32(scaling["low_freq_factor"])
    high_freq_factor = np.float32(scaling["high_freq_factor"])
    original_len = np.float32(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_frequencies: jax.Array) -> jax.Array:
    """Rotates each head's feature pairs by ``position * frequency``.

    Args:
        x: ``[B, T, N, H]`` queries or keys.
        positions: int ``[B, T]``; any integer (padding positions rotate harmlessly, they
            are masked elsewhere).
        inv_frequencies: float32 ``[H/2]`` from ``rope_frequencies``.

    Returns:
        ``[B, T, N, H]`` in the dtype of ``x``; the rotation itself runs in float32.
    """
    if x.ndim != 4 or positions.shape != x.shape[:2]:
        raise ValueError(
            f"apply_rope expects x [B, T, N, H] and positions [B, T], got {x.shape=} "
            f"{positions.shape=}"
        )
    if inv_frequencies.shape != (x.shape[-1] // 2,):
        raise ValueError(f"{inv_frequencies.shape=} does not match head_dim {x.shape[-1]}")
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_frequencies, jnp.float32)
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, H/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
