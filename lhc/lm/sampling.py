"""Turning logits into a sampling distribution: temperature, top-k, top-p, greedy.

The same processing serves generation and speculative decoding, which needs the
processed probabilities of both models (``logits_to_probs``). Order of operations, as in
Hugging Face ``generate``: divide by the temperature, keep the ``top_k`` largest logits,
then keep the smallest set of tokens whose probability mass reaches ``top_p``.
Temperature 0 means greedy: the distribution is one-hot on the argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

_NEG_INF = -jnp.inf


def _concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _checkable(value) -> bool:
    """A value to validate: a number or a concrete array (jax also rebuilds the pytree
    with tracers and placeholders, which are not checked)."""
    return isinstance(value, (int, float, np.generic, np.ndarray, jax.Array)) and _concrete(value)


@struct.dataclass
class SamplingParams:
    """How the next token is drawn.

    A pytree whose fields are traced under ``jit``, so decoding with a new temperature,
    top-k or top-p runs the same compiled program. Validated when the values are concrete.

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
        if _checkable(self.temperature) and not np.all(np.asarray(self.temperature) >= 0):
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if _checkable(self.top_k):
            value = np.asarray(self.top_k)
            if isinstance(self.top_k, (bool, float)) or value.dtype.kind not in "iu" or value < 0:
                raise ValueError(f"top_k must be an int >= 0 (0 disables), got {self.top_k!r}")
        if _checkable(self.top_p) and not np.all(
            (np.asarray(self.top_p) > 0) & (np.asarray(self.top_p) <= 1)
        ):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (concrete values only)."""
        return float(self.temperature) == 0

    def as_arrays(self) -> SamplingParams:
        """The same parameters as float32 / int32 scalars (one traced signature)."""
        return SamplingParams(
            temperature=jnp.asarray(self.temperature, jnp.float32),
            top_k=jnp.asarray(self.top_k, jnp.int32),
            top_p=jnp.asarray(self.top_p, jnp.float32),
        )


def top_k_mask(logits: jax.Array, top_k: int | jax.Array) -> jax.Array:
    """bool ``[..., V]``: the ``top_k`` largest logits (ties with the k-th are kept).

    ``top_k`` may be traced; 0 (or ``>= V``) keeps everything.
    """
    vocab = logits.shape[-1]
    if _concrete(top_k):
        if top_k <= 0 or top_k >= vocab:
            return jnp.ones(logits.shape, bool)
        return logits >= jax.lax.top_k(logits, int(top_k))[0][..., -1:]
    descending = -jnp.sort(-logits, axis=-1)
    kth_index = jnp.clip(top_k - 1, 0, vocab - 1)
    kth_largest = jax.lax.dynamic_index_in_dim(descending, kth_index, axis=-1, keepdims=True)
    return (logits >= kth_largest) | (top_k <= 0)


def top_p_mask(logits: jax.Array, top_p: float | jax.Array) -> jax.Array:
    """bool ``[..., V]``: the nucleus of ``softmax(logits)``.

    A token is kept when the probability mass of the tokens ranked strictly above it
    is below ``top_p``, so the kept set is the smallest prefix (by descending
    probability) whose mass reaches ``top_p``; the most likely token is always kept.
    ``top_p`` may be traced; 1.0 keeps everything.
    """
    if _concrete(top_p) and top_p >= 1.0:
        return jnp.ones(logits.shape, bool)
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1]).astype(jnp.float32)
    order = jnp.argsort(-flat, axis=-1, stable=True)
    sorted_probs = jax.nn.softmax(jnp.take_along_axis(flat, order, axis=-1), axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = (mass_before < top_p) | (top_p >= 1.0)
    keep_sorted = keep_sorted.at[:, 0].set(True)
    rows = jnp.arange(flat.shape[0])[:, None]
    keep = jnp.zeros(flat.shape, bool).at[rows, order].set(keep_sorted)
    return keep.reshape(shape)


def _greedy_logits(logits: jax.Array) -> jax.Array:
    best = jnp.argmax(logits, axis=-1)
    one_hot = jax.nn.one_hot(best, logits.shape[-1], dtype=bool)
    return jnp.where(one_hot, 0.0, _NEG_INF)


def _truncated_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    logits = logits / jnp.asarray(sampling.temperature, jnp.float32)

    def truncate(logits):
        logits = jnp.where(top_k_mask(logits, sampling.top_k), logits, _NEG_INF)
        return jnp.where(top_p_mask(logits, sampling.top_p), logits, _NEG_INF)

    if _concrete(sampling.top_k) and _concrete(sampling.top_p):
        return truncate(logits)
    # Traced settings: the sorts run only when top-k or top-p is on.
    active = (jnp.asarray(sampling.top_k) > 0) | (jnp.asarray(sampling.top_p) < 1.0)
    return jax.lax.cond(active, truncate, lambda logits: logits, logits)


def process_logits(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """float32 logits ``[..., V]`` of the sampling distribution (excluded tokens ``-inf``).

    For greedy sampling every token but the argmax is excluded. With traced parameters
    only the branch that applies runs (``lax.cond``).
    """
    logits = logits.astype(jnp.float32)
    if _concrete(sampling.temperature):
        return _greedy_logits(logits) if sampling.greedy else _truncated_logits(logits, sampling)
    return jax.lax.cond(
        jnp.asarray(sampling.temperature) == 0,
        _greedy_logits,
        lambda logits: _truncated_logits(logits, sampling),
        logits,
    )


def logits_to_probs(logits: jax.Array, sampling: SamplingParams) -> jax.Array:
    """float32 probabilities ``[..., V]`` of the sampling distribution."""
    return jax.nn.softmax(process_logits(logits, sampling), axis=-1)


def sample_tokens(
    rng: jax.Array | None, logits: jax.Array, sampling: SamplingParams
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row.

    Args:
        rng: PRNG key (unused, and may be ``None``, when greedy).
        logits: ``[..., V]``.
        sampling: the processing to apply.

    Returns:
        ``(tokens, log_probs)``: int32 ``[...]`` and float32 ``[...]``, the log-probability
        of each drawn token under the processed distribution (0 for greedy).
    """
    processed = process_logits(logits, sampling)
    if _concrete(sampling.temperature) and sampling.greedy:
        tokens = jnp.argmax(processed, axis=-1)
    else:
        if rng is None:
            raise ValueError("sample_tokens: rng is required unless sampling is greedy")
        tokens = jax.lax.cond(
            jnp.asarray(sampling.temperature) == 0,
            lambda: jnp.argmax(processed, axis=-1).astype(jnp.int32),
            lambda: jax.random.categorical(rng, processed, axis=-1).astype(jnp.int32),
        )
    log_probs = jnp.take_along_axis(
        jax.nn.log_softmax(processed, axis=-1), tokens[..., None], axis=-1
    )[..., 0]
    return tokens.astype(jnp.int32), log_probs
