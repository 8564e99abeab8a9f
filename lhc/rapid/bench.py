"""RAPID against target-only and RAG-only decoding, by context length, in one run.

Examples are passkey questions (``lhc.data.passkey``'s needle at evenly spread depths of
generated filler, the question at the end); the answer sits in one chunk. For each
context length the bench builds the full and the RAG prompts (BM25 over English words),
then runs greedy decoding of ``--new-tokens`` tokens with:

* ``target``: the target on the whole context (``lhc.lm.generate``);
* ``rag``: the drafter on the RAG prompt alone;
* ``rapid eta=E``: RAPID with the drafter (self-speculation when no ``--draft-workdir``)
  for each ``--etas`` value (``eta=0`` is plain speculative decoding with a RAG drafter);
* with ``--draft-workdir`` or ``--draft-checkpoint``, ``rag (large)`` and
  ``rapid (large) eta=E`` for upward speculation with ``--upward-etas``.

The target is ``--workdir`` (an lhc run) or ``--checkpoint`` (with its tokenizer, chat
template and stop tokens), else a random tiny decoder of byte tokens.

``--setup configs/rapid_llama.py:NAME`` prints instead the memory estimate of the
paper's setup on imported checkpoints, and runs it on a JSONL file when the config names
the checkpoints, tokenizer and data (see that config).

Accuracy: the first generated tokens spell the key. Speed: the target's cache of each
long context is prefilled once, untimed (every method that reads the context pays that
prefill alike); each method is then timed from that cache to N new tokens per sequence:
the target appends the question and decodes; RAPID appends the question to a copy of the
target's cache, prefills the drafter's RAG prompt and runs its rounds; RAG-only prefills
its RAG prompt and decodes. Tokens per second are ``B N / t`` with t the fastest of
``--repeats`` calls after a compiling one; speedup is against ``target``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench, lm
from lhc.data.passkey import NEEDLE, QUESTION, Filler
from lhc.lm.decoding import GREEDY
from lhc.lm.sampling import SamplingParams
from lhc.rapid.decoding import (
    build_prompts,
    prefill_contexts,
    rag_generate,
    rapid_generate,
    target_generate,
)
from lhc.rapid.facts import fact_contexts
from lhc.rapid.footprint import memory_estimate, memory_table
from lhc.rapid.retrieval import RetrievalConfig, retrieval_budget, word_terms


def passkey_questions(
    context_len: int, samples: int, *, seed: int = 0, digits: int = 5, tokenizer=None
):
    """``(contexts, questions, answers)``: ``samples`` contexts of ``context_len`` tokens
    of ``tokenizer`` (bytes by default), a needle at depths evenly spread over [0, 1],
    the passkey question."""
    tokenizer = tokenizer or lm.ByteTokenizer()
    rng = np.random.default_rng(seed)
    contexts, questions, answers = [], [], []
    for depth in np.linspace(0.0, 1.0, samples):
        key = int(rng.integers(10 ** (digits - 1), 10**digits))
        needle = tokenizer.encode(NEEDLE.format(key=key))
        filler = Filler().tokens(tokenizer, rng, context_len - len(needle))
        at = int(round(depth * len(filler)))
        contexts.append(np.asarray(filler[:at] + needle + filler[at:], np.int32))
        questions.append(np.asarray(tokenizer.encode(QUESTION), np.int32))
        answers.append(tokenizer.encode(str(key)))
    return contexts, questions, answers


def starts_with_answer(tokens: np.ndarray, answer) -> bool:
    """A passkey answer: the generation begins with the key's tokens."""
    return list(tokens[: len(answer)]) == list(answer)


