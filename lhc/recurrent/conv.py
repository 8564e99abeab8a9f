"""The short causal convolution of Mamba-2, with its state and padding anywhere.

Mamba-2 mixes each channel over the last K inputs (``K = 4``) before the SSD. Under the
causal-LM protocol a call's tokens may include padding (position -1) at any place, and
the cache holds the last ``K - 1`` inputs of earlier calls; a real token must see the
``K - 1`` real inputs before it, skipping padding. ``causal_conv`` gathers each row's
real inputs behind its state (a stable sort), convolves them, and scatters the outputs
back, so padding never enters a window and leaves the state as it was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(x, weight, bias=None, *, real=None, state=None):
    """Depthwise causal convolution over time that skips padding.

    Args:
        x: ``[b, T, C]`` inputs.
        weight: ``[K, C]``; ``y_t = bias + sum_k weight[k] * u_{t - K + 1 + k}`` where
            ``u`` is the row's sequence of real inputs (its state first).
        bias: ``[C]`` or None.
        real: bool ``[b, T]``, false at padding; all true if None.
        state: ``[b, K - 1, C]``, the last ``K - 1`` real inputs before this call
            (oldest first); zeros if None.

    Returns:
        ``(y, new_state)``: ``y [b, T, C]`` (zeros at padding) and the last ``K - 1``
        real inputs after the call, ``[b, K - 1, C]``.
    """
    if jnp.ndim(x) != 3:
        raise ValueError(f"x must be [b, T, C], got shape {jnp.shape(x)}")
    b, t, c = x.shape
    if jnp.ndim(weight) != 2 or weight.shape[1] != c or weight.shape[0] < 1:
        raise ValueError(f"weight must be [K, C={c}] with K >= 1, got shape {jnp.shape(weight)}")
    k = weight.shape[0]
    if bias is not None and jnp.shape(bias) != (c,):
        raise ValueError(f"bias must be [C={c}], got shape {jnp.shape(bias)}")
    if real is None:
        real = jnp.ones((b, t), bool)
    elif jnp.shape(real) != (b, t):
        raise ValueError(f"real must be [b, T] = {(b, t)}, got shape {jnp.shape(real)}")
    if state is None:
        state = jnp.zeros((b, k - 1, c), x.dtype)
    elif jnp.shape(state) != (b, k - 1, c):
        raise ValueError(f"state must be [b, K - 1, C] = {(b, k - 1, c)}, got {jnp.shape(state)}")
    extended = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [b, K - 1 + T, C]
    keep = jnp.concatenate([jnp.ones((b, k - 1), bool), real], axis=1)
    # Real entries first, in order (a stable sort), padding after them.
    order = jnp.argsort(~keep, axis=1, stable=True)
    compact = jnp.take_along_axis(extended, order[..., None], axis=1)
    compact = jnp.where(jnp.take_along_axis(keep, order, axis=1)[..., None], compact, 0)
    windows = jnp.stack([compact[:, j : j + t] for j in range(k)], axis=2)  # [b, T, K, C]
    conv = jnp.einsum("btkc,kc->btc", windows, weight.astype(x.dtype))
    if bias is not None:
        conv = conv + bias.astype(x.dtype)
    # The real token with rank r among the call's real tokens ends window r.
    rank = jnp.cumsum(real, axis=1) - 1
    y = jnp.take_along_axis(conv, jnp.clip(rank, 0, t - 1)[..., None], axis=1)
    y = jnp.where(real[..., None], y, 0)
    count = jnp.sum(real, axis=1)  # the new state: real entries count .. count + K - 2
    index = count[:, None] + jnp.arange(k - 1)[None, :]
    new_state = jnp.take_along_axis(compact, index[..., None], axis=1)
    return y, new_state.astype(jax.dtypes.canonicalize_dtype(state.dtype))
