"""Parameters of ``lhc.lm.Transformer``: their shapes, random and initialised values,
shardings, the stacked and per-layer layouts, and the two kernel layouts."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lhc.lm.config import LMConfig
from lhc.lm.model import Transformer
from lhc.nn.linear import KERNEL_LAYOUTS


def stack_layer_params(params: dict[str, Any], num_layers: int, period: int = 1) -> dict[str, Any]:
    """Converts ``layers_{i}`` subtrees (``scan_layers=False``) into the scanned layout.

    With ``period`` 1 (every layer alike) one stacked ``layers`` subtree with a leading
    ``[L]`` axis; with a longer period ``P`` (``LMConfig.layer_period``) ``layers`` holds
    ``block_{j}`` subtrees with a leading ``[L // P]`` axis (layer ``g P + j`` at ``g``)
    and the last ``L % P`` layers stay ``layers_{i}``. numpy leaves stay on the host
    (``np.stack``); jax arrays are stacked by jax.

    Raises:
        ValueError: a ``layers_{i}`` subtree is missing.
    """
    params = dict(params)
    per_layer = []
    for layer in range(num_layers):
        name = f"layers_{layer}"
        if name not in params:
            raise ValueError(f"params have no {name!r} (expected {num_layers} layers)")
        per_layer.append(params.pop(name))

    # numpy leaves (a checkpoint read from disk) are stacked on the host: an 8B model's
    # layers would need about 14 GiB on one device otherwise.
    def stack(*leaves):
        on_host = all(isinstance(leaf, np.ndarray) for leaf in leaves)
        return np.stack(leaves) if on_host else jnp.stack(leaves)

    if period == 1:
        params["layers"] = jax.tree.map(stack, *per_layer)
        return params
    groups = num_layers // period
    params["layers"] = {
        f"block_{j}": jax.tree.map(stack, *per_layer[j : groups * period : period])
        for j in range(period)
    }
    for layer in range(groups * period, num_layers):
        params[f"layers_{layer}"] = per_layer[layer]
    return params


def unstack_layer_params(params: dict[str, Any]) -> dict[str, Any]:
    """Converts a scanned ``layers`` subtree (``scan_layers=True``, either layout of
    ``stack_layer_params``) into ``layers_{i}``."""
    params = dict(params)
    if "layers" not in params:
        raise ValueError("params have no stacked 'layers' subtree")
    stacked = params.pop("layers")
    if "block_0" not in stacked:
        stacked = {"block_0": stacked}
    period = len(stacked)
    groups = jax.tree.leaves(stacked["block_0"])[0].shape[0]
    for j in range(period):
        for group in range(groups):
            layer = group * period + j
            params[f"layers_{layer}"] = jax.tree.map(lambda x, g=group: x[g], stacked[f"block_{j}"])
    return params


# Input axes of each kernel (the rest are outputs), by the name of its module.
_KERNEL_INPUT_AXES = {"query": 1, "key": 1, "value": 1, "out": 2, "gate": 1, "up": 1, "down": 1}


def convert_kernel_layout(params: dict[str, Any], config: LMConfig, layout: str) -> dict[str, Any]:
    """Parameters of a model with ``config`` in another ``kernel_layout``.

    ``"in_out"`` kernels hold their input axes first, ``"out_in"`` kernels their output
    axes first (see ``LMConfig.kernel_layout``); use the result with
    ``config.replace(kernel_layout=layout)``. numpy leaves stay numpy (as views).

    Raises:
        ValueError: an unknown layout.
    """
    if layout not in KERNEL_LAYOUTS:
        raise ValueError(f"layout must be one of {KERNEL_LAYOUTS}, got {layout!r}")
    if layout == config.kernel_layout:
        return params

    def convert(path, leaf):
        names = [getattr(key, "key", None) for key in path]
        if names[-1] != "kernel":
            return leaf
        module = names[-2]
        num_in = 1 if module == "lm_head" else _KERNEL_INPUT_AXES[module]
        lead = 1 if names[0] == "layers" else 0  # scanned layers lead with [L] or [G]
        rank = leaf.ndim - lead
        axes = list(range(lead))
        if layout == "out_in":  # inputs to the end
            axes += [lead + i for i in range(num_in, rank)] + [lead + i for i in range(num_in)]
        else:  # inputs back to the front
            num_out = rank - num_in
            axes += [lead + i for i in range(num_out, rank)] + [lead + i for i in range(num_out)]
        return (
            np.transpose(leaf, axes) if isinstance(leaf, np.ndarray) else jnp.transpose(leaf, axes)
        )

    return jax.tree_util.tree_map_with_path(convert, params)


def abstract_params(config: LMConfig) -> Any:
    """``ShapeDtypeStruct`` tree of the parameters, boxed with their logical axis names."""
    model = Transformer(config)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda rng: model.init(rng, tokens, tokens), jax.random.key(0))["params"]


def init_params(config: LMConfig, rng: jax.Array) -> Any:
    """Randomly initialised parameters (unboxed), for tests and training from scratch.

    For sharded initialisation use ``lhc.parallel.sharded_init`` with
    ``Transformer(config).init`` instead: this function builds the whole tree on one device.
    """
    return nn.meta.unbox(_init_params_jit(config, rng))


@functools.partial(jax.jit, static_argnums=0)
def _init_params_jit(config: LMConfig, rng: jax.Array) -> Any:
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(config).init(rng, tokens, tokens)["params"]


def random_params(config: LMConfig, seed: int = 0) -> Any:
    """Random normal parameters of ``config`` (scaled by ``embed_dim ** -0.5``), from numpy
    (fast to make at any size; no initialiser is compiled)."""
    rng = np.random.default_rng(seed)
    abstract = nn.meta.unbox(abstract_params(config))
    scale = config.embed_dim**-0.5
    return jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * scale, x.dtype), abstract
    )


def param_shardings(config: LMConfig, mesh: jax.sharding.Mesh, rules) -> Any:
    """``NamedSharding`` tree matching the parameters, from their logical axis names."""
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_params(config)), mesh, rules)


@functools.lru_cache(maxsize=64)
def count_params(config: LMConfig) -> int:
    """Number of parameters of a model with ``config``."""
    return sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(nn.meta.unbox(abstract_params(config)))
    )