def measure_length(
    methods,
    prompts,
    answers,
    cache,
    *,
    new_tokens: int,
    repeats: int,
    correct=starts_with_answer,
) -> list[dict]:
    """One row per method: accuracy, tokens/s after the cached context, acceptance and
    tokens per round. ``methods``: ``(name, run(prompts, n, cache), uses_cache)``;
    ``correct(generated tokens, answer) -> bool``."""
    rows = []
    batch = len(answers)
    # ``generate`` donates the cache it continues from: a copy for each call, made before
    # the clock starts.
    fresh = lambda: (jax.tree.map(jnp.copy, cache),)
    for name, run, uses_cache in methods:
        seconds, out = bench.timed(
            functools.partial(run, prompts, new_tokens),
            repeats,
            prepare=fresh if uses_cache else lambda: (None,),
        )
        tokens = np.asarray(out.tokens)
        accuracy = float(np.mean([correct(row, a) for row, a in zip(tokens, answers)]))
        row = dict(
            method=name,
            accuracy=accuracy,
            tokens_per_s=batch * new_tokens / seconds,
            seconds=seconds,
        )
        if hasattr(out, "num_iterations"):
            row["acceptance"] = float(out.acceptance_rate)
            row["tokens_per_round"] = float(np.asarray(out.lengths).mean()) / max(
                int(out.num_iterations), 1
            )
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base
    return rows


def methods_for(
    target,
    target_params,
    drafter,
    draft_params,
    etas,
    upward,
    upward_etas,
    gamma,
    *,
    alpha: float = 0.1,
    sampling: SamplingParams = GREEDY,
    rng: jax.Array | None = None,
    stop_tokens: tuple[int, ...] = (),
):
    """``(name, run(prompts, new_tokens, cache), uses_cache)``, target-only first; the
    cache is the target's, holding the contexts."""
    common = dict(sampling=sampling, rng=rng, stop_tokens=stop_tokens)

    def target_run(prompts, n, cache):
        return target_generate(
            target, target_params, prompts, max_new_tokens=n, cache=cache, **common
        )

    def rag_run(model, params):
        return lambda prompts, n, cache: rag_generate(
            model, params, prompts, max_new_tokens=n, **common
        )

    def rapid_run(model, params, eta):
        return lambda prompts, n, cache: rapid_generate(
            target,
            target_params,
            prompts,
            max_new_tokens=n,
            drafter=model,
            draft_params=params,
            eta=eta,
            alpha=alpha,
            gamma=gamma,
            target_cache=cache,
            **common,
        )

    methods = [("target", target_run, True), ("rag", rag_run(drafter, draft_params), False)]
    methods += [(f"rapid eta={e:g}", rapid_run(drafter, draft_params, e), True) for e in etas]
    if upward is not None:
        large, large_params = upward
        methods.append(("rag (large)", rag_run(large, large_params), False))
        methods += [
            (f"rapid (large) eta={e:g}", rapid_run(large, large_params, e), True)
            for e in upward_etas
        ]
    return methods


