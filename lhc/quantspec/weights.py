"""The draft's weights: group-wise INT4 quantization of linear layers.

A kernel ``[in..., out...]`` is quantized in groups of ``group_size`` consecutive input
rows per output column, symmetric (``scale = max|w| / 7`` per group, codes ``clamp(round(w
/ scale), -8, 7)``, stored as ``code + 8``) or asymmetric (``scale = (max - min) / 15``
and ``minimum = min`` per group, codes ``clamp(round((w - min) / scale), 0, 15)``), two
codes per byte along the last axis. The codes are rounded to nearest, or with GPTQ
(``lhc.quantspec.gptq``: a calibration Hessian orders the rounding). QuantSpec's code
quantizes only the MLP (GPTQ, group 128, symmetric); ``layers="all"`` also quantizes the
attention projections (the embeddings and the output head stay as they are, as in the
official code).

The draft model is the same model with the dequantized weights: ``dequantize_params``
inside the jitted draft step reads the packed codes and forms the weights on the fly.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from lhc.quantspec.quantize import pack_nibbles, unpack_nibbles

# The kernels of an lhc.lm.Transformer layer and how many leading input axes each has.
MLP_KERNELS = {("mlp", "gate"): 1, ("mlp", "up"): 1, ("mlp", "down"): 1}
ATTENTION_KERNELS = {
    ("attention", "query"): 1,
    ("attention", "key"): 1,
    ("attention", "value"): 1,
    ("attention", "out"): 2,
}


@struct.dataclass
class Int4Weight:
    """A kernel quantized to 4 bits.

    Attributes:
        codes: uint8 ``[in, out / 2]`` (input axes flattened, output axes flattened), with
            a leading layer axis for the kernels of scanned layers.
        scale: float ``[in / group_size, out]`` (likewise).
        shape: the kernel's shape.
        in_axes: how many leading axes of ``shape`` are inputs.
        group_size: input rows per group.
        dtype: the kernel's dtype, which the dequantized kernel takes by default.
        minimum: ``None`` (symmetric: ``w = scale (code - 8)``) or float, as ``scale``
            (asymmetric: ``w = minimum + scale code``).
    """

    codes: jax.Array
    scale: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    in_axes: int = struct.field(pytree_node=False)
    group_size: int = struct.field(pytree_node=False)
    dtype: str = struct.field(pytree_node=False, default="float32")
    minimum: jax.Array | None = None


def group_grid(groups: jax.Array, symmetric: bool, scale_dtype) -> tuple:
    """``(scale, minimum)`` of groups ``[..., g, out]`` (minimum ``None`` when
    symmetric), in ``scale_dtype`` as stored."""
    if symmetric:
        return (jnp.max(jnp.abs(groups), axis=-2) / 7.0).astype(scale_dtype), None
    low, high = jnp.min(groups, axis=-2), jnp.max(groups, axis=-2)
    return ((high - low) / 15.0).astype(scale_dtype), low.astype(scale_dtype)


def round_to_grid(w: jax.Array, scale: jax.Array, minimum: jax.Array | None) -> jax.Array:
    """The stored codes (0-15) of ``w`` on the grid of ``scale`` (and ``minimum``),
    broadcast against ``w``."""
    scale = scale.astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)
    if minimum is None:
        return jnp.clip(jnp.round(w / safe), -8, 7) + 8
    return jnp.clip(jnp.round((w - minimum.astype(jnp.float32)) / safe), 0, 15)


def from_grid(codes: jax.Array, scale: jax.Array, minimum: jax.Array | None) -> jax.Array:
    """float32 values of stored codes (inverse of ``round_to_grid`` on the grid)."""
    if minimum is None:
        return (codes - 8.0) * scale.astype(jnp.float32)
    return minimum.astype(jnp.float32) + codes * scale.astype(jnp.float32)


def _flat_kernel(w: jax.Array, group_size: int, in_axes: int) -> tuple[jax.Array, tuple]:
    """``w`` as float32 ``[in, out]``, after checking ``group_size`` and the sizes."""
    shape = tuple(w.shape)
    rows, cols = math.prod(shape[:in_axes]), math.prod(shape[in_axes:])
    if not isinstance(group_size, int) or group_size < 1 or rows % group_size:
        raise ValueError(
            f"quantize_weight: group_size must be a positive int dividing the input size "
            f"{rows} of a kernel of shape {shape}, got {group_size!r}"
        )
    if cols % 2:
        raise ValueError(
            f"quantize_weight: the output size {cols} of a kernel of shape {shape} must be "
            f"even (two codes per byte)"
        )
    return w.astype(jnp.float32).reshape(rows, cols), shape


def quantize_weight(
    w: jax.Array,
    *,
    group_size: int = 128,
    in_axes: int = 1,
    scale_dtype=jnp.float16,
    symmetric: bool = True,
) -> Int4Weight:
    """INT4 codes (rounded to nearest) and scales of kernel ``w`` (see the module
    docstring).

    Raises:
        ValueError: a group size that does not divide the input size, or an odd output size.
    """
    flat, shape = _flat_kernel(w, group_size, in_axes)
    rows, cols = flat.shape
    groups = flat.reshape(rows // group_size, group_size, cols)
    scale, minimum = group_grid(groups, symmetric, scale_dtype)
    codes = round_to_grid(groups, scale[:, None], None if minimum is None else minimum[:, None])
    return pack_weight(codes.reshape(rows, cols), scale, minimum, shape, in_axes, group_size, w)


def pack_weight(codes, scale, minimum, shape, in_axes, group_size, like) -> Int4Weight:
    """An ``Int4Weight`` of float codes ``[in, out]`` (0-15) and its grid."""
    return Int4Weight(
        codes=pack_nibbles(codes.astype(jnp.uint8)),
        scale=scale,
        shape=shape,
        in_axes=in_axes,
        group_size=group_size,
        dtype=jnp.dtype(like.dtype).name,
        minimum=minimum,
    )


def dequantize_weight(q: Int4Weight, dtype=None) -> jax.Array:
    """The kernel ``scale * (code - 8)`` in its shape and ``dtype`` (default: the
    quantized kernel's own). Kernels stacked over layers (``quantize_params`` of a
    model with ``scan_layers=True``) keep their leading layer axis."""
    codes = unpack_nibbles(q.codes).astype(jnp.float32)
    spread = lambda x: None if x is None else jnp.repeat(x, q.group_size, axis=-2)  # noqa: E731
    values = from_grid(codes, spread(q.scale), spread(q.minimum))
    stacked = q.codes.shape[:-2]
    return values.reshape(*stacked, *q.shape).astype(q.dtype if dtype is None else dtype)


def int4_matmul(x: jax.Array, q: Int4Weight) -> jax.Array:
    """``x [..., in...] @ kernel`` with the kernel dequantized on the fly, in ``x``'s dtype."""
    rows = math.prod(q.shape[: q.in_axes])
    flat = x.reshape(*x.shape[: x.ndim - q.in_axes], rows)
    w = dequantize_weight(q, x.dtype).reshape(rows, -1)
    return (flat @ w).reshape(*flat.shape[:-1], *q.shape[q.in_axes :])


