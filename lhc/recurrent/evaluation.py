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

from lhc import plots


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


@functools.partial(jax.jit, static_argnums=0)
def _chunk_nll(model, params, tokens, positions, targets, cache):
    logits, cache = model.apply({"params": params}, tokens, positions, cache)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return nll, cache


def loss_by_position(model, params, tokens, *, chunk_size: int = 512) -> np.ndarray:
    """The next-token loss at every position of ``tokens [B, T]``, read in chunks through
    the model's cache (memory bounded by what the cache keeps, not by T).

    Returns:
        float64 ``[B, T - 1]``: entry ``[b, i]`` is ``-log q(tokens[b, i + 1] | tokens[b,
        : i + 1])``. Average over the batch and exponentiate for perplexity by position
        (``bucket_means`` bins it).
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [B, T] with T >= 2, got shape {tokens.shape}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    batch, length = tokens.shape
    cache = model.init_cache(batch, length)
    positions = np.broadcast_to(np.arange(length - 1, dtype=np.int32), (batch, length - 1))
    out = []
    for start in range(0, length - 1, chunk_size):
        stop = min(start + chunk_size, length - 1)
        nll, cache = _chunk_nll(
            model,
            params,
            tokens[:, start:stop],
            positions[:, start:stop],
            tokens[:, start + 1 : stop + 1],
            cache,
        )
        out.append(np.asarray(nll, np.float64))
    return np.concatenate(out, axis=1)


def bucket_means(values, edges: Sequence[int]) -> np.ndarray:
    """Means of ``values [..., T]`` (over every leading axis too) in the position buckets
    ``[edges[i], edges[i + 1])``; NaN for an empty bucket."""
    values = np.asarray(values, np.float64)
    values = values.reshape(-1, values.shape[-1])
    edges = list(edges)
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"edges must increase, got {edges}")
    means = []
    for lo, hi in zip(edges, edges[1:]):
        part = values[:, max(lo, 0) : hi]
        means.append(part.mean() if part.size else np.nan)
    return np.asarray(means)


def plot_curves(path: str, x, curves: dict, *, xlabel: str, ylabel: str, title: str, logx=False):
    """Writes one line per ``curves[label]`` against ``x`` as a PNG."""
    plots.curves(
        path,
        {label: (x, y) for label, y in curves.items()},
        xlabel=xlabel,
        ylabel=ylabel,
        title=title,
        log_x_base=10 if logx else None,
    )