def table(results: dict[int, list[dict]]) -> str:
    columns = [
        ("context", "context"), ("method", "method"), ("accuracy", "accuracy", ".2f"),
        ("tok/s", "tokens_per_s", ".1f"), ("speedup", "speedup", ".2fx"),
        ("acceptance", "acceptance", ".3f"), ("tokens/round", "tokens_per_round", ".2f"),
    ]  # fmt: skip
    rows = [{"context": length, **row} for length, rows in results.items() for row in rows]
    return bench.markdown_table(columns, rows)


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
    appended to ``--results``; a rerun skips those already there.
    """
    tokenizer = loaded.tokenizer
    prefix, separator, suffix = chat
    records = bench.read_records(args.results) if args.results else []
    done = {(r["length"], r["pass"], r["method"], r.get("set")) for r in records}
    try:
        facts = fact_contexts(
            args.haystack,
            tokenizer,
            args.context_lengths,
            num_contexts=args.samples,
            facts_per_context=args.facts_per_context,
            seed=args.seed,
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

    def emit(record):
        records.append(record)
        if args.results:
            bench.append_records(args.results, [record])

    for length, bucket in facts.items():
        todo = [
            (kind, j, method)
            for kind, methods in passes.items()
            for j in sets[kind]
            for method in methods
            if (length, kind, method[0], j) not in done
        ]
        if not todo:
            continue
        prompts = [
            build_prompts(
                bucket.contexts,
                [[*tokenizer.encode(q), *suffix] for q in bucket.questions(j)],
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
        if (length, "prefill", "target", None) not in done:
            emit(
                dict(
                    length=length, **{"pass": "prefill"}, method="target", batch=args.samples,
                    seconds=seconds - clock["seconds"], compile_seconds=clock["seconds"],
                    rag_tokens=[len(t) for p in prompts for t in p.rag_tokens],
                )
            )  # fmt: skip
        print(f"context {length}: prefilled in {seconds:.1f} s", flush=True)
        by_name = {kind: {m[0]: m for m in ms} for kind, ms in passes.items()}
        for kind, j, (name, _, _) in todo:
            _, run, uses_cache = by_name[kind][name]
            copy = jax.block_until_ready(jax.tree.map(jnp.copy, cache)) if uses_cache else None
            with bench.compile_clock() as clock:
                start = time.perf_counter()
                out = jax.block_until_ready(run(prompts[j], args.new_tokens, copy))
                seconds = time.perf_counter() - start
            tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
            answers = bucket.answers(j)
            emit(
                dict(
                    length=length, **{"pass": kind}, method=name, set=j,
                    seconds=seconds - clock["seconds"], compile_seconds=clock["seconds"],
                    lengths=lengths.tolist(),
                    correct=[
                        _answered(tokenizer, row, n, a)
                        for row, n, a in zip(tokens, lengths, answers)
                    ],
                    depths=[d[j] for d in bucket.depths],
                    **_speculative_fields(out),
                )
            )  # fmt: skip
            print(f"context {length}: {kind} {name} set {j}: {seconds:.1f} s", flush=True)
        del cache
    result = fact_summary(records, args.new_tokens)
    print(
        f"\ngreedy, {args.samples} contexts x {args.facts_per_context} questions per length, "
        f"chunks of {args.chunk_size}, budget max({args.min_budget}, N / {args.ratio:g}), "
        f"gamma {args.gamma}"
    )
    print(fact_table(result))
    return {"summary": result, "records": records}


def fact_summary(records: list[dict], new_tokens: int) -> list[dict]:
    """One row per (length, method): accuracy over every question with its 95% Wilson
    interval, acceptance and tokens per round (accuracy pass); tokens/s over
    ``new_tokens`` from the cached context, speedup over the target, and seconds per
    question counting the context's prefill (speed pass)."""
    prefill = {r["length"]: r for r in records if r["pass"] == "prefill"}
    rows: dict[tuple[int, str], dict] = {}
    for r in records:
        if r["pass"] == "prefill":
            continue
        row = rows.setdefault(
            (r["length"], r["method"]), dict(length=r["length"], method=r["method"])
        )
        if r["pass"] == "accuracy":
            for key in ("correct", "accepted", "drafted", "lengths"):
                row.setdefault(key, []).extend(r.get(key, []))
            row["rounds"] = row.get("rounds", 0) + r.get("rounds", 0) * len(r["lengths"])
        else:
            batch = len(r["lengths"])
            row["tokens_per_s"] = batch * new_tokens / r["seconds"]
            own = r["seconds"] / batch
            shared = prefill[r["length"]]["seconds"] / prefill[r["length"]]["batch"]
            row["seconds_per_question"] = own + (0.0 if r["method"] == "rag" else shared)
    out = []
    for (length, method), row in sorted(rows.items(), key=lambda item: item[0][0]):
        correct = row.get("correct", [])
        low, high = bench.wilson_interval(sum(correct), len(correct))
        summary = dict(
            length=length, method=method, questions=len(correct),
            accuracy=float(np.mean(correct)) if correct else None, low=low, high=high,
            tokens_per_s=row.get("tokens_per_s"),
            seconds_per_question=row.get("seconds_per_question"),
        )  # fmt: skip
        if row.get("drafted"):
            summary["acceptance"] = sum(row["accepted"]) / max(sum(row["drafted"]), 1)
            summary["tokens_per_round"] = sum(row["lengths"]) / max(row["rounds"], 1)
        out.append(summary)
    for row in out:
        base = next(
            (r for r in out if r["length"] == row["length"] and r["method"] == "target"), {}
        )
        if row["tokens_per_s"] and base.get("tokens_per_s"):
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
    return out


