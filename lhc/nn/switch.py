"""One compiled layer over an array per layer: each weight chosen by ``lax.switch``.

A scan over layers whose weights are stacked on a leading axis (``nn.scan``) compiles one
layer body, but XLA's CPU backend copies each layer's slice out of the stack before a
product can read it: a batch-1 decode step, which only streams weights, then moves every
byte twice. Separate arrays per layer, looped, are read in place but compile the body
once per layer. ``apply_switched`` gets both: a module applied once, in a scan body, with
the parameters of layer ``index`` — every product reads its own layer's array where it
lies, through ``jax.lax.switch(index, [product with layer 0's array, ...])``, a branch
per layer holding that one product (``experiments/lm_decode/layer_layouts.py`` measures
the three layouts).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax

from lhc.nn.linear import Einsum
from lhc.nn.norms import LayerNorm, RMSNorm

# The modules that hold the parameters of a decoder block: each call of one becomes a
# switch over the layers.
PARAMETER_LEAVES = (Einsum, RMSNorm, LayerNorm)


def apply_switched(
    module: nn.Module,
    trees: Sequence[Mapping[str, Any]],
    index: jax.Array,
    *args: Any,
    leaves: tuple[type[nn.Module], ...] = PARAMETER_LEAVES,
    **kwargs: Any,
) -> Any:
    """``module.apply({"params": trees[index]}, *args, **kwargs)`` for a traced ``index``.

    Every call of a ``leaves`` module inside ``module`` runs as
    ``jax.lax.switch(index, [that call with its parameters in trees[i] ...])``, each
    branch reading its own arrays.

    Args:
        module: an unbound module whose parameters live only in ``leaves`` modules.
        trees: one parameter tree of ``module`` per choice (a layer, or a group of them).
        index: int scalar, which tree.
        *args, **kwargs: the call's inputs.
        leaves: the module types that hold parameters.

    Raises:
        flax's ``ScopeParamNotFoundError``: a module outside ``leaves`` reads a
            parameter (it is given none).
    """

    def interceptor(next_fun, call_args, call_kwargs, context):
        inner = context.module
        # The root, and a leaf applied alone inside a branch, have the empty path.
        if context.method_name != "__call__" or not isinstance(inner, leaves) or not inner.path:
            return next_fun(*call_args, **call_kwargs)
        unbound = inner.clone(parent=None)
        choices = [functools.reduce(operator.getitem, inner.path, tree) for tree in trees]

        def branch(params):
            return lambda: unbound.apply({"params": params}, *call_args, **call_kwargs)

        return jax.lax.switch(index, [branch(params) for params in choices])

    with nn.intercept_methods(interceptor):
        return module.apply({"params": {}}, *args, **kwargs)
