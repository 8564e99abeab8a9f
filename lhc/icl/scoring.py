"""Teacher-forced scores of continuations, optionally under a patch at the prompt's last
token: the measurement of task superposition and of task vectors.

``continuation_logprobs`` scores ``prompt + continuation`` pairs in padded batches: the
log-probability of a continuation is the sum over its tokens of log p(token | prompt,
the continuation's earlier tokens), from one forward pass per batch. A ``Patch`` edits
the residual stream (or attention output) at the last prompt token of every row, at
chosen layers: how task vectors are put into a zero-shot query.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lhc.icl.activations import edit_at

WIDTH_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Patch:
    """Vectors put at the last prompt token.

    Attributes:
        layers: the layers edited.
        values: float ``[len(layers), D]`` (the same vector in every row) or
            ``[len(layers), N, D]`` (one per prompt of the call).
        site: ``"residual"`` (after the block) or ``"attention"``.
        mode: ``"replace"`` or ``"add"``.
    """

    layers: tuple[int, ...]
    values: np.ndarray
    site: str = "residual"
    mode: str = "replace"


def padded_width(longest: int, max_len: int) -> int:
    """``longest`` rounded up to a multiple of ``WIDTH_BUCKET``, at most ``max_len``, so
    that few widths compile."""
    return min(-(-longest // WIDTH_BUCKET) * WIDTH_BUCKET, max_len)


def pad_rows(sequences: Sequence[Sequence[int]], max_len: int) -> np.ndarray:
    """int32 ``[B, W]``: the sequences right-padded with 0 to ``padded_width``."""
    width = padded_width(max(len(s) for s in sequences), max_len)
    tokens = np.zeros((len(sequences), width), np.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    return tokens


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(model, params, tokens, intervention):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    extra = {} if intervention is None else {"intervention": intervention}
    logits, _ = model.apply({"params": params}, tokens, positions, **extra)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def _check_pairs(prompts, continuations, max_len):
    if len(prompts) != len(continuations):
        raise ValueError(
            f"prompts and continuations must pair up: {len(prompts)} prompts, "
            f"{len(continuations)} continuations"
        )
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        if not len(p) or not len(c):
            raise ValueError(f"pair {i}: the prompt and the continuation must not be empty")
        if len(p) + len(c) > max_len:
            raise ValueError(
                f"pair {i}: prompt + continuation is {len(p) + len(c)} tokens, beyond the "
                f"model's max_len {max_len}"
            )


def continuation_logprobs(
    model,
    params,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    patch: Patch | None = None,
    batch_size: int = 32,
) -> np.ndarray:
    """log p(continuation | prompt) of each pair, teacher-forced.

    Args:
        model: an ``lhc.lm.Transformer`` (or a model called like one, with ``config``).
        params: its parameters.
        prompts: token ids per pair.
        continuations: token ids per pair (scored one after another).
        patch: an edit at every prompt's last token (``Patch``), or ``None``.
        batch_size: rows per forward pass.

    Returns:
        float64 ``[N]``: the summed log-probabilities.

    Raises:
        ValueError: unpaired lists, an empty prompt or continuation, a pair longer than
            the model's ``max_len``, or a patch of another shape.
    """
    config = model.config
    _check_pairs(prompts, continuations, config.max_len)
    count = len(prompts)
    if patch is not None:
        values = np.asarray(patch.values)
        if values.ndim == 3 and values.shape[1] != count:
            raise ValueError(f"patch.values holds {values.shape[1]} rows, for {count} prompts")
    out = np.zeros(count)
    for start in range(0, count, batch_size):
        rows = range(start, min(start + batch_size, count))
        tokens = pad_rows([list(prompts[i]) + list(continuations[i]) for i in rows], config.max_len)
        width = tokens.shape[1]
        intervention = None
        if patch is not None:
            last = np.array([[len(prompts[i]) - 1] for i in rows])
            values = np.asarray(patch.values)
            values = values[:, start : start + len(rows), None] if values.ndim == 3 else values
            intervention = edit_at(
                config.num_layers,
                width,
                last,
                values,
                layers=patch.layers,
                per_layer=True,
                site=patch.site,
                mode=patch.mode,
            )
        logp = np.asarray(_token_logprobs(model, params, jnp.asarray(tokens), intervention))
        for r, i in enumerate(rows):
            first = len(prompts[i]) - 1  # logp[:, t] scores token t + 1
            out[i] = logp[r, first : first + len(continuations[i])].astype(np.float64).sum()
    return out


def answer_probabilities(
    model,
    params,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[Sequence[int]]],
    *,
    patch: Patch | None = None,
    batch_size: int = 32,
) -> np.ndarray:
    """P(answer) of every candidate answer of every prompt: the product of its tokens'
    teacher-forced probabilities.

    Args:
        prompts: token ids per prompt.
        answers: per prompt, the token ids of each of its K candidate answers (the same
            K for every prompt).
        patch: as for ``continuation_logprobs``, with ``[len(layers), P, D]`` values
            holding one vector per prompt.

    Returns:
        float64 ``[P, K]``. ``1 - sum`` over K is the probability of anything else.
    """
    counts = {len(a) for a in answers}
    if len(counts) > 1:
        raise ValueError(f"every prompt needs the same number of answers, got {sorted(counts)}")
    if len(answers) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but answers for {len(answers)}")
    k = counts.pop() if counts else 0
    flat_prompts = [p for p in prompts for _ in range(k)]
    flat_answers = [a for group in answers for a in group]
    if patch is not None and np.asarray(patch.values).ndim == 3:
        patch = dataclasses.replace(patch, values=np.repeat(np.asarray(patch.values), k, axis=1))
    logp = continuation_logprobs(
        model, params, flat_prompts, flat_answers, patch=patch, batch_size=batch_size
    )
    return np.exp(logp).reshape(len(prompts), k)


def with_other(probabilities: np.ndarray) -> np.ndarray:
    """``[..., K + 1]``: the K answers' probabilities and "other" = 1 - their sum
    (clipped at 0 against rounding)."""
    probabilities = np.asarray(probabilities, np.float64)
    other = np.clip(1 - probabilities.sum(-1, keepdims=True), 0, None)
    return np.concatenate([probabilities, other], axis=-1)


def kl_to_proportions(probabilities: np.ndarray, proportions, eps: float = 1e-12) -> np.ndarray:
    """KL(d || p) from the in-context proportions ``d`` (over the K tasks, none on
    "other") to the model's answer distribution ``p`` (the K answers and "other").

    Args:
        probabilities: ``[..., K]`` answer probabilities.
        proportions: ``[K]``, non-negative, summing to 1.

    Returns:
        ``[...]``: sum over tasks with d > 0 of d log(d / p) (p floored at ``eps``).
    """
    d = np.asarray(proportions, np.float64)
    if d.ndim != 1 or d.shape[0] != np.shape(probabilities)[-1]:
        raise ValueError(
            f"proportions must be [K={np.shape(probabilities)[-1]}], got shape {d.shape}"
        )
    if (d < 0).any() or abs(d.sum() - 1) > 1e-6:
        raise ValueError(f"proportions must be non-negative and sum to 1, got {d.tolist()}")
    p = with_other(probabilities)[..., :-1]
    terms = np.where(d > 0, d * (np.log(np.where(d > 0, d, 1)) - np.log(np.maximum(p, eps))), 0)
    return terms.sum(-1)
