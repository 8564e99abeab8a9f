"""Speculative decoding: a draft model proposes, the target model verifies.

Each iteration the draft model samples ``num_draft`` (gamma) tokens one at a time; the
target model scores the pending token and all drafts in one forward pass; the drafts
are accepted left to right with probability ``min(1, p(d) / q(d))`` (p: target, q:
draft, both after the same temperature / top-k / top-p processing); at the first
rejection a token is drawn from ``norm(max(0, p - q))``, and when every draft is
accepted a bonus token is drawn from the target's next distribution (Leviathan et al.,
2023; Chen et al., 2023). The output is distributed exactly as sampling from the target
alone; with greedy sampling it equals greedy decoding of the target token for token (up
to argmax near-ties, where the target's multi-token verification pass and its one-token
decoding steps may round differently in low precision).

Both models follow the causal-LM protocol (``lhc.lm.model``) and keep ``KVCache``-like
caches with per-sequence ``lengths`` and ``truncate``: after verification each cache is
truncated to the accepted prefix of what it was fed, so sequences of a batch advance by
different amounts. The token sampled last (correction or bonus) is "pending": it is in
no cache yet and is the first token both models are fed in the next iteration. QuantSpec
and RAPID build on this loop with other draft models (the same network over a quantized
cache, a retrieval-augmented drafter); ``verify_drafts`` is the acceptance rule alone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lhc.lm.decoding import (
    GREEDY,
    empty_cache,
    left_padded_positions,
    mesh_context,
    prepare_prompts,
    rules_context,
    static_rules,
)
from lhc.lm.sampling import SamplingParams, logits_to_probs


@struct.dataclass
class SpeculativeOutput:
    """Result of ``speculative_generate``.

    Attributes:
        tokens: int32 ``[B, N]`` generated tokens (``pad_id`` after a sequence stopped).
        lengths: int32 ``[B]`` generated tokens per sequence, stop token included.
        num_iterations: int32 scalar, draft-and-verify rounds (target forward passes
            after the prefill).
        accepted: int32 ``[B]`` draft tokens accepted per sequence.
        drafted: int32 ``[B]`` draft tokens proposed to each sequence while it was active.
    """

    tokens: jax.Array
    lengths: jax.Array
    num_iterations: jax.Array
    accepted: jax.Array
    drafted: jax.Array

    @property
    def acceptance_rate(self) -> jax.Array:
        """Accepted / proposed draft tokens over the batch."""
        return self.accepted.sum() / jnp.maximum(self.drafted.sum(), 1)


@struct.dataclass
class _LoopState:
    """What one draft-and-verify round reads and writes (``[B]`` arrays unless noted)."""

    iteration: jax.Array  # int32 scalar
    pending: jax.Array  # the sampled token not yet in either cache
    position: jax.Array  # its position
    target_cache: Any
    draft_cache: Any
    done: jax.Array  # bool
    generated: jax.Array  # tokens written to ``out`` so far
    out: jax.Array  # int32 [B, N + G + 1]
    accepted: jax.Array
    drafted: jax.Array


def verify_drafts(
    rng: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The speculative-sampling acceptance rule for a batch of draft blocks.

    Args:
        rng: PRNG key.
        draft_tokens: int ``[B, G]``, the drafts d_1..d_G, d_i drawn from ``draft_probs[:, i-1]``.
        draft_probs: float ``[B, G, V]``, the draft distributions q_1..q_G.
        target_probs: float ``[B, G + 1, V]``, the target distributions p_1..p_{G+1} at
            the same positions, plus the one after the last draft.

    Returns:
        ``(num_accepted, next_token)``: int32 ``[B]`` in ``[0, G]``, the length of the
        accepted prefix, and int32 ``[B]``, the token that follows it: drawn from
        ``norm(max(0, p - q))`` at the first rejection, or from p_{G+1} when all drafts
        were accepted.
    """
    batch, num_draft = draft_tokens.shape
    if draft_probs.shape[:2] != (batch, num_draft) or target_probs.shape[:2] != (
        batch,
        num_draft + 1,
    ):
        raise ValueError(
            f"verify_drafts: expected draft_probs [B={batch}, G={num_draft}, V] and "
            f"target_probs [B, G + 1 = {num_draft + 1}, V]; got {draft_probs.shape} and "
            f"{target_probs.shape}"
        )
    accept_rng, residual_rng = jax.random.split(rng)
    index = draft_tokens[..., None].astype(jnp.int32)
    p = jnp.take_along_axis(target_probs[:, :num_draft], index, axis=-1)[..., 0]
    q = jnp.take_along_axis(draft_probs, index, axis=-1)[..., 0]
    # u < p / q, written without the division (q > 0 for a token drawn from q).
    accept = jax.random.uniform(accept_rng, (batch, num_draft)) * q < p
    num_accepted = jnp.cumprod(accept.astype(jnp.int32), axis=1).sum(axis=1)
    rows = jnp.arange(batch)
    padded_q = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    residual = jnp.maximum(target_probs[rows, num_accepted] - padded_q[rows, num_accepted], 0.0)
    # p <= q everywhere only when p == q up to rounding; then p itself is the residual.
    residual = jnp.where(
        residual.sum(-1, keepdims=True) > 0, residual, target_probs[rows, num_accepted]
    )
    next_token = jax.random.categorical(residual_rng, jnp.log(residual), axis=-1)
    return num_accepted.astype(jnp.int32), next_token.astype(jnp.int32)


