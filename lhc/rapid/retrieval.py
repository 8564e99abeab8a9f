"""RAPID's retrieval: the long context cut into chunks, the chunks most like the question
kept within a token budget, in document order, followed by the question.

The paper's drafter reads ``max(min_budget, |C| / ratio)`` tokens of retrieved context
(4,096 and λ = 24 in the paper, 32 in the official LongBench script), chunks of 512
tokens (128 in the script) scored by cosine similarity of normalised embeddings, those
under a similarity threshold dropped (0.3 in the official README, 0.1 in the script).
Here scores come from BM25 over each chunk's terms (``bm25s``) or from any embedding
function (``pooled_hidden_states`` makes one from an lhc model).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lhc.extras import require
from lhc.rapid.config import RetrievalConfig

Tokens = Sequence[int] | np.ndarray


DEFAULT_RETRIEVAL = RetrievalConfig()


@dataclasses.dataclass(frozen=True)
class RagPrompt:
    """A retrieval-augmented prompt.

    Attributes:
        tokens: int32 ``[P]``: prefix, the retrieved chunks in document order (joined by
            the separator), separator, the question.
        chunks: indices of the retrieved chunks, ascending.
        scores: the score of every chunk.
        budget: the token budget the chunks were chosen within.
    """

    tokens: np.ndarray
    chunks: np.ndarray
    scores: np.ndarray
    budget: int


def retrieval_budget(context_len: int, *, min_budget: int = 4096, ratio: float = 24.0) -> int:
    """``max(min_budget, ceil(context_len / ratio))``: tokens of retrieved context."""
    return max(int(min_budget), math.ceil(context_len / ratio))


def chunk_tokens(
    tokens: Tokens, chunk_size: int, boundaries: Sequence[int] = ()
) -> list[np.ndarray]:
    """Consecutive chunks of at most ``chunk_size`` tokens that cover ``tokens``; with
    ``boundaries``, each ends after the last boundary token in its window (if any).

    Raises:
        ValueError: an empty context, or ``chunk_size < 1``.
    """
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(
            f"context must be a non-empty 1-D token sequence, got shape {tokens.shape}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not len(boundaries):
        return [tokens[i : i + chunk_size] for i in range(0, tokens.size, chunk_size)]
    is_boundary = np.isin(tokens, np.asarray(boundaries, np.int32))
    chunks, start = [], 0
    while start < tokens.size:
        end = min(start + chunk_size, tokens.size)
        if end < tokens.size:
            found = np.flatnonzero(is_boundary[start:end])
            end = start + int(found[-1]) + 1 if found.size else end
        chunks.append(tokens[start:end])
        start = end
    return chunks


def token_terms(tokens: Tokens) -> list[str]:
    """A chunk's BM25 terms when no tokenizer is given: its token ids."""
    return [str(int(t)) for t in np.asarray(tokens).reshape(-1)]


def word_terms(decode: Callable[[list[int]], str]) -> Callable[[Tokens], list[str]]:
    """Terms as English words: ``decode`` the tokens to text, then lower-cased words of two
    or more characters without English stop words (``bm25s.tokenize``)."""
    bm25s = require("bm25s", "rapid")

    def terms(tokens: Tokens) -> list[str]:
        text = decode([int(t) for t in np.asarray(tokens).reshape(-1)])
        return bm25s.tokenize([text], return_ids=False, show_progress=False)[0]

    return terms


def bm25_scores(
    chunk_terms: Sequence[Sequence[str]],
    query_terms: Sequence[str],
    *,
    k1: float = 1.5,
    b: float = 0.75,
) -> np.ndarray:
    """BM25 (Lucene's variant, ``bm25s``) score of every chunk for the query, ``[n]``."""
    bm25s = require("bm25s", "rapid")

    logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every index it builds
    index = bm25s.BM25(k1=k1, b=b, method="lucene")
    index.index([list(t) for t in chunk_terms], show_progress=False)
    known = [t for t in query_terms if t in index.vocab_dict]
    if not known:
        return np.zeros(len(chunk_terms), np.float32)
    return np.asarray(index.get_scores(known), np.float32)


def cosine_scores(chunk_embeddings: np.ndarray, query_embedding: np.ndarray) -> np.ndarray:
    """Inner products of the normalised embeddings ``[n, D]`` and ``[D]``, ``[n]``."""
    chunks = np.asarray(chunk_embeddings, np.float32)
    query = np.asarray(query_embedding, np.float32).reshape(-1)
    if chunks.ndim != 2 or chunks.shape[1] != query.shape[0]:
        raise ValueError(
            f"embeddings: expected chunks [n, D] and a query [D], got {chunks.shape} and "
            f"{query.shape}"
        )
    chunks = chunks / np.maximum(np.linalg.norm(chunks, axis=1, keepdims=True), 1e-12)
    query = query / max(float(np.linalg.norm(query)), 1e-12)
    return chunks @ query


