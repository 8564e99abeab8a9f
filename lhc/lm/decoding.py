"""Decoding for any model of the causal-LM protocol: chunked prefill, a jitted decode step
and a decode loop with a step hook.

The pieces, from the bottom up:

* ``prefill(model, params, tokens, positions, cache, chunk_size=...)``: appends a
  (left-padded) prompt to a cache ``chunk_size`` tokens at a time, so the attention of one
  chunk reads the cache without materialising ``[T, S]`` scores for the whole prompt,
  and computes logits only for the last column (the last prompt token); the cache is
  donated.
* ``decode_step(model, params, tokens, positions, cache)``: one jitted step, the cache
  donated (updated in place).
* ``decode_loop(...)``: a ``lax.while_loop`` that samples a token, records it, feeds it
  at its explicit position and samples again, with an optional ``step_hook(state) ->
  state`` called after every sampled token (``DecodeState`` is what it sees: the pending
  token and its position, the cache, the outputs, and ``hook_state``, a pytree of the
  hook's own). A hook may rewrite the pending token or its position, truncate the cache,
  or feed tokens itself (PENCIL's reductions, GCA's landmark tokens).
* ``generate(model, params, prompts, ...)``: all of it for token lists or a padded
  array, optionally continuing from a given cache.

Prompts of different lengths are left-padded: prompt ``b`` of length ``n_b`` sits in the
last ``n_b`` columns with positions ``start_b .. start_b + n_b - 1`` (``start_b = 0``, or
the cache's next position when continuing) and the columns before it have position
``-1`` (padding, never attended to). A sequence stops after it emits a stop token; its
later outputs are ``pad_id`` with log-probability 0, and it feeds padding so its cache
gains no attendable token. The last generated token is returned but never fed: the
returned cache holds the prompt and every generated token but the last.

One compiled program serves many calls: sampling parameters, stop tokens, ``pad_id``
and ``max_new_tokens`` are traced values, and the prompt width and the output length are
rounded up to buckets (``bucket_length``), so a new temperature or a slightly longer
prompt does not compile again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lhc.lm.cache import check_cache
from lhc.lm.prompts import (  # noqa: F401 (bucket_length, left_pad: for earlier imports)
    bucket_length,
    left_pad,
    left_padded_positions,
    prepare_prompts,
    prompt_layout,
    stop_token_array,
)
from lhc.lm.rules import constrain_cache, empty_cache, mesh_context, rules_context, static_rules
from lhc.lm.sampling import SamplingParams, sample_tokens

GREEDY = SamplingParams()
DEFAULT_PREFILL_CHUNK = 512


@struct.dataclass
class DecodeState:
    """What the decode loop carries, and what a step hook receives and returns.

    Attributes:
        step: int32 scalar, tokens generated so far (the next output column).
        token: int32 ``[B]``, the token sampled last, not yet fed to the model.
        position: int32 ``[B]``, the position it will be fed at.
        cache: the model's cache (everything fed so far).
        done: bool ``[B]``, sequences that stopped (stop token or length).
        tokens: int32 ``[B, N]`` generated tokens (``pad_id`` where none).
        log_probs: float32 ``[B, N]``, ``log_softmax(logits)`` of each token.
        sampling_log_probs: float32 ``[B, N]``, log-probability under the processed
            (temperature, top-k, top-p) distribution it was drawn from.
        lengths: int32 ``[B]``, tokens generated per sequence, stop token included.
        hook_state: the step hook's own pytree (``None`` without one).
    """

    step: jax.Array
    token: jax.Array
    position: jax.Array
    cache: Any
    done: jax.Array
    tokens: jax.Array
    log_probs: jax.Array
    sampling_log_probs: jax.Array
    lengths: jax.Array
    hook_state: Any = None


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
        cache: the cache after decoding: the prompt and every generated token but the
            last, which was never fed.
        next_positions: int32 ``[B]``, the position the last generated token would be
            fed at (to continue a conversation, feed it there).
        hook_state: the step hook's final ``hook_state``.
    """

    tokens: jax.Array
    log_probs: jax.Array
    sampling_log_probs: jax.Array
    lengths: jax.Array
    cache: Any
    next_positions: jax.Array
    hook_state: Any = None


