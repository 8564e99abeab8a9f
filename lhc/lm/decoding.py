"""Decoding for any model of the causal-LM protocol: chunked prefill, a jitted decode step
and a decode loop with a step hook.

The pieces, from the bottom up:

* ``prefill(model, params, tokens, positions, cache, chunk_size=...)``: appends a
  (left-padded) prompt to a cache ``chunk_size`` tokens at a time, so the attention of one
  chunk reads the cache without materialising ``[T, S]`` scores for the whole prompt,
  and computes logits only for the last column (the last prompt token).
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

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lhc.lm.sampling import SamplingParams, sample_tokens
from lhc.parallel.mesh import LOGICAL_AXIS_RULES

GREEDY = SamplingParams()
DEFAULT_PREFILL_CHUNK = 512
_MIN_STOP_SLOTS = 4


def bucket_length(length: int, minimum: int = 16) -> int:
    """The compiled length that serves ``length``: at least ``minimum``, a multiple of 16
    up to 64, of 64 up to 512, then of an eighth of the power of two below (at most 12.5%
    padding), so that nearby lengths share one program."""
    length = max(int(length), int(minimum))
    if length <= 64:
        step = 16
    elif length <= 512:
        step = 64
    else:
        step = 1 << (length.bit_length() - 4)
    return -(-length // step) * step


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


# Prompts -------------------------------------------------------------------------------


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
        _check_token_lists(prompts)
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


def _check_token_lists(prompts) -> None:
    """A one-line ``ValueError`` for prompts that are not B non-empty token lists."""
    expected = "prompts: expected B token lists or an int [B, P] array"
    if isinstance(prompts, (str, bytes)):
        raise ValueError(f"{expected}, got a string; tokenize it first (tokenizer.encode)")
    if not isinstance(prompts, Sequence):
        raise ValueError(f"{expected}, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError(f"{expected}, got no prompts")
    if any(isinstance(p, (int, np.integer)) for p in prompts):
        raise ValueError(f"{expected}, got a flat list of ints; one prompt is [tokens]")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(
            f"prompts: every prompt needs at least one token; prompts {empty} are empty"
        )


def left_padded_positions(
    prompt_lengths: jax.Array, width: int, start: jax.Array | int = 0
) -> jax.Array:
    """int32 ``[B, P]`` positions of left-padded prompts, ``-1`` on the padding.

    Prompt ``b`` gets positions ``start[b] .. start[b] + prompt_lengths[b] - 1``.
    """
    offsets = jnp.arange(width, dtype=jnp.int32)[None, :] - (width - prompt_lengths[:, None])
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), prompt_lengths.shape)
    return jnp.where(offsets >= 0, start[:, None] + offsets, -1).astype(jnp.int32)


def stop_token_array(stop_tokens: Sequence[int], vocab_size: int | None = None) -> np.ndarray:
    """int32 stop ids padded with -1 (never a token) to a bucketed length; each id must
    lie in ``[0, vocab_size)`` (unchecked if None)."""
    stop_tokens = [int(t) for t in stop_tokens]
    outside = [t for t in stop_tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:
        raise ValueError(
            f"stop_tokens: ids must lie in [0, vocab_size={vocab_size}), got {outside}"
        )
    slots = max(_MIN_STOP_SLOTS, 1 << max(len(stop_tokens) - 1, 0).bit_length())
    out = np.full((slots,), -1, np.int32)
    out[: len(stop_tokens)] = stop_tokens
    return out


# Meshes and rules --------------------------------------------------------------------------


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


def with_rules(fn: Callable) -> Callable:
    """``fn`` run under ``rules_context(rules)``, ``rules`` an extra keyword argument (for
    a jitted function, a static one)."""

    def wrapped(*args, rules, **kwargs):
        with rules_context(rules):
            return fn(*args, **kwargs)

    wrapped.__name__ = wrapped.__qualname__ = fn.__name__  # no __wrapped__: jit sees `rules`
    return wrapped


def constrain_cache(cache):
    """The cache with every leaf constrained to its logical axes (under active rules)."""
    return jax.tree.map(
        lambda x, spec: nn.with_logical_constraint(x, tuple(spec)), cache, cache.logical_axes()
    )


def empty_cache(model: nn.Module, batch_size: int, cache_len: int):
    """``model.init_cache``, constrained to the cache's logical axes.

    Behind an optimization barrier: attention reads the stored keys before it writes the
    new ones, and XLA would otherwise constant-fold the first chunk's scores against an
    empty cache made in the same program (seconds of compilation per layer).
    """
    return jax.lax.optimization_barrier(constrain_cache(model.init_cache(batch_size, cache_len)))


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


@functools.partial(jax.jit, static_argnums=0, static_argnames="chunk_size")
def prefill(model, params, tokens, positions, cache, *, chunk_size: int = DEFAULT_PREFILL_CHUNK):
    """Jitted ``prefill_chunks``: ``(logits [B, V] of the last column, cache)``."""
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


def _prompt_layout(tokens, lengths, cache, cache_len, max_len, max_new_tokens, pad_id):
    """``generate``'s plan: the prompts left-padded to a bucketed width, each sequence's
    first position, the bucketed output buffer and the new cache's length (``None`` when
    continuing a cache). Raises when the prompts and ``max_new_tokens`` do not fit."""
    batch_size, width = tokens.shape
    if cache is None:
        start = np.zeros((batch_size,), np.int32)
        used = 0
    else:
        start = np.asarray(cache.next_positions(), np.int32)
        used = int(np.max(np.asarray(cache.lengths))) if batch_size else 0
        if np.asarray(cache.lengths).shape != (batch_size,):
            raise ValueError(
                f"cache holds {np.asarray(cache.lengths).shape[0]} sequences, prompts {batch_size}"
            )
    last_position = int(np.max(start + lengths)) + max_new_tokens - 1
    if last_position >= max_len:
        raise ValueError(
            f"prompt width {width} + max_new_tokens {max_new_tokens} (last position "
            f"{last_position}) exceeds the model's max_len {max_len}"
        )
    buffer_len = bucket_length(max_new_tokens)
    # The cache needs width + N - 1 slots (the last token is never fed); buckets round
    # both up, within what the model and the cache allow.
    needed = width + max_new_tokens - 1
    if cache is not None:
        room = None if cache.capacity is None else cache.capacity - used
        limit = "the cache's free capacity"
    else:
        room = max_len if cache_len is None else int(cache_len)
        limit = "cache_len" if cache_len is not None else "the model's max_len"
    if room is not None and needed > room:
        raise ValueError(
            f"{limit} {room} is too small for prompts of width {width} plus {max_new_tokens} "
            f"new tokens ({needed} slots; the last token is never fed)"
        )
    bucketed = bucket_length(width)
    if room is not None:
        bucketed = max(width, min(bucketed, room - max_new_tokens + 1))
    if bucketed > width:
        padding = np.full((batch_size, bucketed - width), pad_id, np.int32)
        tokens = np.concatenate([padding, tokens], axis=1)
    if cache is None and cache_len is None:
        # One spare slot keeps the length a multiple of 16 (it shards evenly).
        cache_len = min(max_len, bucketed + buffer_len)
    return tokens, start, buffer_len, None if cache is not None else int(cache_len)


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
            ``prefill_chunk < 1``.
    """
    vocab_size = getattr(model.config, "vocab_size", None)
    tokens, lengths = prepare_prompts(prompts, prompt_lengths, pad_id, vocab_size)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if not sampling.greedy and rng is None:
        raise ValueError("rng is required when sampling (temperature > 0)")
    tokens, start, buffer_len, cache_len = _prompt_layout(
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
