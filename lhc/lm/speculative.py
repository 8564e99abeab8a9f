"""Speculative decoding: a drafter proposes, a verifier decides what the target keeps.

Each round a ``Drafter`` proposes ``num_draft`` (gamma) tokens with their draft
distributions q; the target scores the pending token and all drafts in one forward pass;
a ``Verifier`` turns the target logits and q into the length of the accepted prefix and
the token that follows it. The token sampled last (correction or bonus) is "pending": it
is in no cache yet and is the first token fed in the next round. Every cache is then cut
back to the accepted prefix of what it was fed, so sequences of a batch advance by
different amounts.

Drafters:

* ``ModelDrafter(model)``: a second causal LM with its own cache (the classic two-model
  setup). With ``prompt=...`` in ``speculative_generate`` it reads its own prompt (a
  retrieval-augmented drafter reads a shorter one). ``refeed=True`` rolls back by
  re-feeding the accepted tokens to the cache it had before the round, for caches that
  cannot truncate across appends (a recurrent state).
* ``SelfDrafter(model)``: drafts with the target's architecture (its parameters, or
  others such as quantized ones) *in the target's own cache*: the drafted keys are
  written there, the cache is rewound, and the verification pass overwrites them
  (QuantSpec's scheme).

Verifiers:

* ``SpeculativeSampling()``: the rule of Leviathan et al. (2023) and Chen et al. (2023):
  accept d with probability ``min(1, p(d) / q(d))``, at the first rejection draw from
  ``norm(max(0, p - q))``, after all G a bonus token from p. The output is distributed
  exactly as sampling from the target alone; with greedy sampling it equals greedy
  decoding of the target token for token (up to argmax near-ties, where the target's
  multi-token verification pass and its one-token decoding steps may round differently
  in low precision). Subclasses change ``adjust`` (the probabilities the acceptance test
  uses) and ``residual`` (what is drawn after a rejection), as RAPID does.

``speculative_generate`` runs the rounds in one ``lax.while_loop``; p and q are the
models' distributions after the same temperature / top-k / top-p processing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lhc.lm.decoding import GREEDY, prefill_chunks
from lhc.lm.drafters import ModelDrafter, SelfDrafter
from lhc.lm.prompts import left_padded_positions, prepare_prompts, stop_token_array
from lhc.lm.rules import empty_cache, mesh_context, static_rules, with_rules
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


# Verifiers ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpeculativeSampling:
    """The lossless acceptance rule; override ``adjust`` / ``residual`` for variants."""

    def adjust(
        self, target_logits: jax.Array, draft_probs: jax.Array, sampling: SamplingParams
    ) -> tuple[jax.Array, jax.Array]:
        """``(p, p_hat)``, both ``[B, G + 1, V]``: the target's distributions and the ones
        the acceptance test compares with q (here the same)."""
        del draft_probs
        target_probs = logits_to_probs(target_logits, sampling)
        return target_probs, target_probs

    def residual(
        self, target_probs: jax.Array, adjusted: jax.Array, draft_probs: jax.Array
    ) -> jax.Array:
        """Unnormalised ``[B, G, V]``: what is drawn after a rejection at each draft.

        ``max(0, p - q)``; where that is zero everywhere (p <= q only when p == q up to
        rounding) p itself.
        """
        del adjusted
        residual = jnp.maximum(target_probs[:, :-1] - draft_probs, 0.0)
        return jnp.where(residual.sum(-1, keepdims=True) > 0, residual, target_probs[:, :-1])

    def __call__(
        self,
        rng: jax.Array,
        draft_tokens: jax.Array,
        draft_probs: jax.Array,
        target_logits: jax.Array,
        sampling: SamplingParams,
    ) -> tuple[jax.Array, jax.Array]:
        """``(num_accepted [B], next_token [B])`` for drafts ``[B, G]`` (see ``verify``)."""
        target_probs, adjusted = self.adjust(target_logits, draft_probs, sampling)
        return self.verify(rng, draft_tokens, draft_probs, target_probs, adjusted)

    def verify(
        self,
        rng: jax.Array,
        draft_tokens: jax.Array,
        draft_probs: jax.Array,
        target_probs: jax.Array,
        adjusted: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Accepts drafts left to right while ``u * q(d) < p_hat(d)``.

        Args:
            rng: PRNG key.
            draft_tokens: int ``[B, G]``, d_1..d_G, d_i drawn from ``draft_probs[:, i-1]``.
            draft_probs: float ``[B, G, V]``, q_1..q_G.
            target_probs: float ``[B, G + 1, V]``, p_1..p_{G+1} at the same positions,
                plus the one after the last draft.
            adjusted: p_hat ``[B, G + 1, V]`` for the acceptance test (default p).

        Returns:
            ``(num_accepted, next_token)``: int32 ``[B]`` in ``[0, G]``, the length of the
            accepted prefix, and int32 ``[B]``, the token that follows it: drawn from
            ``residual`` at the first rejection, or from p_{G+1} when all were accepted.
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
        adjusted = target_probs if adjusted is None else adjusted
        accept_rng, residual_rng = jax.random.split(rng)
        index = draft_tokens[..., None].astype(jnp.int32)
        p = jnp.take_along_axis(adjusted[:, :num_draft], index, axis=-1)[..., 0]
        q = jnp.take_along_axis(draft_probs, index, axis=-1)[..., 0]
        # u < p / q, written without the division (q > 0 for a token drawn from q).
        accept = jax.random.uniform(accept_rng, (batch, num_draft)) * q < p
        num_accepted = jnp.cumprod(accept.astype(jnp.int32), axis=1).sum(axis=1)
        rows = jnp.arange(batch)
        after_rejection = self.residual(target_probs, adjusted, draft_probs)
        bonus = target_probs[:, -1:]
        choices = jnp.concatenate([after_rejection, bonus], axis=1)[rows, num_accepted]
        next_token = jax.random.categorical(residual_rng, jnp.log(choices), axis=-1)
        return num_accepted.astype(jnp.int32), next_token.astype(jnp.int32)


def verify_drafts(
    rng: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array, target_probs: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The speculative-sampling acceptance rule (``SpeculativeSampling().verify``)."""
    return SpeculativeSampling().verify(rng, draft_tokens, draft_probs, target_probs)