# Prefill and one step --------------------------------------------------------------------


def _apply(model, params, tokens, positions, cache, intervention=None, **kwargs):
    extra = {} if intervention is None else {"intervention": intervention}
    return model.apply({"params": params}, tokens, positions, cache, **extra, **kwargs)


def prefill_chunks(
    model, params, tokens, positions, cache, *, chunk_size: int, intervention=None
) -> tuple[jax.Array, Any]:
    """Appends ``tokens [B, P]`` to ``cache`` in chunks; float32 logits ``[B, V]`` of the
    last column. Traceable (``prefill`` is the jitted entry point).

    The first chunk takes ``P mod chunk_size`` columns (the left padding lives there),
    the others ``chunk_size`` each, in a ``lax.scan``.
    """
    width = tokens.shape[1]
    head = width % chunk_size
    logits = None
    if head:
        logits, cache = _apply(
            model,
            params,
            tokens[:, :head],
            positions[:, :head],
            cache,
            intervention,
            last_only=True,
        )
    num_chunks = (width - head) // chunk_size
    if num_chunks:
        batch = tokens.shape[0]

        def chunk(cache, inputs):
            chunk_tokens, chunk_positions = inputs
            logits, cache = _apply(
                model,
                params,
                chunk_tokens,
                chunk_positions,
                cache,
                intervention,
                last_only=True,
            )
            return cache, logits[:, -1]

        split = lambda x: jnp.swapaxes(x[:, head:].reshape(batch, num_chunks, chunk_size), 0, 1)
        cache, chunk_logits = jax.lax.scan(chunk, cache, (split(tokens), split(positions)))
        return chunk_logits[-1], cache
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnums=0, static_argnames="chunk_size", donate_argnames="cache")
def prefill(model, params, tokens, positions, cache, *, chunk_size: int = DEFAULT_PREFILL_CHUNK):
    """Jitted ``prefill_chunks``: ``(logits [B, V] of the last column, cache)``. The cache
    is donated (filled in place, not beside a copy; do not reuse the argument)."""
    return prefill_chunks(model, params, tokens, positions, cache, chunk_size=chunk_size)


def prefilled_cache(
    model,
    params,
    prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
    *,
    extra: int,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
):
    """A cache of ``model`` holding the prompts (token lists, left-padded; or an int
    ``[B, P]`` array), with room for ``extra`` more tokens per sequence: pass it as
    ``cache`` / ``target_cache`` to decode several times after one prefill."""
    tokens, lengths = prepare_prompts(prompts, None, 0, model.config.vocab_size)
    cache = empty_cache(model, tokens.shape[0], tokens.shape[1] + extra)
    positions = left_padded_positions(jnp.asarray(lengths), tokens.shape[1])
    _, cache = prefill(
        model, params, jnp.asarray(tokens), positions, cache, chunk_size=prefill_chunk
    )
    return cache


@functools.partial(jax.jit, static_argnums=0, donate_argnames="cache")
def decode_step(model, params, tokens, positions, cache):
    """One decoding step: ``tokens, positions`` int ``[B]`` (or ``[B, 1]``) appended to
    ``cache``, which is donated (updated in place; do not reuse the argument).

    Returns:
        ``(logits, cache)``: float32 ``[B, V]`` and the updated cache.
    """
    tokens = jnp.reshape(tokens, (-1, 1))
    positions = jnp.reshape(positions, (-1, 1))
    logits, cache = model.apply({"params": params}, tokens, positions, cache)
    return logits[:, -1], cache


# The loop -------------------------------------------------------------------------------


def _record(state: DecodeState, logits, rng, sampling, stop_ids, pad_id, max_new_tokens):
    """Samples from ``logits [B, V]`` for the active sequences and writes column ``step``."""
    token, sampling_log_prob = sample_tokens(jax.random.fold_in(rng, state.step), logits, sampling)
    log_prob = jnp.take_along_axis(
        jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), token[:, None], -1
    )[:, 0]
    active = ~state.done
    column = state.step
    stopped = active & jnp.isin(token, stop_ids)
    return state.replace(
        step=state.step + 1,
        token=jnp.where(active, token, pad_id),
        tokens=state.tokens.at[:, column].set(jnp.where(active, token, pad_id)),
        log_probs=state.log_probs.at[:, column].set(jnp.where(active, log_prob, 0.0)),
        sampling_log_probs=state.sampling_log_probs.at[:, column].set(
            jnp.where(active, sampling_log_prob, 0.0)
        ),
        lengths=state.lengths + active.astype(jnp.int32),
        done=state.done | stopped | (state.step + 1 >= max_new_tokens),
    )