def select_chunks(
    scores: np.ndarray, lengths: Sequence[int], budget: int, threshold: float
) -> np.ndarray:
    """Indices of the chunks to keep, ascending (document order).

    Chunks are taken from the best score down, skipping any that would overflow the
    budget, never one scoring below ``threshold``; ties go to the earlier chunk.
    """
    scores = np.asarray(scores, np.float64)
    order = np.lexsort((np.arange(scores.size), -scores))
    kept, used = [], 0
    for index in order:
        if scores[index] < threshold:
            break
        if used + lengths[index] <= budget:
            kept.append(index)
            used += lengths[index]
    return np.sort(np.asarray(kept, np.int64))


def pooled_hidden_states(
    model, params, *, module_name: str = "final_norm", batch_size: int = 16
) -> Callable[[Sequence[Tokens]], np.ndarray]:
    """An embedding function from an lhc causal LM: the mean over a sequence's tokens of
    the output of the submodule ``module_name`` (the Transformer's final norm).

    Returns ``embed(sequences) -> float32 [n, D]``; sequences are right-padded (padding
    has position -1 and is left out of the mean) and run ``batch_size`` at a time.
    """

    def embed(sequences: Sequence[Tokens]) -> np.ndarray:
        sequences = [np.asarray(s, np.int32).reshape(-1) for s in sequences]
        width = max(s.size for s in sequences)
        out = []
        for start in range(0, len(sequences), batch_size):
            group = sequences[start : start + batch_size]
            tokens = np.zeros((batch_size, width), np.int32)
            positions = np.full((batch_size, width), -1, np.int32)
            for row, sequence in enumerate(group):
                tokens[row, : sequence.size] = sequence
                positions[row, : sequence.size] = np.arange(sequence.size)
            pooled = _pool(model, module_name, params, jnp.asarray(tokens), jnp.asarray(positions))
            out.append(np.asarray(pooled)[: len(group)])
        return np.concatenate(out)

    return embed


@functools.partial(jax.jit, static_argnums=(0, 1))
def _pool(model, module_name, params, tokens, positions):
    _, state = model.apply(
        {"params": params},
        tokens,
        positions,
        capture_intermediates=lambda module, method: module.name == module_name,
        mutable=["intermediates"],
    )
    found = state["intermediates"].get(module_name)
    if found is None:
        raise ValueError(f"pooled_hidden_states: the model has no submodule {module_name!r}")
    hidden = found["__call__"][0].astype(jnp.float32)
    valid = (positions >= 0)[..., None]
    return (hidden * valid).sum(1) / jnp.maximum(valid.sum(1), 1)


def rag_prompt(
    context: Tokens,
    question: Tokens,
    config: RetrievalConfig = DEFAULT_RETRIEVAL,
    *,
    terms: Callable[[Tokens], list[str]] = token_terms,
    embed: Callable[[Sequence[Tokens]], np.ndarray] | None = None,
    prefix: Tokens = (),
    separator: Tokens = (),
) -> RagPrompt:
    """The drafter's prompt: the chunks of ``context`` most like ``question`` within the
    budget, in document order, then ``question``.

    The budget (``retrieval_budget`` of the context's length) covers the whole prompt:
    prefix, chunks, the separator before the question and the question; the separators
    between chunks that are not adjacent in the document come on top.

    Args:
        context: the long context's tokens (1-D).
        question: the question's tokens, which end every prompt (its last token is the
            first one the models decode from).
        config: chunk size, method, threshold and budget.
        terms: ``tokens -> list of terms`` for BM25 (token ids by default, or
            ``word_terms(tokenizer.decode)``).
        embed: ``list of token sequences -> [n, D]`` for dense retrieval; the question
            is embedded with it too.
        prefix: tokens before the retrieved context (e.g. a BOS token).
        separator: tokens between chunks that are not adjacent in the document, and
            between the context and the question.

    Returns:
        A ``RagPrompt``.

    Raises:
        ValueError: an empty context or question, a question (with prefix and
            separator) longer than the budget, dense retrieval without ``embed``.
    """
    chunks = chunk_tokens(context, config.chunk_size, config.boundaries)
    question = np.asarray(question, np.int32).reshape(-1)
    prefix = np.asarray(prefix, np.int32).reshape(-1)
    separator = np.asarray(separator, np.int32).reshape(-1)
    if question.size == 0:
        raise ValueError("question must hold at least one token")
    context_len = sum(c.size for c in chunks)
    budget = retrieval_budget(context_len, min_budget=config.min_budget, ratio=config.ratio)
    fixed = prefix.size + separator.size + question.size
    if fixed > budget:
        raise ValueError(
            f"the question ({question.size} tokens, with prefix and separator {fixed}) is "
            f"longer than the retrieval budget of {budget} tokens"
        )
    if config.method == "bm25":
        scores = bm25_scores([terms(c) for c in chunks], terms(question), k1=config.k1, b=config.b)
    else:
        if embed is None:
            raise ValueError("dense retrieval needs an embedding function: pass embed=...")
        embeddings = np.asarray(embed([*chunks, question]))
        scores = cosine_scores(embeddings[:-1], embeddings[-1])
    kept = select_chunks(scores, [c.size for c in chunks], budget - fixed, config.score_floor)
    parts = [prefix]
    for i, index in enumerate(kept):
        if i and index != kept[i - 1] + 1:
            parts.append(separator)
        parts.append(chunks[index])
    parts += [separator, question]
    return RagPrompt(np.concatenate(parts).astype(np.int32), kept, scores, budget)