def fact_table(rows: list[dict]) -> str:
    rows = [
        {**row, "interval": f"[{row['low']:.2f}, {row['high']:.2f}]"}
        if row["accuracy"] is not None
        else row
        for row in rows
    ]
    columns = [
        ("context", "length"), ("method", "method"), ("questions", "questions"),
        ("accuracy", "accuracy", ".2f"), ("95% interval", "interval"),
        ("acceptance", "acceptance", ".3f"), ("tokens/round", "tokens_per_round", ".2f"),
        ("tok/s", "tokens_per_s", ".1f"), ("speedup", "speedup", ".2fx"),
        ("s/question", "seconds_per_question", ".1f"),
    ]  # fmt: skip
    return bench.markdown_table(columns, rows)


def _load(source: argparse.Namespace, max_len: int, seed: int):
    """``lhc.lm.Checkpoint`` of ``source``'s ``checkpoint`` (its ``max_len`` raised to
    ``max_len``) or ``workdir``; else a random tiny decoder of byte tokens."""
    if source.workdir is not None or source.checkpoint is not None:
        return bench.load_model_source(source, max_len=max_len)
    tokenizer = lm.ByteTokenizer()
    config = lm.LMConfig.tiny(vocab_size=tokenizer.vocab_size, max_len=max_len)
    params = lm.init_params(config, jax.random.key(seed))
    return lm.Checkpoint(lm.Transformer(config), params, tokenizer, (), "random")


def chat_parts(tokenizer) -> tuple[list[int], list[int], list[int]]:
    """``(prefix, separator, suffix)`` tokens that put a context and a question into one
    user turn of the tokenizer's chat template (``prefix context separator question
    suffix``); plain text (a bos, a blank line) without a template."""
    if tokenizer.chat_template is None:
        return (
            ([] if tokenizer.bos_id is None else [tokenizer.bos_id]),
            tokenizer.encode("\n\n"),
            [],
        )
    context, question = "\x00CONTEXT\x00", "\x00QUESTION\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{context}\n\n{question}"}])
    before, rest = text.split(context)
    between, after = rest.split(question)
    return tokenizer.encode(before), tokenizer.encode(between), tokenizer.encode(after)


def _read_jsonl(path: str) -> list[dict]:
    examples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            example = json.loads(line)
            missing = {"context", "question", "answers"} - set(example)
            if missing or not isinstance(example.get("answers"), list):
                raise SystemExit(
                    f"{path}:{number}: expected an object with context, question and answers "
                    f"(a list of strings); missing {sorted(missing)}"
                )
            examples.append(example)
    if not examples:
        raise SystemExit(f"{path}: no examples")
    return examples


def _load_checkpoint(path: str, preset: str, dtype: str, attention_impl: str):
    """A Hugging Face checkpoint, checked to have the preset's architecture."""
    config, params = lm.hf.load(path, jnp.dtype(dtype), attention_impl=attention_impl)
    want = lm.get_preset(preset)
    fields = ("num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")
    differ = [f for f in fields if getattr(config, f) != getattr(want, f)]
    if differ:
        raise SystemExit(
            f"{path}: the checkpoint is not a {preset}: "
            + ", ".join(f"{f} {getattr(config, f)} (preset {getattr(want, f)})" for f in differ)
        )
    return lm.Transformer(config), params


