"""What a decode step of an ``lhc.lm.Transformer`` costs in memory traffic: the bytes it
must read, from which a time floor at a given memory bandwidth follows."""

from __future__ import annotations

import jax.numpy as jnp

from lhc.lm.config import LMConfig
from lhc.lm.params import count_params


def decode_bytes_per_token(
    config: LMConfig, context_len: int, batch_size: int = 1
) -> dict[str, float]:
    """Bytes read from memory per decoded token, and what bounds a decode step.

    One decode step reads every parameter once (shared by the batch) and each sequence's
    keys and values for all ``context_len`` cached tokens, in every layer.

    Returns:
        ``weight_bytes``, ``kv_cache_bytes_per_sequence``, ``bytes_per_step`` and
        ``bytes_per_token`` (``bytes_per_step / batch_size``).
    """
    weight_bytes = count_params(config) * jnp.dtype(config.param_dtype).itemsize
    kv_bytes = (
        2
        * config.num_layers
        * config.num_kv_heads
        * config.head_dim
        * context_len
        * jnp.dtype(config.dtype).itemsize
    )
    per_step = weight_bytes + batch_size * kv_bytes
    return dict(
        weight_bytes=float(weight_bytes),
        kv_cache_bytes_per_sequence=float(kv_bytes),
        bytes_per_step=float(per_step),
        bytes_per_token=float(per_step / batch_size),
    )