def speculative_generate(
    target: nn.Module,
    target_params: Any,
    draft: nn.Module,
    draft_params: Any,
    prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray,
    prompt_lengths: jax.Array | np.ndarray | None = None,
    *,
    max_new_tokens: int,
    num_draft: int = 4,
    sampling: SamplingParams = GREEDY,
    rng: jax.Array | None = None,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    rules: Sequence[tuple[str, Any]] | None = None,
) -> SpeculativeOutput:
    """Generates up to ``max_new_tokens`` per prompt with draft-then-verify rounds.

    Args:
        target: the causal LM whose distribution the output follows.
        target_params: its parameters.
        draft: a cheaper causal LM with the same vocabulary.
        draft_params: its parameters.
        prompts: B token lists, or a left-padded int ``[B, P]`` array.
        prompt_lengths: int ``[B]`` real lengths of a padded array (default: all ``P``).
        max_new_tokens: N.
        num_draft: gamma, draft tokens per round (>= 1).
        sampling: temperature / top-k / top-p, applied to both models (greedy default).
        rng: PRNG key, required unless greedy.
        stop_tokens: ids that end a sequence (the stop token is emitted and counted).
        pad_id: id written after a sequence stopped and used for prompt padding.
        mesh: run under this mesh (parameters may be sharded); activations and caches
            are constrained with ``rules`` (``lhc.parallel.LOGICAL_AXIS_RULES`` by default).
        rules: logical-axis rules for a mesh.

    Returns:
        A ``SpeculativeOutput``.

    Raises:
        ValueError: malformed prompts, vocabularies that differ, ``num_draft < 1``,
            ``P + N + num_draft + 1`` beyond either model's ``max_len``, a missing
            ``rng`` for sampling.
    """
    vocab = target.config.vocab_size
    if draft.config.vocab_size != vocab:
        raise ValueError(
            f"draft vocab_size {draft.config.vocab_size} differs from the target's {vocab}"
        )
    tokens, lengths = prepare_prompts(prompts, prompt_lengths, pad_id, vocab)
    width = tokens.shape[1]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    # A round may append num_draft + 1 slots and keep fewer; a sequence may overshoot N
    # by up to num_draft tokens before it stops.
    cache_len = width + max_new_tokens + num_draft + 1
    for name, model in (("target", target), ("draft", draft)):
        if cache_len > model.config.max_len:
            raise ValueError(
                f"prompt width {width} + max_new_tokens {max_new_tokens} + num_draft + 1 "
                f"= {cache_len} exceeds the {name} model's max_len {model.config.max_len}"
            )
    if not sampling.greedy and rng is None:
        raise ValueError("rng is required when sampling (temperature > 0)")
    rng = jax.random.key(0) if rng is None else rng
    run = functools.partial(
        _speculative_jit,
        target,
        draft,
        max_new_tokens=int(max_new_tokens),
        num_draft=int(num_draft),
        sampling=sampling,
        stop_tokens=tuple(int(t) for t in stop_tokens),
        pad_id=int(pad_id),
        cache_len=int(cache_len),
        rules=static_rules(mesh, rules),
    )
    with mesh_context(mesh):
        return run(target_params, draft_params, jnp.asarray(tokens), jnp.asarray(lengths), rng)


@functools.partial(
    jax.jit,
    static_argnums=(0, 1),
    static_argnames=(
        "max_new_tokens", "num_draft", "sampling", "stop_tokens", "pad_id", "cache_len",
        "rules",
    ),
)  # fmt: skip
def _speculative_jit(
    target, draft, target_params, draft_params, tokens, prompt_lengths, rng, *,
    max_new_tokens, num_draft, sampling, stop_tokens, pad_id, cache_len, rules,
):  # fmt: skip
    with rules_context(rules):
        return _speculative_loop(
            target, draft, target_params, draft_params, tokens, prompt_lengths, rng,
            max_new_tokens=max_new_tokens, num_draft=num_draft, sampling=sampling,
            stop_tokens=stop_tokens, pad_id=pad_id, cache_len=cache_len,
        )  # fmt: skip