def run_setup(config, repeats: int) -> dict[str, Any]:
    """The memory estimate of a ``configs/rapid_llama.py`` setup; and, when it names
    checkpoints, a tokenizer and data, the measured run on them."""
    dtype = dict(dtype=config.dtype, param_dtype=config.dtype)
    target_config = lm.get_preset(config.target, **dtype)
    draft_config = lm.get_preset(config.draft, **dtype) if config.draft else None
    retrieval = RetrievalConfig(**dict(config.retrieval))
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
    result: dict[str, Any] = {"memory": [dict(context=c, rag=r, **m) for c, r, m in rows]}
    if not config.target_checkpoint:
        return result
    if not (config.tokenizer and config.data):
        raise SystemExit("--setup: a target_checkpoint needs config.tokenizer and config.data")
    target, params = _load_checkpoint(
        config.target_checkpoint, config.target, config.dtype, config.attention_impl
    )
    upward = None
    if config.draft_checkpoint:
        upward = _load_checkpoint(
            config.draft_checkpoint, config.draft, config.dtype, config.attention_impl
        )
    tokenizer = lm.load_tokenizer(config.tokenizer)
    examples = _read_jsonl(config.data)
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompts = build_prompts(
        [tokenizer.encode(e["context"]) for e in examples],
        [tokenizer.encode(e["question"]) for e in examples],
        retrieval,
        terms=word_terms(tokenizer.decode),
        prefix=prefix,
        separator=tokenizer.encode("\n\n"),
    )
    sampling = SamplingParams(temperature=decoding.temperature, top_p=decoding.top_p)
    drafter, draft_params = upward if upward is not None else (target, params)
    methods = methods_for(
        target,
        params,
        drafter,
        draft_params,
        [decoding.eta],
        None,
        [],
        decoding.gamma,
        alpha=decoding.alpha,
        sampling=sampling,
        rng=jax.random.key(config.seed),
    )

    def contains(tokens, answers):
        text = tokenizer.decode([int(t) for t in tokens])
        return any(answer in text for answer in answers)

    extra = max(len(q) for q in prompts.questions) + decoding.new_tokens + decoding.gamma + 16
    cache = prefill_contexts(
        target, params, prompts, extra=extra, prefill_chunk=decoding.prefill_chunk
    )
    measured = measure_length(
        methods,
        prompts,
        [e["answers"] for e in examples],
        cache,
        new_tokens=decoding.new_tokens,
        repeats=repeats,
        correct=contains,
    )
    print(f"\n{len(examples)} examples from {config.data}")
    print(table({max(len(c) for c in prompts.contexts): measured}))
    result["measured"] = measured
    return result