def decode_loop(
    model,
    params,
    logits: jax.Array,
    position: jax.Array,
    cache,
    rng: jax.Array,
    *,
    max_new_tokens: jax.Array,
    buffer_len: int,
    sampling: SamplingParams,
    stop_ids: jax.Array,
    pad_id: jax.Array,
    step_hook: Callable[[DecodeState], DecodeState] | None = None,
    hook_state: Any = None,
    intervention=None,
) -> DecodeState:
    """Samples up to ``max_new_tokens`` tokens after ``logits``. Traceable (``generate``
    jits it).

    Args:
        model, params: a causal-LM protocol model and its parameters.
        logits: float32 ``[B, V]``, the next-token logits after the prompt.
        position: int32 ``[B]``, the position of the first generated token.
        cache: the cache holding the prompt.
        rng: PRNG key; token ``i`` is drawn with ``fold_in(rng, i)``.
        max_new_tokens: int32 scalar (traced), at most ``buffer_len``.
        buffer_len: N, the static width of the output buffers.
        sampling: ``SamplingParams`` (fields may be traced).
        stop_ids: int32 ``[M]`` stop ids, -1 for none.
        pad_id: int32 scalar.
        step_hook: ``hook(state) -> state``, called after every sampled token.
        hook_state: the hook's initial pytree.
        intervention: passed to every model call.

    Returns:
        The final ``DecodeState``; ``token``/``position`` hold the last token, not fed.
    """
    batch_size = logits.shape[0]
    record = functools.partial(
        _record,
        rng=rng,
        sampling=sampling,
        stop_ids=stop_ids,
        pad_id=pad_id,
        max_new_tokens=max_new_tokens,
    )
    hook = step_hook if step_hook is not None else (lambda state: state)
    state = DecodeState(
        step=jnp.int32(0),
        token=jnp.zeros((batch_size,), jnp.int32),
        position=position.astype(jnp.int32),
        cache=cache,
        done=jnp.zeros((batch_size,), bool) | (max_new_tokens < 1),
        tokens=jnp.full((batch_size, buffer_len), pad_id, jnp.int32),
        log_probs=jnp.zeros((batch_size, buffer_len), jnp.float32),
        sampling_log_probs=jnp.zeros((batch_size, buffer_len), jnp.float32),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        hook_state=hook_state,
    )
    state = hook(record(state, logits))

    def body(state: DecodeState) -> DecodeState:
        # A finished sequence feeds padding so its cache gains no attendable token.
        fed_position = jnp.where(state.done, -1, state.position)
        logits, cache = _apply(
            model, params, state.token[:, None], fed_position[:, None], state.cache, intervention
        )
        state = state.replace(
            cache=cache, position=jnp.where(state.done, state.position, state.position + 1)
        )
        return hook(record(state, logits[:, -1]))

    def cond(state: DecodeState):
        return (state.step < max_new_tokens) & ~jnp.all(state.done)

    return jax.lax.while_loop(cond, body, state)