def _kernels(layers: str) -> dict:
    if layers == "mlp":
        return MLP_KERNELS
    if layers == "all":
        return {**MLP_KERNELS, **ATTENTION_KERNELS}
    raise ValueError(f"layers must be 'mlp' or 'all', got {layers!r}")


def quantize_params(
    params,
    *,
    group_size: int = 128,
    layers: str = "mlp",
    scale_dtype=jnp.float16,
    symmetric: bool = True,
):
    """``params`` of an ``lhc.lm.Transformer`` with the kernels of ``layers``
    (``"mlp"``: gate, up, down; ``"all"``: also query, key, value, out) replaced by
    ``Int4Weight``s rounded to nearest (``lhc.quantspec.gptq.calibrate``: with GPTQ),
    symmetric or with a minimum per group; everything else unchanged. Layers may loop (``layers_<i>``) or be
    scanned (one ``layers`` subtree stacked over layers: each layer quantized alone)."""
    kernels = _kernels(layers)
    out = dict(params)
    found = 0
    for name, layer in params.items():
        if not (name.startswith("layers_") or name == "layers"):
            continue
        layer = jax.tree.map(lambda x: x, layer)  # a copy to edit
        for (block, proj), in_axes in kernels.items():
            if block in layer and proj in layer[block]:
                kernel = layer[block][proj]["kernel"]
                quantize = functools.partial(
                    quantize_weight,
                    group_size=group_size,
                    in_axes=in_axes,
                    scale_dtype=scale_dtype,
                    symmetric=symmetric,
                )
                if name == "layers":  # stacked: the leading axis is the layer
                    quantize = jax.vmap(quantize)
                layer[block] = dict(layer[block])
                layer[block][proj] = dict(layer[block][proj])
                layer[block][proj]["kernel"] = quantize(kernel)
                found += 1
        out[name] = layer
    if not found:
        raise ValueError(
            "quantize_params: no kernels of an lhc.lm.Transformer found (expected "
            "'layers_<i>/mlp/...' or 'layers/mlp/...')"
        )
    return out


def dequantize_params(params, dtype=None):
    """``params`` with every ``Int4Weight`` turned back into a kernel of ``dtype``
    (default: each kernel's own, so that a bfloat16 model's draft reads bfloat16)."""
    return jax.tree.map(
        lambda x: dequantize_weight(x, dtype) if isinstance(x, Int4Weight) else x,
        params,
        is_leaf=lambda x: isinstance(x, Int4Weight),
    )