def _parser():
    parser = bench.parser("rapid", __doc__)
    parser.add_argument("--setup", default=None, help="configs/rapid_llama.py:NAME")
    bench.add_model_source(
        parser, workdir_help="the trained target (random if neither)", required=False
    )
    draft = parser.add_mutually_exclusive_group()
    draft.add_argument("--draft-workdir", default=None, help="a larger drafter (upward)")
    draft.add_argument("--draft-checkpoint", default=None, help="a larger drafter (upward)")
    parser.add_argument("--context-lengths", type=bench.int_list, default=[2048, 8192])
    parser.add_argument("--samples", type=int, default=4, help="examples per length (a batch)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=10)
    parser.add_argument(
        "--etas", type=bench.float_list, default=[0.0, 10.0], help="RAPID's eta, self-speculation"
    )
    parser.add_argument(
        "--upward-etas",
        type=bench.float_list,
        default=[0.0, 40.0],
        help="RAPID's eta, larger drafter",
    )
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--min-budget", type=int, default=1024)
    parser.add_argument("--ratio", type=float, default=24.0)
    parser.add_argument("--threshold", type=float, default=None, help="BM25 score floor (0)")
    parser.add_argument(
        "--haystack",
        type=bench.str_list,
        default=None,
        help="text files (a book): questions about facts inserted into them, not passkeys",
    )
    parser.add_argument(
        "--facts-per-context", type=int, default=3, help="with --haystack: questions per context"
    )
    parser.add_argument(
        "--results", default=None, help="with --haystack: JSON lines, appended; a rerun resumes"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def passkey_sweep(args, loaded, retrieval, methods, chat) -> dict:
    """The passkey sweep (no ``--haystack``): per context length, ``args.samples``
    passkey contexts prefilled once, every method decoded from them; prints the table."""
    target, params, tokenizer = loaded.model, loaded.params, loaded.tokenizer
    prefix, separator, suffix = chat
    byte_tokens = isinstance(tokenizer, lm.ByteTokenizer)

    def correct(tokens, answer):  # the key's tokens first; a chat model's reply may word it
        if byte_tokens:
            return starts_with_answer(tokens, answer)
        return tokenizer.decode(answer) in tokenizer.decode([int(t) for t in tokens])

    results = {}
    for length in args.context_lengths:
        contexts, questions, answers = passkey_questions(
            length, args.samples, seed=args.seed, tokenizer=tokenizer
        )
        questions = [np.asarray([*q, *suffix], np.int32) for q in questions]
        prompts = build_prompts(
            contexts,
            questions,
            retrieval,
            terms=word_terms(tokenizer.decode),
            prefix=prefix,
            separator=separator,
        )
        extra = max(len(q) for q in questions) + args.new_tokens + args.gamma + 16
        start = time.perf_counter()
        cache = jax.block_until_ready(prefill_contexts(target, params, prompts, extra=extra))
        print(f"context {length}: prefilled in {time.perf_counter() - start:.1f} s", flush=True)
        results[length] = measure_length(
            methods,
            prompts,
            answers,
            cache,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            correct=correct,
        )
        del cache
        rag_len = max(len(t) for t in prompts.rag_tokens)
        print(
            f"context {length}: RAG prompt {rag_len} tokens (budget {prompts.rag[0].budget})",
            flush=True,
        )
    print(
        f"\ngreedy, batch {args.samples}, {args.new_tokens} new tokens, gamma {args.gamma}, "
        f"chunks of {args.chunk_size}; tok/s from the cached context"
    )
    print(table(results))
    return results


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if a.startswith("--config.")]
    argv = [a for a in argv if not a.startswith("--config.")]
    args = _parser().parse_args(argv)
    if args.setup is not None:
        from lhc.train.config import load_config

        return bench.finish(run_setup(load_config(args.setup, overrides), args.repeats), args)
    if overrides:
        raise SystemExit(f"{overrides[0]}: --config.KEY=VALUE overrides go with --setup")
    max_len = max(args.context_lengths) + 1024
    loaded = _load(args, max_len, args.seed)
    target, params = loaded.model, loaded.params
    upward = None
    if args.draft_workdir or args.draft_checkpoint:
        draft_source = argparse.Namespace(
            checkpoint=args.draft_checkpoint, workdir=args.draft_workdir, dtype=args.dtype
        )
        large = _load(draft_source, max_len, args.seed)
        upward = (large.model, large.params)
    retrieval = RetrievalConfig(
        chunk_size=args.chunk_size,
        min_budget=args.min_budget,
        ratio=args.ratio,
        threshold=args.threshold,
    )
    methods = methods_for(
        target,
        params,
        target,
        params,
        args.etas,
        upward,
        args.upward_etas,
        args.gamma,
        stop_tokens=loaded.stop_tokens,
    )
    byte_tokens = isinstance(loaded.tokenizer, lm.ByteTokenizer)
    chat = ([], [], []) if byte_tokens else chat_parts(loaded.tokenizer)
    if args.haystack:
        if args.facts_per_context < 1:
            raise SystemExit(f"--facts-per-context must be >= 1, got {args.facts_per_context}")
        return bench.finish(fact_sweep(args, loaded, retrieval, chat), args)
    return bench.finish(passkey_sweep(args, loaded, retrieval, methods, chat), args)
