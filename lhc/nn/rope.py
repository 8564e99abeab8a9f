"""Rotary position embeddings (RoPE) and the frequency scalings that extend their context.

Rotation follows the "rotate half" layout used by Llama and Qwen2 checkpoints: feature
``i`` of the first half of a head is paired with feature ``i + H/2``, not with its
neighbour.

Scalings (``rope_scaling["rope_type"]``), computed as Hugging Face transformers'
``modeling_rope_utils`` does (in float32, the same operations in the same order):

- ``"default"`` (or ``None``): inverse frequencies ``theta ** (-2i / H)``.
- ``"linear"`` (position interpolation): every frequency divided by ``factor``.
- ``"ntk"``: static NTK-aware scaling, the base raised once to ``theta * factor **
  (H / (H - 2))``. transformers has no static type; its ``"dynamic"`` NTK uses this
  base (with the same ``factor``) exactly when the sequence is ``(2 - 1 / factor) *
  max_position_embeddings`` tokens long (and ``factor**2 - factor + 1`` in place of
  ``factor`` at ``factor * max_position_embeddings`` tokens). ``config_to_hf`` writes it
  as default RoPE with the scaled base, which transformers reads as the same model.
- ``"yarn"`` (YaRN): frequencies that turn more than ``beta_fast`` times over
  ``original_max_position_embeddings`` positions are kept, those that turn fewer than
  ``beta_slow`` times are divided by ``factor``, and the band between is blended
  linearly in the frequency index; then the rotated queries and keys are multiplied by
  ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the ratio of that formula at
  ``mscale`` and ``mscale_all_dim``), as transformers multiplies cos and sin, so the
  attention logits scale by its square (``rope_attention_factor``).
- ``"llama3"``: Llama 3.1's band-wise blend of the original and ``factor``-divided
  frequencies.

``"dynamic"`` (dynamic NTK) is refused: its base grows with the length of the sequence
being run, so keys already in a cache were rotated with other frequencies than a new
query (transformers recomputes them per call, and its own cached generation differs from
a full forward pass). The static ``"ntk"`` with the same ``factor`` is the fixed form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "ntk", "yarn", "llama3")

_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Optional keys, resolved to their defaults in the canonical form (``mscale`` and
# ``mscale_all_dim`` only matter through ``attention_factor`` in the architectures here).
_OPTIONAL_KEYS = {
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
}
# Keys that Hugging Face configs carry beside the scaling parameters and that change
# nothing here.
_IGNORED_KEYS = ("rope_type", "type", "rope_theta")


def _number(key: str, value: Any, cast: type = float) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"rope_scaling[{key!r}] must be a number, got {value!r}")
    value = cast(value)
    if not value > 0:
        raise ValueError(f"rope_scaling[{key!r}] must be positive, got {value}")
    return value


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``), transformers'
    ``yarn_get_mscale``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_options(rope_scaling: Mapping[str, Any], factor: float) -> dict[str, Any]:
    """``beta_fast``, ``beta_slow``, ``attention_factor`` and ``truncate`` with
    transformers' defaults (``None`` or 0 betas mean 32 and 1, as its ``or`` does)."""
    options: dict[str, Any] = {
        "beta_fast": _number("beta_fast", rope_scaling.get("beta_fast") or 32),
        "beta_slow": _number("beta_slow", rope_scaling.get("beta_slow") or 1),
    }
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    options["attention_factor"] = _number("attention_factor", attention_factor)
    # transformers reads rope_parameters.get("truncate", True): an explicit null is false.
    options["truncate"] = bool(rope_scaling.get("truncate", True))
    return options


