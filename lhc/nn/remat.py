"""Named rematerialisation policies.

Layers tag the outputs of their projections with ``jax.ad_checkpoint.checkpoint_name``;
a policy is then a short list of names to keep, and the rest is recomputed in the
backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

# Names tagged by lhc.nn layers.
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
ATTENTION_OUT = "attention_out"
MLP_GATE = "mlp_gate"
MLP_UP = "mlp_up"
MLP_OUT = "mlp_out"

_POLICIES: dict[str, Callable[..., bool] | None] = {
    # Recompute everything inside a block; only the block inputs are kept.
    "full": None,
    # Keep every matmul output (cheapest backward pass, most memory short of no remat).
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    # Keep matmul outputs that contract with weights, recompute attention scores.
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Keep the projection outputs tagged by the layers, recompute norms, RoPE, attention.
    "minimal": jax.checkpoint_policies.save_only_these_names(
        QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTENTION_OUT, MLP_GATE, MLP_UP, MLP_OUT
    ),
    # Keep only q/k/v, recompute the attention and the MLP.
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names(
        QUERY_PROJ, KEY_PROJ, VALUE_PROJ
    ),
}

REMAT_POLICIES = ("none", *_POLICIES)


def remat_policy(name: str) -> Callable[..., bool] | None:
    """The ``jax.checkpoint`` policy called ``name`` (``"none"`` means no remat at all).

    Raises:
        ValueError: ``name`` is not in ``REMAT_POLICIES``.
    """
    if name == "none":
        raise ValueError('remat_policy "none" means no rematerialisation; do not wrap the layer')
    if name not in _POLICIES:
        raise ValueError(f"remat_policy must be one of {REMAT_POLICIES}, got {name!r}")
    return _POLICIES[name]
