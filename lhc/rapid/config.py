"""RAPID's configuration: how the RAG prompt is built (``RetrievalConfig``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """How the RAG prompt is built.

    Attributes:
        chunk_size: at most this many tokens per chunk.
        boundaries: token ids a chunk should end on (e.g. the ids of ``"."`` or a
            newline): each chunk ends after the last of them within ``chunk_size``
            tokens, or at ``chunk_size`` when there is none (the official code splits
            text at sentence and line ends within its token limit). Empty: every chunk
            has ``chunk_size`` tokens but the last.
        method: ``"bm25"`` or ``"dense"`` (cosine similarity of embeddings).
        threshold: chunks scoring below it are never retrieved (cosine similarity for
            dense retrieval, the BM25 score for BM25; ``-inf`` keeps every chunk). None:
            0.3 for dense retrieval (the official README's), 0.0 for BM25.
        min_budget: the budget's floor in tokens (the paper's 4096).
        ratio: λ, the budget is ``max(min_budget, ceil(|C| / ratio))`` tokens of context.
        k1, b: BM25's term-frequency saturation and length normalisation.
    """

    chunk_size: int = 512
    boundaries: tuple[int, ...] = ()
    method: str = "bm25"
    threshold: float | None = None
    min_budget: int = 4096
    ratio: float = 24.0
    k1: float = 1.5
    b: float = 0.75

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.method not in ("bm25", "dense"):
            raise ValueError(f"method must be 'bm25' or 'dense', got {self.method!r}")
        if self.min_budget < 1 or not self.ratio > 0:
            raise ValueError(
                f"min_budget must be >= 1 and ratio > 0, got {self.min_budget} and {self.ratio}"
            )

    @property
    def score_floor(self) -> float:
        """The threshold in effect."""
        if self.threshold is not None:
            return float(self.threshold)
        return 0.3 if self.method == "dense" else 0.0
