"""The fact sweep of ``lhc bench rapid --haystack``: questions about facts inserted
into a real text (``lhc.rapid.facts``), on a real checkpoint, by context length.

Per length, ``--samples`` contexts carry ``--facts-per-context`` facts each, a share
``--paraphrased`` of them with questions that share no word with their facts; the target's
cache of the contexts is prefilled once and every question set decodes from a copy. One
record per (length, pass, method, set) goes to ``--results`` (JSON lines), so a stopped
run resumes; ``fact_summary`` turns the records into accuracy with 95% Wilson intervals
(over all questions, and over the literal and the paraphrased ones apart), acceptance,
tokens/s and seconds per question.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench, stats
from lhc.rapid.bench.common import methods_for
from lhc.rapid.config import RetrievalConfig
from lhc.rapid.decoding import build_prompts, prefill_contexts
from lhc.rapid.facts import fact_contexts
from lhc.rapid.retrieval import word_terms


def _answered(tokenizer, tokens, length: int, answer: str) -> bool:
    """The answer, in any case, within the first ``length`` generated tokens."""
    return answer.lower() in tokenizer.decode([int(t) for t in tokens[:length]]).lower()


def _speculative_fields(out) -> dict:
    if not hasattr(out, "num_iterations"):
        return {}
    return dict(
        accepted=np.asarray(out.accepted).tolist(),
        drafted=np.asarray(out.drafted).tolist(),
        rounds=int(out.num_iterations),
    )


def fact_sweep(args, loaded, retrieval: RetrievalConfig, chat: tuple) -> dict:
    """Questions about facts inserted into ``args.haystack`` (``lhc.rapid.facts``):
    ``args.samples`` contexts per length, ``args.facts_per_context`` questions each.

    Per length, the target's cache of the contexts is prefilled once (timed) and every
    question set decodes from a copy. Accuracy pass: each method on each question set
    with the stop tokens, up to ``--new-tokens``. Speed pass: each method on the first
    set without stop tokens, exactly ``--new-tokens`` tokens; compilation (JAX's own
    clock) is subtracted from the time. One record per (length, pass, method, set) is
    appended to ``--results``, with per context whether the question is paraphrased and
    the fact's statement; a rerun skips those already there.
    """
    tokenizer = loaded.tokenizer
    prefix, separator, suffix = chat
    records = stats.read_records(args.results) if args.results else []
    done = {
        (r["length"], r["pass"], r["method"], r.get("set"), (r.get("contexts") or [0])[0])
        for r in records
    }
    try:
        facts = fact_contexts(
            args.haystack,
            tokenizer,
            args.context_lengths,
            num_contexts=args.samples,
            facts_per_context=args.facts_per_context,
            seed=args.seed,
            paraphrased=args.paraphrased,
        )
    except ValueError as error:
        raise SystemExit(f"--haystack / --samples / --facts-per-context: {error}") from None
    model, params = loaded.model, loaded.params

    def methods(stop_tokens):  # self-speculation: the target drafts on the RAG prompt
        return methods_for(
            model, params, model, params, args.etas, None, [], args.gamma, stop_tokens=stop_tokens
        )

    passes = {"accuracy": methods(loaded.stop_tokens), "speed": methods(())}
    sets = {"accuracy": range(args.facts_per_context), "speed": [0]}

    tags = {"model": args.checkpoint or args.workdir, **bench.provenance(args)}

    def emit(record):
        record = {**tags, **record}
        records.append(record)
        if args.results:
            stats.append_records(args.results, [record])

    def run_batch(length, bucket, picked):
        """Prefills the contexts ``picked`` of ``bucket`` and runs every (pass, question set,
        method) not yet ``done`` on them, each record emitted as it finishes."""
        first = picked[0]
        todo = [
            (kind, j, method)
            for kind, methods in passes.items()
            for j in sets[kind]
            for method in methods
            if (length, kind, method[0], j, first) not in done
        ]
        if not todo:
            return
        contexts = [bucket.contexts[c] for c in picked]
        prompts = [
            build_prompts(
                contexts,
                [[*tokenizer.encode(bucket.questions(j)[c]), *suffix] for c in picked],
                retrieval,
                terms=word_terms(tokenizer.decode),
                prefix=prefix,
                separator=separator,
            )
            for j in range(args.facts_per_context)
        ]
        extra = (
            max(len(q) for p in prompts for q in p.questions) + args.new_tokens + args.gamma + 16
        )
        with bench.compile_clock() as clock:
            start = time.perf_counter()
            cache = jax.block_until_ready(prefill_contexts(model, params, prompts[0], extra=extra))
            seconds = time.perf_counter() - start
        cache_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(cache))
        if (length, "prefill", "target", None, first) not in done:
            emit(
                dict(
                    length=length, **{"pass": "prefill"}, method="target", contexts=list(picked),
                    batch=len(picked), questions_per_context=args.facts_per_context,
                    seconds=seconds - clock["seconds"], compile_seconds=clock["seconds"],
                    cache_bytes_per_context=cache_bytes // len(picked),
                    rag_tokens=[len(t) for p in prompts for t in p.rag_tokens],
                )
            )  # fmt: skip
        print(f"context {length} {list(picked)}: prefilled in {seconds:.1f} s", flush=True)
        by_name = {kind: {m[0]: m for m in ms} for kind, ms in passes.items()}
        for kind, j, (name, _, _) in todo:
            _, run, uses_cache = by_name[kind][name]
            copy = jax.block_until_ready(jax.tree.map(jnp.copy, cache)) if uses_cache else None
            with bench.compile_clock() as clock:
                start = time.perf_counter()
                out = jax.block_until_ready(run(prompts[j], args.new_tokens, copy))
                seconds = time.perf_counter() - start
            tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
            answers = [bucket.answers(j)[c] for c in picked]
            facts = [bucket.facts[c][j] for c in picked]
            emit(
                dict(
                    length=length, **{"pass": kind}, method=name, set=j, contexts=list(picked),
                    seconds=seconds - clock["seconds"], compile_seconds=clock["seconds"],
                    lengths=lengths.tolist(),
                    correct=[
                        _answered(tokenizer, row, n, a) for row, n, a in zip(tokens, lengths, answers)
                    ],
                    answers=[
                        tokenizer.decode([int(t) for t in row[:n]]) for row, n in zip(tokens, lengths)
                    ] if kind == "accuracy" else None,
                    depths=[bucket.depths[c][j] for c in picked],
                    paraphrased=[f.paraphrased for f in facts],
                    fact=[f.statement for f in facts],
                    **_speculative_fields(out),
                )
            )  # fmt: skip
            print(
                f"context {length} {list(picked)}: {kind} {name} set {j}: {seconds:.1f} s",
                flush=True,
            )
        del cache

    # Contexts go through in batches of --context-batch (a long context's cache may not
    # fit many times over): one prefill per batch, shared by every question set.
    step = args.context_batch or args.samples
    for length, bucket in facts.items():
        for first in range(0, args.samples, step):
            picked = range(first, min(first + step, args.samples))
            run_batch(length, bucket, picked)
    result = fact_summary(records, args.new_tokens)
    print(
        f"\ngreedy, {args.samples} contexts x {args.facts_per_context} questions per length, "
        f"chunks of {args.chunk_size}, budget max({args.min_budget}, N / {args.ratio:g}), "
        f"gamma {args.gamma}"
    )
    print(fact_table(result))
    return {"summary": result, "records": records}


def _kinds(record: dict) -> dict[str, list[int]]:
    """The rows of ``record`` (contexts) by question kind."""
    paraphrased = record.get("paraphrased") or [False] * len(record["lengths"])
    return {
        "literal": [i for i, p in enumerate(paraphrased) if not p],
        "paraphrased": [i for i, p in enumerate(paraphrased) if p],
    }


def fact_summary(records: list[dict], new_tokens: int) -> list[dict]:
    """One row per (length, method, question kind): accuracy over the questions with its
    95% Wilson interval, acceptance and tokens per round (accuracy pass); for ``"all"``
    questions also tokens/s over ``new_tokens`` from the cached context, speedup over the
    target, and seconds per question counting the context's prefill (speed pass). The
    ``"literal"`` and ``"paraphrased"`` rows are there when some question is paraphrased.
    """
    prefill: dict[int, list[float]] = {}  # length: [seconds, contexts, questions per context]
    for r in records:
        if r["pass"] == "prefill":
            totals = prefill.setdefault(r["length"], [0.0, 0, r.get("questions_per_context", 1)])
            totals[0] += r["seconds"]
            totals[1] += r["batch"]
    split = any(any(r.get("paraphrased") or ()) for r in records)
    rows: dict[tuple[int, str, str], dict] = {}
    for r in records:
        if r["pass"] == "prefill":
            continue
        groups = {"all": range(len(r["lengths"]))}
        if split and r["pass"] == "accuracy":
            groups.update(_kinds(r))
        for kind, picked in groups.items():
            if not picked:
                continue
            row = rows.setdefault(
                (r["length"], r["method"], kind),
                dict(length=r["length"], method=r["method"], question_kind=kind),
            )
            if r["pass"] == "accuracy":
                for key in ("correct", "accepted", "drafted", "lengths"):
                    if key in r:
                        row.setdefault(key, []).extend(r[key][i] for i in picked)
                row["rounds"] = row.get("rounds", 0) + r.get("rounds", 0) * len(picked)
            else:
                row["speed_questions"] = row.get("speed_questions", 0) + len(r["lengths"])
                row["speed_seconds"] = row.get("speed_seconds", 0.0) + r["seconds"]
    out = []
    for (length, method, kind), row in sorted(rows.items(), key=lambda item: item[0][0]):
        correct = row.get("correct", [])
        low, high = stats.wilson_interval(sum(correct), len(correct))
        summary = dict(
            length=length, method=method, question_kind=kind, questions=len(correct),
            accuracy=float(np.mean(correct)) if correct else None, low=low, high=high,
        )  # fmt: skip
        if row.get("speed_questions"):
            # Decoding new_tokens per question from the cached context; end to end, the
            # context's prefill too (for a method that reads it): all of it for a question
            # alone, its share when the context's questions come together.
            own = row["speed_seconds"] / row["speed_questions"]
            seconds, contexts, per_context = prefill.get(length, (0.0, 1, 1))
            context = 0.0 if method == "rag" else seconds / max(contexts, 1)
            summary.update(
                tokens_per_s=new_tokens / own,
                seconds_per_question=own + context,
                seconds_per_question_shared=own + context / per_context,
            )
        if row.get("drafted"):
            summary["acceptance"] = sum(row["accepted"]) / max(sum(row["drafted"]), 1)
            summary["tokens_per_round"] = sum(row["lengths"]) / max(row["rounds"], 1)
        out.append(summary)
    for row in out:
        key = (row["length"], "target", "all")
        base = next((r for r in out if (r["length"], r["method"], r["question_kind"]) == key), {})
        if row.get("tokens_per_s") and base.get("tokens_per_s"):
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
    return out


def fact_table(rows: list[dict]) -> str:
    rows = [
        {**row, "interval": f"[{row['low']:.2f}, {row['high']:.2f}]"}
        if row["accuracy"] is not None
        else row
        for row in rows
    ]
    split = any(r.get("question_kind", "all") != "all" for r in rows)
    kinds = [("kind", "question_kind")] if split else []
    columns = [
        ("context", "length"), ("method", "method"), *kinds, ("questions", "questions"),
        ("accuracy", "accuracy", ".2f"), ("95% interval", "interval"),
        ("acceptance", "acceptance", ".3f"), ("tokens/round", "tokens_per_round", ".2f"),
        ("tok/s", "tokens_per_s", ".1f"), ("speedup", "speedup", ".2fx"),
        ("s/question alone", "seconds_per_question", ".1f"),
        ("s/question shared", "seconds_per_question_shared", ".1f"),
    ]  # fmt: skip
    return stats.markdown_table(columns, rows)
