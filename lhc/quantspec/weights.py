"""The draft's weights: group-wise symmetric INT4 quantization of linear layers.

A kernel ``[in..., out...]`` is quantized in groups of ``group_size`` consecutive input
rows per output column: ``scale = max|w| / 7`` per group, codes ``clamp(round(w /
scale), -8, 7)``, stored as ``code + 8`` two per byte along the last axis. QuantSpec's
code quantizes only the MLP (GPTQ, group 128, symmetric); here the codes are
round-to-nearest, and ``layers="all"`` also quantizes the attention projections (the
embeddings and the output head stay as they are, as in the official code).

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
    """

    codes: jax.Array
    scale: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    in_axes: int = struct.field(pytree_node=False)
    group_size: int = struct.field(pytree_node=False)
    dtype: str = struct.field(pytree_node=False, default="float32")


def quantize_weight(
    w: jax.Array, *, group_size: int = 128, in_axes: int = 1, scale_dtype=jnp.float16
) -> Int4Weight:
    """INT4 codes and scales of kernel ``w`` (see the module docstring).

    Raises:
        ValueError: a group size that does not divide the input size, or an odd output size.
    """
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
    groups = w.astype(jnp.float32).reshape(rows // group_size, group_size, cols)
    scale = (jnp.max(jnp.abs(groups), axis=1) / 7.0).astype(scale_dtype)
    stored = scale.astype(jnp.float32)[:, None]
    codes = jnp.clip(jnp.round(groups / jnp.where(stored > 0, stored, 1.0)), -8, 7) + 8
    return Int4Weight(
        codes=pack_nibbles(codes.reshape(rows, cols).astype(jnp.uint8)),
        scale=scale,
        shape=shape,
        in_axes=in_axes,
        group_size=group_size,
        dtype=jnp.dtype(w.dtype).name,
    )


def dequantize_weight(q: Int4Weight, dtype=None) -> jax.Array:
    """The kernel ``scale * (code - 8)`` in its shape and ``dtype`` (default: the
    quantized kernel's own). Kernels stacked over layers (``quantize_params`` of a
    model with ``scan_layers=True``) keep their leading layer axis."""
    codes = unpack_nibbles(q.codes).astype(jnp.float32) - 8.0
    scale = jnp.repeat(q.scale.astype(jnp.float32), q.group_size, axis=-2)
    stacked = q.codes.shape[:-2]
    return (codes * scale).reshape(*stacked, *q.shape).astype(q.dtype if dtype is None else dtype)


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


def quantize_params(params, *, group_size: int = 128, layers: str = "mlp", scale_dtype=jnp.float16):
    """``params`` of an ``lhc.lm.Transformer`` with the kernels of ``layers``
    (``"mlp"``: gate, up, down; ``"all"``: also query, key, value, out) replaced by
    ``Int4Weight``s; everything else unchanged. Layers may loop (``layers_<i>``) or be
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
                    quantize_weight, group_size=group_size, in_axes=in_axes, scale_dtype=scale_dtype
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
