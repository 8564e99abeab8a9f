"""Turning logits into a sampling distribution: temperature, top-k, top-p, greedy.

The same processing serves generation and speculative decoding, which needs the
processed probabilities of both models (``logits_to_probs``). Order of operations, as in
Hugging Face ``generate``: divide by the temperature, keep the ``top_k`` largest logits,
then keep the smallest set of tokens whose probability mass reaches ``top_p``.
Temperature 0 means greedy: the distribution is one-hot on the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn.

    Attributes:
        temperature: 0 for greedy decoding, else the softmax temperature (> 0).
        top_k: keep only the ``top_k`` most likely tokens (0 disables).
        top_p: keep the smallest set of most likely tokens with mass ``>= top_p``
            (1.0 disables).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_mask(logits: jax.Array, top_k: int) -> jax.Array:
    """bool ``[..., V]``: the ``top_k`` largest logits (ties with the k-th are kept)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return jnp.ones(logits.shape, bool)
    kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]
    return logits >= kth_largest


def top_p_mask(logits: jax.Array, top_p: float) -> jax.Array:
    """bool ``[..., V]``: the nucleus of ``softmax(logits)``.

    A token is kept when the probability mass of the tokens ranked strictly above it
    is below ``top_p``, so the kept set is the smallest prefix (by descending
    probability) whose mass reaches ``top_p``; the most likely token is always kept.
    """
    if top_p >= 1.0:
        return jnp.ones(logits.shape, bool)
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1]).astype(jnp.float32)
    order = jnp.argsort(-flat, axis=-1, stable=True)
    sorted_probs = jax.nn.softmax(jnp.take_along_axis(flat, order, axis=-1), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted = keep_sorted.at[:, 0].set(True)
    rows = jnp.arange(flat.shape[0])[:, None]
    keep = jnp.zeros(flat.shape, bool).at[rows, order].set(keep_sorted)
    return keep.reshape(shape)


def process_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """float32 logits ``[..., V]`` of the sampling distribution (excluded tokens ``-inf``).

    For greedy sampling every token but the argmax is excluded.
    """
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        best = jnp.argmax(logits, axis=-1)
        one_hot = jax.nn.one_hot(best, logits.shape[-1], dtype=bool)
        return jnp.where(one_hot, 0.0, _NEG_INF)
    logits = logits / jnp.float32(sampling.temperature)
    logits = jnp.where(top_k_mask(logits, sampling.top_k), logits, _NEG_INF)
    logits = jnp.where(top_p_mask(logits, sampling.top_p), logits, _NEG_INF)
    return logits


def logits_to_probs(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """float32 probabilities ``[..., V]`` of the sampling distribution."""
    return jax.nn.softmax(process_logits(logits, sampling), axis=-1)


def sample_tokens(
    rng: jax.Array, logits: jax.Array, sampling: SamplingParams
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row.

    Args:
        rng: PRNG key (unused when greedy).
        logits: ``[..., V]``.
        sampling: the processing to apply.

    Returns:
        ``(tokens, log_probs)``: int32 ``[...]`` and float32 ``[...]``, the log-probability
        of each drawn token under the processed distribution (0 for greedy).
    """
    processed = process_logits(logits, sampling)
    if sampling.greedy:
        tokens = jnp.argmax(processed, axis=-1)
    else:
        tokens = jax.random.categorical(rng, processed, axis=-1)
    log_probs = jnp.take_along_axis(
        jax.nn.log_softmax(processed, axis=-1), tokens[..., None], axis=-1
    )[..., 0]
    return tokens.astype(jnp.int32), log_probs