def validate_rope_scaling(rope_scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Checks a RoPE scaling description and returns it in canonical form.

    Args:
        rope_scaling: ``None`` (no scaling) or a mapping with ``rope_type`` (or the older
            ``type``) in ``ROPE_TYPES`` and that type's parameters:
            ``linear``: ``factor``; ``ntk``: ``factor``; ``yarn``: ``factor``,
            ``original_max_position_embeddings``, optional ``beta_fast`` (32),
            ``beta_slow`` (1), ``attention_factor`` (from ``factor``, ``mscale`` and
            ``mscale_all_dim``, see the module docstring), ``truncate`` (true: the blend
            band's ends rounded outwards to whole indices); ``llama3``: ``factor``,
            ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``.

    Returns:
        ``None`` for no scaling (also for ``rope_type="default"``), else a plain dict
        with ``rope_type`` and float/int parameters; a ``yarn`` one holds all its
        options, defaults resolved (``mscale``/``mscale_all_dim`` folded into
        ``attention_factor``).

    Raises:
        ValueError: unknown type (``"dynamic"`` with its reason), missing or unknown
            keys, or non-positive values.
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise ValueError(f"rope_scaling must be None or a mapping, got {rope_scaling!r}")
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type == "dynamic":
        factor = rope_scaling.get("factor")
        raise ValueError(
            f"rope_scaling rope_type 'dynamic' (dynamic NTK) is not supported: its frequencies "
            "change with the sequence length, which a KV cache cannot follow; use the static "
            f"form with the same factor, {{'rope_type': 'ntk', 'factor': {factor}}}"
        )
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling rope_type must be one of {ROPE_TYPES}, got {rope_type!r} "
            f"(in {dict(rope_scaling)!r})"
        )
    if rope_type == "default":
        return None
    required = _REQUIRED_KEYS[rope_type]
    optional = _OPTIONAL_KEYS.get(rope_type, ())
    missing = [key for key in required if key not in rope_scaling]
    if missing:
        raise ValueError(
            f"rope_scaling of type {rope_type!r} needs keys {required}, missing {missing} "
            f"(got {dict(rope_scaling)!r})"
        )
    unknown = [k for k in rope_scaling if k not in required + optional + _IGNORED_KEYS]
    if unknown:
        raise ValueError(
            f"rope_scaling of type {rope_type!r} takes keys {required + optional}, got unknown "
            f"keys {unknown}"
        )
    canonical: dict[str, Any] = {"rope_type": rope_type}
    for key in required:
        cast = int if key == "original_max_position_embeddings" else float
        canonical[key] = _number(key, rope_scaling[key], cast)
    if rope_type == "llama3" and canonical["high_freq_factor"] <= canonical["low_freq_factor"]:
        raise ValueError(
            "rope_scaling high_freq_factor must exceed low_freq_factor, got "
            f"{canonical['high_freq_factor']} <= {canonical['low_freq_factor']}"
        )
    if rope_type == "yarn":
        canonical.update(_yarn_options(rope_scaling, canonical["factor"]))
    return canonical


def rope_attention_factor(rope_scaling: Mapping[str, Any] | None) -> float:
    """The factor on cos and sin (so on rotated queries and keys): YaRN's
    ``attention_factor``, else 1."""
    scaling = validate_rope_scaling(rope_scaling)
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    return scaling["attention_factor"]


def ntk_rope_theta(head_dim: int, rope_theta: float, factor: float) -> float:
    """The base of static NTK-aware scaling, ``rope_theta * factor ** (H / (H - 2))``, in
    float64 as transformers' dynamic NTK computes its base."""
    return float(rope_theta) * float(factor) ** (head_dim / (head_dim - 2))


def _yarn_frequencies(head_dim: int, rope_theta: float, scaling: Mapping[str, Any]) -> np.ndarray:
    """transformers' ``_compute_yarn_parameters``: the blend band in float64, the
    frequencies and the ramp in float32."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    pos_freqs = np.power(np.float32(rope_theta), exponents)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(scaling["factor"]) * pos_freqs)
    original_len = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        # The index whose wavelength fits `rotations` times into the original context.
        wavelengths = original_len / (rotations * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(rope_theta))

    low = correction_dim(scaling["beta_fast"])
    high = correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers, against a zero-width band
    index = np.arange(head_dim // 2, dtype=np.float32)
    ramp = np.clip((index - np.float32(low)) / np.float32(high - low), 0, 1).astype(np.float32)
    extrapolation_weight = np.float32(1.0) - ramp
    return (
        interpolation * (np.float32(1.0) - extrapolation_weight)
        + extrapolation * extrapolation_weight
    ).astype(np.float32)


def rope_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Inverse frequencies of the rotary embedding, one per feature pair.

    Computed in float32 as the reference checkpoints' code does, so that angles at long
    positions agree bit for bit as far as possible. YaRN's attention factor is not part
    of them: see ``rope_attention_factor``.

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
    rope_type = None if scaling is None else scaling["rope_type"]
    if rope_type == "yarn":
        return _yarn_frequencies(head_dim, rope_theta, scaling)
    if rope_type == "ntk":
        rope_theta = ntk_rope_theta(head_dim, rope_theta, scaling["factor"])
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(rope_theta), exponents)).astype(np.float32)
    if rope_type in (None, "ntk"):
        return inv_freq
    factor = np.float32(scaling["factor"])
    if rope_type == "linear":
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


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_frequencies: jax.Array, scale: float = 1.0
) -> jax.Array:
    """Rotates each head's feature pairs by ``position * frequency``.

    Args:
        x: ``[B, T, N, H]`` queries or keys.
        positions: int ``[B, T]``; any integer (padding positions rotate harmlessly, they
            are masked elsewhere).
        inv_frequencies: float32 ``[H/2]`` from ``rope_frequencies``.
        scale: factor on cos and sin, so on the result (``rope_attention_factor``: YaRN's
            temperature; applied to queries and keys it scales their products by its
            square, as transformers does).

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
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
