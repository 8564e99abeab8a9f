"""The tables of ``experiments/rapid`` from its raw results (``lhc report``): one block
per results file of the fact sweep (``lhc bench rapid --haystack``).

Per context length and method: accuracy with its 95% Wilson interval (all questions,
then the literal and the paraphrased ones), McNemar's exact test of each RAPID setting
against RAG alone and against the target on the same questions, acceptance, decoding
speed from the cached context, seconds per question end to end (the context's prefill
charged whole to a question alone, or shared by the questions of one context), and the
caches each method holds.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from lhc import stats
from lhc.rapid.bench.facts import fact_summary


def _answers(records: list[dict]) -> dict[tuple, dict[tuple, bool]]:
    """``{(length, method): {(set, context): correct}}`` of the accuracy pass."""
    out: dict[tuple, dict[tuple, bool]] = defaultdict(dict)
    for r in records:
        if r["pass"] == "accuracy":
            contexts = r.get("contexts") or range(len(r["correct"]))
            for c, right in zip(contexts, r["correct"]):
                out[r["length"], r["method"]][r["set"], c] = bool(right)
    return out


def _paired(answers, length: int, method: str, against: str) -> float | None:
    mine, theirs = answers.get((length, method)), answers.get((length, against))
    if not mine or not theirs or method == against:
        return None
    items = sorted(set(mine) & set(theirs))
    return stats.mcnemar([mine[i] for i in items], [theirs[i] for i in items])["p_value"]


def tables(records: list[dict]) -> str:
    new_tokens = max((max(r["lengths"]) for r in records if r["pass"] == "speed"), default=1)
    rows = fact_summary(records, new_tokens)
    answers = _answers(records)
    prefill = defaultdict(list)
    for r in records:
        if r["pass"] == "prefill":
            prefill[r["length"]].append(r)
    for row in rows:
        if row["question_kind"] == "all":
            row["p_rag"] = _paired(answers, row["length"], row["method"], "rag")
            row["p_target"] = _paired(answers, row["length"], row["method"], "target")
        done = prefill.get(row["length"])
        if done and done[0].get("cache_bytes_per_context"):
            full = np.mean([r["cache_bytes_per_context"] for r in done]) / 2**20
            rag = full * np.mean([t for r in done for t in r["rag_tokens"]]) / row["length"]
            row["cache_mb"] = {"target": full, "rag": rag}.get(row["method"], full + rag)
        if row.get("accuracy") is not None:
            row["interval"] = f"[{row['low']:.2f}, {row['high']:.2f}]"
    columns = [
        ("context", "length", ","), ("method", "method"), ("questions", "question_kind"),
        ("n", "questions"), ("accuracy", "accuracy", ".2f"), ("95% interval", "interval"),
        ("p vs RAG", "p_rag", ".2g"), ("p vs target", "p_target", ".2g"),
        ("acceptance", "acceptance", ".2f"), ("tok/s", "tokens_per_s", ".1f"),
        ("speedup", "speedup", ".2fx"), ("s/question alone", "seconds_per_question", ".1f"),
        ("s/question shared", "seconds_per_question_shared", ".1f"),
        ("cache MB", "cache_mb", ".0f"),
    ]  # fmt: skip
    return stats.markdown_table(columns, rows)


def render(results: dict[str, list[dict]]) -> dict[str, str]:
    return {name: tables(records) for name, records in results.items()}
