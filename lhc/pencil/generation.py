"""Reduction-aware generation: PENCIL's reductions on a KV cache, batched.

When a sequence generates ``[RETURN]`` and the rule of ``lhc.pencil.reduction`` matches
(``C [CALL] T [SEP] A [RETURN] -> C A``), the keys and values of ``C`` stay valid: the
attention is causal and positions in ``C`` do not move. So the cache is cut back to the
``[CALL]``'s position and only the answer ``A`` is fed again, at its new positions
``|C| .. |C| + |A| - 1``; the next token is then sampled after ``A``, exactly as if the
reduced sequence ``C A`` had been run from scratch. The official implementation has no
cache: every generated token re-runs the whole reduced context
(``generate_recompute`` here does the same, batched, for tests and ``lhc bench pencil``).

``generate`` runs on any model of lhc's causal-LM protocol whose cache can be truncated
back to any position (``lhc.lm.Transformer``'s ``KVCache``). It is
``lhc.lm.decoding.decode_loop`` with a step hook: after each sampled token the hook
appends it to a per-sequence copy of the reduced context, and for each sequence whose
token triggers a reduction it rewrites the context, truncates the cache at
``min(|C|, |C A| - 1)``, feeds the answer but its last token in chunks of
``answer_chunk`` tokens (one model call per chunk, all reducing sequences together;
the others feed padding, which is dropped again), and makes the answer's last token the
next one the loop feeds. Each sequence reduces on its own schedule.

The context limit is the number of positions the reduced context may occupy (the
paper's 2048). A sequence whose reduced context would outgrow it stops and is recorded
as ``overflowed``: nothing is truncated silently. A generated ``[RETURN]`` or stop token
is never fed, so it may arrive when the context is full.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lhc.lm import decoding
from lhc.lm.prompts import bucket_length, stop_token_array
from lhc.lm.rules import empty_cache
from lhc.lm.sampling import SamplingParams, sample_tokens
from lhc.pencil.reduction import find_reduction, reduce_once

GREEDY = SamplingParams()


@struct.dataclass
class SpecialIds:
    """The ids the reduction and the loop need (int32 scalars, traced)."""

    call: jax.Array
    sep: jax.Array
    ret: jax.Array
    pad: jax.Array

    @classmethod
    def of(cls, tokenizer) -> SpecialIds:
        """From an ``lhc.pencil.PencilTokenizer`` (or anything with the same ids)."""
        return cls(
            call=jnp.int32(tokenizer.call_id),
            sep=jnp.int32(tokenizer.sep_id),
            ret=jnp.int32(tokenizer.return_id),
            pad=jnp.int32(tokenizer.pad_id),
        )


@struct.dataclass
class ReductionState:
    """The hook's state (``DecodeState.hook_state``).

    Attributes:
        context: int32 ``[B, C + 1]``, the reduced sequence, prompt first; token ``i``
            sits at position ``i`` (one spare column holds a ``[RETURN]`` or a stop
            token that arrives when the context is full).
        length: int32 ``[B]``, tokens in ``context``.
        max_length: int32 ``[B]``, the largest ``length`` a sequence reached: the
            context it needed (a ``[RETURN]`` or stop token, never fed, not counted).
        reductions: int32 ``[B]``, reductions applied.
        overflowed: bool ``[B]``, the sequence stopped because its context outgrew the
            limit.
        seen: int32 ``[B]``, generated tokens already appended to ``context``.
    """

    context: jax.Array
    length: jax.Array
    max_length: jax.Array
    reductions: jax.Array
    overflowed: jax.Array
    seen: jax.Array


@struct.dataclass
class PencilOutput:
    """Result of ``generate`` (and ``generate_recompute``).

    Attributes:
        tokens: int32 ``[B, N]``, the whole trace as generated, before any reduction
            (``pad`` after a sequence stopped).
        log_probs: float32 ``[B, N]``, ``log_softmax(logits)`` of each token.
        lengths: int32 ``[B]``, tokens generated, stop token included.
        context: int32 ``[B, C + 1]``, the final reduced sequence (prompt included).
        context_lengths: int32 ``[B]``.
        max_context: int32 ``[B]``, the largest context each sequence needed.
        reductions: int32 ``[B]``.
        overflowed: bool ``[B]``.
    """

    tokens: jax.Array
    log_probs: jax.Array
    lengths: jax.Array
    context: jax.Array
    context_lengths: jax.Array
    max_context: jax.Array
    reductions: jax.Array
    overflowed: jax.Array


def _take_rows(array: jax.Array, index: jax.Array) -> jax.Array:
    """``array[b, index[b, ...]]`` with the index clipped into range."""
    return jnp.take_along_axis(array, jnp.clip(index, 0, array.shape[1] - 1), axis=1)


def find_reductions(context, length, special: SpecialIds):
    """Where the last token of each row triggers a reduction, batched.

    Args:
        context: int32 ``[B, W]``; length: int32 ``[B]`` (the last token at
            ``length - 1``).

    Returns:
        ``(matched, call, sep)``: bool ``[B]`` (the last token is a ``[RETURN]`` with a
        ``[SEP]`` before it and a ``[CALL]`` before that) and the indices of that
        ``[SEP]`` (the last before it) and ``[CALL]`` (the last before the ``[SEP]``).
    """
    index = jnp.arange(context.shape[1], dtype=jnp.int32)[None, :]
    last = length - 1
    is_return = _take_rows(context, last[:, None])[:, 0] == special.ret
    sep = jnp.max(jnp.where((context == special.sep) & (index < last[:, None]), index, -1), 1)
    call = jnp.max(jnp.where((context == special.call) & (index < sep[:, None]), index, -1), 1)
    return is_return & (length > 0) & (sep >= 0) & (call >= 0), call, sep


def _reduction_hook(state: decoding.DecodeState, *, model, params, special, answer_chunk, limit):
    """After each sampled token: append it to the context; reduce where it matches."""
    hooked: ReductionState = state.hook_state
    batch, width = hooked.context.shape
    rows = jnp.arange(batch)
    new = state.lengths > hooked.seen  # a token was sampled for this row at this step
    context = hooked.context.at[rows, hooked.length].set(
        jnp.where(new, state.token, _take_rows(hooked.context, hooked.length[:, None])[:, 0]),
        mode="drop",
    )
    length = hooked.length + new.astype(jnp.int32)

    matched, call, sep = find_reductions(context, length, special)
    answer_length = length - 1 - sep - 1
    new_length = call + answer_length
    reduce = new & matched & (new_length >= 1)
    index = jnp.arange(width, dtype=jnp.int32)[None, :]
    source = jnp.where(index < call[:, None], index, index - call[:, None] + sep[:, None] + 1)
    reduced = jnp.where(index < new_length[:, None], _take_rows(context, source), special.pad)
    context = jnp.where(reduce[:, None], reduced, context)
    length = jnp.where(reduce, new_length, length)
    # The last token of the reduced context is fed next, by the loop; the cache keeps
    # every position before min(|C|, |C A| - 1) and is fed the tokens in between here.
    keep = jnp.minimum(call, new_length - 1)
    next_position = jnp.where(reduce, new_length - 1, state.position)
    next_token = _take_rows(context, (length - 1)[:, None])[:, 0]

    def rewind(cache):
        cache = cache.truncate_at_position(jnp.where(reduce, keep, state.position))
        to_feed = jnp.where(reduce, new_length - 1 - keep, 0)
        num_chunks = (jnp.max(to_feed) + answer_chunk - 1) // answer_chunk
        offsets = jnp.arange(answer_chunk, dtype=jnp.int32)[None, :]

        def feed(carry):
            chunk, cache = carry
            index = keep[:, None] + chunk * answer_chunk + offsets
            valid = reduce[:, None] & (index < (new_length - 1)[:, None])
            tokens = jnp.where(valid, _take_rows(context, index), special.pad)
            positions = jnp.where(valid, index, -1)
            _, cache = model.apply({"params": params}, tokens, positions, cache)
            return chunk + 1, cache

        _, cache = jax.lax.while_loop(lambda c: c[0] < num_chunks, feed, (jnp.int32(0), cache))
        # Drop the padding the chunks left after each sequence's last real token.
        return cache.truncate_at_position(next_position)

    cache = jax.lax.cond(jnp.any(reduce), rewind, lambda cache: cache, state.cache)
    # A sequence whose next token would sit past the limit stops (stop tokens and
    # [RETURN]s are never fed, so they may take the spare column).
    overflow = ~state.done & (length > limit)
    return state.replace(
        token=jnp.where(reduce, next_token, state.token),
        position=next_position,
        cache=cache,
        done=state.done | overflow,
        hook_state=ReductionState(
            context=context,
            length=length,
            max_length=jnp.maximum(hooked.max_length, jnp.where(new & ~reduce, length, 0)),
            reductions=hooked.reductions + reduce.astype(jnp.int32),
            overflowed=hooked.overflowed | overflow,
            seen=state.lengths,
        ),
    )


@functools.partial(
    jax.jit,
    static_argnums=0,
    static_argnames=("buffer_len", "limit", "prefill_chunk", "answer_chunk"),
)
def _generate_jit(
    model,
    params,
    prompts,
    prompt_lengths,
    rng,
    sampling,
    stop_ids,
    max_new_tokens,
    special,
    *,
    buffer_len,
    limit,
    prefill_chunk,
    answer_chunk,
):
    batch, width = prompts.shape
    # One cache slot per position: the prompts are right-padded, and all but their last
    # token are prefilled, then the padding is dropped again, so the cache needs no room
    # beyond the context limit.
    cache = empty_cache(model, batch, limit)
    index = jnp.arange(width, dtype=jnp.int32)[None, :]
    last = prompt_lengths - 1
    in_prefix = index < last[:, None]
    _, cache = decoding.prefill_chunks(
        model,
        params,
        jnp.where(in_prefix, prompts, special.pad),
        jnp.where(in_prefix, index, -1),
        cache,
        chunk_size=prefill_chunk,
    )
    cache = cache.truncate_at_position(last)
    logits, cache = model.apply(
        {"params": params}, _take_rows(prompts, last[:, None]), last[:, None], cache
    )
    context = jnp.full((batch, limit + 1), special.pad, jnp.int32).at[:, :width].set(prompts)
    hooked = ReductionState(
        context=context,
        length=prompt_lengths,
        max_length=prompt_lengths,
        reductions=jnp.zeros((batch,), jnp.int32),
        overflowed=jnp.zeros((batch,), bool),
        seen=jnp.zeros((batch,), jnp.int32),
    )
    hook = functools.partial(
        _reduction_hook,
        model=model,
        params=params,
        special=special,
        answer_chunk=answer_chunk,
        limit=limit,
    )
    state = decoding.decode_loop(
        model,
        params,
        logits[:, -1],
        prompt_lengths,
        cache,
        rng,
        max_new_tokens=max_new_tokens,
        buffer_len=buffer_len,
        sampling=sampling,
        stop_ids=stop_ids,
        pad_id=special.pad,
        step_hook=hook,
        hook_state=hooked,
    )
    hooked = state.hook_state
    return PencilOutput(
        tokens=state.tokens,
        log_probs=state.log_probs,
        lengths=state.lengths,
        context=hooked.context,
        context_lengths=hooked.length,
        max_context=hooked.max_length,
        reductions=hooked.reductions,
        overflowed=hooked.overflowed,
    )


def _right_padded(
    prompts, pad_id: int, vocab_size: int | None, limit: int
) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(prompts, (np.ndarray, jax.Array)) or not len(prompts):
        raise ValueError("prompts must be a non-empty list of token-id lists")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths < 1).any():
        raise ValueError(f"every prompt needs at least one token; got lengths {lengths.tolist()}")
    longest = int(lengths.max())
    if longest > limit:
        raise ValueError(f"a prompt of {longest} tokens does not fit the context_limit {limit}")
    # A bucketed width (fewer compiled programs) within the context.
    width = max(longest, min(bucket_length(longest), limit))
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = np.asarray(prompt, np.int32)
    if vocab_size is not None and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"prompt token ids must lie in [0, vocab_size={vocab_size}); got min {tokens.min()} "
            f"max {tokens.max()}"
        )
    return tokens, lengths


def _validate(model, prompts, max_new_tokens, context_limit, pad_id, sampling, rng):
    if not isinstance(context_limit, int) or not 1 <= context_limit <= model.config.max_len:
        raise ValueError(
            f"context_limit must be an int in [1, the model's max_len={model.config.max_len}], "
            f"got {context_limit!r}"
        )
    tokens, lengths = _right_padded(
        prompts, pad_id, getattr(model.config, "vocab_size", None), context_limit
    )
    if not sampling.greedy and rng is None:
        raise ValueError("rng is required when sampling (temperature > 0)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return tokens, lengths


def generate(
    model,
    params,
    prompts: Sequence[Sequence[int]],
    tokenizer,
    *,
    max_new_tokens: int,
    context_limit: int,
    sampling: SamplingParams = GREEDY,
    rng: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
    answer_chunk: int = 32,
    prefill_chunk: int = decoding.DEFAULT_PREFILL_CHUNK,
) -> PencilOutput:
    """Generates with PENCIL's reductions on the KV cache.

    Args:
        model: a causal-LM protocol model whose cache truncates to any position
            (``lhc.lm.Transformer``).
        params: its parameters.
        prompts: B token-id lists (e.g. ``<|startoftext|> ... <|endofprompt|>``).
        tokenizer: gives ``call_id``, ``sep_id``, ``return_id``, ``pad_id``, ``eos_id``
            (``lhc.pencil.PencilTokenizer``).
        max_new_tokens: N, the most tokens generated per sequence, reductions aside
            (the paper allows 50k for SAT/QBF and 350k for puzzles).
        context_limit: the most positions a reduced context may take (the model's
            context, 2048 in the paper).
        sampling: temperature / top-k / top-p (greedy by default; the paper samples at
            temperature 0.8 with top-k 200).
        rng: PRNG key, required unless greedy.
        stop_tokens: ids that end a sequence (default: the tokenizer's end of text).
        answer_chunk: answer tokens fed per model call after a reduction.
        prefill_chunk: prompt tokens per prefill call.

    Returns:
        A ``PencilOutput``.

    Raises:
        ValueError: malformed prompts, a prompt longer than ``context_limit``, a
            ``context_limit`` beyond the model's ``max_len``, a missing ``rng``.
    """
    tokens, lengths = _validate(
        model, prompts, max_new_tokens, context_limit, tokenizer.pad_id, sampling, rng
    )
    if answer_chunk < 1:
        raise ValueError(f"answer_chunk must be >= 1, got {answer_chunk}")
    stop_tokens = [tokenizer.eos_id] if stop_tokens is None else list(stop_tokens)
    out = _generate_jit(
        model,
        params,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        jax.random.key(0) if rng is None else rng,
        sampling.as_arrays(),
        jnp.asarray(stop_token_array(stop_tokens)),
        jnp.int32(max_new_tokens),
        SpecialIds.of(tokenizer),
        buffer_len=bucket_length(max_new_tokens),
        limit=int(context_limit),
        prefill_chunk=int(prefill_chunk),
        answer_chunk=int(answer_chunk),
    )
    return out.replace(
        tokens=out.tokens[:, :max_new_tokens], log_probs=out.log_probs[:, :max_new_tokens]
    )


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(model, params, tokens, positions, last):
    logits, _ = model.apply({"params": params}, tokens, positions)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]


@jax.jit
def _draw(rng, logits, sampling):
    """One token per row and its log-probability under the unprocessed logits (jitted:
    ``sample_tokens`` with array sampling parameters branches under ``lax.cond``, which
    run eagerly would compile on every call)."""
    drawn, _ = sample_tokens(rng, logits, sampling)
    log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), drawn[:, None], -1)[:, 0]
    return drawn, log_probs


def generate_recompute(
    model,
    params,
    prompts: Sequence[Sequence[int]],
    tokenizer,
    *,
    max_new_tokens: int,
    context_limit: int,
    sampling: SamplingParams = GREEDY,
    rng: jax.Array | None = None,
    stop_tokens: Sequence[int] | None = None,
) -> PencilOutput:
    """PENCIL generation as the official code does it: no cache; every token re-runs the
    whole reduced context (here batched, contexts right-padded to a bucketed width), and
    the reduction is applied to Python lists (``reduce_once_ids``).

    Same arguments and result as ``generate``, which must give the same tokens: token
    ``i`` of every sequence is drawn with ``fold_in(rng, i)`` from the same logits.
    """
    pad_id = tokenizer.pad_id
    _validate(model, prompts, max_new_tokens, context_limit, pad_id, sampling, rng)
    rng = jax.random.key(0) if rng is None else rng
    stop_tokens = {tokenizer.eos_id} if stop_tokens is None else set(stop_tokens)
    special = (tokenizer.call_id, tokenizer.sep_id, tokenizer.return_id)
    batch = len(prompts)
    contexts = [list(map(int, p)) for p in prompts]
    max_context = [len(c) for c in contexts]
    reductions = [0] * batch
    overflowed = [False] * batch
    done = [False] * batch
    generated = np.full((batch, max_new_tokens), pad_id, np.int32)
    log_probs = np.zeros((batch, max_new_tokens), np.float32)
    lengths = np.zeros(batch, np.int32)
    sampling_arrays = sampling.as_arrays()
    for step in range(max_new_tokens):
        if all(done):
            break
        # Only the running sequences are computed (a stopped one may hold a context one
        # token past the limit); widths are bucketed within the model's max_len.
        longest = max(len(c) for b, c in enumerate(contexts) if not done[b])
        width = max(longest, min(bucket_length(longest), model.config.max_len))
        tokens = np.full((batch, width), pad_id, np.int32)
        positions = np.full((batch, width), -1, np.int32)
        for b, context in enumerate(contexts):
            if not done[b]:
                tokens[b, : len(context)] = context
                positions[b, : len(context)] = np.arange(len(context))
        last = np.array([0 if done[b] else len(c) - 1 for b, c in enumerate(contexts)], np.int32)
        logits = _last_logits(model, params, jnp.asarray(tokens), jnp.asarray(positions), last)
        drawn, token_log_probs = _draw(jax.random.fold_in(rng, step), logits, sampling_arrays)
        drawn, token_log_probs = np.asarray(drawn), np.asarray(token_log_probs)
        for b in range(batch):
            if done[b]:
                continue
            token = int(drawn[b])
            generated[b, step], log_probs[b, step] = token, token_log_probs[b]
            lengths[b] += 1
            context = contexts[b] + [token]
            found = find_reduction(context, *special) if token == tokenizer.return_id else None
            reduced = None if found is None else reduce_once(context, *special)
            if reduced:  # a reduction that leaves at least one token to continue from
                contexts[b] = reduced
                reductions[b] += 1
            else:
                contexts[b] = context
                max_context[b] = max(max_context[b], len(context))
            reduced = contexts[b]
            stopped = token in stop_tokens or lengths[b] >= max_new_tokens
            if len(reduced) > context_limit and not stopped:
                overflowed[b] = True
            done[b] = stopped or overflowed[b]
    context_array = np.full((batch, context_limit + 1), pad_id, np.int32)
    for b, context in enumerate(contexts):
        context_array[b, : len(context)] = context[: context_limit + 1]
    return PencilOutput(
        tokens=jnp.asarray(generated),
        log_probs=jnp.asarray(log_probs),
        lengths=jnp.asarray(lengths),
        context=jnp.asarray(context_array),
        context_lengths=jnp.asarray([len(c) for c in contexts], jnp.int32),
        max_context=jnp.asarray(max_context, jnp.int32),
        reductions=jnp.asarray(reductions, jnp.int32),
        overflowed=jnp.asarray(overflowed),
    )


def trace_rate(generated: Sequence[int], reference: Sequence[int]) -> float:
    """The paper's trace rate: the fraction of the reference trace's tokens that the
    generated trace (before reduction) matches position by position."""
    if not len(reference):
        raise ValueError("trace_rate needs a non-empty reference trace")
    matched = sum(1 for a, b in zip(generated, reference) if int(a) == int(b))
    return matched / len(reference)