@struct.dataclass
class _LoopState:
    """What one draft-and-verify round reads and writes (``[B]`` arrays unless noted)."""

    iteration: jax.Array  # int32 scalar
    pending: jax.Array  # the sampled token not yet in any cache
    position: jax.Array  # its position
    target_cache: Any
    drafter_state: Any
    done: jax.Array  # bool
    generated: jax.Array  # tokens written to ``out`` so far
    out: jax.Array  # int32 [B, N + G + 1]
    accepted: jax.Array
    drafted: jax.Array


def _draft_prompts(drafter, tokens, lengths, draft_prompts, draft_prompt_lengths, pad_id, vocab):
    """The drafter's prompts (the target's when ``draft_prompts`` is None), checked."""
    if draft_prompts is None:
        return tokens, lengths
    if isinstance(drafter, SelfDrafter):
        raise ValueError("a SelfDrafter shares the target's cache: it reads the target prompt")
    draft_tokens, draft_lengths = prepare_prompts(
        draft_prompts, draft_prompt_lengths, pad_id, vocab
    )
    if draft_tokens.shape[0] != tokens.shape[0] or (draft_tokens[:, -1] != tokens[:, -1]).any():
        raise ValueError(
            "draft_prompts must have one prompt per target prompt, each ending with the "
            f"target prompt's last token; got last tokens {draft_tokens[:, -1].tolist()} "
            f"for {tokens[:, -1].tolist()}"
        )
    return draft_tokens, draft_lengths


def _target_start(target_cache, shape, cache_len: int, max_new_tokens: int) -> np.ndarray:
    """Each sequence's first target position: 0, or the next position of ``target_cache``
    when it has room for ``cache_len`` more slots."""
    batch, width = shape
    if target_cache is None:
        return np.zeros((batch,), np.int32)
    start = np.asarray(target_cache.next_positions(), np.int32)
    if start.shape != (batch,):
        raise ValueError(f"target_cache holds {start.shape[0]} sequences, prompts {batch}")
    used = int(np.max(np.asarray(target_cache.lengths)))
    capacity = target_cache.capacity
    if capacity is not None and used + cache_len > capacity:
        raise ValueError(
            f"target_cache has {capacity - used} free slots; prompt width {width} + "
            f"max_new_tokens {max_new_tokens} + num_draft + 1 needs {cache_len}"
        )
    return start


def _check_max_len(what, max_new_tokens: int) -> None:
    name, model, needed = what
    if needed > model.config.max_len:
        raise ValueError(
            f"prompt width + max_new_tokens {max_new_tokens} + num_draft + 1 = {needed} "
            f"(after the cached context) exceeds the {name} model's max_len "
            f"{model.config.max_len}"
        )


