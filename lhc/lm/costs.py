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


def visible_pairs(length: int, window: int | None = None) -> int:
    """(query, key) pairs a causal prompt of ``length`` tokens attends: each query at
    position ``p`` sees ``p + 1`` keys, or ``min(p + 1, window)`` with a window."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def prefill_flops(config: LMConfig, length: int) -> dict[str, float]:
    """Matmul FLOPs of prefilling a ``length``-token prompt (batch 1), the causal work
    only: every projection and MLP matrix once per token, the attention scores and
    weighted values of every visible pair (per layer, its own window), and the output
    head for the last token (what a prefill keeps).

    Returns:
        ``weights`` (projections and MLP), ``attention``, ``head`` and ``total``.
    """
    d, h = config.embed_dim, config.head_dim
    projections = d * h * (2 * config.num_heads + 2 * config.num_kv_heads)
    mlp = (3 if config.mlp_type in ("swiglu", "geglu") else 2) * d * config.mlp_dim
    weights = 2.0 * length * config.num_layers * (projections + mlp)
    attention = sum(
        4.0 * config.num_heads * h * visible_pairs(length, config.layer_window(layer))
        for layer in range(config.num_layers)
    )
    head = 2.0 * d * config.vocab_size
    return dict(weights=weights, attention=attention, head=head, total=weights + attention + head)


def ring_attention_costs(
    config: LMConfig, length: int, sequence: int, batch_size: int = 1
) -> dict[str, float]:
    """What ring attention (``attention_impl="ring"``) sends and computes on one device
    when ``batch_size`` windows of ``length`` tokens are split over ``sequence`` devices
    in zig-zag order, in the forward pass of every layer together.

    Each device holds ``length / sequence`` tokens of each window and passes its keys,
    values and their int32 positions on ``sequence - 1`` times per layer. A training step
    with every layer rematerialised sends them again in the recomputation and sends the
    keys' and values' gradients back in the backward pass: about three times
    ``bytes_sent``. ``attention_flops`` counts the visible (query, key) pairs
    (``visible_pairs``, each layer its own window), split equally by the zig-zag order;
    blocks that a mask cuts through are computed whole, so the ring does a little more.

    Returns:
        ``tokens_per_device``, ``bytes_sent``, ``attention_flops``, and
        ``flops_per_byte``: a device's ring transfers hide behind its attention when
        that is at least (its matmul rate) / (the bandwidth of one ring link).
    """
    if sequence < 1 or length % sequence:
        raise ValueError(
            f"ring_attention_costs: sequence must be >= 1 and divide length={length}, "
            f"got {sequence}"
        )
    tokens = length // sequence
    itemsize = jnp.dtype(config.dtype).itemsize
    per_step = batch_size * tokens * (2 * config.num_kv_heads * config.head_dim * itemsize + 4)
    bytes_sent = float(config.num_layers * (sequence - 1) * per_step)
    flops = (
        batch_size
        * sum(
            4.0
            * config.num_heads
            * config.head_dim
            * visible_pairs(length, config.layer_window(layer))
            for layer in range(config.num_layers)
        )
        / sequence
    )
    return dict(
        tokens_per_device=float(tokens),
        bytes_sent=bytes_sent,
        attention_flops=flops,
        flops_per_byte=flops / bytes_sent if bytes_sent else float("inf"),
    )
