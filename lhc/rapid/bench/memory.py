"""The memory footprint of ``lhc bench rapid --setup``: ``lhc.rapid.footprint``'s estimate
of a ``configs/rapid_llama.py`` setup at each of its context lengths, as a table in GiB.
Analytic, so it runs anywhere without the checkpoints."""

from __future__ import annotations

from lhc import lm, stats
from lhc.rapid.config import RetrievalConfig
from lhc.rapid.footprint import memory_estimate
from lhc.rapid.retrieval import retrieval_budget

PARTS = (
    "target_weights",
    "draft_weights",
    "target_cache",
    "draft_cache",
    "round_buffers",
    "prefill_scores",
    "total",
)


def memory_table(rows: list[tuple[int, int, dict[str, float]]]) -> str:
    """A markdown table, GiB: one row per ``(context_len, rag_len, estimate)``."""
    columns = [("context", "context"), ("RAG prompt", "rag")]
    columns += [(name, name, ".2f") for name in PARTS]
    table = [
        dict(context=context, rag=rag, **{n: parts[n] / 2**30 for n in PARTS})
        for context, rag, parts in rows
    ]
    return stats.markdown_table(columns, table)


def setup_memory(config, retrieval: RetrievalConfig) -> list[dict]:
    """Prints the estimate of ``config`` (a ``configs/rapid_llama.py`` setup) per context
    length with the RAG prompt ``retrieval`` gives it; one row of bytes per length."""
    dtype = dict(dtype=config.dtype, param_dtype=config.dtype)
    target_config = lm.get_preset(config.target, **dtype)
    draft_config = lm.get_preset(config.draft, **dtype) if config.draft else None
    decoding = config.decoding
    rows = []
    for context in config.contexts:
        rag_len = retrieval_budget(context, min_budget=retrieval.min_budget, ratio=retrieval.ratio)
        rows.append(
            (
                context,
                rag_len,
                memory_estimate(
                    target_config,
                    draft_config,
                    context_len=context,
                    rag_len=rag_len,
                    new_tokens=decoding.new_tokens,
                    gamma=decoding.gamma,
                    batch_size=config.batch_size,
                    prefill_chunk=decoding.prefill_chunk,
                    attention_impl=config.attention_impl,
                ),
            )
        )
    drafter_name = config.draft or "the target (self-speculation)"
    print(
        f"target {config.target}, drafter {drafter_name}, batch {config.batch_size}, "
        f"{decoding.new_tokens} new tokens, gamma {decoding.gamma}, "
        f"{config.attention_impl} attention; GiB"
    )
    print(memory_table(rows))
    return [dict(context=c, rag=r, **m) for c, r, m in rows]