def speculative_generate(
    target: nn.Module,
    target_params: Any,
    draft: nn.Module | ModelDrafter | SelfDrafter,
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
    verifier: SpeculativeSampling | None = None,
    draft_prompts: Sequence[Sequence[int]] | jax.Array | np.ndarray | None = None,
    draft_prompt_lengths: jax.Array | np.ndarray | None = None,
    prefill_chunk: int = 512,
    target_cache: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Sequence[tuple[str, Any]] | None = None,
) -> SpeculativeOutput:
    """Generates up to ``max_new_tokens`` per prompt with draft-then-verify rounds.

    Args:
        target: the causal LM whose distribution the output follows.
        target_params: its parameters.
        draft: a drafter (``ModelDrafter``, ``SelfDrafter`` or one of your own), or a
            causal LM, which becomes ``ModelDrafter(draft)``.
        draft_params: the drafter's parameters.
        prompts: B token lists, or a left-padded int ``[B, P]`` array.
        prompt_lengths: int ``[B]`` real lengths of a padded array (default: all ``P``).
        max_new_tokens: N.
        num_draft: gamma, draft tokens per round (>= 1).
        sampling: temperature / top-k / top-p, applied to both models (greedy default).
        rng: PRNG key, required unless greedy.
        stop_tokens: ids that end a sequence (the stop token is emitted and counted).
        pad_id: id written after a sequence stopped and used for prompt padding.
        verifier: the acceptance rule (``SpeculativeSampling()`` by default).
        draft_prompts: the drafter's own prompts (default: ``prompts``), e.g. a
            retrieved context; each must end with the same token as its target prompt
            (the first pending token).
        draft_prompt_lengths: real lengths of a padded ``draft_prompts`` array.
        prefill_chunk: prompt tokens per prefill chunk.
        target_cache: continue from this target cache (e.g. a long shared context
            prefilled once with ``lhc.lm.prefill``): the prompts are appended at each
            sequence's next position. It is not modified. The drafter starts from its
            own prompts alone.
        mesh: run under this mesh (parameters may be sharded); activations and caches
            are constrained with ``rules`` (``lhc.parallel.LOGICAL_AXIS_RULES`` by default).
        rules: logical-axis rules for a mesh.

    Returns:
        A ``SpeculativeOutput``.

    Raises:
        ValueError: malformed prompts, vocabularies that differ, ``num_draft < 1``, a
            prompt plus ``N + num_draft + 1`` beyond either model's ``max_len``, a
            missing ``rng`` for sampling, draft prompts that end on another token.
    """
    drafter = draft if isinstance(draft, (ModelDrafter, SelfDrafter)) else ModelDrafter(draft)
    if not hasattr(drafter, "propose"):
        raise ValueError(f"draft must be a causal LM or a drafter, got {type(draft).__name__}")
    vocab = target.config.vocab_size
    if drafter.config.vocab_size != vocab:
        raise ValueError(
            f"draft vocab_size {drafter.config.vocab_size} differs from the target's {vocab}"
        )
    tokens, lengths = prepare_prompts(prompts, prompt_lengths, pad_id, vocab)
    draft_tokens, draft_lengths = _draft_prompts(
        drafter, tokens, lengths, draft_prompts, draft_prompt_lengths, pad_id, vocab
    )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    # A round may append num_draft + 1 slots and keep fewer; a sequence may overshoot N
    # by up to num_draft tokens before it stops.
    extra = max_new_tokens + num_draft + 1
    cache_len, draft_cache_len = tokens.shape[1] + extra, draft_tokens.shape[1] + extra
    start = _target_start(target_cache, tokens.shape, cache_len, max_new_tokens)
    _check_max_len(("target", target, int(start.max(initial=0)) + cache_len), max_new_tokens)
    _check_max_len(("draft", drafter, draft_cache_len), max_new_tokens)
    if not sampling.greedy and rng is None:
        raise ValueError("rng is required when sampling (temperature > 0)")
    rng = jax.random.key(0) if rng is None else rng
    run = functools.partial(
        _speculative_jit,
        target,
        drafter,
        verifier if verifier is not None else SpeculativeSampling(),
        max_new_tokens=int(max_new_tokens),
        num_draft=int(num_draft),
        # Static: the loop compiles only the processing it uses (greedy needs no sorts).
        sampling=SamplingParams(
            float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)
        ),
        cache_len=int(cache_len),
        draft_cache_len=int(draft_cache_len),
        prefill_chunk=int(prefill_chunk),
        rules=static_rules(mesh, rules),
    )
    with mesh_context(mesh):
        return run(
            target_params,
            draft_params,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            jnp.asarray(draft_tokens),
            jnp.asarray(draft_lengths),
            rng,
            jnp.asarray(stop_token_array(stop_tokens, vocab)),
            jnp.int32(pad_id),
            target_cache,
            jnp.asarray(start),
        )


