"""The passkey sweep of ``lhc bench rapid`` (no ``--haystack``, no ``--setup``): models
trained here (or a random one, or a checkpoint) on passkey questions, by context length.

Examples are passkey questions (``lhc.train.passkey``'s needle at evenly spread depths of
generated filler, the question at the end); the answer sits in one chunk. Per length,
``--samples`` contexts are prefilled once into the target's cache, untimed, and every
method is timed from a copy of it (``common.measure_length``).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from lhc import lm
from lhc.rapid.bench.common import measure_length, starts_with_answer, table
from lhc.rapid.decoding import build_prompts, prefill_contexts
from lhc.rapid.retrieval import word_terms
from lhc.train.passkey import NEEDLE, QUESTION, Filler


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
