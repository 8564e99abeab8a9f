"""Batched autoregressive generation: one prefill, then a jitted ``lax.while_loop``.

Prompts of different lengths are left-padded: prompt ``b`` of length ``n_b`` sits in the
last ``n_b`` columns of a ``[B, P]`` array with positions ``0 .. n_b - 1``, and the
columns before it have position ``-1`` (padding, never attended to). Every sequence then
decodes at its own next position. A sequence stops after it emits a stop token; its
later outputs are ``pad_id`` with log-probability 0, and it feeds padding (position -1)
to the model so its cache stays clean.

Works with any model that follows the causal-LM protocol (``lhc.lm.model``) and has a
``config`` with ``max_len`` and an ``init_cache(batch, max_len)`` method.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lhc.lm.sampling import SamplingParams, sample_tokens
from lhc.parallel.mesh import LOGICAL_AXIS_RULES

GREEDY = SamplingParams()


@struct.dataclass
class GenerateOutput:
    """Result of ``generate``.

    Attributes:
        tokens: int32 ``[B, N]`` generated tokens (``pad_id`` after a sequence stopped).
        log_probs: float32 ``[B, N]`` log-probability of each token under the model,
            ``log_softmax(logits)`` without temperature or truncation (0 after stopping).
        sampling_log_probs: float32 ``[B, N]`` log-probability under the processed
            distribution the token was drawn from (0 for greedy and after stopping).
        lengths: int32 ``[B]`` generated tokens per sequence, stop token included.
        cache: the cache after decoding (prompt and generated tokens).
    """

    tokens: jax.Array
    log_probs: jax.Array
    sampling_log_probs: jax.Array
    lengths: jax.Array
    cache: Any


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int = 0, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads ragged token sequences.

    Args:
        sequences: B lists of token ids (each non-empty).
        pad_id: filler token id.
        width: P, the padded length (default: the longest sequence).

    Returns:
        ``(tokens, lengths)``: int32 ``[B, P]`` and int32 ``[B]``.
    """
    lengths = np.array([len(s) for s in sequences], np.int32)
    if len(sequences) == 0 or (lengths == 0).any():
        raise ValueError(
            f"left_pad needs at least one non-empty sequence; got lengths {lengths.tolist()}"
        )
    width = int(lengths.max()) if width is None else width
    if width < lengths.max():
        raise ValueError(f"width {width} is shorter than the longest sequence ({lengths.max()})")
    tokens = np.full((len(sequences), width), pad_id, np.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, width - len(sequence) :] = np.asarray(sequence, np.int32)
    return tokens, lengths


