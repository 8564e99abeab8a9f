"""RAPID decoding: a drafter on the retrieval-augmented prompt, the target on the whole
context, one speculative loop.

Both models keep their own cache (``lhc.lm.ModelDrafter``: the drafter's is as long as
its RAG prompt, the target's as long as the context), both append the kept tokens and
are cut back after a rejection; the verifier is ``RapidSampling``. The drafter is the
target itself (self-speculation, the default) or another model with the same vocabulary,
such as a larger one (upward speculation: it reads only the short prompt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from lhc.lm.decoding import GREEDY, generate, prefilled_cache
from lhc.lm.sampling import SamplingParams
from lhc.lm.speculative import ModelDrafter, SpeculativeOutput, speculative_generate
from lhc.rapid.config import RetrievalConfig
from lhc.rapid.retrieval import DEFAULT_RETRIEVAL, RagPrompt, Tokens, rag_prompt, token_terms
from lhc.rapid.transfer import RapidSampling


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The two prompts of each example.

    Attributes:
        contexts: the target's prompts up to the question: prefix, context, separator
            (what ``prefill_contexts`` caches).
        questions: the questions.
        rag: the drafter's ``RagPrompt`` per example.
    """

    contexts: list[np.ndarray]
    questions: list[np.ndarray]
    rag: list[RagPrompt]

    @property
    def full(self) -> list[np.ndarray]:
        """The target's whole prompts: context then question."""
        return [np.concatenate([c, q]) for c, q in zip(self.contexts, self.questions)]

    @property
    def rag_tokens(self) -> list[np.ndarray]:
        return [r.tokens for r in self.rag]


def build_prompts(
    contexts: Sequence[Tokens],
    questions: Sequence[Tokens],
    retrieval: RetrievalConfig = DEFAULT_RETRIEVAL,
    *,
    terms: Callable[[Tokens], list[str]] = token_terms,
    embed: Callable[[Sequence[Tokens]], np.ndarray] | None = None,
    prefix: Tokens = (),
    separator: Tokens = (),
) -> Prompts:
    """The full and the RAG prompt of every (context, question) pair (see ``rag_prompt``).

    Raises:
        ValueError: different numbers of contexts and questions, no examples, or any
            error of ``rag_prompt`` (empty context, a question longer than the budget).
    """
    if len(contexts) != len(questions) or not len(contexts):
        raise ValueError(
            f"expected as many contexts as questions (at least one), got {len(contexts)} "
            f"and {len(questions)}"
        )
    heads, tails, rag = [], [], []
    for context, question in zip(contexts, questions):
        rag.append(
            rag_prompt(
                context,
                question,
                retrieval,
                terms=terms,
                embed=embed,
                prefix=prefix,
                separator=separator,
            )
        )
        parts = [np.asarray(x, np.int32).reshape(-1) for x in (prefix, context, separator)]
        heads.append(np.concatenate(parts))
        tails.append(np.asarray(question, np.int32).reshape(-1))
    return Prompts(heads, tails, rag)


def prefill_contexts(model, params, prompts: Prompts, *, extra: int, prefill_chunk: int = 512):
    """A cache of ``model`` holding every example's context (left-padded), with room for
    ``extra`` more tokens per sequence: pass it as ``target_cache`` / ``cache`` to decode
    several times after one prefill of the long context."""
    return prefilled_cache(
        model, params, prompts.contexts, extra=extra, prefill_chunk=prefill_chunk
    )


def rapid_generate(
    target: Any,
    target_params: Any,
    prompts: Prompts,
    *,
    max_new_tokens: int,
    drafter: Any = None,
    draft_params: Any = None,
    eta: float = 10.0,
    alpha: float = 0.1,
    gamma: int = 10,
    sampling: SamplingParams = GREEDY,
    rng: jax.Array | None = None,
    stop_tokens: Sequence[int] = (),
    pad_id: int = 0,
    prefill_chunk: int = 512,
    target_cache: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Sequence[tuple[str, Any]] | None = None,
) -> SpeculativeOutput:
    """RAPID: drafts from ``prompts.rag``, verified by the target on ``prompts.full``.

    Args:
        target: the long-context causal LM.
        target_params: its parameters.
        prompts: from ``build_prompts``.
        max_new_tokens: N.
        drafter: the draft causal LM (default: the target, self-speculation); any model
            of the same vocabulary (a larger one for upward speculation).
        draft_params: its parameters (default: the target's when the drafter is the target).
        eta, alpha: the knowledge transfer's step and tail protection (``RapidSampling``).
        gamma: draft tokens per round.
        sampling, rng, stop_tokens, pad_id, prefill_chunk, mesh, rules: as in
            ``lhc.lm.speculative_generate``.
        target_cache: the target's cache already holding the contexts
            (``prefill_contexts``); then only the questions are appended to it.

    Returns:
        A ``lhc.lm.SpeculativeOutput``.

    Raises:
        ValueError: a drafter with another vocabulary, a drafter without parameters, and
            everything ``speculative_generate`` refuses.
    """
    if drafter is None:
        drafter, draft_params = target, target_params if draft_params is None else draft_params
    elif draft_params is None:
        raise ValueError("draft_params is required when a drafter is given")
    return speculative_generate(
        target,
        target_params,
        ModelDrafter(drafter),
        draft_params,
        prompts.full if target_cache is None else prompts.questions,
        max_new_tokens=max_new_tokens,
        num_draft=gamma,
        sampling=sampling,
        rng=rng,
        stop_tokens=stop_tokens,
        pad_id=pad_id,
        verifier=RapidSampling(eta=float(eta), alpha=float(alpha)),
        draft_prompts=prompts.rag_tokens,
        prefill_chunk=prefill_chunk,
        target_cache=target_cache,
        mesh=mesh,
        rules=rules,
    )


def target_generate(target, target_params, prompts: Prompts, *, cache=None, **kwargs):
    """The long-context baseline: ``lhc.lm.generate`` of the target on the full prompts,
    or on the questions after a ``cache`` of the contexts (``prefill_contexts``; donated)."""
    if cache is None:
        return generate(target, target_params, prompts.full, **kwargs)
    return generate(target, target_params, prompts.questions, cache=cache, **kwargs)


def rag_generate(model, params, prompts: Prompts, **kwargs):
    """The RAG baseline: ``lhc.lm.generate`` of a model on the RAG prompts."""
    return generate(model, params, prompts.rag_tokens, **kwargs)
