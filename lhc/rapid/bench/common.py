"""What the measurements of ``lhc bench rapid`` share: the models, the decoding methods
(target-only, RAG-only, RAPID) as runs from a prefilled cache, their timing and the
table of it, and the chat template's parts around a context and a question."""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lhc import bench, lm, stats
from lhc.lm.decoding import GREEDY
from lhc.lm.sampling import SamplingParams
from lhc.rapid.decoding import rag_generate, rapid_generate, target_generate


def load_model(source: argparse.Namespace, max_len: int, seed: int):
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


def starts_with_answer(tokens: np.ndarray, answer) -> bool:
    """A passkey answer: the generation begins with the key's tokens."""
    return list(tokens[: len(answer)]) == list(answer)


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


def table(results: dict[int, list[dict]]) -> str:
    """A markdown table of ``measure_length``'s rows, one block per context length."""
    columns = [
        ("context", "context"), ("method", "method"), ("accuracy", "accuracy", ".2f"),
        ("tok/s", "tokens_per_s", ".1f"), ("speedup", "speedup", ".2fx"),
        ("acceptance", "acceptance", ".3f"), ("tokens/round", "tokens_per_round", ".2f"),
    ]  # fmt: skip
    rows = [{"context": length, **row} for length, rows in results.items() for row in rows]
    return stats.markdown_table(columns, rows)