def prepare_prompts(
    prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
    prompt_lengths: jax.Array | np.ndarray | None,
    pad_id: int,
    vocab_size: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Validated left-padded prompts: ``(tokens int32 [B, P], lengths int32 [B])``.

    Args:
        prompts: B token lists, or a left-padded int ``[B, P]`` array.
        prompt_lengths: int ``[B]`` real lengths of a padded array (default: all ``P``).
        pad_id: filler for token lists.
        vocab_size: token ids must lie in ``[0, vocab_size)`` (unchecked if None).

    Raises:
        ValueError: a prompt array that is not 2-D, lengths outside ``[1, P]``, lengths
            given with token lists, token ids outside the vocabulary.
    """
    if isinstance(prompts, (jax.Array, np.ndarray)):
        tokens = np.asarray(prompts)
        if tokens.ndim != 2:
            raise ValueError(
                f"prompts must be int [B, P] or a list of token lists, got {tokens.shape=}"
            )
        lengths = (
            np.full(tokens.shape[0], tokens.shape[1], np.int32)
            if prompt_lengths is None
            else np.asarray(prompt_lengths)
        )
    else:
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths applies to a padded array, not to token lists")
        tokens, lengths = left_pad(prompts, pad_id)
    batch_size, width = tokens.shape
    if lengths.shape != (batch_size,) or (lengths < 1).any() or (lengths > width).any():
        raise ValueError(
            f"prompt_lengths must be [B={batch_size}] values in [1, {width}], got {lengths.tolist()}"
        )
    if vocab_size is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"prompt token ids must lie in [0, vocab_size={vocab_size}); got min {tokens.min()} "
            f"max {tokens.max()}"
        )
    return tokens.astype(np.int32), lengths.astype(np.int32)


def left_padded_positions(prompt_lengths: jax.Array, width: int) -> jax.Array:
    """int32 ``[B, P]`` positions of left-padded prompts, ``-1`` on the padding."""
    offsets = jnp.arange(width, dtype=jnp.int32)[None, :] - (width - prompt_lengths[:, None])
    return jnp.where(offsets >= 0, offsets, -1).astype(jnp.int32)


def generate(
    model: nn.Module,
    params: Any,
    prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
    prompt_lengths: jax.Array | np.ndarray | None = None,
    *,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    rng: jax.Array | None = None,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    cache_len: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Sequence[tuple[str, Any]] | None = None,
) -> GenerateOutput:
    """Generates up to ``max_new_tokens`` tokens per prompt.

    Args:
        model: a causal LM module (e.g. ``lhc.lm.Transformer``).
        params: its parameters (may be sharded; then pass ``mesh``).
        prompts: B token lists, or a left-padded int ``[B, P]`` array.
        prompt_lengths: int ``[B]`` real lengths of a padded array (default: all ``P``).
        max_new_tokens: N.
        sampling: temperature / top-k / top-p (greedy by default).
        rng: PRNG key, required unless greedy.
        stop_tokens: ids that end a sequence (the stop token is emitted and counted).
        pad_id: id written after a sequence stopped and used for prompt padding.
        cache_len: cache slots (default ``P + N``, the minimum).
        mesh: run under this mesh; activations and the cache are constrained with
            ``rules`` (``lhc.parallel.LOGICAL_AXIS_RULES`` by default).
        rules: logical-axis rules for a mesh.

    Returns:
        A ``GenerateOutput``.

    Raises:
        ValueError: malformed prompts, ``P + N`` beyond ``cache_len`` or the model's
            ``max_len``, a missing ``rng`` for sampling.
    """
    vocab_size = getattr(model.config, "vocab_size", None)
    tokens, lengths = prepare_prompts(prompts, prompt_lengths, pad_id, vocab_size)
    width = tokens.shape[1]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    needed = width + max_new_tokens
    cache_len = needed if cache_len is None else cache_len
    if cache_len < needed:
        raise ValueError(
            f"cache_len {cache_len} is too small for prompts of width {width} plus "
            f"{max_new_tokens} new tokens ({needed})"
        )
    max_len = model.config.max_len
    if cache_len > max_len:
        raise ValueError(
            f"prompt width {width} + max_new_tokens {max_new_tokens} (cache_len {cache_len}) "
            f"exceeds the model's max_len {max_len}"
        )
    if not sampling.greedy and rng is None:
        raise ValueError("rng is required when sampling (temperature > 0)")
    rng = jax.random.key(0) if rng is None else rng
    rules = static_rules(mesh, rules)
    run = functools.partial(
        _generate_jit,
        model,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_tokens=tuple(int(t) for t in stop_tokens),
        pad_id=int(pad_id),
        cache_len=int(cache_len),
        rules=rules,
    )
    with mesh_context(mesh):
        return run(params, jnp.asarray(tokens), jnp.asarray(lengths), rng)


def static_rules(
    mesh: jax.sharding.Mesh | None, rules: Sequence[tuple[str, Any]] | None
) -> tuple | None:
    """Logical-axis rules as a hashable static jit argument (the defaults under a mesh).

    Mesh-axis lists (from configs) become tuples; a change of rules retraces.
    """
    if mesh is not None and rules is None:
        rules = LOGICAL_AXIS_RULES
    if rules is None:
        return None
    return tuple((name, tuple(t) if isinstance(t, list) else t) for name, t in rules)


def mesh_context(mesh: jax.sharding.Mesh | None):
    """``jax.set_mesh(mesh)``, or nothing without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def rules_context(rules: tuple | None):
    """``nn.logical_axis_rules(rules)``, or nothing without rules."""
    return contextlib.nullcontext() if rules is None else nn.logical_axis_rules(rules)


def empty_cache(model: nn.Module, batch_size: int, cache_len: int):
    """``model.init_cache``, constrained to the cache's logical axes."""
    cache = model.init_cache(batch_size, cache_len)
    return jax.tree.map(
        lambda x, spec: nn.with_logical_constraint(x, tuple(spec)), cache, cache.logical_axes()
    )


@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("max_new_tokens", "sampling", "stop_tokens", "pad_id", "cache_len", "rules"),
)
def _generate_jit(
    model, params, tokens, prompt_lengths, rng, *, max_new_tokens, sampling, stop_tokens, pad_id,
    cache_len, rules,
):  # fmt: skip
    with rules_context(rules):
        batch_size, width = tokens.shape
        apply = functools.partial(model.apply, {"params": params})
        cache = empty_cache(model, batch_size, cache_len)
        logits, cache = apply(tokens, left_padded_positions(prompt_lengths, width), cache)
        stop_ids = jnp.asarray(stop_tokens, jnp.int32)

        def body(state):
            step, last_logits, cache, done, out = state
            token, sampling_log_prob = sample_tokens(
                jax.random.fold_in(rng, step), last_logits, sampling
            )
            log_prob = jnp.take_along_axis(
                jax.nn.log_softmax(last_logits.astype(jnp.float32), axis=-1), token[:, None], -1
            )[:, 0]
            out = dict(
                tokens=out["tokens"].at[:, step].set(jnp.where(done, pad_id, token)),
                log_probs=out["log_probs"].at[:, step].set(jnp.where(done, 0.0, log_prob)),
                sampling_log_probs=out["sampling_log_probs"]
                .at[:, step]
                .set(jnp.where(done, 0.0, sampling_log_prob)),
                lengths=out["lengths"] + (~done).astype(jnp.int32),
            )
            # A finished sequence feeds padding so its cache gains no attendable slots.
            position = jnp.where(done, -1, prompt_lengths + step)
            token = jnp.where(done, pad_id, token)
            if stop_tokens:
                done = done | jnp.isin(token, stop_ids)
            next_logits, cache = apply(token[:, None], position[:, None], cache)
            return step + 1, next_logits[:, -1], cache, done, out

        def cond(state):
            step, _, _, done, _ = state
            return (step < max_new_tokens) & ~jnp.all(done)

        out = dict(
            tokens=jnp.full((batch_size, max_new_tokens), pad_id, jnp.int32),
            log_probs=jnp.zeros((batch_size, max_new_tokens), jnp.float32),
            sampling_log_probs=jnp.zeros((batch_size, max_new_tokens), jnp.float32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )
        done = jnp.zeros((batch_size,), bool)
        state = (jnp.int32(0), logits[:, -1], cache, done, out)
        _, _, cache, _, out = jax.lax.while_loop(cond, body, state)
        return GenerateOutput(cache=cache, **out)
