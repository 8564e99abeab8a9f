"""What EMLoC is compared with: the same memory, pruned without the JS search.

* ``uniform_memory``: every layer and head keeps the same evenly spaced tokens.
* ``snapkv_memory``: in the style of SnapKV (Li et al., 2024): the whole context is
  prefilled once; each layer's key/value head keeps the tokens its last ``window``
  queries (the observation window) attend to most (probabilities summed over those
  queries and the query heads of the group, average-pooled over tokens), plus the window
  itself; the same keep ratio in every layer (H2O, which accumulates the scores of every
  query, is the same selection with the window widened to the whole context).

Both return a ``LayerwiseMemory`` of one sequence holding ``floor(C keep)`` tokens per
head in every layer (at least one; SnapKV at least the window), for a context of ``C``
tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc.emloc.examples import Example, join_examples, pooled_head_scores, top_tokens
from lhc.emloc.memory import LayerwiseMemory, append_kept, capacity_slots, empty_memory
from lhc.lm.cache import init_cache


def _check_keep(keep: float) -> None:
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be a ratio in (0, 1], got {keep}")


@functools.partial(jax.jit, static_argnames=("model",))
def _prefill(model, params, cache, tokens, positions, embeddings, embedded, probe):
    (_, cache), state = model.apply(
        {"params": params},
        tokens,
        positions,
        cache,
        embeddings=embeddings,
        embedding_mask=embedded,
        probe=probe,
        last_only=True,
        mutable=["intermediates"],
    )
    probs = [
        state["intermediates"][f"layers_{i}"]["attention"]["attention_probs"][0]
        for i in range(model.config.num_layers)
    ]
    return cache, probs


def _context(model, params, examples: Sequence[Example], window: int):
    """The context's cache and the attention probabilities of its last ``window``
    tokens (columns: the cache's slots, then the context's own keys), its length, and
    the number of slots. The context is right-padded to ``capacity_slots`` (positions
    passed in, not built in the program: one compiled program for contexts of similar
    lengths)."""
    cfg = model.config
    tokens, _, embeddings, embedded = join_examples(examples, cfg.embed_dim)
    length = tokens.size
    if length > cfg.max_len:
        raise ValueError(f"the context has {length} tokens, the model's max_len is {cfg.max_len}")
    slots = min(capacity_slots(length), cfg.max_len)
    pad = slots - length
    positions = np.pad(np.arange(length, dtype=np.int32), (0, pad), constant_values=-1)
    probe = np.arange(max(0, length - window), length, dtype=np.int32)[None]
    cache, probs = _prefill(
        model,
        params,
        init_cache(cfg, 1, slots),
        jnp.asarray(np.pad(tokens, (0, pad))[None]),
        jnp.asarray(positions[None]),
        jnp.asarray(np.pad(embeddings, ((0, pad), (0, 0)))[None]),
        jnp.asarray(np.pad(embedded, (0, pad))[None]),
        jnp.asarray(probe),
    )
    return cache, probs, length, slots


def _memory(model, cache, length: int, kept: list[np.ndarray]) -> LayerwiseMemory:
    return append_kept(
        empty_memory(model.config),
        [k[:, :, :length] for k in cache.keys],
        [v[:, :, :length] for v in cache.values],
        np.arange(length),
        kept,
        start=length,
    )


def uniform_memory(model: Any, params: Any, examples: Sequence[Example], keep: float):
    """Every layer and head keeps ``floor(C keep)`` evenly spaced tokens (the last one
    included)."""
    _check_keep(keep)
    cache, _, length, _ = _context(model, params, examples, window=1)
    count = max(1, int(length * keep))
    chosen = np.unique(np.round(np.linspace(length - 1, 0, count)).astype(int))
    kept = np.tile(chosen, (model.config.num_kv_heads, 1))
    return _memory(model, cache, length, [kept] * model.config.num_layers)


def snapkv_scores(probs: np.ndarray, num_kv_heads: int, length: int, pool: int) -> np.ndarray:
    """float64 ``[K, C]``: the observation window's probabilities ``probs [1, N, W, C]``
    (over the context's keys) summed over the window and the query heads of each group,
    average-pooled."""
    summed = np.asarray(probs, np.float64)[0, :, :, :length].sum(1)  # [N, C]
    return pooled_head_scores(summed, num_kv_heads, pool)


def snapkv_memory(
    model: Any,
    params: Any,
    examples: Sequence[Example],
    keep: float,
    *,
    window: int = 8,
    pool: int = 5,
) -> LayerwiseMemory:
    """SnapKV-style pruning of the whole context (see the module docstring)."""
    _check_keep(keep)
    if window < 1 or pool < 1 or pool % 2 == 0:
        raise ValueError(f"window must be >= 1 and pool odd >= 1, got {window}, {pool}")
    cache, probs, length, slots = _context(model, params, examples, window)
    window = min(window, length)
    count = max(window, int(length * keep))
    kept = []
    for layer_probs in probs:
        # Columns: the cache's (empty) slots, then the context's own keys.
        own = np.asarray(layer_probs)[..., slots:]
        scores = snapkv_scores(own, model.config.num_kv_heads, length, pool)
        scores[:, length - window :] = np.inf  # the observation window stays
        kept.append(top_tokens(scores, count))
    return _memory(model, cache, length, kept)
