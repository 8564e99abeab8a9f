"""RAPID (Chen et al., ICML 2025): retrieval-augmented speculative decoding.

A drafter reads a short prompt of retrieved chunks, the target verifies on the whole
long context, and the verifier moves the target's distribution toward the drafter's
(inference-time knowledge transfer)::

    prompts = lhc.rapid.build_prompts(contexts, questions, lhc.rapid.RetrievalConfig())
    out = lhc.rapid.rapid_generate(model, params, prompts, max_new_tokens=64, eta=10.0)

* ``lhc.rapid.config``: ``RetrievalConfig``, how the RAG prompt is built.
* ``lhc.rapid.retrieval``: chunking, BM25 (``bm25s``) or dense scores, the budget
  ``max(min_budget, |C| / ratio)``, the similarity threshold, chunks in document order.
* ``lhc.rapid.transfer``: ``transfer_logits``, ``residual_probs`` and the verifier
  ``RapidSampling`` (an ``lhc.lm.SpeculativeSampling`` whose ``eta = 0`` is the
  lossless rule).
* ``lhc.rapid.footprint``: what a run holds in memory (weights, both caches, buffers).
* ``lhc.rapid.decoding``: ``rapid_generate`` (self- or upward speculation),
  ``prefill_contexts`` (a long context prefilled once, decoded from many times) and the
  two baselines, ``target_generate`` and ``rag_generate``.
"""

from lhc.rapid.config import RetrievalConfig
from lhc.rapid.decoding import (
    Prompts,
    build_prompts,
    prefill_contexts,
    rag_generate,
    rapid_generate,
    target_generate,
)
from lhc.rapid.footprint import memory_estimate
from lhc.rapid.retrieval import (
    RagPrompt,
    bm25_scores,
    chunk_tokens,
    cosine_scores,
    pooled_hidden_states,
    rag_prompt,
    retrieval_budget,
    select_chunks,
    token_terms,
    word_terms,
)
from lhc.rapid.transfer import RapidSampling, residual_probs, transfer_logits

__all__ = [
    "Prompts",
    "RagPrompt",
    "RapidSampling",
    "RetrievalConfig",
    "bm25_scores",
    "build_prompts",
    "chunk_tokens",
    "cosine_scores",
    "memory_estimate",
    "pooled_hidden_states",
    "prefill_contexts",
    "rag_generate",
    "rag_prompt",
    "rapid_generate",
    "residual_probs",
    "retrieval_budget",
    "select_chunks",
    "target_generate",
    "token_terms",
    "transfer_logits",
    "word_terms",
]