@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("buffer_len", "cache_len", "prefill_chunk", "step_hook", "rules"),
    donate_argnames="cache",
)
def _generate_jit(
    model,
    params,
    tokens,
    prompt_lengths,
    start,
    cache,
    rng,
    sampling,
    stop_ids,
    pad_id,
    max_new_tokens,
    hook_state,
    intervention,
    *,
    buffer_len,
    cache_len,
    prefill_chunk,
    step_hook,
    rules,
):
    with rules_context(rules):
        batch_size, width = tokens.shape
        if cache is None:
            cache = empty_cache(model, batch_size, cache_len)
        else:
            cache = constrain_cache(cache)
        positions = left_padded_positions(prompt_lengths, width, start)
        logits, cache = prefill_chunks(
            model,
            params,
            tokens,
            positions,
            cache,
            chunk_size=prefill_chunk,
            intervention=intervention,
        )
        state = decode_loop(
            model,
            params,
            logits,
            start + prompt_lengths,
            cache,
            rng,
            max_new_tokens=max_new_tokens,
            buffer_len=buffer_len,
            sampling=sampling,
            stop_ids=stop_ids,
            pad_id=pad_id,
            step_hook=step_hook,
            hook_state=hook_state,
            intervention=intervention,
        )
        return GenerateOutput(
            tokens=state.tokens,
            log_probs=state.log_probs,
            sampling_log_probs=state.sampling_log_probs,
            lengths=state.lengths,
            cache=state.cache,
            next_positions=state.position,
            hook_state=state.hook_state,
        )


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
    cache: Any = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    step_hook: Callable[[DecodeState], DecodeState] | None = None,
    hook_state: Any = None,
    intervention: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Sequence[tuple[str, Any]] | None = None,
) -> GenerateOutput:
    """Generates up to ``max_new_tokens`` tokens per prompt.

    Args:
        model: a causal-LM protocol module (``lhc.lm.Transformer`` or any other) with a
            ``config.max_len`` and ``init_cache(batch, max_len)``.
        params: its parameters (may be sharded; then pass ``mesh``).
        prompts: B token lists, or a left-padded int ``[B, P]`` array.
        prompt_lengths: int ``[B]`` real lengths of a padded array (default: all ``P``).
        max_new_tokens: N.
        sampling: temperature / top-k / top-p (greedy by default).
        rng: PRNG key, required unless greedy.
        stop_tokens: ids that end a sequence (the stop token is emitted and counted).
        pad_id: id written after a sequence stopped and used for prompt padding.
        cache_len: cache size for a new cache (default: the bucketed prompt width plus
            the bucketed N, the smallest that one compiled program serves).
        cache: continue from this cache (e.g. ``GenerateOutput.cache``); the prompts
            are appended at each sequence's next position. It is donated.
        prefill_chunk: prompt tokens per prefill chunk.
        step_hook: ``hook(DecodeState) -> DecodeState`` after every sampled token (a
            hashable function: it is part of the compiled program).
        hook_state: the hook's initial pytree (``DecodeState.hook_state``).
        intervention: an ``lhc.nn.Intervention`` applied at every model call (its
            values and mask must broadcast over any number of tokens: ``[L, 1|B, 1, D]``).
        mesh: run under this mesh; activations and the cache are constrained with
            ``rules`` (``lhc.parallel.LOGICAL_AXIS_RULES`` by default).
        rules: logical-axis rules for a mesh.

    Returns:
        A ``GenerateOutput`` with ``[B, N]`` outputs.

    Raises:
        ValueError: malformed prompts, a prompt and N beyond ``cache_len``, the cache's
            capacity or the model's ``max_len``, a missing ``rng`` for sampling,
            ``prefill_chunk < 1``, a ``cache`` without the cache protocol.
    """
    vocab_size = getattr(model.config, "vocab_size", None)
    tokens, lengths = prepare_prompts(prompts, prompt_lengths, pad_id, vocab_size)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if not sampling.greedy and rng is None:
        raise ValueError("rng is required when sampling (temperature > 0)")
    if cache is not None:
        check_cache(cache)
    tokens, start, buffer_len, cache_len = prompt_layout(
        tokens, lengths, cache, cache_len, model.config.max_len, max_new_tokens, pad_id
    )
    rules = static_rules(mesh, rules)
    sampling_arrays = sampling.as_arrays()
    with mesh_context(mesh):
        out = _generate_jit(
            model,
            params,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            jnp.asarray(start),
            cache,
            jax.random.key(0) if rng is None else rng,
            sampling_arrays,
            jnp.asarray(stop_token_array(stop_tokens, vocab_size)),
            jnp.int32(pad_id),
            jnp.int32(max_new_tokens),
            hook_state,
            intervention,
            buffer_len=buffer_len,
            cache_len=cache_len,
            prefill_chunk=int(prefill_chunk),
            step_hook=step_hook,
            rules=rules,
        )
    return out.replace(
        tokens=out.tokens[:, :max_new_tokens],
        log_probs=out.log_probs[:, :max_new_tokens],
        sampling_log_probs=out.sampling_log_probs[:, :max_new_tokens],
    )
