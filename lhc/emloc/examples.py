"""Demonstrations as EMLoC and the baselines it is compared with read them: ``Example``
(tokens, answer mask, input embeddings), joined into one sequence, and the per-head
token scores both prune by (pooled over tokens, the best kept)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    """One demonstration (or a query): tokens, some of them replaced by embeddings.

    Attributes:
        tokens: int ``[n]``.
        answer: bool ``[n]``: the answer's tokens (what the demonstration teaches).
        embeddings: ``None`` or float ``[n, D]`` input embeddings (image patches).
        embedded: ``None`` or bool ``[n]``: where ``embeddings`` replace ``tokens``.
    """

    tokens: np.ndarray
    answer: np.ndarray
    embeddings: np.ndarray | None = None
    embedded: np.ndarray | None = None

    def __post_init__(self):
        tokens, answer = np.asarray(self.tokens), np.asarray(self.answer)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or not tokens.size:
            raise ValueError(f"Example.tokens must be a non-empty int [n], got {tokens.shape}")
        if answer.shape != tokens.shape or answer.dtype != bool:
            raise ValueError(f"Example.answer must be bool {tokens.shape}, got {answer.shape}")
        if (self.embeddings is None) != (self.embedded is None):
            raise ValueError("Example: give embeddings and embedded together, or neither")
        if self.embeddings is not None:
            embeddings, embedded = np.asarray(self.embeddings), np.asarray(self.embedded)
            if embeddings.ndim != 2 or embeddings.shape[0] != tokens.size:
                raise ValueError(
                    f"Example.embeddings must be [n={tokens.size}, D], got {embeddings.shape}"
                )
            if embedded.shape != tokens.shape or embedded.dtype != bool:
                raise ValueError(f"Example.embedded must be bool {tokens.shape}")

    def __len__(self) -> int:
        return int(np.asarray(self.tokens).size)


def join_examples(examples: Sequence[Example], embed_dim: int):
    """Concatenated tokens, answer mask, embeddings and embedding mask of ``examples``."""
    tokens = np.concatenate([np.asarray(e.tokens, np.int32) for e in examples])
    answer = np.concatenate([np.asarray(e.answer) for e in examples])
    embeddings = np.zeros((tokens.size, embed_dim), np.float32)
    embedded = np.zeros(tokens.size, bool)
    start = 0
    for e in examples:
        if e.embeddings is not None:
            if np.asarray(e.embeddings).shape[1] != embed_dim:
                raise ValueError(
                    f"Example embeddings have width {np.asarray(e.embeddings).shape[1]}, the "
                    f"model's embed_dim is {embed_dim}"
                )
            embeddings[start : start + len(e)] = e.embeddings
            embedded[start : start + len(e)] = e.embedded
        start += len(e)
    return tokens, answer, embeddings, embedded


def pooled_head_scores(summed: np.ndarray, num_kv_heads: int, pool: int) -> np.ndarray:
    """float64 ``[K, C]``: per-query-head token scores ``summed [N, C]`` added over the
    query heads of each key/value group, then average-pooled over tokens (kernel
    ``pool``, zero padding counted, as ``avg_pool1d`` with padding ``pool // 2``)."""
    grouped = np.asarray(summed, np.float64).reshape(num_kv_heads, -1, summed.shape[-1]).sum(1)
    half = pool // 2
    padded = np.pad(grouped, ((0, 0), (half, half)))
    return sum(padded[:, i : i + grouped.shape[1]] for i in range(pool)) / pool


def top_tokens(scores: np.ndarray, count: int) -> np.ndarray:
    """int ``[K, count]``: each head's ``count`` highest-scoring tokens (ties: earlier
    tokens first)."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    return order[:, :count]