def _speculative_loop(
    target, draft, target_params, draft_params, tokens, prompt_lengths, rng, *,
    max_new_tokens, num_draft, sampling, stop_tokens, pad_id, cache_len,
):  # fmt: skip
    batch_size, width = tokens.shape
    apply_target = functools.partial(target.apply, {"params": target_params})
    apply_draft = functools.partial(draft.apply, {"params": draft_params})
    target_cache = empty_cache(target, batch_size, cache_len)
    draft_cache = empty_cache(draft, batch_size, cache_len)
    # Prefill everything but the last prompt token, which becomes the pending token.
    if width > 1:
        positions = left_padded_positions(prompt_lengths, width)[:, :-1]
        _, target_cache = apply_target(tokens[:, :-1], positions, target_cache)
        _, draft_cache = apply_draft(tokens[:, :-1], positions, draft_cache)
    offsets = jnp.arange(num_draft + 1, dtype=jnp.int32)
    stop_ids = jnp.asarray(stop_tokens, jnp.int32)
    buffer_len = max_new_tokens + num_draft + 1

    def draft_step(carry, key):
        token, position, cache = carry
        logits, cache = apply_draft(token[:, None], position[:, None], cache)
        probs = logits_to_probs(logits[:, -1], sampling)
        proposal = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
        next_position = jnp.where(position < 0, -1, position + 1)
        return (proposal, next_position, cache), (proposal, probs)

    def body(state: _LoopState) -> _LoopState:
        pending, position, done = state.pending, state.position, state.done
        keys = jax.random.split(jax.random.fold_in(rng, state.iteration), num_draft + 1)
        fed_position = jnp.where(done, -1, position)
        target_start, draft_start = state.target_cache.lengths, state.draft_cache.lengths

        # Draft: feed the pending token and the drafts, sampling d_1..d_G on the way.
        (last, last_position, draft_cache), (proposals, draft_probs) = jax.lax.scan(
            draft_step, (pending, fed_position, state.draft_cache), keys[:num_draft]
        )
        proposals = proposals.T  # [B, G]
        draft_probs = jnp.swapaxes(draft_probs, 0, 1)  # [B, G, V]
        # d_G itself, so that the draft cache holds it when every draft is accepted.
        _, draft_cache = apply_draft(last[:, None], last_position[:, None], draft_cache)

        # Target: score the pending token and all drafts at once.
        block = jnp.concatenate([pending[:, None], proposals], axis=1)
        block_positions = jnp.where(done[:, None], -1, position[:, None] + offsets[None, :])
        target_logits, target_cache = apply_target(block, block_positions, state.target_cache)
        target_probs = logits_to_probs(target_logits, sampling)

        num_accepted, next_token = verify_drafts(keys[-1], proposals, draft_probs, target_probs)
        new_tokens = jnp.concatenate([proposals, jnp.zeros_like(proposals[:, :1])], axis=1)
        new_tokens = jnp.where(
            offsets[None, :] == num_accepted[:, None], next_token[:, None], new_tokens
        )
        count = num_accepted + 1
        if stop_tokens:
            is_stop = jnp.isin(new_tokens, stop_ids) & (offsets[None, :] < count[:, None])
            count = jnp.where(is_stop.any(axis=1), jnp.argmax(is_stop, axis=1) + 1, count)
            stopped = is_stop.any(axis=1)
        else:
            stopped = jnp.zeros_like(done)
        count = jnp.where(done, 0, count)

        # Write the new tokens at each sequence's own offset in the output buffer.
        write = offsets[None, :] < count[:, None]
        columns = jnp.where(write, state.generated[:, None] + offsets[None, :], buffer_len)
        out = state.out.at[jnp.arange(batch_size)[:, None], columns].set(new_tokens, mode="drop")

        # Keep the pending token and the accepted drafts in both caches.
        kept = jnp.where(done, 0, num_accepted + 1)
        generated = state.generated + count
        return _LoopState(
            iteration=state.iteration + 1,
            pending=next_token,
            position=jnp.where(done, position, position + kept),
            target_cache=target_cache.truncate(target_start + kept),
            draft_cache=draft_cache.truncate(draft_start + kept),
            done=done | stopped | (generated >= max_new_tokens),
            generated=generated,
            out=out,
            accepted=state.accepted + jnp.where(done, 0, jnp.minimum(num_accepted, count)),
            drafted=state.drafted + jnp.where(done, 0, num_draft),
        )

    zeros = jnp.zeros((batch_size,), jnp.int32)
    state = jax.lax.while_loop(
        lambda state: ~jnp.all(state.done),
        body,
        _LoopState(
            iteration=jnp.int32(0),
            pending=tokens[:, -1],
            position=prompt_lengths - 1,
            target_cache=target_cache,
            draft_cache=draft_cache,
            done=jnp.zeros((batch_size,), bool),
            generated=zeros,
            out=jnp.full((batch_size, buffer_len), pad_id, jnp.int32),
            accepted=zeros,
            drafted=zeros,
        ),
    )
    lengths = jnp.minimum(state.generated, max_new_tokens)
    columns = jnp.arange(max_new_tokens)[None, :]
    return SpeculativeOutput(
        tokens=jnp.where(columns < lengths[:, None], state.out[:, :max_new_tokens], pad_id),
        lengths=lengths,
        num_iterations=state.iteration,
        accepted=state.accepted,
        drafted=state.drafted,
    )
