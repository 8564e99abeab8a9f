"""How much of a prediction comes from early context: Effective Remembrance.

``EffRem_T(t) = TV(q(. | x[0:T]), q(. | x[t:T]))`` (Buitrago Ruiz & Gu, ICML 2025): the
total-variation distance ``1/2 sum_v |p(v) - p'(v)|`` between the model's next-token
distribution after the whole sequence and after only its suffix from t, the suffix read
from a fresh state. 0 at t = 0; near 1 already at small t when the earliest tokens
dominate the prediction (a model failing past its training length); rising gradually
towards t = T when recent tokens matter most.

It needs nothing but the causal-LM protocol: the suffixes of one call are left-padded
with position -1 (padding, which a recurrent model's state and a Transformer's
attention ignore) and numbered from 0, as a fresh run would.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnums=0)
def _last_distribution(model, params, tokens, positions):
    logits, _ = model.apply({"params": params}, tokens, positions)
    return jax.nn.softmax(logits[:, -1].astype(jnp.float32), axis=-1)


def total_variation(p, q) -> np.ndarray:
    """``1/2 sum |p - q|`` over the last axis."""
    return 0.5 * np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).sum(-1)


def effective_remembrance(
    model,
    params,
    tokens: Sequence[int],
    starts: Sequence[int] | None = None,
    *,
    batch_size: int = 16,
) -> np.ndarray:
    """``EffRem_T(t)`` of one sequence ``tokens`` (T tokens) for every t in ``starts``.

    Args:
        model: a causal LM of the protocol (``model.apply(variables, tokens, positions)``).
        params: its parameters.
        tokens: the sequence x[0:T].
        starts: the values of t, each in ``[0, T)`` (default: all of them).
        batch_size: suffixes run per call.

    Returns:
        float64 ``[len(starts)]``.
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"tokens must be a non-empty 1-D sequence, got shape {tokens.shape}")
    length = tokens.size
    starts = np.arange(length) if starts is None else np.asarray(starts)
    if starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer):
        raise ValueError(f"starts must be a 1-D sequence of ints, got {starts!r}")
    if starts.size and (starts.min() < 0 or starts.max() >= length):
        raise ValueError(f"starts must lie in [0, T={length}), got {starts.tolist()}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    full = _last_distribution(model, params, tokens[None], np.arange(length, dtype=np.int32)[None])
    out = []
    for first in range(0, starts.size, batch_size):
        group = starts[first : first + batch_size]
        batch = np.zeros((batch_size, length), np.int32)  # a fixed shape: one compilation
        positions = np.full((batch_size, length), -1, np.int32)
        for row, t in enumerate(group):
            batch[row, t:] = tokens[t:]
            positions[row, t:] = np.arange(length - t)
        positions[len(group) :, -1] = 0  # unused rows: one real token, so softmax is defined
        suffix = _last_distribution(model, params, batch, positions)[: len(group)]
        out.append(total_variation(full, suffix))
    return np.concatenate(out) if out else np.zeros((0,), np.float64)