def _speculative_loop(
    target,
    drafter,
    verifier,
    target_params,
    draft_params,
    tokens,
    prompt_lengths,
    draft_tokens,
    draft_lengths,
    rng,
    stop_ids,
    pad_id,
    target_cache,
    start,
    *,
    max_new_tokens,
    num_draft,
    sampling,
    cache_len,
    draft_cache_len,
    prefill_chunk,
):
    # One function of ~140 lines: the round (draft, verify, commit, stop) is closures over
    # the prefilled caches inside one lax.while_loop; split, they would pass a dozen arrays.
    batch_size, width = tokens.shape
    apply_target = functools.partial(target.apply, {"params": target_params})
    if target_cache is None:
        target_cache = empty_cache(target, batch_size, cache_len)
    # Prefill everything but the last prompt token, which becomes the pending token.
    if width > 1:
        positions = left_padded_positions(prompt_lengths, width, start)[:, :-1]
        _, target_cache = prefill_chunks(
            target,
            target_params,
            tokens[:, :-1],
            positions,
            target_cache,
            chunk_size=prefill_chunk,
        )
    draft_width = draft_tokens.shape[1]
    draft_positions = left_padded_positions(draft_lengths, draft_width)[:, :-1]
    drafter_state = drafter.prefill(
        draft_params,
        draft_tokens[:, :-1],
        draft_positions,
        target_cache,
        cache_len=draft_cache_len,
        prefill_chunk=prefill_chunk,
    )
    offsets = jnp.arange(num_draft + 1, dtype=jnp.int32)
    buffer_len = max_new_tokens + num_draft + 1
    # The drafter feeds its pending token at its own position (its prompt may differ),
    # one that drafts in the target's cache at the target's (after a ``target_cache`` too).
    if getattr(drafter, "in_target_cache", False):
        draft_shift = jnp.zeros_like(prompt_lengths)
    else:
        draft_shift = draft_lengths - (start + prompt_lengths)

    def body(state: _LoopState) -> _LoopState:
        pending, position, done = state.pending, state.position, state.done
        keys = jax.random.split(jax.random.fold_in(rng, state.iteration), num_draft + 1)
        draft_position = jnp.where(done, -1, position + draft_shift)
        target_start = state.target_cache.lengths

        proposal = drafter.propose(
            draft_params,
            state.drafter_state,
            state.target_cache,
            pending,
            draft_position,
            keys[:num_draft],
            sampling,
        )
        proposals = proposal.tokens

        # Target: score the pending token and all drafts at once.
        block = jnp.concatenate([pending[:, None], proposals], axis=1)
        block_positions = jnp.where(done[:, None], -1, position[:, None] + offsets[None, :])
        target_logits, target_cache = apply_target(block, block_positions, proposal.target_cache)
        num_accepted, next_token = verifier(
            keys[-1], proposals, proposal.probs, target_logits, sampling
        )
        new_tokens = jnp.concatenate([proposals, jnp.zeros_like(proposals[:, :1])], axis=1)
        new_tokens = jnp.where(
            offsets[None, :] == num_accepted[:, None], next_token[:, None], new_tokens
        )
        count = num_accepted + 1
        is_stop = jnp.isin(new_tokens, stop_ids) & (offsets[None, :] < count[:, None])
        stopped = is_stop.any(axis=1)
        count = jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, count)
        count = jnp.where(done, 0, count)

        # Write the new tokens at each sequence's own offset in the output buffer.
        write = offsets[None, :] < count[:, None]
        columns = jnp.where(write, state.generated[:, None] + offsets[None, :], buffer_len)
        out = state.out.at[jnp.arange(batch_size)[:, None], columns].set(new_tokens, mode="drop")

        # Keep the pending token and the accepted drafts in every cache.
        kept = jnp.where(done, 0, num_accepted + 1)
        draft_block_positions = jnp.where(
            done[:, None], -1, draft_position[:, None] + offsets[None, :]
        )
        drafter_state = drafter.commit(
            draft_params, proposal.state, block, draft_block_positions, kept
        )
        generated = state.generated + count
        return _LoopState(
            iteration=state.iteration + 1,
            pending=next_token,
            position=jnp.where(done, position, position + kept),
            target_cache=target_cache.truncate(target_start + kept),
            drafter_state=drafter_state,
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
            position=start + prompt_lengths - 1,
            target_cache=target_cache,
            drafter_state=drafter_state,
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


_speculative_jit = jax.jit(
    with_rules(_speculative_loop),
    static_argnums=(0, 1, 2),
    static_argnames=(
        "max_new_tokens",
        "num_draft",
        "sampling",
        "cache_len",
        "draft_cache_len",
        "prefill_chunk",
        "rules",
    ),
)
