"""Scores of several candidate answers after one prompt, the prompt run once.

``score_answers`` prefills each prompt into a cache once (``lhc.lm.decoding.prefill_chunks``),
copies the cache once per candidate answer (every leaf repeated along the axis its
``logical_axes`` names ``cache_batch``), and appends all the answers, but their last token,
to the copies in one batched call. The prefill's last logits give every answer's first
token; the answer call gives the rest. Scoring ``K`` answers so costs one prompt pass
instead of ``K`` (``lhc.icl.scoring.continuation_logprobs`` runs every
``prompt + answer`` in full, which is what the tests compare against).

What comes back per prompt and answer (``AnswerScores``): the log-probability of the
first token, of the whole answer (the sum over its tokens, teacher-forced), the first
token's rank in the next-token distribution, and whether every token of the answer is
the most probable at its step (the answer is what greedy decoding produces).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lhc.lm.cache import repeat_rows
from lhc.lm.decoding import DEFAULT_PREFILL_CHUNK, prefill_chunks
from lhc.lm.prompts import bucket_length, left_pad, left_padded_positions
from lhc.lm.rules import empty_cache

ANSWER_BUCKET = 4


@dataclasses.dataclass(frozen=True)
class AnswerScores:
    """Scores of K answers of each of P prompts.

    Attributes:
        first_logprobs: float64 ``[P, K]``, log p(the answer's first token | prompt).
        logprobs: float64 ``[P, K]``, log p(answer | prompt), summed over its tokens.
        first_ranks: int ``[P, K]``, how many tokens of the vocabulary are more probable
            than the answer's first token (0: it is the most probable next token).
        greedy: bool ``[P, K]``, every token of the answer is the most probable at its
            step (greedy decoding would write the answer).
    """

    first_logprobs: np.ndarray
    logprobs: np.ndarray
    first_ranks: np.ndarray
    greedy: np.ndarray

    @property
    def first_probabilities(self) -> np.ndarray:
        """``[P, K]``: p(first token | prompt)."""
        return np.exp(self.first_logprobs)

    @property
    def probabilities(self) -> np.ndarray:
        """``[P, K]``: p(answer | prompt)."""
        return np.exp(self.logprobs)


@functools.partial(jax.jit, static_argnums=0, static_argnames="chunk_size")
def _token_scores(model, params, prompts, prompt_lengths, answers, answer_lengths, *, chunk_size):
    """``(log p, rank)`` of every answer token, float32 and int32 ``[B * K, A]``.

    ``prompts``: int32 ``[B, W]`` left-padded; ``answers``: int32 ``[B * K, A]``
    right-padded, the K answers of prompt ``b`` in rows ``b * K ..``.
    """
    batch, width = prompts.shape
    rows, answer_width = answers.shape
    per_prompt = rows // batch
    cache = empty_cache(model, batch, width + answer_width - 1)
    positions = left_padded_positions(prompt_lengths, width)
    last, cache = prefill_chunks(model, params, prompts, positions, cache, chunk_size=chunk_size)
    logp = [jnp.repeat(jax.nn.log_softmax(last.astype(jnp.float32), -1), per_prompt, 0)[:, None]]
    if answer_width > 1:
        # Answer token j + 1 is scored by the logits at answer token j.
        steps = jnp.arange(answer_width - 1, dtype=jnp.int32)[None, :]
        starts = jnp.repeat(prompt_lengths, per_prompt)[:, None]
        answer_positions = jnp.where(steps < answer_lengths[:, None] - 1, starts + steps, -1)
        logits, _ = model.apply(
            {"params": params},
            answers[:, :-1],
            answer_positions,
            repeat_rows(cache, per_prompt),
        )
        logp.append(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
    logp = jnp.concatenate(logp, axis=1)
    token_logp = jnp.take_along_axis(logp, answers[..., None], axis=-1)
    ranks = jnp.sum(logp > token_logp, axis=-1, dtype=jnp.int32)
    return token_logp[..., 0], ranks


def _check(prompts, answers, max_len: int) -> int:
    if len(prompts) != len(answers):
        raise ValueError(
            f"answers: expected one list per prompt ({len(prompts)}), got {len(answers)}"
        )
    counts = {len(group) for group in answers}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            f"answers: expected the same number (>= 1) of answers for every prompt, "
            f"got {sorted(counts)}"
        )
    for i, (prompt, group) in enumerate(zip(prompts, answers)):
        if not len(prompt) or not all(len(a) for a in group):
            raise ValueError(f"prompt {i}: expected a non-empty prompt and non-empty answers")
        longest = len(prompt) + max(len(a) for a in group)
        if longest > max_len:
            raise ValueError(
                f"prompt {i}: expected prompt + answer within the model's max_len {max_len}, "
                f"got {longest} tokens"
            )
    return counts.pop()


def score_answers(
    model,
    params,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[Sequence[int]]],
    *,
    batch_size: int = 8,
    width: int | None = None,
    answer_width: int | None = None,
    chunk_size: int = DEFAULT_PREFILL_CHUNK,
) -> AnswerScores:
    """Scores the K candidate answers of every prompt, the prompt prefilled once.

    Args:
        model: a causal LM of the protocol of ``lhc.lm`` (``config.max_len``).
        params: its parameters.
        prompts: P token lists.
        answers: per prompt, K token lists (the same K for every prompt).
        batch_size: prompts per call (``batch_size * K`` cache copies).
        width: the padded prompt width of every call (default: the longest prompt,
            rounded up by ``lhc.lm.bucket_length``); one width for many calls compiles once.
        answer_width: the padded answer width (default: the longest answer rounded up to
            a multiple of ``ANSWER_BUCKET``), likewise.
        chunk_size: prefill chunk.

    Returns:
        ``AnswerScores`` of shape ``[P, K]``.

    Raises:
        ValueError: answers not paired with prompts, different K, empty prompts or
            answers, a prompt and answer beyond the model's ``max_len``, a ``width``
            (``answer_width``) shorter than a prompt (an answer), or a ``batch_size``
            below 1.
    """
    max_len = model.config.max_len
    per_prompt = _check(prompts, answers, max_len)
    if batch_size < 1:
        raise ValueError(f"batch_size: expected an integer >= 1, got {batch_size}")
    longest = max(len(p) for p in prompts)
    longest_answer = max(len(a) for group in answers for a in group)
    for name, given, least in (
        ("width", width, longest),
        ("answer_width", answer_width, longest_answer),
    ):
        if given is not None and given < least:
            raise ValueError(f"{name}: expected at least the longest ({least}), got {given}")
    width = bucket_length(longest) if width is None else int(width)
    if answer_width is None:
        answer_width = -(-longest_answer // ANSWER_BUCKET) * ANSWER_BUCKET
    if width + answer_width - 1 > max_len:  # no room to round up: the exact sizes
        width, answer_width = longest, longest_answer
    if width + answer_width - 1 > max_len:
        raise ValueError(
            f"prompts: expected the longest prompt ({longest} tokens) and the longest answer "
            f"({longest_answer}) to fit the model's max_len {max_len} together"
        )
    count = len(prompts)
    token_logp = np.zeros((count, per_prompt, answer_width), np.float64)
    ranks = np.zeros((count, per_prompt, answer_width), np.int64)
    for start in range(0, count, batch_size):
        # The last call is filled up with copies of its first prompt: one shape, one program.
        rows = [i if i < count else start for i in range(start, start + batch_size)]
        tokens, lengths = left_pad([prompts[i] for i in rows], width=width)
        flat = [list(a) for i in rows for a in answers[i]]
        answer_tokens = np.zeros((len(flat), answer_width), np.int32)
        for r, answer in enumerate(flat):
            answer_tokens[r, : len(answer)] = answer
        answer_lengths = np.array([len(a) for a in flat], np.int32)
        logp, rank = _token_scores(
            model,
            params,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            jnp.asarray(answer_tokens),
            jnp.asarray(answer_lengths),
            chunk_size=chunk_size,
        )
        kept = min(batch_size, count - start)
        shape = (batch_size, per_prompt, answer_width)
        token_logp[start : start + kept] = np.asarray(logp).reshape(shape)[:kept]
        ranks[start : start + kept] = np.asarray(rank).reshape(shape)[:kept]
    lengths = np.array([[len(a) for a in group] for group in answers])
    inside = np.arange(answer_width) < lengths[..., None]
    return AnswerScores(
        first_logprobs=token_logp[..., 0],
        logprobs=np.where(inside, token_logp, 0).sum(-1),
        first_ranks=ranks[..., 0],
        greedy=np.where(inside, ranks == 0, True).all(-1),
    )
