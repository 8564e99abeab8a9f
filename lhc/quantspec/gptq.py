"""GPTQ (Frantar et al., ICLR 2023): INT4 draft weights rounded in the order a
calibration Hessian gives, each rounding error spread over the rows not yet rounded.

QuantSpec's draft uses GPTQ weights (4 bits, groups of 128, symmetric, MLP only). For a
kernel ``W [in, out]`` applied to inputs ``X [n, in]``: ``H = 2 X^T X / n``, damped by
``damp * mean(diag H)`` on the diagonal (inputs that never fire get ``H_ii = 1`` and
zero weights), and ``U`` the upper Cholesky factor of ``H^-1``. The input rows are
rounded in order (no activation reordering); a group's grid (``lhc.quantspec.weights``:
symmetric or with a minimum) is fixed from its rows as they stand when the group begins;
after row ``i`` is rounded, its error ``e = (w_i - q_i) / U_ii`` is taken off every later
row ``j``: ``w_j -= U_ij e``. The official code applies the same updates in blocks of
128 rows (lazy batch updates); one row at a time gives the same result up to rounding.

``calibrate`` runs the model's layers one after the other on calibration tokens: each
layer's kernel inputs are collected with the layer in full precision, its kernels are
quantized, and the quantized layer's output is the next layer's input (GPTQ's
sequential order across layers; within a layer every kernel sees the full-precision
layer, GPTQ's default without ``--true-sequential``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc import lm
from lhc.lm.model import Block
from lhc.quantspec.weights import (
    Int4Weight,
    _flat_kernel,
    _kernels,
    dequantize_weight,
    from_grid,
    group_grid,
    pack_weight,
    round_to_grid,
)


@functools.partial(jax.jit, static_argnames=("group_size", "symmetric", "scale_dtype"))
def _gptq(w, hessian, damp, *, group_size, symmetric, scale_dtype):
    rows, cols = w.shape
    diag = jnp.diag(hessian)
    dead = diag == 0
    hessian = hessian + jnp.diag(jnp.where(dead, 1.0, 0.0))
    w = jnp.where(dead[:, None], 0.0, w)
    hessian = hessian + damp * jnp.mean(jnp.diag(hessian)) * jnp.eye(rows)
    lower = jnp.linalg.cholesky(hessian)
    inverse = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(rows))
    upper = jnp.linalg.cholesky(inverse).T  # inverse = upper^T upper
    groups = rows // group_size
    scale0, minimum0 = group_grid(w[:group_size][None], symmetric, scale_dtype)
    minimum0 = jnp.zeros_like(scale0) if minimum0 is None else minimum0

    def row(i, carry):
        w, codes, scales, minimums, scale, minimum = carry
        group = i // group_size

        def new_grid(_):
            block = jax.lax.dynamic_slice_in_dim(w, group * group_size, group_size)
            s, m = group_grid(block[None], symmetric, scale_dtype)
            return s, (jnp.zeros_like(s) if m is None else m)

        scale, minimum = jax.lax.cond(
            i % group_size == 0, new_grid, lambda _: (scale, minimum), None
        )
        m = None if symmetric else minimum[0]
        code = round_to_grid(w[i], scale[0], m)
        error = (w[i] - from_grid(code, scale[0], m)) / upper[i, i]
        later = jnp.arange(rows) > i
        w = w - jnp.where(later, upper[i], 0.0)[:, None] * error[None]
        codes = codes.at[i].set(code)
        scales = scales.at[group].set(scale[0])
        minimums = minimums.at[group].set(minimum[0])
        return w, codes, scales, minimums, scale, minimum

    init = (
        w,
        jnp.zeros((rows, cols), jnp.float32),
        jnp.zeros((groups, cols), scale_dtype),
        jnp.zeros((groups, cols), scale_dtype),
        scale0,
        minimum0,
    )
    _, codes, scales, minimums, _, _ = jax.lax.fori_loop(0, rows, row, init)
    return codes, scales, minimums


def gptq_weight(
    w: jax.Array,
    hessian: jax.Array,
    *,
    group_size: int = 128,
    in_axes: int = 1,
    scale_dtype=jnp.float16,
    symmetric: bool = True,
    damp: float = 0.01,
) -> Int4Weight:
    """Kernel ``w`` quantized with GPTQ (see the module docstring) for the Hessian
    ``hessian [in, in]`` of its inputs (``in``: the product of the input axes).

    Raises:
        ValueError: sizes as for ``quantize_weight``; a Hessian of another size.
    """
    flat, shape = _flat_kernel(w, group_size, in_axes)
    rows = flat.shape[0]
    if tuple(hessian.shape) != (rows, rows):
        raise ValueError(
            f"gptq_weight: hessian must be [{rows}, {rows}] for a kernel of shape {shape}, "
            f"got {tuple(hessian.shape)}"
        )
    codes, scale, minimum = _gptq(
        flat,
        jnp.asarray(hessian, jnp.float32),
        jnp.float32(damp),
        group_size=group_size,
        symmetric=symmetric,
        scale_dtype=jnp.dtype(scale_dtype),
    )
    minimum = None if symmetric else minimum
    return pack_weight(codes, scale, minimum, shape, in_axes, group_size, w)


def _layer_inputs(config, layer: int, layer_params, x, positions, kernels) -> tuple:
    """``(output, {(block, proj): H})``: the layer's output on ``x`` and the Hessian
    ``2 X^T X / n`` of the inputs of each kernel in ``kernels``."""
    hessians = {}
    features = {  # the input size of each kernel (the attention output: heads x head dim)
        path: int(np.prod(layer_params[path[0]][path[1]]["kernel"].shape[:in_axes]))
        for path, in_axes in kernels.items()
    }

    def record(next_fn, args, kwargs, context):
        path = tuple(context.module.path)
        if context.method_name == "__call__" and path in kernels:
            flat = args[1].reshape(-1, features[path]).astype(jnp.float32)
            hessians[path] = 2.0 * flat.T @ flat / flat.shape[0]
        return next_fn(*args, **kwargs)

    block = Block(config, window=config.layer_window(layer))
    with nn.intercept_methods(record):
        (out, _), _ = block.apply(
            {"params": layer_params}, (x, None), positions, None, None, None, layer
        )
    return out, hessians


def calibrate(
    model: Any,
    params: Any,
    tokens: np.ndarray,
    *,
    group_size: int = 128,
    layers: str = "mlp",
    scale_dtype=jnp.float16,
    symmetric: bool = True,
    damp: float = 0.01,
    log=None,
) -> Any:
    """``params`` of an ``lhc.lm.Transformer`` with the kernels of ``layers`` (as
    ``quantize_params``) quantized by GPTQ on calibration ``tokens`` (int ``[n, T]``,
    every row ``T`` tokens of real text), layer after layer (see the module docstring).
    Scanned layers are unstacked for the calibration and stacked again. ``log(message)``
    hears of each layer.

    Raises:
        ValueError: tokens that are not ``[n, T]``.
    """
    config = model.config
    if config.scan_layers:
        looped = lm.Transformer(dataclasses.replace(config, scan_layers=False))
        settings = dict(group_size=group_size, layers=layers, scale_dtype=scale_dtype)
        settings.update(symmetric=symmetric, damp=damp, log=log)
        draft = calibrate(looped, lm.unstack_layer_params(params), tokens, **settings)
        return lm.stack_layer_params(draft, config.num_layers)
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or not tokens.size:
        raise ValueError(f"calibrate: tokens must be int [n, T], got {tokens.dtype} {tokens.shape}")
    kernels = _kernels(layers)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    _, state = model.apply(
        {"params": params},
        jnp.asarray(tokens, jnp.int32),
        positions,
        mutable=["intermediates"],
    )
    x = state["intermediates"]["layers_0"]["layer_input"][0]  # the embedded tokens
    out = dict(params)
    for layer in range(config.num_layers):
        name = f"layers_{layer}"
        _, hessians = _layer_inputs(config, layer, params[name], x, positions, kernels)
        quantized = jax.tree.map(lambda a: a, params[name])
        for (block, proj), in_axes in kernels.items():
            kernel = params[name][block][proj]["kernel"]
            q = gptq_weight(
                kernel,
                hessians[block, proj],
                group_size=group_size,
                in_axes=in_axes,
                scale_dtype=scale_dtype,
                symmetric=symmetric,
                damp=damp,
            )
            quantized[block] = dict(quantized[block])
            quantized[block][proj] = dict(quantized[block][proj], kernel=q)
        out[name] = quantized
        dense = jax.tree.map(
            lambda a: dequantize_weight(a) if isinstance(a, Int4Weight) else a,
            quantized,
            is_leaf=lambda a: isinstance(a, Int4Weight),
        )
        x, _ = _layer_inputs(config, layer, dense, x, positions, {})
        if log is not None:
            log(f"GPTQ: layer {layer + 1}/{config.num_layers}")
    return out
